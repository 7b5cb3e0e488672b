"""`jaxppo.train`: check the config, build the program for this host's devices, run the loop;
and `jaxppo.make_train`: one member's whole training as a pure function to jit and vmap.

Every entry point (`train`, `jaxppo.distributed.train_distributed`) goes through
`train_with`: the checks, the resume, the run folder and the run loop are the same; only the
runner that runs the chunks (a `jaxppo.run.runner.Runner`) differs.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxppo.search import sweep
from jaxppo.core.algorithm import Algorithm, TrainState
from jaxppo.core.hyperparams import HyperParams
from jaxppo.config import PPOConfig, function_hooks, own_critic_lr
from jaxppo.config_fields import is_flax_module
from jaxppo.envs.record import network_record
from jaxppo.errors import ConfigError, warn
from jaxppo.run import hostloop
from jaxppo.run.actorlearner import ActorLearnerRunner
from jaxppo.run.hostloop import HostLoopRunner
from jaxppo.run.runner import ChunkRunner
from jaxppo.program import recent
from jaxppo.program.build import build_program, train_function
from jaxppo.run.loop import chunk_length, finish_run, open_folder, train_loop
from jaxppo.run.policy import check_key
from jaxppo.program.layout import Layout
from jaxppo.program.resolved import Resolved, note_partial_batch, resolve
from jaxppo.run.folder import ResumePoint, begin_resume, check_start
from jaxppo.run.logs import check_wandb
from jaxppo.run.progress import compiling
from jaxppo.run.result import TrainResult
from jaxppo.run.saving import save_result
from jaxppo.run.runner import Runner
from jaxppo.run.schedules import continue_schedules, schedule_record
from jaxppo.process import enable_compilation_cache


def train(
    config: PPOConfig | None,
    *,
    hparams: HyperParams | None = None,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    callback: Callable[[list[dict]], Any] | None = None,
    resume: str | Path | None = None,
    stop_after_iterations: int | None = None,
    plot: bool = True,
    trust_config: bool = True,
) -> TrainResult:
    """Train PPO as configured on this host's devices.

    `num_seeds > 1` trains the seeds in one vmapped program. (Several hosts:
    `jaxppo.distributed.train_distributed`, the same loop.) Nothing is created in the run
    folder before every check has passed.

    Args:
        config: the run's config; None with `resume` (the folder's config.yaml is used).
        hparams: the tunable scalars (default: from the config); a `HyperParams.stack` of
            num_seeds settings is a sweep, member i training with the i-th: the run folder
            then gets sweep.json (`jaxppo.search.sweep`), and progress, summary and plots name
            members by the hyperparameters that differ. Resuming a sweep without hparams
            uses sweep.json's.
        run_dir: the run folder (jaxppo.run.folder), if any: config.yaml, metrics.jsonl
            (appended as training goes), checkpoints/ (every `checkpoint_minutes`, every
            `checkpoint_every` iterations and at the end), params.msgpack, summary.json,
            curve.png (unless plot=False) and, with `tensorboard`, tensorboard/.
        progress: show a progress bar (default: when stderr is a terminal, else a line per
            chunk); False shows nothing.
        callback: called with the metric rows of each finished chunk (one dict per
            iteration and seed, as metrics.jsonl holds them), as `callback(rows)`; one that
            takes two arguments, `callback(rows, run)`, also gets the run as the chunk left it
            (`jaxppo.run.loop.ChunkEnd`: `iteration`, `env_steps`, `state`, `params`, the
            last two fetched when read). Returning False or raising
            `jaxppo.StopTraining` stops the run after that chunk: it is checkpointed and
            finished, and the result has `completed` False and `stopped` saying why. Any other
            exception is raised again once the checkpoint, params.msgpack and summary.json of
            that iteration are written. The config's stop_at_return and
            stop_after_no_improvement stop a run the same way.
        resume: a run folder to continue from its newest checkpoint; metrics.jsonl is cut
            back to the checkpoint and appended to. A given config may change fields like
            total_timesteps, but not shapes (ConfigError). The number of devices may differ
            from the saved run's if it divides num_envs.
        stop_after_iterations: run at most this many iterations in this call, then
            checkpoint and return (`TrainResult.completed` is False); resume later with
            `resume=run_dir`.
        plot: write curve.png.
        trust_config: False refuses, with `resume` and no config, a folder's config.yaml that
            names a module to import (its "module:Class" env; importing runs the module's
            code): for run folders you did not write.

    Returns:
        The TrainResult: params, final state, metrics and the run's summary.

    Raises:
        ConfigError: a bad config or argument.
        CheckpointError: a run folder that cannot be resumed (nothing in it is changed).
        TrainingDivergedError: a health metric became NaN/inf.
        TrainingInterrupted: SIGINT (Ctrl-C) or SIGTERM stopped training after the running
            chunk; checkpoint, params and summary are written first, and its `result` holds
            the TrainResult.
    """
    return train_with(_local_runner, EntryPoint("train", "jaxppo train"), config,
                      hparams=hparams, run_dir=run_dir, progress=progress, callback=callback,
                      resume=resume, stop_after_iterations=stop_after_iterations, plot=plot,
                      trust_config=trust_config)


def make_train(config: PPOConfig, hparams: HyperParams | None = None):
    """A pure `train_fn(key, hparams=None) -> (final TrainState, metrics [num_iterations])`.

    Nothing in it touches Python state, so a user can `jax.jit` it and `jax.vmap` it over
    keys (seeds) and over a batched `HyperParams` (a sweep of lr, clip_param, ...).

    It is one device's program (`num_devices` is not read). `jaxppo.train(config)` lays the
    same run over the local devices (on a CPU one per core, by default): on small programs
    that trains faster than one device with XLA's own threads (docs/performance.md).
    """
    algo = Algorithm.create(resolve(config))
    note_partial_batch(algo.config)
    if algo.config.pbt is not None or algo.config.search is not None:
        raise ConfigError(
            "make_train builds one member's train function, but this config's "
            f"{'pbt' if algo.config.pbt is not None else 'search'} trains a population in one "
            "program: use jaxppo.train(config) (or drop it and jax.vmap train_fn over a "
            "HyperParams.stack yourself)")
    if hparams is not None:
        check_hparams(hparams, 1, "make_train(config, hparams)", algo.config)
    hp = hparams if hparams is not None else HyperParams.from_config(algo.config)
    train_hp = train_function(algo)

    def train_fn(key, hparams: HyperParams | None = None):
        _check_train_key(key)
        if hparams is not None:
            check_hparams(hparams, 1, "train_fn(key, hparams)", algo.config)
        return train_hp(key, hp if hparams is None else hparams)

    return train_fn


@dataclass
class Start:
    """Where a run starts, once every check has passed: what a runner factory is given.

    Attributes:
        resolved: the run's resolved config and layout.
        hp: the hyperparameters it trains with ([num_seeds] leaves for a sweep).
        restored: a resumed run's unsharded state (numpy); None for a new run.
        iteration: the iteration the state is at (0 for a new run).
        wall_offset: a resumed run's wall time so far, in seconds.
        sweep_record: sweep.json's record of a sweep's members, or None.
    """

    resolved: Resolved
    hp: HyperParams
    restored: TrainState | None = None
    iteration: int = 0
    wall_offset: float = 0.0
    sweep_record: dict | None = None

RunnerFactory = Callable[[Start], Runner]


@dataclass(frozen=True)
class EntryPoint:
    """What differs between the functions that start a run (`train`, `train_distributed`).

    Attributes:
        caller: the function's name, for the messages.
        command: the command that continues a run (`<command> --resume RUN_DIR`).
        layout: the layout the config resolves on (`jaxppo.resolve`).
        check: more checks of the resolved run, before anything starts.
        label: the run's name in the progress, `{env}` standing for the env's name
            (default: the env's name).
        plot_label: the run's name in curve.png, likewise.
        summary: more entries for summary.json, from the result.
    """

    caller: str
    command: str
    layout: Layout | str | None = "local"
    check: Callable[[Resolved], None] | None = None
    label: str | None = None
    plot_label: str | None = None
    summary: Callable[[TrainResult], dict] | None = None


def train_with(make_runner: RunnerFactory, entry: EntryPoint, config: PPOConfig | None, *,
               hparams: HyperParams | None, run_dir: str | Path | None, progress: bool | None,
               callback: Callable[[list[dict]], Any] | None, resume: str | Path | None,
               stop_after_iterations: int | None, plot: bool,
               trust_config: bool = True) -> TrainResult:
    """Check, resume, build the runner, open the run folder, run the loop and finish the folder.

    Args:
        make_runner: builds (and compiles) the runner from the checked start.
        entry: what the calling entry point names and checks differently.
        config, hparams, run_dir, progress, callback, resume, stop_after_iterations, plot,
            trust_config: as `train` takes them.

    Returns:
        The TrainResult.

    Raises:
        What `train` raises, and what `make_runner` raises.
    """
    if callback is not None and not callable(callback):
        raise ConfigError(f"callback={callback!r} must be a function of the metric rows of each "
                          "chunk (callback(rows), or callback(rows, run)), or None")
    config, run_dir, point = begin_resume(entry.caller, config, run_dir, resume, trust_config)
    try:
        start = _checked_start(entry, config, run_dir, point, hparams, stop_after_iterations)
    finally:
        if point is not None:
            point.close()
    config = start.resolved.config
    env = {"env": config.env_name}
    with compiling(progress):
        runner = make_runner(start)
    try:
        # Every check has passed: from here on the run folder may be written to.
        folder = open_folder(run_dir, config, start.iteration if point is not None else None)
        try:
            if folder is not None:
                folder.record_sweep(start.sweep_record)
            record = start.sweep_record
            schedules = schedule_record(start.hp, config)
            result = train_loop(
                runner, config, folder=folder, start_iter=start.iteration,
                resumed=point is not None, wall_offset=start.wall_offset,
                stop_after_iterations=stop_after_iterations, progress=progress,
                callback=callback, label=entry.label and entry.label.format(**env),
                member_labels=None if record is None else record["labels"],
                checkpoint_record=schedules)
            plot_label = entry.plot_label and entry.plot_label.format(**env)
            result._save = functools.partial(
                save_result, snapshot=runner.snapshot, record=schedules, sweep_record=record,
                label=plot_label, extra_summary=entry.summary)
            return finish_run(result, folder, entry.command, plot=plot, label=plot_label,
                              extra_summary=entry.summary(result) if entry.summary else None)
        finally:
            if folder is not None:
                folder.close()
    finally:
        runner.close()


def _local_runner(start: Start) -> Runner:
    """The chunk on this host's devices, or for an env that steps in Python the host loop
    (max_policy_lag 0) or the actor-learner."""
    resolved, hp = start.resolved, start.hp
    if resolved.host_loop:
        host = ActorLearnerRunner if resolved.config.max_policy_lag else HostLoopRunner
        return host(resolved, hp, start.restored)
    program = recent.program(resolved, hp, chunk_length(resolved.config))
    return ChunkRunner(program, hp, jax.random.PRNGKey(resolved.config.seed), start.restored)


def _checked_start(entry: EntryPoint, config: PPOConfig, run_dir, point: ResumePoint | None,
                   hparams: HyperParams | None, stop_after_iterations: int | None) -> Start:
    """Every check, then the hyperparameters and (resuming) the checkpoint's state."""
    resolved = prepare(config, run_dir, point, stop_after_iterations, entry.command, entry.layout)
    if entry.check is not None:
        entry.check(resolved)
    if hparams is not None:
        check_hparams(hparams, resolved.config.num_seeds, config=resolved.config)
    hp, record = sweep.run_hparams(resolved.config, hparams, run_dir, point is not None)
    start = Start(resolved, hp, sweep_record=record)
    if point is not None:  # read and check the checkpoint before compiling
        from_record = hparams is None and record is not None
        start.hp, notes = continue_schedules(hp, point.meta, resolved.config,
                                             given=hparams is not None, from_record=from_record,
                                             labels=record and record["labels"])
        start.restored, start.iteration, start.wall_offset = point.restore(
            _abstract_state(resolved, start.hp), resolved.config)
        print("\n".join(notes), file=sys.stderr, flush=True)
    return start


def _abstract_state(resolved: Resolved, hp: HyperParams) -> Any:
    """The shapes and dtypes of the run's unsharded TrainState, whatever layout saved it."""
    if resolved.host_loop:  # a gymnasium env: the learner state (jaxppo.run.hostloop)
        return hostloop.abstract_state(resolved, hp)
    program = build_program(resolved.with_layout(None), hp, 1)
    return jax.eval_shape(program.init, jax.random.PRNGKey(resolved.config.seed), hp)


def _note_unnamed_code(config: PPOConfig, run_dir, point: ResumePoint | None) -> None:
    """Say, when a new run folder starts, what of the run's own code its config.yaml can only
    name: a reward hook written as a function, a network class no other process can import."""
    if run_dir is None or point is not None:
        return
    where = Path(run_dir) / "config.yaml"
    hooks = function_hooks(config.transforms)
    if hooks:
        warn(f"the reward hook(s) {', '.join(map(repr, hooks))} are Python functions, which "
             f"{where} records by name only: the policy loads, evaluates and exports without "
             "them, but resuming needs them again from Python (jaxppo.train(config, "
             "resume=RUN_DIR) with the same transforms); to resume from the command line, make "
             "each a transform (jaxppo.envs.transforms.register_transform)")
    module = config.network.module
    named = network_record(module)[0] if is_flax_module(module) else ""
    if named and ":" not in named:
        warn(f"the network {named} cannot be imported by another process, so "
             f"{where} can only name it: load the policy with jaxppo.load_policy(RUN_DIR, "
             f"network={type(module).__name__}(...)) and resume from Python with it; for "
             "`jaxppo eval`, `export` and `--resume` on the command line, define it in a module "
             "of its own")


def prepare(config: PPOConfig, run_dir, point: ResumePoint | None, stop_after_iterations,
            resume_command: str, layout: Layout | str | None = None) -> Resolved:
    """The checks every entry point makes before building anything.

    Turns on the persistent compilation cache once they pass.

    Args:
        config: the run's config.
        run_dir: its run folder, or None.
        point: the checkpoint a resumed run continues from; None for a new run.
        stop_after_iterations: the iterations this call may run (None: to the end).
        resume_command: the command that continues a run, for the messages.
        layout: the layout to resolve the config on (`jaxppo.resolve`).

    Returns:
        The resolved run.

    Raises:
        ConfigError: a bad config, stop_after_iterations, or run folder.
        CheckpointError: a resumed run whose metrics.jsonl lacks rows.
    """
    resolved = resolve(config, layout)
    note_partial_batch(resolved.config)
    _note_unnamed_code(resolved.config, run_dir, point)
    check_wandb(resolved.config)  # the wandb package, when the config logs to W&B
    if stop_after_iterations is not None and (
            not isinstance(stop_after_iterations, int) or stop_after_iterations < 1):
        raise ConfigError(f"stop_after_iterations={stop_after_iterations!r} must be an "
                          "integer >= 1 (or None to run to the end)")
    check_start(run_dir, point, resolved.config, resume_command)
    enable_compilation_cache(resolved.config.compilation_cache_dir)
    return resolved


def check_hparams(hp, num_seeds: int, where: str = "train(config, hparams)",
                  config: PPOConfig | None = None) -> None:
    """ConfigError unless `hp` is a HyperParams of one setting, or (num_seeds > 1) a
    HyperParams.stack of exactly num_seeds settings; with `config`, also where `hp` gives
    the critic a learning rate that the config's program would not use."""
    if not isinstance(hp, HyperParams):
        raise ConfigError(
            f"{where}: hparams is {type(hp).__name__} {repr(hp)[:60]}, not a jaxppo.HyperParams; "
            "pass HyperParams.from_config(config) (or HyperParams.stack([...]) for a sweep)")
    if config is not None and not own_critic_lr(config) and not isinstance(
            hp.critic_lr_points, jax.core.Tracer) and np.any(
                np.asarray(hp.critic_lr_points)[..., 1] >= 0):
        raise ConfigError(
            f"{where}: hparams give critic_lr a value, but the config's critic_lr is null, so "
            "its program steps the critic with lr; set critic_lr in the config too (any value: "
            "each setting's own comes from hparams)")
    scalar_dims = {np.ndim(getattr(hp, f)) for f in HyperParams.scalar_leaves}
    point_dims = {np.ndim(getattr(hp, f)) for f in HyperParams.point_leaves}
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


def _check_train_key(key) -> None:
    """train_fn's key: one PRNG key (under jax.vmap, one per seed)."""
    try:
        check_key(key)
    except TypeError as e:
        raise TypeError(f"train_fn(key, ...): {e} (jax.vmap(train_fn)(jax.random.split(key, n)) "
                        "trains n seeds)") from None
