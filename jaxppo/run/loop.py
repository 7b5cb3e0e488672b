"""The run loop: the same for one device, this host's devices, or several hosts.

The loop does not know where the chunk runs: it drives a `jaxppo.run.runner.Runner`, and
between chunks it checks health (NaN/inf), appends metrics.jsonl, checkpoints on the
configured cadence, reports progress and calls the callback. Everything written goes through
one jaxppo.run.folder.RunFolder.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxppo.core.algorithm import METRIC_KEYS, Algorithm, TrainState
from jaxppo.config import PPOConfig
from jaxppo.errors import ActionMaskError, StopTraining, TrainingDivergedError, TrainingInterrupted
from jaxppo.core.evaluation import EVAL_METRIC_KEYS
from jaxppo.search.pbt import metric_keys as pbt_metric_keys
from jaxppo.program.build import auto_chunk
from jaxppo.program.layout import Layout, describe_layout
from jaxppo.run.policy import check_action_mask, check_key, check_obs, evaluate_policy
from jaxppo.run.folder import RunFolder
from jaxppo.run.runner import Runner
from jaxppo.process import __version__, process_uptime

# Metrics whose non-finite value means training diverged (episode stats are NaN by design
# when no episode ended in an iteration).
HEALTH_KEYS = ("policy_loss", "value_loss", "entropy", "kl", "grad_norm")


@dataclass
class TrainResult:
    """What `train` returns.

    params: the trained network params ([num_seeds, ...] leaves when num_seeds > 1).
    state: the final TrainState, with a leading [num_devices] axis when `device_axis` (the
    envs split over devices: params are identical across it) and then [num_seeds] when
    num_seeds > 1. Seeds or PBT members split over devices come back as one
    [num_seeds, ...] state, as from one device. `layout`: where the run trained, in words
    (e.g. "16 seeds over 2 CPU devices (8 each, no collectives)").
    metrics: name -> array [num_iterations] (num_seeds == 1) or [num_seeds, num_iterations];
    also `iteration`, `wall_time` (s since process start, at the end of the chunk that held
    the iteration; a resumed run adds the time of the processes before it) and `sps` (env
    steps per second of that chunk, all seeds); with eval_every, eval_return_mean/std and
    eval_length_mean (NaN on iterations without evaluation). A resumed run's metrics start
    at iteration 1 (the earlier ones are read back from metrics.jsonl).
    `policy(obs, key=None, deterministic=False, seed=0)` and `value(obs, seed=0)` take raw
    observations [..., *obs_shape] and apply the run's observation normalisation (a
    recurrent run acts through `jaxppo.load_policy(run_dir).step`; `evaluate` works for both);
    a run trained with the env's action mask also takes `action_mask=` [..., num_actions], the
    legal actions (as `jaxppo.Policy.step` does).
    iterations_done / completed: how far the run got (completed is False after
    stop_after_iterations); resumed_from: the checkpoint iteration it started from, if any.
    hosts: processes the run was spread over (1 unless jaxppo.distributed); host_failures:
    the hosts lost and replaced during the run; summary: summary.json's content (run folder);
    interrupted: the signal (SIGINT, SIGTERM) that stopped the run early, if one did;
    stopped: why the run stopped before its end, if a stop rule (stop_at_return,
    stop_after_no_improvement) or the callback (False, StopTraining) stopped it.
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
    interrupted: str | None = None
    stopped: str | None = None
    layout: str = ""
    device_axis: bool | None = None  # None: num_devices > 1

    def __post_init__(self):
        if self.device_axis is None:
            self.device_axis = self.num_devices > 1

    @property
    def env(self):
        """The env the run trained on (a gymnax env, wrapped by the config's transforms)."""
        return self._algorithm.spec.env

    @property
    def env_params(self):
        return self._algorithm.spec.env_params

    def _seed_slice(self, tree, seed):
        seeds = self.config.num_seeds
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < seeds:
            raise ValueError(f"seed={seed!r}, but the run trained {seeds} seed(s): use a seed "
                             f"index from 0 to {seeds - 1}")
        if self.device_axis:  # params are replicated: any device's copy will do
            tree = jax.tree.map(lambda x: x[0], tree)
        if seeds == 1:
            return tree
        return jax.tree.map(lambda x: x[seed], tree)

    def policy(self, obs, key=None, deterministic: bool = False, seed: int = 0,
               action_mask=None):
        if key is None:
            if not deterministic:
                raise ValueError("policy(obs, key): a PRNG key is needed to sample; "
                                 "pass key=jax.random.PRNGKey(0) or deterministic=True")
            key = jax.random.PRNGKey(0)
        check_key(key)
        obs = check_obs(obs, self._algorithm)
        mask = None if self._algorithm.recurrent else check_action_mask(action_mask, obs,
                                                                         self._algorithm)
        st = self._seed_slice(self.state, seed)
        return self._policy_fn(st.params, st.obs_stats, obs, key, deterministic, mask)

    def value(self, obs, seed: int = 0):
        obs = check_obs(obs, self._algorithm)
        st = self._seed_slice(self.state, seed)
        return self._value_fn(st.params, st.obs_stats, obs)

    def evaluate(self, episodes: int = 10, seed: int = 0, deterministic: bool = True,
                 max_steps: int | None = None, policy_seed: int = 0) -> dict:
        """One episode in each of `episodes` fresh envs reset from PRNGKey(seed), with the
        policy of seed `policy_seed`: return/length mean and std, and the per-episode arrays.
        `jaxppo.load_policy(run_dir).evaluate(...)` gives the same numbers."""
        st = self._seed_slice(self.state, policy_seed)
        return evaluate_policy(self._algorithm, st.params, st.obs_stats, episodes=episodes,
                               seed=seed, deterministic=deterministic, max_steps=max_steps)


def metric_keys(config: PPOConfig) -> tuple[str, ...]:
    """The metrics each iteration gives: the training ones, eval_* and PBT's when configured."""
    return (METRIC_KEYS + (EVAL_METRIC_KEYS if config.eval_every else ())
            + pbt_metric_keys(config))


def chunk_length(config: PPOConfig) -> int:
    """Iterations per call into the compiled program: log_every (default ~40 calls per run),
    never past a checkpoint iteration."""
    n_iter = config.num_iterations
    chunk_len = min(config.log_every or auto_chunk(n_iter), n_iter)
    if config.checkpoint_every:
        chunk_len = min(chunk_len, config.checkpoint_every)
    return chunk_len


class StopSignals:
    """SIGINT and SIGTERM during a run: stop after the running chunk, with everything saved.

    While active (a context manager, in the main thread) the signals do not kill the process.
    A watcher thread reads them through `signal.set_wakeup_fd`, so they are answered at once
    even while a chunk runs inside XLA. The first is acknowledged on stderr and recorded: the
    run loop stops after the running chunk and checkpoints. A second one stops at once: on
    the command line (exit_at_once) the process ends with the shell's code for that signal
    (130 for SIGINT) as soon as no file of the run folder is being written, the folder
    holding the last chunk's metrics and its last complete checkpoint; in a library call,
    KeyboardInterrupt is raised when Python next runs in the main thread.

    The command line enters one around the whole run (`exit_at_once=True`): a signal before
    training starts (while compiling) ends the process at once, and the loop's own
    `StopSignals.during_loop` joins it instead of installing another.
    """

    _active: StopSignals | None = None

    def __init__(self, exit_at_once: bool = False, command: str = "jaxppo train"):
        self.exit_at_once, self.command = exit_at_once, command
        self.received: str | None = None
        self.phase = "before"  # "before" the loop, in the "loop", "after" it (finishing)
        self.writing = threading.Lock()  # held while the loop writes to the run folder
        self.folder: RunFolder | None = None
        self.saver: _Saver | None = None
        self.rows_done: int | None = None
        self.final_chunk = False  # the running chunk is the loop's last
        self.num_iterations = 0
        self._raise = False
        self._lock = threading.RLock()
        self._previous: dict = {}
        self._socks = self._watcher = None
        self._previous_fd = -1

    @classmethod
    @contextlib.contextmanager
    def during_loop(cls, folder: RunFolder | None, saver: _Saver, num_iterations: int):
        """The run loop's signals: the command line's StopSignals when one is active, else
        a library call's own (installed for the loop only)."""
        outer = cls._active
        signals = outer if outer is not None else cls()
        with contextlib.nullcontext(signals) if outer is not None else signals:
            with signals._lock:
                signals.folder, signals.saver = folder, saver
                signals.num_iterations, signals.phase = num_iterations, "loop"
            try:
                yield signals
            finally:
                signals.phase = "after"

    def stopping(self) -> bool:
        """Whether a signal asked the loop to stop (signals not yet seen by the watcher are
        read first, so one sent a moment ago counts)."""
        self._drain()
        return self.received is not None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        self._socks = socket.socketpair()
        for s in self._socks:
            s.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._socks[1].fileno(),
                                                 warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        self._watcher = threading.Thread(target=self._watch, name="jaxppo-signals", daemon=True)
        self._watcher.start()
        if self.exit_at_once:
            StopSignals._active = self
        return self

    def __exit__(self, *exc):
        if self._socks is None:
            return False
        if StopSignals._active is self:
            StopSignals._active = None
        self._drain()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._socks[1].close()  # the watcher reads the end of the stream and returns
        self._watcher.join(timeout=5)
        self._socks[0].close()
        return False

    def _handle(self, signum, frame):
        """The main thread's handler. A library call's second signal raises here; on the
        command line the watcher thread (or `stopping`) acts, never code interrupted midway
        through a write."""
        if not self.exit_at_once:
            self._drain()
            if self._raise:
                self._raise = False
                raise KeyboardInterrupt

    def _watch(self) -> None:
        sock = self._socks[0]
        while True:
            try:
                select.select([sock], [], [])
            except (OSError, ValueError):
                return
            if not self._drain():
                return

    def _drain(self) -> bool:
        """Act on every signal number waiting in the wakeup socket; False once it is closed."""
        with self._lock:
            if self._socks is None:
                return False
            while True:
                try:
                    data = self._socks[0].recv(64)
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                if not data:
                    return False
                for signum in data:
                    self._on_signal(signal.Signals(signum).name)

    def _on_signal(self, name: str) -> None:
        if self.exit_at_once and self.phase == "before":
            _exit(name, f"{name} stopped jaxppo before training started; nothing was saved")
        if self.received is not None:  # the second: stop at once
            if self.exit_at_once:
                self._exit_now(name)
            self._raise = True
            return
        self.received = name
        if self.phase == "loop":
            then = ("Ctrl-C again to stop at once (the run folder keeps its last checkpoint)"
                    if self.exit_at_once else "Ctrl-C again to stop without saving")
            what = ("the running chunk is the last one: training ends with it and saves as usual"
                    if self.final_chunk else
                    "training stops after the running chunk and saves a checkpoint")
            print(f"\n{name}: {what}; {then}", file=sys.stderr, flush=True)
        else:
            print(f"\n{name}: the last chunk is done; writing the run folder's final files (a "
                  "moment); Ctrl-C again to stop at once", file=sys.stderr, flush=True)

    def _exit_now(self, name: str) -> None:
        """End the process once no file of the run folder is being written and the last
        checkpoint is complete, saying what the folder holds."""
        self.writing.acquire()  # waits for a write in progress; never released
        folder, saver = self.folder, self.saver
        if folder is None:
            _exit(name, f"{name} stopped training at once; no run folder was given, so nothing "
                        "was saved")
        # A checkpoint being written completes; if it fails, the ones before it stand.
        with contextlib.suppress(Exception):
            if folder.store is not None:
                folder.store.wait()
        saved = saver.saved_at if saver is not None else None
        rows = (f"; metrics.jsonl has iterations 1 to {self.rows_done} (a resume cuts it back to "
                f"{saved})" if self.rows_done and saved is not None and self.rows_done > saved
                else "")
        if saved:
            _exit(name, f"Second {name}: stopped at once. {folder.path} keeps the checkpoint of "
                        f"iteration {saved} of {self.num_iterations}{rows}; continue with: "
                        f"{self.command} --resume {folder.path}")
        _exit(name, f"Second {name}: stopped at once, before the first checkpoint was saved, so "
                    f"{folder.path} holds nothing to resume from (only the metrics of the "
                    "iterations so far); start the run again")


def _exit(name: str, message: str) -> None:
    """Print `message` and end the process now with the shell's code for signal `name`."""
    print(f"\n{message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + int(getattr(signal, name)))


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
        callback: called with the metric rows of each finished chunk; returning False or
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
    end_iter = config.num_iterations if stop_after_iterations is None else min(
        config.num_iterations, start_iter + stop_after_iterations)
    history = _History(config, folder.previous_rows if folder else [])
    reporter = _Reporter(config, config.num_iterations, progress, start=start_iter, label=label,
                         member_labels=member_labels)
    t_train = time.perf_counter()
    saver = _Saver(runner, config, folder, saved_at=start_iter if resumed else None,
                   record=checkpoint_record)
    rules = _StopRules(config, folder.previous_rows if folder else [])
    it, wall, last_row, stopped = start_iter, wall_offset, None, None
    if progress is not False:
        print(f"layout: {layout_text(runner, config)}", file=sys.stderr, flush=True)
    with StopSignals.during_loop(folder, saver, config.num_iterations) as signals:
        try:
            while it < end_iter and stopped is None and not signals.stopping():
                stop = _chunk_stop(config, it, end_iter, at_evals=folder is not None)
                signals.final_chunk = stop >= end_iter
                t0 = time.perf_counter()
                metrics = runner.train_chunk(it, stop)
                dt = time.perf_counter() - t0
                wall = wall_offset + process_uptime()
                sps = (stop - it) * config.batch_size * config.num_seeds / max(dt, 1e-9)
                rows = _chunk_rows(metrics, history.keys, it, stop, wall, sps, config.num_seeds)
                with signals.writing:  # a second signal waits for these writes
                    _check_masks(metrics, rows, last_row, folder, config)
                    _check_health(rows, last_row, folder, config.num_seeds)
                    history.append(metrics, it, stop, wall, sps)
                    if folder is not None:
                        folder.write_rows(rows)
                    it, last_row, signals.rows_done = stop, rows[-1], stop
                    saver.after_chunk(it, end_iter, wall)
                    stopped = rules.after_chunk(rows)
                    if folder is not None and rules.best_iter == it and rules.improved:
                        folder.save_best(rules.best_record(), runner.snapshot())
                try:
                    if callback is not None and callback(rows) is False:
                        stopped = stopped or "the callback returned False"
                except StopTraining as e:
                    stopped = stopped or ("the callback raised StopTraining"
                                          + (f": {e}" if str(e) else ""))
                except Exception as e:
                    _keep_on_failure(e, runner, config, folder, saver, signals, history, it, wall,
                                     start_iter if resumed else None, t_train)
                    raise
                reporter.update(it, rows, sps)
            with signals.writing:
                saver.at_end(it, wall)
        finally:
            reporter.close()
    # A signal during the last chunk stops nothing: the run (or this call's share) is done.
    interrupted = signals.received if it < end_iter and stopped is None else None
    return _result(runner, config, folder, history.metrics(), iterations_done=it,
                   resumed_from=start_iter if resumed else None,
                   train_seconds=time.perf_counter() - t_train, interrupted=interrupted,
                   stopped=stopped if it < config.num_iterations else None)


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


class _StopRules:
    """The config's stop rules, decided after each chunk on the mean over seeds (members),
    and the best evaluation so far (what best/ keeps): stop_at_return on the latest eval
    return (with eval_every) or the training return (each seed's latest finite
    episode_return_mean; every seed must have one), and stop_after_no_improvement on the
    evaluations since the best one. A resumed run counts its earlier evaluations too."""

    def __init__(self, config: PPOConfig, previous_rows: list[dict]):
        self.config = config
        self.best, self.best_iter, self.best_per_seed = -math.inf, None, []
        self.since = 0  # evaluations since the best one
        self.improved = False
        self._evaluations(previous_rows)

    def _evaluations(self, rows: list[dict]) -> tuple[int, float] | None:
        """Count the evaluations in `rows`; the latest as (iteration, mean over seeds)."""
        by_it: dict[int, list[float]] = {}
        for r in rows:
            v = r.get("eval_return_mean")
            if v is not None and math.isfinite(v):
                by_it.setdefault(r["iteration"], []).append(v)
        latest = None
        for it in sorted(by_it):
            mean = float(np.mean(by_it[it]))
            if mean > self.best:
                self.best, self.best_iter, self.best_per_seed = mean, it, by_it[it]
                self.since, self.improved = 0, True
            else:
                self.since += 1
            latest = (it, mean)
        return latest

    def after_chunk(self, rows: list[dict]) -> str | None:
        """Why the run stops after this chunk's `rows`, or None."""
        cfg = self.config
        self.improved = False
        latest = self._evaluations(rows)
        seeds = f" (mean over {cfg.num_seeds} seeds)" if cfg.num_seeds > 1 else ""
        it = rows[-1]["iteration"]
        if cfg.stop_at_return is not None:
            if cfg.eval_every:
                value, what = (latest[1], "eval") if latest else (None, "eval")
            else:
                value, what = self._training_return(rows), "training"
            if value is not None and value >= cfg.stop_at_return:
                return (f"the {what} return {value:.1f}{seeds} reached "
                        f"stop_at_return={cfg.stop_at_return:g} at iteration {it}")
        n = cfg.stop_after_no_improvement
        if n and latest is not None and self.since >= n:
            return (f"no better eval return{seeds} in {n} evaluations (the best, "
                    f"{self.best:.1f}, was at iteration {self.best_iter})")
        return None

    def _training_return(self, rows: list[dict]) -> float | None:
        last: dict[int, float] = {}
        for r in rows:
            v = r.get("episode_return_mean")
            if v is not None and math.isfinite(v):
                last[r.get("seed", 0)] = v
        return float(np.mean(list(last.values()))) if len(last) == self.config.num_seeds else None

    def best_record(self) -> dict:
        """best/best.json's content: the best evaluation's iteration and returns."""
        return {"iteration": self.best_iter,
                "env_steps": self.best_iter * self.config.batch_size,
                "eval_return_mean": self.best,
                "eval_return_per_seed": [float(v) for v in self.best_per_seed]}


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
    rows = []
    for j in range(stop - it):
        for s in range(seeds):
            row = {k: float(metrics[k][s, j] if seeds > 1 else metrics[k][j]) for k in keys}
            row.update(iteration=it + j + 1, wall_time=wall, sps=sps)
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
            + ". Try a lower lr, a smaller max_grad_norm, or "
            "normalize_observations=true / normalize_rewards=true.",
            row["iteration"],
            last_finite,
        )


class _History:
    """The run's metric arrays: a resumed run's earlier rows, then every chunk's metrics."""

    def __init__(self, config: PPOConfig, previous_rows: list[dict]):
        self.keys = metric_keys(config)
        self.seeds = config.num_seeds
        self.parts = _history_from_rows(previous_rows, self.keys, self.seeds)

    def append(self, metrics: dict, it: int, stop: int, wall: float, sps: float) -> None:
        for k in self.keys:
            self.parts[k].append(np.asarray(metrics[k]))
        n = stop - it
        for k, v in (("iteration", np.arange(it + 1, stop + 1)),
                     ("wall_time", np.full(n, wall)), ("sps", np.full(n, sps))):
            self.parts[k].append(np.broadcast_to(v, (self.seeds, n)) if self.seeds > 1 else v)

    def metrics(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v, axis=-1) for k, v in self.parts.items() if v}


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
        cfg, runner = self.config, self.runner
        self.folder.save_checkpoint(iteration, runner.snapshot(), {
            "env_steps": iteration * cfg.batch_size, "num_devices": runner.shards,
            "hosts": runner.hosts, "num_seeds": cfg.num_seeds,
            "wall_time": wall, "config": self.config_record, "env": cfg.env_name,
            "jaxppo_version": __version__, **self.record,
        })
        self.saved_at, self.saved_time = iteration, time.monotonic()


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
    """Where the runner trains, in one line (`jaxppo.resolve.describe_layout`)."""
    layout = getattr(runner, "layout", None)
    if layout is None:  # a runner over hosts, or the gymnasium host loop
        if runner.hosts > 1:
            layout = Layout(runner.shards // runner.hosts, runner.hosts)
        else:
            layout = Layout()
    hp = getattr(runner, "hp", None)
    return describe_layout(config, layout, sweep=hp is not None and np.ndim(hp.clip_param) == 1)

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
        elif k in METRIC_KEYS or k in EVAL_METRIC_KEYS or k.startswith(("pbt_", "hp_")):
            arr = arr.astype(np.float32)
        history[k].append(arr if seeds > 1 else arr[0])
    return history


def _short(row: dict | None) -> str:
    if not row:
        return "none (it failed in the first iteration)"
    keys = ("iteration", "episode_return_mean", "policy_loss", "value_loss", "grad_norm", "kl")
    return ", ".join(f"{k}={row[k]:.4g}" for k in keys if k in row)


class _Reporter:
    """Progress between chunks: a rich bar on a terminal, a plain line otherwise; both show
    the recent return, steps/s, the ETA and the last evaluation. The return is the mean over
    seeds; for a sweep (member_labels) the best and the worst setting instead, each the mean
    of the members with that label, e.g. "best lr=0.001: 480.2, worst lr=0.0001: 21.0"."""

    def __init__(self, config: PPOConfig, n_iter: int, progress: bool | None, start: int = 0,
                 label: str | None = None, member_labels: list[str] | None = None):
        self.n_iter = n_iter
        self.start = start
        self.config = config
        self.label = label or config.env_name
        self.member_labels = member_labels
        self.member_return: dict[int, float] = {}  # seed index -> recent return
        self.interactive = sys.stderr.isatty() if progress is None else progress
        self.quiet = progress is False
        self.last_return = float("nan")
        self.last_eval = "-"
        self.t0 = time.perf_counter()
        self.bar = None
        if self.interactive and not self.quiet:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            columns = [
                TextColumn(f"[bold]{self.label}[/]"), BarColumn(bar_width=16),
                MofNCompleteColumn(), TextColumn("return {task.fields[ret]}"),
                TextColumn("{task.fields[sps]} steps/s"),
            ]
            if config.eval_every:
                columns.append(TextColumn("eval {task.fields[eval]}"))
            columns += [TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
            self.bar = Progress(*columns)
            self.task = self.bar.add_task("train", total=n_iter, completed=start, ret="   -  ",
                                          sps="-", eval="-")
            self.bar.start()

    def _by_setting(self, per_seed: dict[int, float]) -> list[tuple[float, str]]:
        """(value, label) per distinct member label, best first; members that share a label
        (seeds of one setting) are averaged."""
        groups: dict[str, list[float]] = {}
        for s, v in per_seed.items():
            groups.setdefault(self.member_labels[s], []).append(v)
        return sorted(((float(np.mean(v)), k) for k, v in groups.items()), reverse=True)

    def return_text(self) -> str:
        """The return the progress shows: the mean over seeds, or a sweep's best and worst."""
        if not self.member_labels:
            return f"{self.last_return:.1f}"
        ranked = self._by_setting(self.member_return)
        if not ranked:
            return "-"
        (best, best_lab), (worst, worst_lab) = ranked[0], ranked[-1]
        if len(ranked) == 1:
            return f"{best_lab}: {best:.1f}"
        return f"best {best_lab}: {best:.1f}, worst {worst_lab}: {worst:.1f}"

    def update(self, done_iters: int, rows: list[dict], sps: float):
        rets = [r["episode_return_mean"] for r in rows if math.isfinite(r["episode_return_mean"])]
        if rets:
            self.last_return = float(np.mean(rets[-max(1, self.config.num_seeds) * 10:]))
        if self.member_labels:
            for s in range(len(self.member_labels)):
                own = [r["episode_return_mean"] for r in rows if r.get("seed", 0) == s
                       and math.isfinite(r["episode_return_mean"])]
                if own:
                    self.member_return[s] = float(np.mean(own[-10:]))
        evals = [r for r in rows if math.isfinite(r.get("eval_return_mean", float("nan")))]
        if evals:
            last = evals[-1]["iteration"]
            at_last = [r for r in evals if r["iteration"] == last]
            if self.member_labels:
                value, lab = self._by_setting(
                    {r.get("seed", 0): r["eval_return_mean"] for r in at_last})[0]
                self.last_eval = f"best {lab}: {value:.1f}@{last}"
            else:
                self.last_eval = f"{np.mean([r['eval_return_mean'] for r in at_last]):.1f}@{last}"
        if self.bar is not None:
            self.bar.update(self.task, completed=done_iters, ret=self.return_text(),
                            sps=f"{sps:,.0f}", eval=self.last_eval)
        elif not self.quiet:
            steps = done_iters * self.config.batch_size
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done_iters - self.start, 1) * (self.n_iter - done_iters)
            ev = f"  eval {self.last_eval}" if self.config.eval_every else ""
            print(f"[{self.label}] iter {done_iters}/{self.n_iter}  "
                  f"steps {steps:,}  return {self.return_text()}{ev}  {sps:,.0f} steps/s  "
                  f"ETA {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def finish_run(result: TrainResult, folder, resume_command: str, **finish) -> TrainResult:
    """Write the run folder's final files (params, summary, plot) and return the result, or
    raise TrainingInterrupted when a signal stopped the run (the files are written first)."""
    if folder is not None:
        outer = StopSignals._active  # the command line's: a second signal waits for these files
        with outer.writing if outer is not None else contextlib.nullcontext():
            result.summary = folder.finish(result, **finish)
    if result.interrupted:
        saved = (f"checkpoint, params and summary of iteration {result.iterations_done} are in "
                 f"{folder.path}; continue with: {resume_command} --resume {folder.path}"
                 if folder is not None else "no run folder was given, so nothing was saved")
        raise TrainingInterrupted(
            f"{result.interrupted} stopped training after iteration {result.iterations_done} of "
            f"{result.config.num_iterations}: {saved}", result.interrupted, result)
    return result


def open_folder(run_dir: str | Path | None, config: PPOConfig,
                resume_iteration: int | None) -> RunFolder | None:
    """The run folder at `run_dir` opened for writing (None when there is none); a resumed
    run's (`resume_iteration`) metrics.jsonl is cut back to its checkpoint."""
    return None if run_dir is None else RunFolder(run_dir, config, resume_iteration=resume_iteration)
