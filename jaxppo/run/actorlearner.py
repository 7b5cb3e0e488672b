"""Actor-learner mode (the Sebulba layout) for envs that step in Python: `max_policy_lag >= 1`.

`actor_threads` threads each own a vector env of num_envs / actor_threads envs (a
`jaxppo.run.hostloop.HostRollout`) and play rollouts of num_steps steps with the jitted policy,
each with the newest params the learner has published; the learner (the thread that calls
`train_chunk`: the run loop's) takes one rollout from every actor per update, joins them along
the env axis (one update sees num_envs x num_steps, as configured) and runs the host loop's
compiled update (`jaxppo.core.ppo.update`), whose importance ratio is against the log-probs the
actors recorded. Acting and learning overlap: while the learner learns from rollout k, the
actors play rollout k + 1.

The schedule. Rollout k (from 0) is learned by update k + 1; played with params version v (the
params after v updates), its lag is k - v. Having played rollout k - 1, an actor takes the
params for rollout k (waiting until version >= k - max_policy_lag exists; then the newest)
*before* it hands rollout k - 1 over, so the newest version it can see is k - 1: at lag 1 every
rollout k >= 1 is played with version k - 1 whatever the timing, and a run repeats exactly
given its seed. At lag >= 2 the version a rollout sees depends on timing; each rollout records
it (and the observation statistics it normalised with), and the metrics report the lags.

Randomness: rollout k's sampling noise comes from `fold_in(actors' key, k)` and each env's
global index (`jaxppo.core.ppo.rollout_noise`), and the envs reset from the host loop's seeds,
so the numbers do not depend on how many actor threads share the envs either.

Faults: an actor's exception stops the run with that exception (a note says which actor, which
rollout and where); a learner that waits longer than `rollout_timeout` for a rollout stops with
a `RolloutTimeoutError`; SIGINT/SIGTERM end the running chunk after the update in progress
(`stop_check`); `close()` stops and joins the actor threads.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxppo.core.algorithm import Transition, TrainState
from jaxppo.core.hyperparams import HyperParams
from jaxppo.core.losses import shares_log_std
from jaxppo.errors import RolloutTimeoutError, warn
from jaxppo.process import release_free_memory
from jaxppo.program.resolved import Resolved
from jaxppo.run.hostloop import (HostLoopRunner, HostRollout, SeedRollouts, iteration_of,
                                open_rollout, over_seeds, zero_transition)

ACTOR_KEY_TAG = 0xAC7  # folds the actors' key stream out of the run's key
METRIC_KEYS = ("policy_lag", "actor_wait_seconds", "learner_wait_seconds")
POLL_SECONDS = 0.05  # how often a waiting thread looks for a stop, an error or a timeout
JOIN_SECONDS = 10.0  # how long close() waits for the actor threads to stop
MIN_TIMEOUT = 60.0  # the derived rollout timeout's floor, in seconds


def metric_keys(config) -> tuple[str, ...]:
    """The metrics an actor-learner run adds to each iteration's row: the policy lag its
    update saw (mean over its rollouts, in updates), the seconds the actors waited for params
    before those rollouts (mean) and the seconds the learner waited for them."""
    return METRIC_KEYS if config.max_policy_lag else ()


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def actor_threads(config, cores: int | None = None, hosts: int = 1) -> tuple[int, str]:
    """(actor threads, why): the config's, or with actor_threads null the most that divide
    this host's envs (num_envs / hosts) and leave one of the cores to the learner."""
    if config.actor_threads is not None:
        return config.actor_threads, f"actor_threads={config.actor_threads}"
    cores = available_cores() if cores is None else cores
    most = max(1, cores - 1)
    envs = config.num_envs // hosts
    threads = max(d for d in range(1, min(most, envs) + 1) if envs % d == 0)
    mine = (f"num_envs={config.num_envs}" if hosts == 1 else
            f"this host's {envs} envs (num_envs={config.num_envs} / {hosts} hosts)")
    return threads, (f"actor_threads null: {cores} core{'s' if cores > 1 else ''}, one left to "
                     "the learner" + (f", {threads} dividing {mine}" if threads < most else ""))


@dataclasses.dataclass
class Rollout:
    """What an actor hands the learner: rollout `index` (learned by update index + 1)."""

    index: int
    version: int  # the params version it was played with (the params after `version` updates)
    traj: Transition  # numpy [T, E_a, ...]
    obs_stats: Any  # the observation statistics the policy normalised with (of that version)
    wait_seconds: float  # how long the actor waited for those params
    seconds: float  # how long playing it took
    envs_after: tuple  # the envs' observations and episode trackers after it (for snapshots)


class ParamsBoard:
    """The newest params (with the observation statistics) the learner has published, and
    their version; actors wait on it for a version recent enough."""

    def __init__(self, params, obs_stats, version: int):
        self._cond = threading.Condition()
        self._latest = (version, params, obs_stats)

    def publish(self, version: int, params, obs_stats) -> None:
        with self._cond:
            self._latest = (version, params, obs_stats)
            self._cond.notify_all()

    def wait(self, version: int, stop: threading.Event) -> tuple | None:
        """(version, params, obs_stats) of the newest params once their version is >= `version`;
        None when `stop` is set first."""
        with self._cond:
            while self._latest[0] < version:
                if stop.is_set():
                    return None
                self._cond.wait(POLL_SECONDS)
            return self._latest


@dataclasses.dataclass
class _Shared:
    """What every actor thread reads: the board, the stop flag, the noise and the schedule."""

    board: ParamsBoard
    stop: threading.Event
    noise: Callable  # (key, env_ids) -> noise [S?, T, E_a, A]
    key: jax.Array  # the actors' key stream (rollout k: fold(key, k)), one per seed [S?, 2]
    fold: Callable  # jax.random.fold_in, over seeds
    gamma: Any  # one per seed [S] with several
    max_lag: int
    end: int  # rollouts 0..end-1 (the run's num_iterations)


class Actor:
    """One actor thread: its envs (a HostRollout, or SeedRollouts: its envs of every seed),
    the global ids of those envs and the queue
    its rollouts go to (bounded: at most max_policy_lag wait there)."""

    def __init__(self, index: int, rollout: HostRollout | SeedRollouts, env_ids: np.ndarray,
                 max_lag: int):
        self.index = index
        self.rollout = rollout
        self.env_ids = env_ids
        self.queue: queue.Queue = queue.Queue(maxsize=max_lag)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.playing: int | None = None  # the rollout it plays (None: between rollouts)
        self.phase = "starting"

    def start(self, first: int, shared: _Shared) -> None:
        self.thread = threading.Thread(target=self._run, args=(first, shared), daemon=True,
                                       name=f"jaxppo-actor-{self.index}")
        self.thread.start()

    def _run(self, first: int, shared: _Shared) -> None:
        try:
            self._play_from(first, shared)
        except BaseException as e:  # noqa: BLE001 - the learner raises it
            self.error = e
        self.phase = "ended"

    def _params_for(self, k: int, shared: _Shared):
        """(version, params, obs_stats, seconds waited) for rollout k, or None once stopped."""
        self.phase = f"waiting for params of version >= {k - shared.max_lag} for rollout {k}"
        t0 = time.perf_counter()
        got = shared.board.wait(max(0, k - shared.max_lag), shared.stop)
        return None if got is None else (*got, time.perf_counter() - t0)

    def _play_from(self, k: int, shared: _Shared) -> None:
        got = self._params_for(k, shared)
        while got is not None:
            version, params, obs_stats, waited = got
            self.playing, self.phase = k, f"stepping its envs (rollout {k})"
            noise = np.asarray(shared.noise(shared.fold(shared.key, k), self.env_ids))
            t0 = time.perf_counter()
            traj = self.rollout.collect(params, obs_stats, noise, shared.gamma)
            r = self.rollout
            item = Rollout(k, version, traj, obs_stats, waited, time.perf_counter() - t0,
                           (r.obs.copy(), r.discounted_return.copy(), r.episode_return.copy(),
                            r.episode_length.copy()))
            self.playing, k = None, k + 1
            # The next rollout's params before this one is handed over (see the module doc).
            got = self._params_for(k, shared) if k < shared.end else None
            if not self._put(item, shared.stop):
                return

    def _put(self, item: Rollout, stop: threading.Event) -> bool:
        self.phase = f"handing rollout {item.index} over"
        while not stop.is_set():
            try:
                self.queue.put(item, timeout=POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False


class _Stopped(Exception):
    """The loop asked the chunk to end (a stop signal) while the learner waited."""


class ActorLearnerRunner(HostLoopRunner):
    """The `jaxppo.run.runner.Runner` of an env stepped in Python with max_policy_lag >= 1:
    actor threads play rollouts while the learner (the caller of `train_chunk`) learns.
    `snapshot()` is the learner state, as the host loop's."""

    extra_metric_keys = METRIC_KEYS

    def __init__(self, resolved: Resolved, hp: HyperParams, restored: TrainState | None = None,
                 keys: jax.Array | None = None):
        cfg = resolved.config
        self.max_lag = cfg.max_policy_lag
        self.threads, why = actor_threads(cfg, hosts=resolved.layout.num_processes)
        self.actors: list[Actor] = []
        self._stop = threading.Event()
        self._shared: _Shared | None = None
        self._taken: list[Rollout] = []  # this update's rollouts so far
        self._slowest = 0.0  # the slowest rollout so far, in seconds
        self.last_rollouts: list[Rollout] = []  # those the last update learned from, in actor order
        # Set by the run loop: True when a stop signal asks the running chunk to end (which
        # it does after its first iteration: a chunk does at least one).
        self.stop_check: Callable[[], bool] | None = None
        self._may_stop = False
        super().__init__(resolved, hp, restored, keys)
        per = cfg.num_envs // self.hosts // self.threads
        self.layout_note = (f"actor-learner: {self.threads} actor thread"
                            f"{'s' if self.threads > 1 else ''} x {per} envs"
                            f"{' of each seed' if self.seeded else ''} ({why}), "
                            f"max_policy_lag {self.max_lag}"
                            + (f", acting on one device, the update split over {self.shards}"
                               if self.shards > 1 else ""))
        if self.hosts == 1:
            state = self.learner.unsharded(self.state)
            self._envs_after = (np.asarray(state.last_obs), *(np.asarray(x) for x in (
                state.discounted_return, state.episode_return, state.episode_length)))
        else:  # this host's envs, as they start
            obs = self._joined_obs()
            zeros = np.zeros(obs.shape[:self._env_axis + 1], np.float32)
            self._envs_after = (obs, zeros, zeros.copy(), zeros.astype(np.int32))

    def _open_envs(self, seeds: list[list[int]]) -> np.ndarray:
        per = len(seeds[0]) // self.threads
        for a in range(self.threads):  # close() closes those made when one fails
            first = self.env_lo + a * per  # global ids
            ids = np.arange(first, first + per, dtype=np.int32)
            rollout = open_rollout(self.algorithm, [s[a * per:(a + 1) * per] for s in seeds])
            self.actors.append(Actor(a, rollout, ids, self.max_lag))
        return self._joined_obs()

    def _joined_obs(self) -> np.ndarray:
        """Every actor's envs' observations, joined along the envs [S?, E/hosts, ...]."""
        return np.concatenate([a.rollout.obs for a in self.actors], axis=self._env_axis)

    @property
    def _env_axis(self) -> int:
        return 1 if self.config.num_seeds > 1 else 0

    def _compile(self):
        state, first = self.acting_state(), self.actors[0]
        noise = jax.eval_shape(self._noise, state.rng, first.env_ids)
        np.asarray(self._noise(state.rng, first.env_ids))  # compiled for the actors' env count
        step_noise = np.zeros(noise.shape[:self._env_axis] + noise.shape[self._env_axis + 1:],
                              noise.dtype)  # one step's: [S?, E_a, A]
        outs = first.rollout.warm_up(state.params, state.obs_stats, step_noise)
        zero = zero_transition(outs, self.config.num_steps, first.rollout.obs, self.seeded,
                               first.rollout.policy_inputs()[3])
        self._compile_update(join_rollouts([zero] * self.threads, self.seeded))

    # ------------------------------------------------------------------ the Runner protocol
    def train_chunk(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Iterations start+1..stop (fewer when `stop_check` asks the chunk to end: one at
        least); their metrics [iterations done]."""
        if iteration_of(self.state) != start:
            raise ValueError(f"train_chunk({start}, {stop}): the learner is at iteration "
                             f"{iteration_of(self.state)}")
        rows = []
        for it in range(start + 1, stop + 1):
            self._may_stop = bool(rows)
            if self._stop_asked():
                break
            try:
                metrics = self.iterate()[0]
            except _Stopped:
                break
            rows.append(self.with_evaluation(it, metrics))
        return self.columns(rows)

    def iterate(self) -> tuple[dict, Transition]:
        """One update: a rollout from every actor (waiting for them), joined along the envs,
        then the compiled update; the new params are published. Returns its metrics (numpy
        scalars, the policy lag and the waits among them) and the joined rollout."""
        state = self.state
        k = iteration_of(state)
        self.last_rollouts = []  # the last update's: not held through this one
        self._start_actors(k)
        t0 = time.perf_counter()
        while len(self._taken) < self.threads:
            self._taken.append(self._take(self.actors[len(self._taken)], k))
        waited = time.perf_counter() - t0
        taken, self._taken = self._taken, []
        traj = join_rollouts([r.traj for r in taken], self.seeded)
        t1 = time.perf_counter()
        self.state, metrics = self.learner.update(state, traj)
        acting = self.acting_state()
        self._shared.board.publish(k + 1, acting.params, acting.obs_stats)
        self._envs_after = tuple(np.concatenate(parts, axis=self._env_axis) for parts in
                                 zip(*(r.envs_after for r in taken)))
        metrics = dict(jax.device_get(metrics))
        release_free_memory(time.perf_counter() - t1)  # what a long update freed
        metrics.update(policy_lag=np.float32(np.mean([k - r.version for r in taken])),
                       actor_wait_seconds=np.float32(np.mean([r.wait_seconds for r in taken])),
                       learner_wait_seconds=np.float32(waited))
        self.last_rollouts = taken
        return metrics, traj

    def _stop_asked(self) -> bool:
        return self._may_stop and self.stop_check is not None and self.stop_check()

    def _start_actors(self, start: int) -> None:
        if self._shared is not None:
            return
        cfg, state = self.config, self.acting_state()
        fold = over_seeds(jax.random.fold_in, self.seeded, (0, None))
        key = fold(self.keys if self.seeded else self.keys[0], ACTOR_KEY_TAG)
        self._shared = _Shared(
            board=ParamsBoard(state.params, state.obs_stats, start), stop=self._stop,
            noise=self._noise, key=key, fold=fold, gamma=self._gamma, max_lag=self.max_lag,
            end=cfg.num_iterations)
        for actor in self.actors:
            actor.start(start, self._shared)

    def _take(self, actor: Actor, k: int) -> Rollout:
        """Actor `actor`'s rollout k, waiting for it; raises the actor's error, _Stopped when
        the loop asks the chunk to end, RolloutTimeoutError after the timeout."""
        t0 = time.perf_counter()
        while True:
            try:
                item = actor.queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._raise_actor_error()
                if self._stop_asked():
                    raise _Stopped from None
                waited = time.perf_counter() - t0
                if waited > self._timeout():
                    raise self._timeout_error(actor, k, waited) from None
                continue
            if item.index != k:  # cannot happen: each queue is in order
                raise RuntimeError(f"actor {actor.index} handed over rollout {item.index}, "
                                   f"the learner expected {k}")
            self._slowest = max(self._slowest, item.seconds)
            return item

    def _timeout(self) -> float:
        given = self.config.rollout_timeout
        return given if given is not None else max(MIN_TIMEOUT, 10 * self._slowest)

    def _timeout_error(self, actor: Actor, k: int, waited: float) -> RolloutTimeoutError:
        cfg = self.config
        lo, hi = int(actor.env_ids[0]), int(actor.env_ids[-1])
        limit = (f"rollout_timeout={cfg.rollout_timeout:g}" if cfg.rollout_timeout is not None
                 else f"rollout_timeout null: {MIN_TIMEOUT:.0f} s or 10x the slowest rollout so "
                      f"far ({self._slowest:.2f} s)")
        return RolloutTimeoutError(
            f"actor thread {actor.index} of {self.threads} (envs {lo}-{hi}) handed over no "
            f"rollout for {waited:.1f} s ({limit}) while the learner waited for rollout {k} "
            f"(iteration {k + 1}); the actor is {actor.phase}: its envs stopped answering, or "
            "run far slower than before. If they are only slow, raise rollout_timeout (e.g. "
            f"rollout_timeout={max(2 * waited, 120):.0f})")

    def _raise_actor_error(self) -> None:
        """An actor's exception, raised here with a note on where it came from."""
        for actor in self.actors:
            err = actor.error
            if err is None:
                continue
            actor.error = None
            where = _where(err)
            lo, hi = int(actor.env_ids[0]), int(actor.env_ids[-1])
            what = (f"while playing rollout {actor.playing} (iteration {actor.playing + 1})"
                    if actor.playing is not None else f"while {actor.phase}")
            err.add_note(f"jaxppo: actor thread {actor.index} of {self.threads} (envs {lo}-{hi}) "
                         f"raised this {what}; the run stopped. Where: {where}")
            raise err

    def _trackers(self) -> dict:
        """The envs' observations and episode trackers after the rollouts the last update
        learned from (which a resume does not use: it restarts the envs)."""
        last_obs, disc, ret, length = (x.copy() for x in self._envs_after)
        return dict(last_obs=last_obs, discounted_return=disc, episode_return=ret,
                    episode_length=length)

    def close(self) -> None:
        """Stop the actor threads, join them, then close every env."""
        self._stop.set()
        deadline = time.monotonic() + JOIN_SECONDS
        for actor in self.actors:
            if actor.thread is not None:
                actor.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [a for a in self.actors if a.thread is not None and a.thread.is_alive()]
        for actor in self.actors:
            if actor not in stuck:
                actor.rollout.close()
        if stuck:
            warn(f"actor thread(s) {[a.index for a in stuck]} did not stop within "
                 f"{JOIN_SECONDS:g} s ({stuck[0].phase}); their envs are left open and the "
                 "threads end with the process")
        if self._eval_envs is not None:
            self._eval_envs.close()


def _where(err: BaseException) -> str:
    """A short traceback of an actor's error: the three innermost frames, innermost first,
    and the last of jaxppo's own (where jaxppo called into the env)."""
    frames = traceback.extract_tb(err.__traceback__)
    package = str(Path(__file__).resolve().parents[1])
    inner = frames[-3:]
    ours = [f for f in frames[:-3] if str(Path(f.filename).resolve()).startswith(package)]
    shown = list(reversed(inner)) + ([None, ours[-1]] if ours else [])
    return " <- ".join("..." if f is None else f"{Path(f.filename).name}:{f.lineno} in {f.name}"
                       for f in shown)


def join_rollouts(parts: list[Transition], seeded: bool = False) -> Transition:
    """The actors' rollouts [S?, T, E_a, ...] as one [S?, T, E, ...], in actor order (so in
    global env order); the carries they started from [S?, E_a, ...] likewise. A log std shared
    by every state ([S?, T, D]) becomes one per env ([S?, T, E, D]): actors may have played
    with different params versions, and an update compiles for one shape."""
    env_axis = 2 if seeded else 1

    def per_env(traj: Transition) -> Transition:
        if not shares_log_std(traj.dist):
            return traj
        loc, log_std = traj.dist
        return traj._replace(dist=traj.dist._replace(
            log_std=np.broadcast_to(np.expand_dims(log_std, env_axis), loc.shape)))

    parts = [per_env(p) for p in parts]
    if len(parts) == 1:  # one actor: its rollout as it is, not a copy
        return parts[0]
    carry0 = jax.tree.map(lambda *xs: np.concatenate(xs, axis=env_axis - 1),
                          *(p.carry0 for p in parts))
    parts = [p._replace(carry0=()) for p in parts]
    joined = jax.tree.map(lambda *xs: np.concatenate(xs, axis=env_axis), *parts)
    return joined._replace(carry0=carry0)
