"""`jaxppo.train`: check the config, build the program for this host's devices, run the loop.

Python's only jobs: build the program once (jaxppo.program), then hand it to the run loop
(jaxppo.run.loop), which starts each chunk (jit(lax.scan) over `log_every` iterations, vmapped
over seeds) and between chunks writes the run folder and reports progress.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxppo.run import checkpoints as ckpt
from jaxppo.search import sweep
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.config import PPOConfig
from jaxppo.errors import ConfigError
from jaxppo.run.hostloop import HostLoopRunner
from jaxppo.program import ChunkRunner, build_program
from jaxppo.run.loop import (TrainResult, chunk_length, finish_run, open_folder, restore_checkpoint,
                         run_loop)
from jaxppo.run.policy import check_key
from jaxppo.resolve import Layout, Resolved, note_partial_batch, resolve
from jaxppo.run.folder import check_run_dir
from jaxppo.run.logs import check_wandb
from jaxppo.process import enable_compilation_cache


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

    hparams: the tunable scalars (default: from the config); a `HyperParams.stack` of
    num_seeds settings is a sweep, member i training with the i-th: the run folder then gets
    sweep.json (`jaxppo.search.sweep`), and progress, summary and plots name members by the
    hyperparameters that differ. Resuming a sweep without hparams uses sweep.json's.

    run_dir: if given, the run folder (jaxppo.run.folder): config.yaml, metrics.jsonl (appended as
    training goes), checkpoints/ (every `checkpoint_minutes`, every `checkpoint_every`
    iterations and at the end), params.msgpack, summary.json, curve.png (unless plot=False)
    and, with `tensorboard`, tensorboard/. Nothing is created before every check has passed.
    resume: a run folder to continue from its newest checkpoint; metrics.jsonl is cut back to
    the checkpoint and appended to. `config` may be None (the folder's config.yaml is used);
    a given config may change fields like total_timesteps, but not shapes (ConfigError). The
    number of devices may differ from the saved run's if it divides num_envs.
    stop_after_iterations: run at most this many iterations in this call, then checkpoint and
    return (`TrainResult.completed` is False); resume later with `resume=run_dir`.
    progress: show a progress bar (default: when stderr is a terminal, else a line per chunk).
    callback: called with the metric rows of each finished chunk.
    Raises ConfigError for a bad config, CheckpointError for a run folder that cannot be
    resumed (nothing in it is changed then) and TrainingDivergedError on NaN/inf. SIGINT
    (Ctrl-C) or SIGTERM stops after the running chunk: checkpoint, params and summary are
    written, then TrainingInterrupted is raised (its `result` holds the TrainResult).
    """
    if callback is not None and not callable(callback):
        raise ConfigError(f"callback={callback!r} must be a function of the metric rows of each "
                          "chunk (callback(rows)), or None")
    config, run_dir, resume_store, resume_step, resume_meta = ckpt.begin_resume(
        "train", config, run_dir, resume)
    try:
        run = prepare(config, run_dir, resume_meta, stop_after_iterations, "jaxppo train",
                      layout="local")
        config = run.config
        if hparams is not None:
            check_hparams(hparams, config.num_seeds)
        hp, record = sweep.run_hparams(config, hparams, run_dir, resume is not None)
        restored, start_iter, wall_offset = None, 0, 0.0
        if resume_store is not None:  # read and check the checkpoint before compiling
            restored, start_iter, wall_offset = restore_checkpoint(
                resume_store, resume_step, run, run_dir, hp)
        runner = (HostLoopRunner(run, hp, restored) if run.host_loop else ChunkRunner(  # gymnasium
            build_program(run, hp, chunk_length(config)), hp, jax.random.PRNGKey(config.seed), restored))
    finally:
        if resume_store is not None:
            resume_store.close()

    # Every check has passed: from here on the run folder may be written to.
    folder = open_folder(run_dir, config, start_iter if resume is not None else None)
    try:
        if folder is not None:
            folder.record_sweep(record)
        result = run_loop(runner, config, folder=folder, start_iter=start_iter,
                          resumed=resume is not None, wall_offset=wall_offset,
                          stop_after_iterations=stop_after_iterations, progress=progress,
                          callback=callback,
                          member_labels=None if record is None else record["labels"])
        return finish_run(result, folder, "jaxppo train", plot=plot)
    finally:
        runner.close()  # a gymnasium run's envs
        if folder is not None:
            folder.close()


def prepare(config: PPOConfig, run_dir, resume_meta: dict | None, stop_after_iterations,
            resume_command: str, layout: Layout | str | None = None) -> Resolved:
    """The checks every entry point makes before building anything: the config resolved
    (`jaxppo.resolve`, on `layout`), a resumable (or fresh) run folder, a valid
    stop_after_iterations. Turns on the persistent compilation cache."""
    run = resolve(config, layout)
    note_partial_batch(run.config)
    check_wandb(run.config)  # the wandb package, when the config logs to W&B
    if stop_after_iterations is not None and (
            not isinstance(stop_after_iterations, int) or stop_after_iterations < 1):
        raise ConfigError(f"stop_after_iterations={stop_after_iterations!r} must be an "
                          "integer >= 1 (or None to run to the end)")
    if resume_meta is not None:
        ckpt.check_resumable(resume_meta.get("config") or {}, run.config, run_dir)
        ckpt.check_metrics_file(run_dir, int(resume_meta["iteration"]), run.config.num_seeds)
    else:
        if run_dir is not None:
            check_run_dir(run_dir)
        ckpt.refuse_checkpointed_run_dir(run_dir, resume_command)
    enable_compilation_cache(run.config.compilation_cache_dir)
    return run


def make_train(config: PPOConfig, hparams: HyperParams | None = None):
    """A pure `train_fn(key, hparams=None) -> (final TrainState, metrics [num_iterations])`.

    Nothing in it touches Python state, so a user can `jax.jit` it and `jax.vmap` it over
    keys (seeds) and over a batched `HyperParams` (a sweep of lr, clip_param, ...).
    """
    algo = Algorithm(resolve(config))
    note_partial_batch(algo.config)
    if algo.config.pbt is not None or algo.config.search is not None:
        raise ConfigError(
            "make_train builds one member's train function, but this config's "
            f"{'pbt' if algo.config.pbt is not None else 'search'} trains a population in one "
            "program: use jaxppo.train(config) (or drop it and jax.vmap train_fn over a "
            "HyperParams.stack yourself)")
    if hparams is not None:
        check_hparams(hparams, 1, "make_train(config, hparams)")
    hp = hparams if hparams is not None else HyperParams.from_config(algo.config)
    train_hp = algo.make_train()

    def train_fn(key, hparams: HyperParams | None = None):
        _check_train_key(key)
        if hparams is not None:
            check_hparams(hparams, 1, "train_fn(key, hparams)")
        return train_hp(key, hp if hparams is None else hparams)

    return train_fn


def check_hparams(hp, num_seeds: int, where: str = "train(config, hparams)") -> None:
    """ConfigError unless `hp` is a HyperParams of one setting, or (num_seeds > 1) a
    HyperParams.stack of exactly num_seeds settings."""
    if not isinstance(hp, HyperParams):
        raise ConfigError(
            f"{where}: hparams is {type(hp).__name__} {repr(hp)[:60]}, not a jaxppo.HyperParams; "
            "pass HyperParams.from_config(config) (or HyperParams.stack([...]) for a sweep)")
    scalar_dims = {np.ndim(getattr(hp, f)) for f in _SCALAR_HPARAMS}
    point_dims = {np.ndim(hp.lr_points), np.ndim(hp.entropy_points)}
    if scalar_dims == {0} and point_dims == {2}:
        return
    if scalar_dims != {1} or point_dims != {3}:
        raise ConfigError(
            f"{where}: hparams has fields of mixed ranks (clip_param {np.shape(hp.clip_param)}, "
            f"lr_points {np.shape(hp.lr_points)}); build it with HyperParams.from_config or "
            "HyperParams.stack")
    n = np.shape(hp.clip_param)[0]
    if num_seeds == 1:
        fix = ("jax.vmap train_fn over it: jax.vmap(train_fn)(keys, hparams)" if "train_fn" in where
               else f"set num_seeds={n} (member i trains with setting i)")
        raise ConfigError(f"{where}: hparams is a stack of {n} settings (a sweep), but this "
                          f"trains one; {fix}, or pass one HyperParams.from_config(config)")
    if n != num_seeds:
        raise ConfigError(
            f"hparams has a leading axis of ({n},), but num_seeds={num_seeds}; a batched "
            "HyperParams needs exactly one entry per seed")


_SCALAR_HPARAMS = ("clip_param", "vf_clip_param", "vf_coeff", "kl_coeff", "kl_target",
                   "max_grad_norm", "gamma", "gae_lambda")


def _check_train_key(key) -> None:
    """train_fn's key: one PRNG key (under jax.vmap, one per seed)."""
    try:
        check_key(key)
    except TypeError as e:
        raise TypeError(f"train_fn(key, ...): {e} (jax.vmap(train_fn)(jax.random.split(key, n)) "
                        "trains n seeds)") from None
