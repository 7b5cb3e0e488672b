"""Moving a run's TrainState between the device layout and the unsharded one.

The *device layout* is what the program holds: [local_devices, seeds?, ...] on each process
when pmapped, [seeds?, ...] otherwise. The *unsharded layout* is one host-side (numpy)
TrainState of the whole run, as if it ran on one device: every env in global order, one copy
of the replicated fields. Snapshots and checkpoints use the unsharded layout, so a run saved
on any number of devices or hosts resumes on any other number that divides num_envs; keys
derive from global env ids, so the continuation is the same. Collectives over the axis are
XLA's: within a host, shared memory; across hosts, gloo on CPU and NCCL on GPU.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jaxppo.core.algorithm import TrainState
from jaxppo.program.layout import Layout

# TrainState fields with one entry per env (split over devices); every other field is the
# same on every device (replicated).
PER_ENV_FIELDS = ("env_state", "last_obs", "discounted_return", "episode_return",
                  "episode_length", "env_ids", "carry")


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
