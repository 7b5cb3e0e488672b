"""The run loop: the same for one device, this host's devices, or several hosts.

The loop does not know where the chunk runs: it drives a `jaxppo.run.runner.Runner`, and
between chunks it checks health (NaN/inf), appends metrics.jsonl, checkpoints on the
configured cadence, applies the stop rules, reports progress and calls the callback.
Everything written goes through one jaxppo.run.folder.RunFolder.
"""

from __future__ import annotations

import inspect
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxppo.core.algorithm import update_metric_keys
from jaxppo.config import PPOConfig, steps_in_python
from jaxppo.errors import ActionMaskError, StopTraining, TrainingDivergedError, TrainingInterrupted
from jaxppo.core.evaluation import EVAL_METRIC_KEYS
from jaxppo.search.pbt import metric_keys as pbt_metric_keys
from jaxppo.program.build import auto_chunk
from jaxppo.program.layout import Layout, describe_layout
from jaxppo.run.actorlearner import metric_keys as actor_learner_metric_keys
from jaxppo.run.folder import RunFolder
from jaxppo.run.progress import Reporter
from jaxppo.run.result import TrainResult
from jaxppo.run.runner import Runner
from jaxppo.run.signals import StopSignals
from jaxppo.run.stop_rules import StopRules
from jaxppo.process import __version__, process_uptime


def train_loop(runner: Runner, config: PPOConfig, *, folder: RunFolder | None = None,
               start_iter: int = 0, resumed: bool = False, wall_offset: float = 0.0,
               stop_after_iterations: int | None = None, progress: bool | None = None,
               callback: Callable[[list[dict]], Any] | None = None, label: str | None = None,
               member_labels: list[str] | None = None,
               checkpoint_record: dict | None = None) -> TrainResult:
    """Train chunk after chunk from `start_iter` to the end (or stop_after_iterations more).

    Args:
        runner: where the chunks run.
        config: the run's (resolved) config.
        folder: the run folder that gets every metric row and checkpoint; None writes nothing.
        start_iter: the iteration the runner's state is at (a resumed run's checkpoint).
        resumed: True when that state comes from a checkpoint (not saved again unchanged).
        wall_offset: the wall time of the processes that ran the run before (a resumed run).
        stop_after_iterations: train at most this many iterations, then checkpoint and return.
        progress: a progress bar; None: a bar on a terminal, else a line per chunk; False: none.
        callback: called with the metric rows of each finished chunk (and a ChunkEnd, when it
            takes two arguments: the state and params then); returning False or
            raising StopTraining stops the run there (checkpointed, `stopped` says why). Any
            other exception from it is re-raised once a checkpoint, params.msgpack and
            summary.json of that iteration are written.
        label: the run's name in the progress (default: the env's name).
        member_labels: for a sweep, each seed index's hyperparameters ("lr=0.001"), which the
            progress shows instead of a mean over seeds.
        checkpoint_record: more entries for every checkpoint's record (the schedules the run
            trains with, which a resume continues).

    Returns:
        The TrainResult. On SIGINT/SIGTERM the loop stops after the running chunk and
        checkpoints; the result's `interrupted` names the signal (the caller finishes the run
        folder and raises). A signal during the last chunk stops nothing (`interrupted` stays
        None). A second signal stops at once (`StopSignals`).

    Raises:
        TrainingDivergedError: a health metric became NaN/inf (the rows before it are kept).
    """
    end_iter = _end_iteration(config, start_iter, stop_after_iterations)
    resumed_from = start_iter if resumed else None
    history = _History(config, folder.previous_rows if folder else [],
                       getattr(runner, "algorithm", None))
    reporter = _reporter(runner, config, progress, start_iter, label, member_labels)
    t_train = time.perf_counter()
    saver = _Saver(runner, config, folder, saved_at=resumed_from, record=checkpoint_record)
    rules = StopRules(config, folder.previous_rows if folder else [])
    it, wall, last_row, stopped = start_iter, wall_offset, None, None
    reporter.show_layout(layout_text(runner, config), runner.shards // runner.hosts)
    with StopSignals.during_loop(folder, saver, config.num_iterations) as signals:
        try:
            while it < end_iter and stopped is None and not signals.stopping():
                stop = _chunk_stop(config, it, end_iter, at_evals=folder is not None)
                signals.final_chunk = stop >= end_iter
                metrics, rows, wall, sps, stop = _run_chunk(runner, config, history.keys, it,
                                                            stop, wall_offset, signals)
                with signals.writing:  # a second signal waits for these writes
                    _check_rows(metrics, rows, last_row, folder, config)
                    history.append(metrics, it, stop, wall, sps)
                    if folder is not None:
                        folder.write_rows(rows)
                    it, last_row, signals.rows_done = stop, rows[-1], stop
                    saver.after_chunk(it, end_iter, wall)
                    stopped = rules.after_chunk(rows)
                    _keep_best(folder, rules, runner, it)
                try:
                    asked = _callback_stop(callback, rows, runner, config, it)
                except Exception as e:
                    _keep_on_failure(e, runner, config, folder, saver, signals, history, it, wall,
                                     resumed_from, t_train)
                    raise
                stopped = stopped or asked
                reporter.update(it, rows, sps)
            with signals.writing:
                saver.at_end(it, wall)
        finally:
            reporter.close()
    # A signal during the last chunk stops nothing: the run (or this call's share) is done.
    interrupted = signals.received if it < end_iter and stopped is None else None
    return _result(runner, config, folder, history.metrics(), iterations_done=it,
                   resumed_from=resumed_from, train_seconds=time.perf_counter() - t_train,
                   interrupted=interrupted, stopped=stopped if it < config.num_iterations else None)


def _reporter(runner: Runner, config: PPOConfig, progress: bool | None, start_iter: int,
              label: str | None, member_labels: list[str] | None) -> Reporter:
    """The run's progress: a multi-agent env's return is its team's, beside its win rate where
    the env reports wins (SMAX) and the episode value it shows (Overcooked's dishes)."""
    spec = runner.algorithm.spec
    shown = getattr(spec.env, "progress_value", None) if getattr(spec, "agents", ()) else None
    return Reporter(config, config.num_iterations, progress, start=start_iter, label=label,
                    member_labels=member_labels, team=bool(getattr(spec, "agents", ())),
                    wins=bool(getattr(runner.algorithm, "reports_wins", False)), value=shown)


def _end_iteration(config: PPOConfig, start_iter: int, more: int | None) -> int:
    """Where this call's training ends: the run's last iteration, or `more` after start_iter."""
    return config.num_iterations if more is None else min(config.num_iterations, start_iter + more)


def _run_chunk(runner: Runner, config: PPOConfig, keys, it: int, stop: int, wall_offset: float,
               signals: StopSignals) -> tuple[dict, list[dict], float, float, int]:
    """Iterations it+1..stop on the runner: their metrics and metrics.jsonl rows, the wall
    time at the chunk's end, its env steps per second (all seeds) and the iteration it ended
    at. A runner with a `stop_check` (the actor-learner) may end the chunk early when a stop
    signal comes, after one iteration at least. An error from the runner gets a note on what
    the run folder keeps."""
    if hasattr(runner, "stop_check"):
        runner.stop_check = lambda: signals.stopping() and not signals.final_chunk
    t0 = time.perf_counter()
    try:
        metrics = runner.train_chunk(it, stop)
    except Exception as e:
        _note_last_checkpoint(e, signals.folder, signals.saver, it)
        raise
    stop = it + np.shape(metrics["env_steps"])[-1]
    dt = time.perf_counter() - t0
    wall = wall_offset + process_uptime()
    sps = (stop - it) * config.batch_size * config.num_seeds / max(dt, 1e-9)
    rows = _chunk_rows(metrics, keys, it, stop, wall, sps, config.num_seeds)
    return metrics, rows, wall, sps, stop


def _check_rows(metrics: dict, rows: list[dict], last_row: dict | None, folder,
                config: PPOConfig) -> None:
    """A chunk's checks before its rows are kept: the action mask, then the health metrics
    (each raises after writing the rows before the first bad one)."""
    _check_masks(metrics, rows, last_row, folder, config)
    _check_health(rows, last_row, folder, config.num_seeds)


def _note_last_checkpoint(err: Exception, folder: RunFolder | None, saver: _Saver,
                          it: int) -> None:
    """A note on an error from the runner (an actor's exception, a stalled env): what the run
    folder keeps to continue from."""
    if folder is None:
        return
    saved = saver.saved_at
    err.add_note(f"jaxppo: the run stopped in the chunk after iteration {it}; "
                 + (f"{folder.path} keeps the checkpoint of iteration {saved}: continue with "
                    f"--resume {folder.path}" if saved else
                    f"{folder.path} holds no checkpoint yet (only the metrics so far)"))


def _keep_best(folder: RunFolder | None, rules: StopRules, runner: Runner, it: int) -> None:
    """best/ gets the state of iteration `it` when its evaluation is the best so far."""
    if folder is not None and rules.best_iter == it and rules.improved:
        folder.save_best(rules.best_record(), runner.snapshot())


class ChunkEnd:
    """What a callback of two arguments, `callback(rows, run)`, gets besides the rows: the
    run as the chunk left it. `iteration`, `env_steps` (per seed), `config`; `state` (the
    TrainState, numpy leaves, [num_seeds, ...] when num_seeds > 1) and `params` (its
    network params) are fetched from the devices when first read."""

    def __init__(self, runner: Runner, config: PPOConfig, iteration: int):
        self._runner, self.config, self.iteration = runner, config, iteration
        self.env_steps = iteration * config.batch_size
        self._state = None

    @property
    def state(self):
        if self._state is None:
            self._state = self._runner.snapshot()
        return self._state

    @property
    def params(self):
        return self.state.params


def takes_run(callback: Callable) -> bool:
    """True when `callback` takes a second positional argument (the ChunkEnd)."""
    try:
        ps = list(inspect.signature(callback).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in ps)


def _callback_stop(callback: Callable[..., Any] | None, rows: list[dict], runner: Runner,
                   config: PPOConfig, it: int) -> str | None:
    """Why the callback stops the run after the chunk of `rows` (it returned False or raised
    StopTraining), or None; any other exception from it goes on."""
    try:
        if callback is None:
            return None
        args = (rows, ChunkEnd(runner, config, it)) if takes_run(callback) else (rows,)
        if callback(*args) is False:
            return "the callback returned False"
    except StopTraining as e:
        return "the callback raised StopTraining" + (f": {e}" if str(e) else "")
    return None


def _keep_on_failure(err: Exception, runner: Runner, config: PPOConfig, folder, saver: _Saver,
                     signals: StopSignals, history: _History, it: int, wall: float,
                     resumed_from: int | None, t_train: float) -> None:
    """The callback raised: write the checkpoint, params.msgpack and summary.json of
    iteration `it` (the chunk it was called for) before the error goes on, and say so in a
    note on it."""
    if folder is None:
        return
    try:
        with signals.writing:
            saver.at_end(it, wall)
            result = _result(runner, config, folder, history.metrics(), iterations_done=it,
                             resumed_from=resumed_from, train_seconds=time.perf_counter() - t_train,
                             interrupted=None, stopped=f"the callback raised {type(err).__name__}")
            folder.finish(result, plot=False)
    except Exception as save_error:  # noqa: BLE001 - the callback's error is the one to raise
        err.add_note(f"jaxppo: saving the run after this error failed too: {save_error}")
        return
    err.add_note(f"jaxppo: the callback raised after iteration {it} of {config.num_iterations}; "
                 f"the checkpoint, params.msgpack and summary.json of that iteration are in "
                 f"{folder.path}; continue with --resume {folder.path}")


def open_folder(run_dir: str | Path | None, config: PPOConfig,
                resume_iteration: int | None) -> RunFolder | None:
    """The run folder at `run_dir` opened for writing (None when there is none); a resumed
    run's (`resume_iteration`) metrics.jsonl is cut back to its checkpoint."""
    return None if run_dir is None else RunFolder(run_dir, config, resume_iteration=resume_iteration)


def finish_run(result: TrainResult, folder, resume_command: str, **finish) -> TrainResult:
    """Write the run folder's final files (params, summary, plot) and return the result, or
    raise TrainingInterrupted when a signal stopped the run (the files are written first)."""
    if folder is not None:
        with StopSignals.holding_writes():  # the command line's: a second signal waits
            result.summary = folder.finish(result, **finish)
    if result.interrupted:
        saved = (f"checkpoint, params and summary of iteration {result.iterations_done} are in "
                 f"{folder.path}; continue with: {resume_command} --resume {folder.path}"
                 if folder is not None else "no run folder was given, so nothing was saved")
        raise TrainingInterrupted(
            f"{result.interrupted} stopped training after iteration {result.iterations_done} of "
            f"{result.config.num_iterations}: {saved}", result.interrupted, result)
    return result


def _result(runner: Runner, config: PPOConfig, folder, metrics: dict, *, iterations_done: int,
            resumed_from: int | None, train_seconds: float,
            interrupted: str | None, stopped: str | None = None) -> TrainResult:
    algo = runner.algorithm
    state = runner.final_state()
    params = jax.tree.map(lambda x: x[0], state.params) if runner.params_replicated else state.params
    return TrainResult(
        config=config, params=params, state=state, num_devices=runner.shards, hosts=runner.hosts,
        metrics=metrics, run_dir=folder.path if folder else None,
        compile_seconds=runner.compile_seconds, train_seconds=train_seconds, _algorithm=algo,
        _policy_fn=jax.jit(algo.act, static_argnames=("deterministic",)),
        _value_fn=jax.jit(algo.value), iterations_done=iterations_done,
        completed=iterations_done >= config.num_iterations, resumed_from=resumed_from,
        host_failures=list(runner.host_failures), interrupted=interrupted, stopped=stopped,
        layout=layout_text(runner, config), device_axis=bool(runner.params_replicated),
    )


def layout_text(runner: Runner, config: PPOConfig) -> str:
    """Where the runner trains, in one line (`jaxppo.program.layout.describe_layout`)."""
    layout = getattr(runner, "layout", None)
    if layout is None:  # a runner over hosts, or the gymnasium host loop
        if runner.hosts > 1:
            layout = Layout(runner.shards // runner.hosts, runner.hosts)
        else:
            layout = Layout()
    hp = getattr(runner, "hp", None)
    text = describe_layout(config, layout, sweep=hp is not None and np.ndim(hp.clip_param) == 1)
    note = getattr(runner, "layout_note", None)  # e.g. the actor-learner's threads and lag
    return f"{text}; {note}" if note else text


def metric_keys(config: PPOConfig, algorithm=None) -> tuple[str, ...]:
    """The metrics each iteration gives: the training ones (with a multi-agent env's own, of
    its `algorithm`, and critic_lr when set), and eval_*, PBT's and the actor-learner's when
    configured."""
    agents = algorithm.agent_metric_keys if algorithm is not None else ()
    evals = algorithm.eval_metric_keys if algorithm is not None else EVAL_METRIC_KEYS
    return (update_metric_keys(config) + agents + (evals if config.eval_every else ())
            + pbt_metric_keys(config) + actor_learner_metric_keys(config))


def chunk_length(config: PPOConfig) -> int:
    """Iterations per call into the compiled program: log_every (default ~40 calls per run),
    never past a checkpoint iteration. An env that steps in Python gains nothing from longer
    chunks (each iteration is a call from Python anyway): by default its chunk is one
    iteration, so that progress, checkpoint_minutes and stop signals come after each."""
    n_iter = config.num_iterations
    auto = 1 if steps_in_python(config.env) else auto_chunk(n_iter)
    chunk_len = min(config.log_every or auto, n_iter)
    if config.checkpoint_every:
        chunk_len = min(chunk_len, config.checkpoint_every)
    return chunk_len


def _chunk_stop(config: PPOConfig, it: int, end_iter: int, at_evals: bool = False) -> int:
    """Where the chunk from `it` ends: a chunk's length on, never past a checkpoint iteration
    (nor, `at_evals`, past an evaluation, so that the best-evaluated params can be kept)."""
    stop = min(end_iter, it + chunk_length(config))
    for every in (config.checkpoint_every, config.eval_every if at_evals else 0):
        if every:
            stop = min(stop, (it // every + 1) * every)
    return stop


def _chunk_rows(metrics: dict, keys, it: int, stop: int, wall: float, sps: float,
                seeds: int) -> list[dict]:
    """metrics.jsonl's rows of iterations it+1..stop: one per iteration (and seed)."""
    n = stop - it
    arrays = {k: np.asarray(metrics[k]).reshape(seeds, n) for k in keys}
    for k, v in (("iteration", np.arange(it + 1, stop + 1)), ("wall_time", np.full(n, wall)),
                 ("sps", np.full(n, sps))):
        arrays[k] = np.broadcast_to(v, (seeds, n))
    return metric_rows(arrays, keys, seeds)


def metric_rows(metrics: dict, keys, seeds: int) -> list[dict]:
    """metrics.jsonl's rows, one per iteration (and seed, when several), from [seeds, n]
    arrays of `keys` and of iteration, wall_time and sps."""
    rows = []
    for j in range(np.shape(metrics["iteration"])[-1]):
        for s in range(seeds):
            row = {k: float(metrics[k][s, j]) for k in keys}
            row.update(iteration=int(metrics["iteration"][s, j]),
                       wall_time=float(metrics["wall_time"][s, j]), sps=float(metrics["sps"][s, j]))
            if seeds > 1:
                row["seed"] = s
            rows.append(row)
    return rows


def _check_masks(metrics: dict, rows: list[dict], last_row: dict | None, folder,
                 config: PPOConfig) -> None:
    """ActionMaskError at the first iteration whose rollout met a state the env's action mask
    left without a legal action, after writing the rows before it."""
    counts = metrics.get("masked_out_states")
    if counts is None:
        return
    per_iter = np.asarray(counts).reshape((-1, np.shape(counts)[-1])).sum(axis=0)
    bad = np.flatnonzero(per_iter > 0)
    if bad.size == 0:
        return
    j = int(bad[0])
    seeds = config.num_seeds
    if folder is not None:
        folder.write_rows(rows[:j * seeds])
    iteration = rows[j * seeds]["iteration"]
    raise ActionMaskError(
        f"{config.env_name}'s action mask left {int(per_iter[j])} state(s) with no legal "
        f"action in iteration {iteration}'s rollout, so the policy had no action to choose "
        "there. Fix the env's action_mask(state, params) so that every state it reaches has "
        "at least one legal action (a state with none should end the episode), or set "
        "mask_actions=false to train without the mask. Metrics so far are kept"
        + (f" in {folder.path / 'metrics.jsonl'}" if folder else "") + ".",
        iteration, rows[j * seeds - 1] if j else last_row)


# Metrics whose non-finite value means training diverged (episode stats are NaN by design
# when no episode ended in an iteration).
HEALTH_KEYS = ("policy_loss", "value_loss", "entropy", "kl", "grad_norm")


def _check_health(rows: list[dict], last_row: dict | None, folder, seeds: int) -> None:
    """TrainingDivergedError at the first row with a non-finite health metric, after writing
    the rows before it; `last_row`: the previous chunk's last row."""
    for i, row in enumerate(rows):
        bad = [k for k in HEALTH_KEYS if not math.isfinite(row[k])]
        if not bad:
            continue
        if folder is not None:
            folder.write_rows(rows[:i])
        last_finite = rows[i - 1] if i else last_row
        raise TrainingDivergedError(
            f"training diverged at iteration {row['iteration']}"
            + (f" (seed {row['seed']})" if seeds > 1 else "")
            + f": {', '.join(bad)} became NaN/inf. Last finite metrics: "
            f"{_short(last_finite)}. Metrics so far are kept"
            + (f" in {folder.path / 'metrics.jsonl'}" if folder else "")
            + ". " + _divergence_advice(row["iteration"]),
            row["iteration"],
            last_finite,
        )


def _divergence_advice(iteration: int) -> str:
    """What to try for a run that diverged at `iteration`: in the first, the network's or the
    env's numbers come before the step size."""
    later = ("Try a lower lr, a smaller max_grad_norm, or normalize_observations=true / "
             "normalize_rewards=true.")
    if iteration > 1:
        return later
    return ("It failed in the first iteration, where the usual cause is not the step size: "
            "check that the network gives finite outputs for the env's observations (a custom "
            "module's log of a non-positive number, a division by zero, an unset parameter) "
            "and that the env's observations and rewards are finite. If they are: " + later)


def _short(row: dict | None) -> str:
    if not row:
        return "none (it failed in the first iteration)"
    keys = ("iteration", "episode_return_mean", "policy_loss", "value_loss", "grad_norm", "kl")
    return ", ".join(f"{k}={row[k]:.4g}" for k in keys if k in row)


class _History:
    """The run's metric arrays: a resumed run's earlier rows, then every chunk's metrics."""

    def __init__(self, config: PPOConfig, previous_rows: list[dict], algorithm=None):
        self.keys = metric_keys(config, algorithm)
        self.seeds = config.num_seeds
        self.parts = _history_from_rows(previous_rows, self.keys, self.seeds)

    def append(self, metrics: dict, it: int, stop: int, wall: float, sps: float) -> None:
        for k in self.keys:
            arr = np.asarray(metrics[k])  # [seeds, n]; the chunk of one seed is [n]
            self.parts[k].append(arr[None] if self.seeds == 1 else arr)
        n = stop - it
        for k, v in (("iteration", np.arange(it + 1, stop + 1)),
                     ("wall_time", np.full(n, wall)), ("sps", np.full(n, sps))):
            self.parts[k].append(np.broadcast_to(v, (self.seeds, n)))

    def metrics(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v, axis=-1) for k, v in self.parts.items() if v}


def _history_from_rows(rows: list[dict], keys, seeds: int) -> dict[str, list]:
    """Metric arrays of earlier rows (a resumed run's past), as the first entry of each list."""
    history: dict[str, list] = {k: [] for k in keys + ("iteration", "wall_time", "sps")}
    if not rows:
        return history
    by_seed = [[r for r in rows if r.get("seed", 0) == s] for s in range(seeds)]
    n = min(len(b) for b in by_seed)
    for k in history:
        arr = np.asarray([[np.nan if r.get(k) is None else r[k] for r in b[:n]] for b in by_seed],
                         np.float64)
        if k == "iteration":
            arr = arr.astype(np.int64)
        elif k in ("env_steps", "episodes"):  # the dtypes the compiled program returns
            arr = arr.astype(np.int32)
        elif k not in ("wall_time", "sps"):  # every other metric: float32, as computed
            arr = arr.astype(np.float32)
        history[k].append(arr)
    return history


class _Saver:
    """The checkpoint cadence: every checkpoint_every iterations, after checkpoint_minutes,
    and at the end of the call (unless the state is saved already)."""

    def __init__(self, runner: Runner, config: PPOConfig, folder, saved_at: int | None,
                 record: dict | None = None):
        self.runner, self.config, self.folder = runner, config, folder
        self.saved_at, self.saved_time = saved_at, time.monotonic()
        self.config_record = config.to_dict()
        self.record = record or {}

    def after_chunk(self, it: int, end_iter: int, wall: float) -> None:
        cfg = self.config
        if self.folder is not None and (
                (cfg.checkpoint_every and it % cfg.checkpoint_every == 0)
                or (cfg.checkpoint_minutes and it < end_iter and time.monotonic()
                    - self.saved_time >= 60 * cfg.checkpoint_minutes)):
            self.save(it, wall)

    def at_end(self, it: int, wall: float) -> None:
        if self.folder is not None and self.saved_at != it:
            self.save(it, wall)

    def save(self, iteration: int, wall: float) -> None:
        runner = self.runner
        self.folder.save_checkpoint(iteration, runner.snapshot(), checkpoint_meta(
            self.config, iteration, wall, runner.shards, runner.hosts, self.record,
            self.config_record))
        self.saved_at, self.saved_time = iteration, time.monotonic()


def checkpoint_meta(config: PPOConfig, iteration: int, wall: float, shards: int, hosts: int,
                    record: dict, config_record: dict | None = None) -> dict:
    """A checkpoint's record: where the run was, how it was laid out, its config, and
    `record` (the schedules it trains with, which a resume continues)."""
    return {"env_steps": iteration * config.batch_size, "num_devices": shards, "hosts": hosts,
            "num_seeds": config.num_seeds, "wall_time": wall,
            "config": config_record or config.to_dict(), "env": config.env_name,
            "jaxppo_version": __version__, **record}
