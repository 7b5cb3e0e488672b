"""Where the chunk runs: one device (`jit`), this host's devices, or the devices of several
hosts (`pmap` over one axis spanning them, after `jax.distributed.initialize`).

A chunk is a `lax.scan` of `jaxppo.core.ppo.iteration`, evaluating when due; this module also
moves the state between the device layout and the unsharded one (see "state layouts" below).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm, TrainState
from jaxppo.core.evaluation import EVAL_KEY_TAG, EVAL_METRIC_KEYS
from jaxppo.core.hyperparams import HyperParams
from jaxppo.errors import ConfigError
from jaxppo.resolve import Layout, Resolved
from jaxppo.search.pbt import Explorer

AXIS = "device"

# TrainState fields with one entry per env (split over devices); every other field is the
# same on every device (replicated).
PER_ENV_FIELDS = ("env_state", "last_obs", "discounted_return", "episode_return",
                  "episode_length", "env_ids", "carry")


# ---------------------------------------------------------------------- the program
class Program(NamedTuple):
    """The compiled entry points of a run: `init(key, hp)` and `chunk(state, hp, start, stop)`
    (iterations start..min(start + chunk_len, stop) - 1; the rest of the chunk is skipped)."""

    algorithm: Algorithm
    layout: Layout
    init: Callable
    chunk: Callable
    # The shards hold whole runs: different PBT members (splits_population) or seeds
    # (splits_seeds); every state field is then split by member, none is replicated.
    population: bool = False


# ---------------------------------------------------------------------- chunks of iterations
def train_function(algo: Algorithm) -> Callable:
    """A pure `train_fn(key, hp) -> (final TrainState, metrics [num_iterations])`."""
    algo.require_compiled_env("make_train")
    n_iter = algo.config.num_iterations

    def train_fn(key, hp):
        state = ppo.init(algo, key, hp)
        return jax.lax.scan(lambda s, _: ppo.iteration(algo, s, hp), state, None, length=n_iter)

    return train_fn


def chunk(algo: Algorithm, state: TrainState, hp: HyperParams, start: jax.Array, length: int,
          stop: jax.Array | None = None):
    """`length` iterations from `start`; iterations from `stop` (default: the run's end)
    on are skipped (cond on an unbatched index, so under vmap it stays a real branch).

    With `eval_every > 0`, iteration k (1-based) is followed by an evaluation when k is a
    multiple of eval_every or the last iteration; its eval_* metrics are NaN otherwise.
    """
    n_iter = algo.config.num_iterations
    stop = n_iter if stop is None else jnp.minimum(stop, n_iter)
    return jax.lax.scan(lambda s, i: chunk_step(algo, s, hp, start + i, stop), state,
                        jnp.arange(length))


def chunk_step(algo: Algorithm, s: TrainState, hp: HyperParams, index: jax.Array,
               stop: jax.Array):
    """Iteration `index` (0-based) of a chunk: run when index < stop, else skipped (zero
    metrics, state unchanged); then the evaluation when due. A PBT member trains with the
    hyperparameters in its state (`hp` only gives their shapes)."""
    cfg = algo.config
    if s.hparams is not None:
        hp = s.hparams

    def live_iteration(s):
        return ppo.iteration(algo, s, hp)

    def skip(s):
        _, m = jax.eval_shape(live_iteration, s)
        return s, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), m)

    live = index < stop
    s, m = jax.lax.cond(live, live_iteration, skip, s)
    if cfg.eval_every:
        done = index + 1
        due = jnp.logical_or(done % cfg.eval_every == 0, done == cfg.num_iterations)
        m = {**m, **_maybe_evaluate(algo, s, jnp.logical_and(live, due))}
    return s, m


def _maybe_evaluate(algo: Algorithm, state: TrainState, due: jax.Array) -> dict:
    """Eval metrics when `due` (unbatched), NaN otherwise. The key is folded from the
    training key without consuming it, so training randomness does not change."""

    def evaluate(st):
        return algo.evaluate(st.params, st.obs_stats, jax.random.fold_in(st.rng, EVAL_KEY_TAG))

    def skip(st):
        return {k: jnp.float32(jnp.nan) for k in EVAL_METRIC_KEYS}

    return jax.lax.cond(due, evaluate, skip, state)


def _program_devices(layout: Layout) -> list:
    """The devices the pmap spans, in shard order: each process's first local_devices."""
    if layout.num_processes == 1:
        return jax.local_devices()[:layout.local_devices]
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    return [d for p in sorted(by_process) for d in by_process[p][:layout.local_devices]]


def build_program(resolved: Resolved, hp: HyperParams, chunk_len: int) -> Program:
    """jit (one shard) or pmap (several, on one host or many: `resolved.layout`) of init and
    chunk, vmapped over seeds when asked. Device layout: [local_devices?, seeds?, ...]."""
    if resolved.splits_population:
        return _population_program(resolved, hp, chunk_len)
    if resolved.splits_seeds:
        return _seeds_program(resolved, hp, chunk_len)
    seeds = resolved.config.num_seeds
    layout = resolved.layout
    shards = layout.shards
    algo = Algorithm.create(resolved, axis_name=AXIS if shards > 1 else None)
    local = algo.local_envs
    hp_axis = (0 if _is_batched(hp, seeds) else None) if seeds > 1 else None

    def init_one(key, hp, shard):
        return ppo.init(algo, key, hp, env_index_offset=shard * local)

    def chunk_one(state, hp, start, stop):
        return chunk(algo, state, hp, start, chunk_len, stop)

    if seeds > 1:
        def init_dev(root, hp, shard):
            keys = jax.random.split(root, seeds)
            return jax.vmap(init_one, in_axes=(0, hp_axis, None))(keys, hp, shard)

        chunk_dev = jax.vmap(chunk_one, in_axes=(0, hp_axis, None, None))
        if resolved.config.pbt is not None:
            chunk_dev = _population_chunk(algo, chunk_len)
    else:
        init_dev, chunk_dev = init_one, chunk_one

    if shards == 1:
        init = jax.jit(lambda root, hp: init_dev(root, hp, 0))
        compiled = jax.jit(chunk_dev, donate_argnums=0)
    else:
        devices = _program_devices(layout)
        pinit = jax.pmap(init_dev, axis_name=AXIS, in_axes=(None, None, 0), devices=devices)
        first = layout.first_shard
        init = lambda root, hp: pinit(root, hp, jnp.arange(first, first + layout.local_devices))  # noqa: E731
        compiled = jax.pmap(chunk_dev, axis_name=AXIS, in_axes=(0, None, None, None),
                            devices=devices, donate_argnums=0)
    return Program(algo, layout, init, compiled)


def _population_chunk(algo: Algorithm, chunk_len: int, axis_name: str | None = None) -> Callable:
    """A PBT run's chunk: each iteration runs every member (vmapped, each with the
    hyperparameters in its state), then the population's exploit/explore step (jaxppo.search.pbt)
    sees all of them at once. With `axis_name` the members are split over that pmap axis;
    the chunk's metrics are then gathered over it, so every shard returns the whole
    population's. Metrics come back [members, chunk_len], as from the vmapped chunk."""
    explorer = Explorer(algo)
    n_iter = algo.config.num_iterations
    step = jax.vmap(lambda s, h, i, stop: chunk_step(algo, s, h, i, stop),
                    in_axes=(0, 0, None, None))

    def population_chunk(state, hp, start, stop):
        stop = jnp.minimum(stop, n_iter)

        def body(s, i):
            s, m = step(s, s.hparams, start + i, stop)
            s, pm = explorer.step(s, m, start + i, stop, axis_name)
            return s, {**m, **pm}

        state, m = jax.lax.scan(body, state, jnp.arange(chunk_len))
        m = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), m)
        if axis_name is not None:
            m = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, tiled=True), m)
        return state, m

    return population_chunk


def _population_program(resolved: Resolved, hp: HyperParams, chunk_len: int) -> Program:
    """A PBT population split over the layout's shards (devices, or hosts): each shard trains
    num_seeds / shards whole members, with no collective between iterations; the shards
    exchange fitness values and the best members' learner states at exploit steps only.
    Member i is the same as on one device (its key is the i-th of the run's)."""
    layout = resolved.layout
    seeds = resolved.config.num_seeds
    # A member's envs are one shard.
    algo = Algorithm.create(dataclasses.replace(resolved, layout=Layout()))
    devices = _program_devices(layout)
    init = _whole_runs_init(algo, layout, seeds, _is_batched(hp, seeds), devices)
    compiled = jax.pmap(_population_chunk(algo, chunk_len, AXIS), axis_name=AXIS,
                        in_axes=(0, None, None, None), devices=devices, donate_argnums=0)
    return Program(algo, layout, init, compiled, population=True)


def _own_slice(hp: HyperParams, batched: bool, first, local: int) -> HyperParams:
    """The hyperparameters of a shard's runs first..first+local (a sweep's or a population's
    batched ones), or the shared ones."""
    if not batched:
        return hp
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, local), hp)


def _whole_runs_init(algo: Algorithm, layout: Layout, seeds: int, batched: bool,
                     devices) -> Callable:
    """init(root, hp) of runs (seeds, sweep or population members) split over the layout's
    shards, num_seeds / shards whole runs each: run i's key is the i-th of the run's, its
    hyperparameters the i-th of batched ones, as on one device."""
    local = seeds // layout.shards

    def init_dev(root, hp, shard):
        first = shard * local
        keys = jax.lax.dynamic_slice_in_dim(jax.random.split(root, seeds), first, local)
        return jax.vmap(lambda k, h: ppo.init(algo, k, h), in_axes=(0, 0 if batched else None))(
            keys, _own_slice(hp, batched, first, local))

    pinit = jax.pmap(init_dev, axis_name=AXIS, in_axes=(None, None, 0), devices=devices)
    first = layout.first_shard
    return lambda root, hp: pinit(root, hp, jnp.arange(first, first + layout.local_devices))


def _seeds_program(resolved: Resolved, hp: HyperParams, chunk_len: int) -> Program:
    """Seeds (or a sweep's members) split over this host's devices: each device trains
    num_seeds / devices whole seeds, vmapped, with all of each seed's envs; nothing passes
    between devices. Seed i is the same as vmapped on one device (its key is the i-th of the
    run's, its hyperparameters the i-th of a sweep's)."""
    layout = resolved.layout
    seeds = resolved.config.num_seeds
    local = seeds // layout.shards
    algo = Algorithm.create(dataclasses.replace(resolved, layout=Layout()))
    batched = _is_batched(hp, seeds)

    def chunk_dev(state, hp, start, stop):
        first = jax.lax.axis_index(AXIS) * local  # which device: no data crosses devices
        return jax.vmap(lambda s, h: chunk(algo, s, h, start, chunk_len, stop),
                        in_axes=(0, 0 if batched else None))(
            state, _own_slice(hp, batched, first, local))

    devices = _program_devices(layout)
    init = _whole_runs_init(algo, layout, seeds, batched, devices)
    compiled = jax.pmap(chunk_dev, axis_name=AXIS, in_axes=(0, None, None, None),
                        devices=devices, donate_argnums=0)
    return Program(algo, layout, init, compiled, population=True)


def initialise_and_compile(program: Program, key: jax.Array, hp: HyperParams):
    """Run `init`, then compile `chunk` for the resulting state; returns (state, compiled).
    The two run one after the other (docs/design.md, "Compiling while init runs")."""
    start0 = jnp.asarray(0, jnp.int32)
    state = program.init(key, hp)
    if program.layout.num_processes > 1:
        # Across processes, pmap's ahead-of-time lowering takes the global shapes while calls
        # pass each process's part; compile by calling it instead, on an empty range of
        # iterations (every iteration is skipped, the state comes back unchanged).
        state, _ = program.chunk(state, hp, start0, start0)
        return state, program.chunk
    return state, program.chunk.lower(state, hp, start0, start0).compile()


def _is_batched(hp: HyperParams, seeds: int) -> bool:
    """True when `hp` carries one set of hyperparameters per seed (a leading axis)."""
    n = np.ndim(hp.clip_param)
    if n == 0:
        return False
    if n == 1 and hp.clip_param.shape[0] == seeds:
        return True
    raise ConfigError(
        f"hparams has a leading axis of {np.shape(hp.clip_param)}, but num_seeds={seeds}; "
        "a batched HyperParams needs exactly one entry per seed"
    )


# ---------------------------------------------------------------------- state layouts
# The *device layout* is what the program holds: [local_devices, seeds?, ...] on each process
# when pmapped, [seeds?, ...] otherwise. The *unsharded layout* is one host-side (numpy)
# TrainState of the whole run, as if it ran on one device: every env in global order, one copy
# of the replicated fields. Snapshots and checkpoints use the unsharded layout, so a run saved
# on any number of devices or hosts resumes on any other number that divides num_envs; keys
# derive from global env ids, so the continuation is the same. Collectives over the axis are
# XLA's: within a host, shared memory; across hosts, gloo on CPU and NCCL on GPU.
def _split_fields(population: bool) -> tuple[str, ...]:
    """The TrainState fields split over shards: the per-env ones, or (a PBT population split
    over its shards) every field, by member."""
    return tuple(TrainState.__dataclass_fields__) if population else PER_ENV_FIELDS


def _map_fields(fn_env: Callable, fn_rep: Callable, state: TrainState,
                population: bool = False) -> TrainState:
    split = _split_fields(population)
    return state.replace(**{
        name: jax.tree.map(fn_env if name in split else fn_rep, getattr(state, name))
        for name in state.__dataclass_fields__})


def shard_state(state: TrainState, shards: int, seeds: int, population: bool = False) -> TrainState:
    """Unsharded layout -> [shards, seeds?, ...] (numpy): each shard's envs, the rest copied
    (population: each shard's members, [shards, members/shards, ...])."""
    def env(x):
        x = np.asarray(x)
        s = 1 if seeds > 1 and not population else 0  # the env (or member) axis
        x = x.reshape(x.shape[:s] + (shards, x.shape[s] // shards) + x.shape[s + 1:])
        return np.moveaxis(x, s, 0)

    def rep(x):
        x = np.asarray(x)
        return np.broadcast_to(x, (shards,) + x.shape).copy()

    return _map_fields(env, rep, state, population)


def unshard_state(state: TrainState, shards: int, seeds: int, population: bool = False) -> TrainState:
    """[shards, seeds?, ...] -> unsharded layout (numpy); replicated fields from shard 0."""
    def env(x):
        x = np.asarray(x)
        s = 1 if seeds > 1 and not population else 0
        x = np.moveaxis(x, 0, s)
        return x.reshape(x.shape[:s] + (x.shape[s] * x.shape[s + 1],) + x.shape[s + 2:])

    return _map_fields(env, lambda x: np.asarray(x)[0], state, population)


def to_unsharded(state: TrainState, layout: Layout, seeds: int,
                 population: bool = False) -> TrainState:
    """The whole run's state in the unsharded layout (numpy), from a single process's
    device-layout state. (Several processes: `local_part` on each, `join_parts` of them.)"""
    if layout.num_processes > 1:
        raise ValueError("to_unsharded needs every shard in this process; across processes use "
                         "local_part on each and join_parts")
    return join_parts([local_part(state, layout)], layout.shards, seeds, population)


def local_part(state: TrainState, layout: Layout, replicated: bool = True,
               population: bool = False) -> TrainState:
    """This process's shards of the state as numpy [local_devices, seeds?, ...], with no
    collective; the replicated fields are left out (None) unless `replicated` (a population
    split over shards has none: every field is its members')."""
    host = jax.device_get(state)
    if layout.shards == 1:
        host = jax.tree.map(lambda x: np.asarray(x)[None], host)
    else:
        host = jax.tree.map(np.asarray, host)
    if not replicated:
        split = _split_fields(population)
        host = host.replace(**{n: None for n in host.__dataclass_fields__ if n not in split})
    return host


def join_parts(parts: list[TrainState], shards: int, seeds: int,
               population: bool = False) -> TrainState:
    """The unsharded state from every process's `local_part`, in process order (the first
    with its replicated fields)."""
    first = parts[0]
    full = first.replace(**{
        n: jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *(getattr(p, n) for p in parts))
        for n in _split_fields(population) if getattr(first, n) is not None})
    if shards == 1:
        return jax.tree.map(lambda x: x[0], full)
    return unshard_state(full, shards, seeds, population)


def from_unsharded(state: TrainState, template: TrainState, layout: Layout, seeds: int,
                   population: bool = False) -> TrainState:
    """This process's part of an unsharded state, placed as `template` (a device-layout state
    of the same program) is placed."""
    if layout.shards == 1:
        return jax.tree.map(lambda new, old: jax.device_put(np.asarray(new), old.sharding),
                            state, template)
    full = shard_state(state, layout.shards, seeds, population)
    lo, hi = layout.first_shard, layout.first_shard + layout.local_devices
    return jax.tree.map(lambda new, old: jax.device_put(np.ascontiguousarray(new[lo:hi]), old.sharding),
                        full, template)


def local_metrics(metrics: dict, layout: Layout) -> dict[str, np.ndarray]:
    """Metrics of a chunk as numpy, without the device axis (they are global already; seeds
    split over devices: each device's seeds, joined in seed order)."""
    if layout.by_seed and layout.shards > 1:
        return jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), metrics)
    m = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data if layout.shards > 1 else x),
                     metrics)
    return jax.tree.map(lambda x: x[0], m) if layout.shards > 1 else m


class ChunkRunner:
    """A compiled program and its state on this process's devices: a `jaxppo.run.runner.Runner`
    (driven by the run loop in-process, and inside each host's learner for several hosts)."""

    def __init__(self, program: Program, hp: HyperParams, key: jax.Array,
                 restored: TrainState | None = None):
        self.program = program
        self.layout = program.layout
        self.algorithm = program.algorithm
        self.config = program.algorithm.config
        self.shards = self.layout.shards
        self.hosts = self.layout.num_processes
        self.hp = hp
        self.population = program.population
        # pmapped params are one copy per device, unless the devices hold different members
        self.params_replicated = self.shards > 1 and not program.population
        self.host_failures: list[dict] = []
        t0 = time.perf_counter()
        check_memory_estimate(program, key, hp)
        self.state, self.compiled = initialise_and_compile(program, key, hp)
        check_memory(self.compiled, program, self.state)
        if restored is not None:
            self.state = from_unsharded(restored, self.state, self.layout, self.config.num_seeds,
                                        self.population)
        self.compile_seconds = time.perf_counter() - t0

    def train_chunk(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Iterations start+1..stop (at most one chunk); their metrics [seeds?, stop - start]."""
        self.state, m = self.compiled(self.state, self.hp, jnp.asarray(start, jnp.int32),
                                      jnp.asarray(stop, jnp.int32))
        m = local_metrics(m, self.layout)
        return {k: v[..., :stop - start] for k, v in m.items()}

    def snapshot(self) -> TrainState:
        """The state after the last chunk, unsharded (one process holding every shard)."""
        return to_unsharded(self.state, self.layout, self.config.num_seeds, self.population)

    def local_part(self, replicated: bool = True) -> TrainState:
        """This process's shards of the state after the last chunk (see `local_part`)."""
        return local_part(self.state, self.layout, replicated, self.population)

    def final_state(self) -> Any:
        """The state as the program holds it (device layout), for TrainResult.state; a
        population split over this process's devices as [members, ...] (unsharded)."""
        if self.population and self.hosts == 1:
            return self.snapshot()
        return self.state

    def close(self) -> None:
        """Nothing to release: the state goes with the runner."""


class MemoryPart(NamedTuple):
    """One part of what the training program holds at once (all seeds on this process)."""

    what: str  # e.g. "the rollout buffer and live envs"
    cause: str  # the fields that size it, e.g. "num_envs*num_steps = 2,048 transitions"
    field: str  # the field to lower to shrink it
    nbytes: int
    count: int = 0  # the field's value when the part grows linearly with it, else 0


def memory_parts(program: Program, state) -> list[MemoryPart]:
    """A lower bound of the program's memory on this process, by the field that sizes each
    part, largest first: network params with their gradients and optimizer state, the
    rollout buffer with the live envs, and (with eval_every) the evaluation envs. `state`:
    the program's state, or its shapes (`jax.eval_shape(program.init, ...)`)."""
    algo, cfg = program.algorithm, program.algorithm.config
    params, opt = _nbytes(state.params), _nbytes(state.opt_state)
    live = sum(_nbytes(getattr(state, n)) for n in PER_ENV_FIELDS)
    obs_dims = len(algo.spec.obs_shape)
    envs = int(np.prod(state.last_obs.shape[:state.last_obs.ndim - obs_dims]))  # all copies
    copies = max(1, envs // algo.local_envs)  # seeds x devices on this process
    per_env, obs = live / envs, _nbytes(state.last_obs) / envs
    widths = int(sum(cfg.network.hidden_sizes))
    torsos = 1 if cfg.network.shared_trunk else 2
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params)) // copies
    # Per transition: the observation, action, log prob, value, reward, done, advantage and
    # return (4 bytes each), and an update's activations of one minibatch row per layer.
    per_row = obs + 7 * 4 + widths * 4 * torsos / cfg.num_minibatches
    rollout = envs * cfg.num_steps * per_row + live
    sizes = cfg.network.hidden_sizes
    shaped_by = ("network.kwargs" if cfg.network.custom  # a user's module: its own arguments
                 else f"network.hidden_sizes={list(sizes)}")
    parts = [
        MemoryPart("network parameters, gradients and optimizer state",
                   f"{shaped_by}: {n_params:,} parameters per seed",
                   shaped_by.partition("=")[0], 2 * params + opt),
        MemoryPart("the rollout buffer and live envs",
                   f"num_envs*num_steps = {cfg.batch_size:,} transitions per iteration",
                   "num_envs", int(rollout), cfg.num_envs),
    ]
    if cfg.eval_every:  # each eval env: its state, observation and one layer's activations
        widest = max(cfg.network.hidden_sizes)
        parts.append(MemoryPart(
            "the evaluation envs", f"eval_episodes={cfg.eval_episodes:,} envs run at once",
            "eval_episodes", int(copies * cfg.eval_episodes * (per_env + obs + widest * 4)),
            cfg.eval_episodes))
    return sorted(parts, key=lambda p: -p.nbytes)


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def check_memory_estimate(program: Program, key: jax.Array, hp: HyperParams) -> None:
    """Before anything is allocated or compiled: a ConfigError when a lower bound of what the
    program holds (`memory_parts` of the state's shapes) exceeds the free memory, naming
    the part that dominates and the field to lower."""
    free = free_memory()
    if free is None:
        return
    try:
        shapes = jax.eval_shape(program.init, key, hp)
        parts = memory_parts(program, shapes)
    except Exception:  # noqa: BLE001 - no estimate for this program: the check after compiling stands
        return
    needed = sum(p.nbytes for p in parts)
    if jax.devices()[0].platform != "cpu":  # each device has its own memory
        needed //= program.layout.local_devices
    if needed > free:
        raise ConfigError(memory_message(f"at least {_size(needed)}", needed, free, parts,
                                         program.algorithm.config))


def check_memory(compiled, program: Program, state) -> None:
    """Before the first call: a ConfigError when the compiled program needs more memory than
    the device has free (XLA's own figure from compiling; running would fail with an
    allocation error deep inside, or get the process killed)."""
    try:
        m = compiled.memory_analysis()
        needed = int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - no analysis on this backend: nothing to check
        return
    if jax.devices()[0].platform == "cpu":  # CPU "devices" share the host's memory
        needed *= program.layout.local_devices
    free = free_memory()
    if free is None or needed <= free:
        return
    raise ConfigError(memory_message(f"about {_size(needed)} of working memory beyond its state",
                                     needed, free, memory_parts(program, state),
                                     program.algorithm.config))


def memory_message(need: str, needed: int, free: int, parts: list[MemoryPart], config) -> str:
    """One paragraph: what the program needs, its largest parts with the fields that size
    them, and the field to lower (with how far, where the part grows with it)."""
    seeds = config.num_seeds
    listed = "; ".join(f"{p.what} {_size(p.nbytes)} ({p.cause})" for p in parts if p.nbytes)
    where = jax.devices()[0].device_kind
    text = (f"the training program needs {need}, but {_size(free)} is free on {where}. Its "
            f"largest parts{f', for all {seeds:,} seeds' if seeds > 1 else ''}: {listed}. ")
    top = parts[0]
    fixes = []
    if seeds > 1 and needed / seeds <= free:  # one seed fits: the seed count is the lever
        fixes.append(f"lower num_seeds (at most about {max(1, int(free / (needed / seeds))):,} "
                     "would fit)")
    if top.count:
        rest = needed - top.nbytes  # what lowering the field leaves
        fits = int((free - rest) / (top.nbytes / top.count)) if free > rest else 0
        fixes.append(f"lower {top.field}"
                     + (f" (at most about {fits:,} would fit)" if fits >= 1 else ""))
    else:
        fixes.append(f"use fewer or narrower layers in {top.field}")
    advice = " or ".join(fixes)
    return text + advice[0].upper() + advice[1:] + "."


def _size(nbytes: float) -> str:
    """Bytes as GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def free_memory() -> int | None:
    """Bytes free for the program: the accelerator's free memory, or the host's available
    memory on a CPU; None where it cannot be known."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def auto_chunk(num_iterations: int) -> int:
    """About 40 progress updates per run; each chunk is one call into the compiled program."""
    return max(1, math.ceil(num_iterations / 40))
