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
	@echo "make bench [BENCH_ARGS=--only-side-by-side]                side by side with PureJaxRL + own benchmarks -> experiments/results/bench-<date>.json"
	@echo "make experiments [EXPERIMENT_ARGS=...]                     tuned configs x 4 seeds -> README table"
	@echo "make ray-cluster | ray-submit ENV=... HOSTS=2 | ray-stop     a loopback Ray cluster and a job on it"
	@echo "make ray-bench                                             multi-host vs one process -> experiments/results/ray-bench.json"
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
	$(BIN)/python experiments/bench.py $(BENCH_ARGS)

# Tuned configs x 4 seeds -> experiments/results/<env>.json/.png and the README table.
# EXPERIMENT_ARGS='--env CartPole-v1 --max-steps 2e6' to select envs or cap budgets.
experiments: $(STAMP)
	$(BIN)/python experiments/run_experiments.py $(EXPERIMENT_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# ---- Multi-host PPO over Ray, tried on this machine: a head and RAY_WORKERS worker nodes, all
# on loopback (127.0.0.1). Each worker node is one "host": one CPU for Ray, pinned to its own
# core (taskset; cores reused when there are more workers than cores), so its learner does
# not share a core with the other's, as on separate machines. The head holds no learner
# (--num-cpus=0): it runs Ray's services and the job's driver. The loopback wrapper keeps Ray
# from swapping 127.0.0.1 for the machine's outward IP; RAY_worker_niceness=0 runs the
# learners at normal priority (Ray's default nice 15 hands their core to any other process).
# On a real cluster use `ray start` on each node and `ray job submit` against the head (see
# README, "Multi-host with Ray").
RAY_PORT      ?= 6379
RAY_DASHBOARD ?= 8265
RAY_WORKERS   ?= 2
NPROC         := $(shell nproc 2>/dev/null || echo 1)
RAY_LOOPBACK  := env RAY_USAGE_STATS_ENABLED=0 RAY_worker_niceness=0 $(BIN)/python -m jaxppo.distributed.loopback
RAY_NODE_ARGS := --node-ip-address=127.0.0.1 --object-store-memory=200000000 --disable-usage-stats
RAY_RUNTIME_ENV := {"working_dir": ".", "excludes": [".venv/", "runs/", ".git/", "**/__pycache__/", "*.egg-info/", ".pytest_cache/", ".cache/"]}

.PHONY: ray-cluster ray-submit ray-stop ray-bench

ray-cluster: $(STAMP)
	$(RAY_LOOPBACK) start --head --port=$(RAY_PORT) $(RAY_NODE_ARGS) --num-cpus=0 \
		--include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=$(RAY_DASHBOARD)
	for i in $$(seq 0 $$(($(RAY_WORKERS) - 1))); do \
		taskset -c $$((i % $(NPROC))) $(RAY_LOOPBACK) start --address=127.0.0.1:$(RAY_PORT) \
			$(RAY_NODE_ARGS) --num-cpus=1 --dashboard-agent-listen-port=0 || exit 1; \
	done
	sleep 3  # let the workers register before showing the cluster
	$(RAY_LOOPBACK) status --address=127.0.0.1:$(RAY_PORT)

# The job runs this venv's python (an absolute path: the job's cwd is an uploaded copy of
# the working dir, without .venv) and writes its run folder to ./runs.
ray-submit: $(STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/ray job submit --address http://127.0.0.1:$(RAY_DASHBOARD) \
		--runtime-env-json '$(RAY_RUNTIME_ENV)' -- \
		$(abspath $(BIN))/python -m jaxppo.distributed --hosts $(HOSTS) --env $(ENV) \
		--runs-dir $(abspath runs) $(ARGS)

# A loopback cluster's benchmark (starts its own): multi-host vs one process, side by side.
ray-bench: $(STAMP)
	$(BIN)/python experiments/ray_bench.py

# Stops every Ray process of this user on this machine (Ray's own `ray stop`).
ray-stop: $(STAMP)
	$(BIN)/ray stop
