"""`jaxppo.train`: check the config, build the program for this host's devices, run the loop.

Python's only jobs: build the program once (jaxppo.layouts), then hand it to the run loop
(jaxppo.loop), which starts each chunk (jit(lax.scan) over `log_every` iterations, vmapped
over seeds) and between chunks writes the run folder and reports progress.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxppo.algorithm import Algorithm, HyperParams, TrainState
from jaxppo.config import ConfigError, PPOConfig
from jaxppo.envs import make_env
from jaxppo.recurrent import algorithm_class


class TrainingDivergedError(RuntimeError):
    """A loss, gradient or parameter became NaN/inf; metrics up to that point are kept."""

    def __init__(self, message: str, iteration: int, last_finite: dict | None):
        super().__init__(message)
        self.iteration = iteration
        self.last_finite = last_finite


def process_uptime() -> float:
    """Seconds since this process started (from /proc where available)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORT_TIME


_IMPORT_TIME = time.perf_counter()


def enable_compilation_cache(path: str | None) -> None:
    """Turn on JAX's persistent compilation cache so a repeated run skips most compiling."""
    if not path:
        return
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclass
class TrainResult:
    """What `train` returns.

    params: the trained network params ([num_seeds, ...] leaves when num_seeds > 1).
    state: the final TrainState, with a leading [num_devices] axis when num_devices > 1
    (params are identical across it) and then [num_seeds] when num_seeds > 1.
    metrics: name -> array [num_iterations] (num_seeds == 1) or [num_seeds, num_iterations];
    also `iteration`, `wall_time` (s since process start, at the end of the chunk that held
    the iteration; a resumed run adds the time of the processes before it) and `sps` (env
    steps per second of that chunk, all seeds); with eval_every, eval_return_mean/std and
    eval_length_mean (NaN on iterations without evaluation). A resumed run's metrics start
    at iteration 1 (the earlier ones are read back from metrics.jsonl).
    `policy(obs, key=None, deterministic=False, seed=0)` and `value(obs, seed=0)` take raw
    observations [..., *obs_shape] and apply the run's observation normalisation.
    iterations_done / completed: how far the run got (completed is False after
    stop_after_iterations); resumed_from: the checkpoint iteration it started from, if any.
    hosts: processes the run was spread over (1 unless jaxppo.distributed); host_failures:
    the hosts lost and replaced during the run; summary: summary.json's content (run folder).
    """

    config: PPOConfig
    params: Any
    state: TrainState
    metrics: dict[str, np.ndarray]
    run_dir: Path | None = None
    compile_seconds: float = 0.0
    train_seconds: float = 0.0
    _algorithm: Algorithm | None = field(default=None, repr=False)
    _policy_fn: Callable | None = field(default=None, repr=False)
    _value_fn: Callable | None = field(default=None, repr=False)

    num_devices: int = 1
    iterations_done: int = 0
    completed: bool = True
    resumed_from: int | None = None
    hosts: int = 1
    host_failures: list = field(default_factory=list)
    summary: dict | None = None

    def _seed_slice(self, tree, seed):
        if self.num_devices > 1:  # params are replicated: any device's copy will do
            tree = jax.tree.map(lambda x: x[0], tree)
        if self.config.num_seeds == 1:
            return tree
        return jax.tree.map(lambda x: x[seed], tree)

    def policy(self, obs, key=None, deterministic: bool = False, seed: int = 0):
        if key is None:
            if not deterministic:
                raise ValueError("policy(obs, key): a PRNG key is needed to sample; "
                                 "pass key=jax.random.PRNGKey(0) or deterministic=True")
            key = jax.random.PRNGKey(0)
        st = self._seed_slice(self.state, seed)
        return self._policy_fn(st.params, st.obs_stats, obs, key, deterministic)

    def value(self, obs, seed: int = 0):
        st = self._seed_slice(self.state, seed)
        return self._value_fn(st.params, st.obs_stats, obs)

    def evaluate(self, episodes: int = 10, seed: int = 0, deterministic: bool = True,
                 max_steps: int | None = None, policy_seed: int = 0) -> dict:
        """One episode in each of `episodes` fresh envs reset from PRNGKey(seed), with the
        policy of seed `policy_seed`: return/length mean and std, and the per-episode arrays.
        `jaxppo.load_policy(run_dir).evaluate(...)` gives the same numbers."""
        from jaxppo.policy import evaluate_act

        def act(obs, key=None):
            return self.policy(obs, key, deterministic=key is None, seed=policy_seed)

        return evaluate_act(act, self.config, self._algorithm.spec, episodes=episodes, seed=seed,
                            deterministic=deterministic, max_steps=max_steps)


def train(
    config: PPOConfig | None,
    *,
    hparams: HyperParams | None = None,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    callback: Callable[[list[dict]], None] | None = None,
    resume: str | Path | None = None,
    stop_after_iterations: int | None = None,
    plot: bool = True,
) -> TrainResult:
    """Train PPO as configured on this host's devices; `num_seeds > 1` trains the seeds in one
    vmapped program. (Several hosts: `jaxppo.distributed.train_distributed`, same loop.)

    run_dir: if given, the run folder (jaxppo.rundir): config.yaml, metrics.jsonl (appended as
    training goes), checkpoints/ (every `checkpoint_every` iterations and at the end),
    params.msgpack, summary.json, curve.png (unless plot=False) and, with `tensorboard`,
    tensorboard/. Nothing is created before every check has passed.
    resume: a run folder to continue from its newest checkpoint; metrics.jsonl is cut back to
    the checkpoint and appended to. `config` may be None (the folder's config.yaml is used);
    a given config may change fields like total_timesteps, but not shapes (ConfigError). The
    number of devices may differ from the saved run's if it divides num_envs.
    stop_after_iterations: run at most this many iterations in this call, then checkpoint and
    return (`TrainResult.completed` is False); resume later with `resume=run_dir`.
    progress: show a progress bar (default: when stderr is a terminal, else a line per chunk).
    callback: called with the metric rows of each finished chunk.
    Raises ConfigError for a bad config, CheckpointError for a run folder that cannot be
    resumed (nothing in it is changed then) and TrainingDivergedError on NaN/inf.
    """
    from jaxppo import checkpoint as ckpt
    from jaxppo.layouts import ChunkRunner, build_program, local_layout
    from jaxppo.loop import chunk_length, open_folder, restore_checkpoint, run_loop

    config, run_dir, resume_store, resume_step, resume_meta = ckpt.begin_resume(
        "train", config, run_dir, resume)
    try:
        config = prepare(config, run_dir, resume_meta, stop_after_iterations, "jaxppo train")
        spec = make_env(config)
        layout = local_layout(config)
        hp = hparams if hparams is not None else HyperParams.from_config(config)
        restored, start_iter, wall_offset = None, 0, 0.0
        if resume_store is not None:  # read and check the checkpoint before compiling
            restored, start_iter, wall_offset = restore_checkpoint(
                resume_store, resume_step, config, run_dir, hp)
        program = build_program(config, spec, hp, layout, chunk_length(config))
        runner = ChunkRunner(program, hp, jax.random.PRNGKey(config.seed), restored)
    finally:
        if resume_store is not None:
            resume_store.close()

    # Every check has passed: from here on the run folder may be written to.
    folder = open_folder(run_dir, config, start_iter if resume is not None else None)
    try:
        result = run_loop(runner, config, folder=folder, start_iter=start_iter,
                          resumed=resume is not None, wall_offset=wall_offset,
                          stop_after_iterations=stop_after_iterations, progress=progress,
                          callback=callback)
        if folder is not None:
            result.summary = folder.finish(result, plot=plot)
    finally:
        if folder is not None:
            folder.close()
    return result


def prepare(config: PPOConfig, run_dir, resume_meta: dict | None, stop_after_iterations,
            resume_command: str) -> PPOConfig:
    """The checks every entry point makes before building anything: a valid config, a
    resumable (or fresh) run folder, a valid stop_after_iterations, an evaluation bound.
    Turns on the persistent compilation cache. Returns the validated config."""
    from jaxppo import checkpoint as ckpt

    config = config.validate()
    if stop_after_iterations is not None and (
            not isinstance(stop_after_iterations, int) or stop_after_iterations < 1):
        raise ConfigError(f"stop_after_iterations={stop_after_iterations!r} must be an "
                          "integer >= 1 (or None to run to the end)")
    if resume_meta is not None:
        ckpt.check_resumable(resume_meta.get("config") or {}, config, run_dir)
    else:
        ckpt.refuse_checkpointed_run_dir(run_dir, resume_command)
    if config.eval_every:
        from jaxppo.evaluation import eval_max_steps

        eval_max_steps(config, make_env(config).env_params)  # ConfigError now, not mid-trace
    enable_compilation_cache(config.compilation_cache_dir)
    return config


def _version() -> str:
    from jaxppo import __version__

    return __version__


def make_train(config: PPOConfig, hparams: HyperParams | None = None):
    """A pure `train_fn(key, hparams=None) -> (final TrainState, metrics [num_iterations])`.

    Nothing in it touches Python state, so a user can `jax.jit` it and `jax.vmap` it over
    keys (seeds) and over a batched `HyperParams` (a sweep of lr, clip_param, ...).
    """
    config = config.validate()
    algo = algorithm_class(config)(config)
    hp = hparams if hparams is not None else HyperParams.from_config(config)
    train_hp = algo.make_train()

    def train_fn(key, hparams: HyperParams | None = None):
        return train_hp(key, hp if hparams is None else hparams)

    return train_fn
