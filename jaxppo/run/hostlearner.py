"""The learner of an env that steps in Python: `jaxppo.core.ppo.update` on one device (jit),
or split over this host's devices (pmap) as the compiled path splits its envs.

Split over N devices (`num_devices: N`), device d holds envs d*E/N..(d+1)*E/N - 1 of the
rollout [T, E] (global env order) and a copy of every replicated field (params, optimiser,
statistics, KL coefficient, key, counters); the update's collectives are the compiled path's
(`jaxppo.core.collectives`: gradients and statistics averaged over the axis, minibatches cut
from global env ids), so it equals the one-device update up to float rounding. Acting reads
device 0's copy (`replica`). Snapshots are in the unsharded layout
(`jaxppo.program.shards`), so a run resumes on any device count.

On several hosts (a multi-process layout, after `jax.distributed.initialize`) the pmap spans
every host's devices in shard order, as the compiled multi-host program's does, and each
process feeds its own devices: its envs' rollout [T, E/hosts] cut over them and its shards of
the state; the collectives all-reduce over every host's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm, TrainState, Transition
from jaxppo.core.collectives import env_axes
from jaxppo.core.hyperparams import HyperParams
from jaxppo.program.build import AXIS, program_devices
from jaxppo.program.resolved import Resolved
from jaxppo.program.shards import local_part, shard_state, to_unsharded


def _over_seeds(fn, seeded: bool, in_axes):
    return jax.vmap(fn, in_axes=in_axes) if seeded else fn


class Learner:
    """The compiled update of a host-loop run on its layout's devices; `update(state, traj)`
    takes the learner state in the device layout ([N, S?, ...] when split, else [S?, ...])
    and the whole rollout [S?, T, E, ...] (numpy)."""

    def __init__(self, resolved: Resolved, hp: HyperParams, seeded: bool, hp_axis: int | None):
        self.layout = resolved.layout
        self.shards = n = resolved.layout.shards
        self.local = resolved.layout.local_devices  # the shards this process feeds
        self.seeded = seeded
        self.num_seeds = resolved.config.num_seeds
        self.hp = hp
        algo = Algorithm.create(resolved, axis_name=AXIS if n > 1 else None)
        update = _over_seeds(lambda s, traj, hp, start, stats: ppo.update(
            algo, s, traj, s.env_ids, hp, start, stats), seeded, (0, 0, hp_axis, 0, 0))
        if n == 1:
            self._update = jax.jit(update)
        else:
            self.devices = program_devices(self.layout)
            self._update = jax.pmap(update, axis_name=AXIS, in_axes=(0, 0, None, 0, 0),
                                    devices=self.devices)

    def place(self, state: TrainState) -> TrainState:
        """An unsharded learner state (numpy or one device's arrays) in the device layout."""
        if self.shards == 1:
            return jax.tree.map(jnp.asarray, state)
        full = shard_state(jax.device_get(state), self.shards, self.num_seeds)
        if self.layout.num_processes > 1:  # this process's shards
            first = self.layout.first_shard
            full = jax.tree.map(lambda x: x[first:first + self.local], full)
        return jax.pmap(lambda s: s, devices=self.devices)(full)  # placed as pmap places

    def replica(self, state: TrainState) -> TrainState:
        """The state as one device holds it: device 0's copy when split (only its replicated
        fields, e.g. params, obs_stats, rng, counters, mean the whole run's)."""
        if self.shards == 1:
            return state
        # Device 0's own buffer, not x[0]: that is an array replicated over every device,
        # and a policy step on it would run on all of them.
        return jax.tree.map(lambda x: x.addressable_shards[0].data.reshape(x.shape[1:]), state)

    def unsharded(self, state: TrainState) -> TrainState:
        """The state in the unsharded layout (numpy), as checkpoints hold it."""
        if self.shards == 1:
            return jax.device_get(state)
        return to_unsharded(state, self.layout, self.num_seeds)

    def local_part(self, state: TrainState, replicated: bool = True) -> TrainState:
        """This process's shards of the state as numpy [local_devices, S?, ...]
        (`jaxppo.program.shards.local_part`: the replicated fields None unless `replicated`)."""
        return local_part(state, self.layout, replicated)

    def _args(self, state: TrainState, traj: Transition) -> tuple:
        if self.shards > 1:
            traj = shard_rollout(traj, self.local, self.seeded)
        return state, traj, self.hp, state.env_steps, state.obs_stats

    def compile(self, state: TrainState, traj: Transition) -> None:
        """Compile the update for this state and a rollout shaped as `traj`. Across
        processes pmap's ahead-of-time lowering takes global shapes while calls pass each
        process's part, so every host compiles it by calling it (the result is dropped)."""
        if self.layout.num_processes > 1:
            jax.block_until_ready(self._update(*self._args(state, traj)))
            return
        self._update = self._update.lower(*self._args(state, traj)).compile()

    def update(self, state: TrainState, traj: Transition, rng: jax.Array | None = None):
        """(new state, metrics) of the update on `traj`; `rng` (one device's, [S?, 2])
        replaces the state's key first. Metrics are one device's (they are global)."""
        if rng is not None:
            if self.shards > 1:
                rng = np.broadcast_to(np.asarray(rng), (self.local,) + rng.shape)
            state = state.replace(rng=rng)
        state, metrics = self._update(*self._args(state, traj))
        if self.shards == 1:
            return state, metrics
        if self.layout.num_processes > 1:  # this process's first device's copy
            return state, jax.tree.map(lambda x: x.addressable_shards[0].data[0], metrics)
        return state, jax.tree.map(lambda x: x[0], metrics)


def shard_rollout(traj: Transition, shards: int, seeded: bool) -> Transition:
    """A rollout [S?, T, E, ...] (numpy) as [shards, S?, T, E/shards, ...]: shard d holds
    envs d*E/shards.. in global order; a leaf with no env axis (a log std shared by every
    state) is copied to every shard."""
    lead = 1 if seeded else 0

    def split(x, axis):
        x = np.asarray(x)
        if axis < 0:
            return np.broadcast_to(x, (shards,) + x.shape)
        return split_envs(x, shards, lead + axis)

    return jax.tree.map(split, traj, env_axes(traj))


def split_envs(x, shards: int, axis: int) -> np.ndarray:
    """An array (numpy) with envs along `axis` as [shards, ..., E/shards, ...]: shard d holds
    envs d*E/shards.. in global order."""
    x = np.asarray(x)
    x = x.reshape(x.shape[:axis] + (shards, x.shape[axis] // shards) + x.shape[axis + 1:])
    return np.moveaxis(x, axis, 0)
