# jaxppo: `make train ENV=CartPole-v1` and `make test` each install what they need first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ENV    ?= CartPole-v1
ARGS   ?=
HOSTS  ?= 2
PYTEST_ARGS ?=

.PHONY: install train test test-fast bench experiments clean help

help:
	@echo "make train ENV=CartPole-v1 [ARGS='--set lr=3e-4 --seeds 4']  train, write runs/<env>-<time>/"
	@echo "make test                                                  the whole test suite (CPU)"
	@echo "make bench                                                 benchmarks -> experiments/results/*.json"
	@echo "make experiments [EXPERIMENT_ARGS=...]                     tuned configs x 4 seeds -> README table"
	@echo "make install | clean"

# The venv is rebuilt only when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m jaxppo train --env $(ENV) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python experiments/bench.py

# Tuned configs x 4 seeds -> experiments/results/<env>.json/.png and the README table.
# EXPERIMENT_ARGS='--env CartPole-v1 --max-steps 2e6' to select envs or cap budgets.
experiments: $(STAMP)
	$(BIN)/python experiments/run_experiments.py $(EXPERIMENT_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
