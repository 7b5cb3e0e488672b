"""Building the compiled program for a layout: the chunk (a `lax.scan` of
`jaxppo.core.ppo.iteration`, evaluating when due) and `init`, for one device (`jit`), this
host's devices or the devices of several hosts (`pmap` over one axis spanning them, after
`jax.distributed.initialize`); seeds, sweep or PBT members split over devices without
collectives, or envs split with all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm, TrainState
from jaxppo.core.evaluation import EVAL_KEY_TAG
from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.spec import vmap_runs
from jaxppo.errors import ConfigError
from jaxppo.program.layout import Layout
from jaxppo.program.resolved import Resolved
from jaxppo.search.pbt import Explorer

AXIS = "device"


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
    hp_axis = (0 if is_batched(hp, seeds) else None) if seeds > 1 else None

    def init_one(key, hp, shard):
        return ppo.init(algo, key, hp, env_index_offset=shard * local)

    def chunk_one(state, hp, start, stop):
        return chunk(algo, state, hp, start, chunk_len, stop)

    if seeds > 1:
        def init_dev(root, hp, shard):
            keys = jax.random.split(root, seeds)
            return jax.vmap(init_one, in_axes=(0, hp_axis, None))(keys, hp, shard)

        chunk_dev = vmap_runs(chunk_one, in_axes=(0, hp_axis, None, None))
        if resolved.config.pbt is not None:
            chunk_dev = _population_chunk(algo, chunk_len)
    else:
        init_dev, chunk_dev = init_one, chunk_one

    if shards == 1:
        init = jax.jit(lambda root, hp: init_dev(root, hp, 0))
        compiled = jax.jit(chunk_dev, donate_argnums=0)
    else:
        devices = program_devices(layout)
        pinit = jax.pmap(init_dev, axis_name=AXIS, in_axes=(None, None, 0), devices=devices)
        first = layout.first_shard
        init = lambda root, hp: pinit(root, hp, jnp.arange(first, first + layout.local_devices))  # noqa: E731
        compiled = jax.pmap(chunk_dev, axis_name=AXIS, in_axes=(0, None, None, None),
                            devices=devices, donate_argnums=0)
    return Program(algo, layout, init, compiled)


def _population_program(resolved: Resolved, hp: HyperParams, chunk_len: int) -> Program:
    """A PBT population split over the layout's shards (devices, or hosts): each shard trains
    num_seeds / shards whole members, with no collective between iterations; the shards
    exchange fitness values and the best members' learner states at exploit steps only.
    Member i is the same as on one device (its key is the i-th of the run's)."""
    layout = resolved.layout
    seeds = resolved.config.num_seeds
    # A member's envs are one shard.
    algo = Algorithm.create(dataclasses.replace(resolved, layout=Layout()))
    devices = program_devices(layout)
    init = _whole_runs_init(algo, layout, seeds, is_batched(hp, seeds), devices)
    compiled = jax.pmap(_population_chunk(algo, chunk_len, AXIS), axis_name=AXIS,
                        in_axes=(0, None, None, None), devices=devices, donate_argnums=0)
    return Program(algo, layout, init, compiled, population=True)


def _seeds_program(resolved: Resolved, hp: HyperParams, chunk_len: int) -> Program:
    """Seeds (or a sweep's members) split over this host's devices: each device trains
    num_seeds / devices whole seeds, vmapped, with all of each seed's envs; nothing passes
    between devices. Seed i is the same as vmapped on one device (its key is the i-th of the
    run's, its hyperparameters the i-th of a sweep's)."""
    layout = resolved.layout
    seeds = resolved.config.num_seeds
    local = seeds // layout.shards
    algo = Algorithm.create(dataclasses.replace(resolved, layout=Layout()))
    batched = is_batched(hp, seeds)

    def chunk_dev(state, hp, start, stop):
        first = jax.lax.axis_index(AXIS) * local  # which device: no data crosses devices
        return vmap_runs(lambda s, h: chunk(algo, s, h, start, chunk_len, stop),
                         in_axes=(0, 0 if batched else None))(
            state, _own_slice(hp, batched, first, local))

    devices = program_devices(layout)
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


def auto_chunk(num_iterations: int) -> int:
    """About 40 progress updates per run; each chunk is one call into the compiled program."""
    return max(1, math.ceil(num_iterations / 40))


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

    traced = []  # the live branch's metric shapes: cond traces it first, skip reuses them

    def live_iteration(s):
        s, m = ppo.iteration(algo, s, hp)
        traced.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), m))
        return s, m

    def skip(s):
        m = traced[-1] if traced else jax.eval_shape(live_iteration, s)[1]
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
        return {k: jnp.float32(jnp.nan) for k in algo.eval_metric_keys}

    return jax.lax.cond(due, evaluate, skip, state)


def _population_chunk(algo: Algorithm, chunk_len: int, axis_name: str | None = None) -> Callable:
    """A PBT run's chunk: each iteration runs every member (vmapped, each with the
    hyperparameters in its state), then the population's exploit/explore step (jaxppo.search.pbt)
    sees all of them at once. With `axis_name` the members are split over that pmap axis;
    the chunk's metrics are then gathered over it, so every shard returns the whole
    population's. Metrics come back [members, chunk_len], as from the vmapped chunk."""
    explorer = Explorer(algo)
    n_iter = algo.config.num_iterations
    step = vmap_runs(lambda s, h, i, stop: chunk_step(algo, s, h, i, stop),
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


def _own_slice(hp: HyperParams, batched: bool, first, local: int) -> HyperParams:
    """The hyperparameters of a shard's runs first..first+local (a sweep's or a population's
    batched ones), or the shared ones."""
    if not batched:
        return hp
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, local), hp)


def program_devices(layout: Layout) -> list:
    """The devices the pmap spans, in shard order: each process's first local_devices."""
    if layout.num_processes == 1:
        return jax.local_devices()[:layout.local_devices]
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    return [d for p in sorted(by_process) for d in by_process[p][:layout.local_devices]]


def is_batched(hp: HyperParams, seeds: int) -> bool:
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
