# jaxppo: `make train ENV=CartPole-v1` and `make test` each install what they need first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The exact versions the tests ran with (pyproject.toml declares ranges): every install here
# applies them.
CONSTRAINTS := constraints.txt
# What the venv holds: the package alone (`make train`), or with the dev extras (`make test`
# and every other target).
BASE_STAMP := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed-dev
# The env suites' extras (an ENV of "<suite>:<name>" needs its suite's).
SUITE_EXTRAS := brax jumanji craftax xminigrid jaxmarl gymnasium envpool
ENV    ?= CartPole-v1
ARGS   ?=
HOSTS  ?= 2
RUNS_DIR ?= runs
RESUME ?=
PYTEST_ARGS ?=
# Test files run in parallel, one worker per CPU (pytest-xdist): a file's tests stay on one
# worker (the Ray tests share one cluster). PYTEST_WORKERS=0 runs everything in this process.
# (A worker more than the CPUs was measured slower on 2 cores: the Ray tests' learners, on
# the same cores, became the last to finish.)
PYTEST_WORKERS ?= logical
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: install train test test-fast wheel-check bench experiments docs docs-serve clean help

help:
	@echo "make train ENV=CartPole-v1 [ARGS='--set lr=3e-4 --seeds 4']  train, write RUNS_DIR/<env>-<time>/ (RUNS_DIR=runs)"
	@echo "  ENV=<suite>:<name> (envpool:Breakout-v5, jaxmarl:..., brax:...) installs that suite's extra first"
	@echo "make train RESUME=runs/<dir> [ARGS='--set total_timesteps=2e6']  continue that run (its env and config)"
	@echo "make test [PYTEST_WORKERS=0] [PYTEST_ARGS=...]             the whole test suite (CPU), files in parallel over the cores"
	@echo "make bench [BENCH_ARGS=--only-side-by-side]                side by side with PureJaxRL + own benchmarks -> experiments/results/bench-<date>.json"
	@echo "make experiments [EXPERIMENT_ARGS=...]                     tuned configs x 4 seeds -> docs/results.md table"
	@echo "make ray-cluster [RAY_WORKERS=2 RAY_PORT=6379]             a loopback Ray cluster: head + worker nodes, one core each"
	@echo "make ray-submit ENV=... HOSTS=2 [RESUME=runs/<dir>]        a job on it; run folder in RUNS_DIR (made absolute)"
	@echo "make ray-stop [RAY_PORT=6379]                              stop that cluster only (other Ray clusters keep running)"
	@echo "  RUNS_DIR=path sets where runs go; a --runs-dir (or --resume) in ARGS wins, made absolute for ray-submit"
	@echo "make ray-bench                                             multi-host vs one process -> experiments/results/ray-bench.json"
	@echo "make docs                                                  build the documentation site into site/ (mkdocs build --strict)"
	@echo "make docs-serve                                            serve the site on 127.0.0.1:8000, rebuilt on every edit"
	@echo "make wheel-check                                           build the wheel, install it alone in a fresh venv, train CartPole from it"
	@echo "make install (the dev extras, as make test) | clean      INSTALLER=pip installs with pip instead of uv"

# Each install is redone only when pyproject.toml or constraints.txt changes. `make train`
# installs the package without extras; `make test` adds the dev extras (every optional suite,
# Ray, W&B, ONNX, pytest, the docs tools) to the same venv, which then serves both. pip puts uv
# (pinned in constraints.txt) into the venv and uv installs the rest, byte-compiled as pip
# would: the dev extras in about 36 s where pip took about 116 (2 cores, empty caches; uv
# fetches and unpacks in parallel). uv reads its own settings, not pip's: where it cannot
# install (say, a package mirror set in pip.conf only), pip does instead; INSTALLER=pip
# always uses pip. The package's own sources (an editable install) are byte-compiled by
# compileall, once: where PYTHONDONTWRITEBYTECODE is set nothing else writes them, and every
# process (a run, each test's subprocess, each Ray learner) would compile jaxppo anew.
INSTALLER ?= uv
pip_install = $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) $(1)
uv_install = { $(call pip_install,uv) && $(BIN)/uv pip install --quiet --python $(BIN)/python \
	--compile-bytecode -c $(CONSTRAINTS) $(1); } || { echo "uv could not install; pip installs instead" >&2; \
	$(call pip_install,$(1)); }
# $(call install,WHAT): WHAT (pip's syntax) into the venv, at the tested versions.
install = $(if $(filter pip,$(INSTALLER)),$(pip_install),$(uv_install))

$(BASE_STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call install,-e .)
	$(BIN)/python -m compileall -q jaxppo
	@touch $(BASE_STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call install,-e ".[dev]")
	$(BIN)/python -m compileall -q jaxppo
	@touch $(STAMP) $(BASE_STAMP) $(SUITE_EXTRAS:%=$(VENV)/.installed-%)

install: $(STAMP)

# The value of option $(1) in ARGS ("$(1) X" or "$(1)=X"; the last one wins, as in argparse).
arg_value = $(lastword $(foreach w,$(join $(ARGS),$(addprefix :=:,$(wordlist 2,$(words $(ARGS)),$(ARGS)))),$(patsubst $(1):=:%,%,$(filter $(1):=:%,$(w)))$(firstword $(subst :=:, ,$(patsubst $(1)=%,%,$(filter $(1)=%,$(w)))))))
# The run folder to resume: RESUME=, or a --resume in ARGS.
RESUME_DIR = $(or $(call arg_value,--resume),$(RESUME))
# --env $(ENV), except for a resumed run, whose env is in its config.yaml; an ENV given on the
# command line together with a resume is passed on, and refused by the CLI as a clash.
ENV_ARG = $(if $(and $(RESUME_DIR),$(filter-out command line,$(origin ENV))),,--env $(ENV))

# The suite of an ENV named "<suite>:<name>" (envpool:Breakout-v5 -> envpool) is a pip extra:
# `make train` installs it beside the package, once (the stamp .venv/.installed-<suite>; the
# dev extras hold every suite).
ENV_EXTRA = $(if $(findstring :,$(ENV)),$(filter $(SUITE_EXTRAS),$(firstword $(subst :, ,$(ENV)))))

$(VENV)/.installed-%: pyproject.toml $(CONSTRAINTS) | $(BASE_STAMP)
	$(call install,-e ".[$*]")
	@touch $@

train: $(BASE_STAMP) $(if $(ENV_EXTRA),$(VENV)/.installed-$(ENV_EXTRA))
	$(BIN)/python -m jaxppo train $(ENV_ARG) $(if $(RESUME),--resume $(RESUME)) \
		--runs-dir $(RUNS_DIR) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow" $(PYTEST_ARGS)

# The package as users get it (.ci/wheel_check.sh): sdist and wheel built, the wheel alone
# installed (with constraints.txt) into a fresh venv outside the repository, then `jaxppo
# envs` and a short CartPole run from a folder outside it. Needs `build` (dev extras).
wheel-check: $(STAMP)
	BUILD_PYTHON=$(BIN)/python PYTHON=$(PYTHON) bash .ci/wheel_check.sh

bench: $(STAMP)
	$(BIN)/python experiments/bench.py $(BENCH_ARGS)

# Tuned configs x 4 seeds -> experiments/results/<env>.json/.png and the table of docs/results.md.
# EXPERIMENT_ARGS='--env CartPole-v1 --max-steps 2e6' to select envs or cap budgets.
experiments: $(STAMP)
	$(BIN)/python experiments/run_experiments.py $(EXPERIMENT_ARGS)

# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link, anchor or API
# reference; the configuration reference is generated from jaxppo/config.py (docs/hooks.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# ---- Multi-host PPO over Ray, tried on this machine: a head and RAY_WORKERS worker nodes, all
# on loopback (127.0.0.1), with their own Ray temp dir RAY_TEMP_DIR (sessions, logs) so that
# `make ray-stop` finds this cluster's processes and no others. Each worker node is one
# "host": one CPU for Ray, pinned to its own core (taskset; cores reused when there are more
# workers than cores), so its learner does not share a core with the other's, as on separate
# machines. The head holds no learner
# (--num-cpus=0): it runs Ray's services and the job's driver. The loopback wrapper keeps Ray
# from swapping 127.0.0.1 for the machine's outward IP; RAY_worker_niceness=0 runs the
# learners at normal priority (Ray's default nice 15 hands their core to any other process).
# Every node, `ray status` and `ray job submit` run with one RAY_AUTH_MODE: token when a Ray
# token is at hand (~/.ray/auth_token, which any local `ray.init()` writes), else disabled
# (or as RAY_AUTH_MODE says); Ray alone would start a token-only head and refuse its workers.
# On a real cluster use `ray start` on each node and `ray job submit` against the head (see
# docs/scaling.md, "Many hosts with Ray").
RAY_PORT      ?= 6379
RAY_DASHBOARD ?= 8265
RAY_WORKERS   ?= 2
RAY_TEMP_DIR  ?= /tmp/jaxppo-ray-$(shell id -u)-$(RAY_PORT)
RAY_CLIENT_PORT ?= $(shell echo $$(($(RAY_PORT) == 6379 ? 10001 : $(RAY_PORT) + 1)))
NPROC         := $(shell nproc 2>/dev/null || echo 1)
RAY_LOOPBACK  := env RAY_USAGE_STATS_ENABLED=0 RAY_worker_niceness=0 $(BIN)/python -m jaxppo.distributed.loopback
# Ports a second cluster on this machine would also want: the nodes' agents get free ones,
# Ray Client gets RAY_CLIENT_PORT (Ray's 10001 for the default RAY_PORT, else RAY_PORT + 1;
# not in 10002-19999, Ray's worker ports).
RAY_NODE_ARGS := --node-ip-address=127.0.0.1 --object-store-memory=200000000 --disable-usage-stats \
	--temp-dir=$(RAY_TEMP_DIR) --dashboard-agent-listen-port=0
RAY_RUNTIME_ENV := {"working_dir": ".", "excludes": [".venv/", "runs/", ".git/", "**/__pycache__/", "*.egg-info/", ".pytest_cache/", ".cache/"]}

.PHONY: ray-cluster ray-submit ray-stop ray-bench

ray-cluster: $(STAMP)
	$(RAY_LOOPBACK) start --head --port=$(RAY_PORT) $(RAY_NODE_ARGS) --num-cpus=0 \
		--ray-client-server-port=$(RAY_CLIENT_PORT) \
		--include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=$(RAY_DASHBOARD)
	for i in $$(seq 0 $$(($(RAY_WORKERS) - 1))); do \
		taskset -c $$((i % $(NPROC))) $(RAY_LOOPBACK) start --address=127.0.0.1:$(RAY_PORT) \
			$(RAY_NODE_ARGS) --num-cpus=1 || exit 1; \
	done
	sleep 3  # let the workers register before showing the cluster
	$(RAY_LOOPBACK) status --address=127.0.0.1:$(RAY_PORT)

# The job runs this venv's python (an absolute path: the job's cwd is an uploaded copy of
# the working dir, without .venv) and writes its run folder to RUNS_DIR. Paths are made
# absolute here, for the same reason: RUNS_DIR, or a --runs-dir in ARGS (which wins, as with
# `make train`), and RESUME or a --resume in ARGS; they follow ARGS, so they win over the
# relative ones there.
ray-submit: $(STAMP)
	$(RAY_LOOPBACK) job submit --address http://127.0.0.1:$(RAY_DASHBOARD) \
		--runtime-env-json '$(RAY_RUNTIME_ENV)' -- \
		$(abspath $(BIN))/python -m jaxppo.distributed --hosts $(HOSTS) $(ENV_ARG) $(ARGS) \
		--runs-dir "$$(realpath -m -- $(or $(call arg_value,--runs-dir),$(RUNS_DIR)))" \
		$(if $(RESUME_DIR),--resume "$$(realpath -m -- $(RESUME_DIR))")

# A loopback cluster's benchmark (starts its own): multi-host vs one process, side by side.
ray-bench: $(STAMP)
	$(BIN)/python experiments/ray_bench.py

# Stops the cluster of `make ray-cluster` (same RAY_PORT): the processes that name its GCS
# address or RAY_TEMP_DIR, and their children (workers, job drivers): SIGTERM (the GCS last),
# SIGKILL for what is left after 10 s. Other Ray clusters keep running (Ray's own `ray stop`
# would stop every Ray process of this user on this machine).
ray-stop: $(STAMP)
	$(BIN)/python -m jaxppo.distributed.loopback stop-cluster --address=127.0.0.1:$(RAY_PORT) \
		--temp-dir=$(RAY_TEMP_DIR)
