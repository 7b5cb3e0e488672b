"""Everything that crosses shards (devices or hosts) in a PPO iteration.

Each function takes the pmap `axis_name` (None: one shard, and the function is the identity
or a plain reduction). Keys that shuffle or cut the batch derive from global env ids, so
the global batch and its minibatches are the same on 1 device, N devices or H hosts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from jaxppo.core.losses import shares_log_std
from jaxppo.core.running_stats import RunningStats


def pmean(x, axis_name: str | None):
    """The mean of `x` over the shards (`x` itself without an axis)."""
    return x if axis_name is None else jax.lax.pmean(x, axis_name)


def all_gather(tree, axis_name: str | None):
    """Every shard's value of `tree`, with a leading [shards] axis, in one collective:
    the leaves travel together as one flat vector. Without an axis: [1, ...]."""
    if axis_name is None:
        return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
    flat, unravel = ravel_pytree(tree)
    return jax.vmap(unravel)(jax.lax.all_gather(flat, axis_name))


# ---------------------------------------------------------------------- moments
def local_moments(x: jax.Array, axis=None):
    """(mean, variance) of one shard's samples, over `axis` (default: all elements)."""
    mean = jnp.mean(x, axis=axis)
    return mean, jnp.mean(jnp.square(x - mean), axis=axis)


def combine_moments(means: jax.Array, variances: jax.Array):
    """Global (mean, variance) from per-shard moments [S, ...] of equal-size shards (Chan's
    merge). With one shard it returns that shard's moments unchanged, bit for bit."""
    mean = jnp.mean(means, axis=0)
    return mean, jnp.mean(variances + jnp.square(means - mean), axis=0)


def merge_gathered(stats: RunningStats, gathered, n_local: int, shards: int) -> RunningStats:
    """Merge the all-gathered shard moments ([S, ...] mean and variance) into stats."""
    return stats.merge(*combine_moments(*gathered), n_local * shards)


def merge_stats(stats: RunningStats, x: jax.Array, axis_name: str | None,
                shards: int) -> RunningStats:
    """Merge a batch [N, ...] (this shard's part) into stats, with the moments of all shards."""
    gathered = all_gather(local_moments(x, axis=0), axis_name)
    return merge_gathered(stats, gathered, x.shape[0], shards)


# ---------------------------------------------------------------------- episode statistics
def local_episode_stats(traj) -> jax.Array:
    """[5] float32 from a rollout [T, E]: episodes that ended in this shard's rollout, the
    sums of their returns and lengths, and their min and max return (+inf/-inf when none).
    An episode ends where terminated or truncated, or where `traj.episode_end` says when given."""
    done = (jnp.logical_or(traj.terminated, traj.truncated) if traj.episode_end is None
            else traj.episode_end)
    return jnp.stack([
        jnp.sum(done).astype(jnp.float32),
        jnp.sum(jnp.where(done, traj.episode_return, 0.0)),
        jnp.sum(jnp.where(done, traj.episode_length, 0)).astype(jnp.float32),
        jnp.min(jnp.where(done, traj.episode_return, jnp.inf)),
        jnp.max(jnp.where(done, traj.episode_return, -jnp.inf)),
    ])


def local_agent_stats(traj, num_agents: int) -> jax.Array:
    """[num_agents + 1 (+ K)] float32 from a multi-agent rollout [T, E*N] (actors env-major):
    each agent's returns summed over the episodes that ended (its env's shared end), then the
    episodes won among them (0 when the env reports no wins, `traj.won` None), then the sums
    of the K episode values of those episodes (where `traj.episode_values` is given)."""
    done = jnp.logical_or(traj.terminated, traj.truncated)
    per_env = lambda x: x.reshape((x.shape[0], -1, num_agents) + x.shape[2:])  # noqa: E731
    returns = jnp.sum(jnp.where(per_env(done), per_env(traj.episode_return), 0.0), axis=(0, 1))
    won = (jnp.zeros(()) if traj.won is None
           else jnp.sum(jnp.logical_and(per_env(done), per_env(traj.won))[..., 0]))
    parts = [returns, won[None].astype(jnp.float32)]
    if traj.episode_values is not None:  # [T, E, K], the env's first agent's copy
        ended = jnp.where(per_env(done)[..., 0, None], per_env(traj.episode_values)[:, :, 0], 0.0)
        parts.append(jnp.sum(ended, axis=(0, 1)))
    return jnp.concatenate(parts)


def episode_metrics(gathered: jax.Array) -> dict:
    """Metrics from every shard's `local_episode_stats` ([S, 5])."""
    n_done = jnp.sum(gathered[:, 0])
    has = n_done > 0
    denom = jnp.maximum(n_done, 1.0)
    nan = jnp.float32(jnp.nan)
    return {
        "episode_return_mean": jnp.where(has, jnp.sum(gathered[:, 1]) / denom, nan),
        "episode_return_min": jnp.where(has, jnp.min(gathered[:, 3]), nan),
        "episode_return_max": jnp.where(has, jnp.max(gathered[:, 4]), nan),
        "episode_length_mean": jnp.where(has, jnp.sum(gathered[:, 2]) / denom, nan),
        "episodes": n_done.astype(jnp.int32),
    }


# ---------------------------------------------------------------------- sync="batch"
def env_axes(traj):
    """The env axis of every leaf of a rollout (-1: the same for every env, e.g. a
    state-independent log std)."""
    axes = jax.tree.map(lambda _: 1, traj)._replace(carry0=jax.tree.map(lambda _: 0, traj.carry0))
    if shares_log_std(traj.dist):
        axes = axes._replace(dist=axes.dist._replace(log_std=-1))
    return axes


def gather_envs(traj, env_ids: jax.Array, axis_name: str):
    """(rollout [T, num_envs, ...], env ids [num_envs]) of every shard, in global env order,
    through one all-gather: every leaf travels as float32 columns of one array [E, F]
    (exact for the bools, small ints and floats a rollout holds)."""
    leaves, treedef = jax.tree.flatten((traj, env_ids))
    axes = jax.tree.leaves((env_axes(traj), 0))
    cols, layout = [], []
    for x, ax in zip(leaves, axes):
        if ax < 0:
            layout.append(None)
            continue
        y = jnp.moveaxis(x, ax, 0)
        cols.append(y.reshape((y.shape[0], -1)).astype(jnp.float32))
        layout.append((ax, y.shape[1:], x.dtype))
    gathered = jax.lax.all_gather(jnp.concatenate(cols, axis=1), axis_name, tiled=True)
    out, i = [], 0
    for x, lay in zip(leaves, layout):
        if lay is None:
            out.append(x)
            continue
        ax, shape, dtype = lay
        n = int(np.prod(shape))
        y = gathered[:, i:i + n].reshape((gathered.shape[0],) + shape).astype(dtype)
        out.append(jnp.moveaxis(y, 0, ax))
        i += n
    return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------------- minibatch keys
def minibatch_indices(key: jax.Array, env_ids: jax.Array, num_steps: int, num_minibatches: int,
                      recurrent: bool, agents_together: int = 1) -> jax.Array:
    """Each epoch's minibatches, cut so that the global minibatch is the same set of
    transitions however the envs are spread over devices or hosts.

    Feed-forward: [M, T/M, E] time indices; each env's T steps are shuffled by a key
    from its global index, and minibatch j takes T/M steps of every env.
    Recurrent: [M, E/M] env columns (whole sequences); minibatch j holds one env of each
    group of M consecutive global env ids, chosen by a permutation keyed by the group.
    Recurrent with `agents_together` = N > 1 (a network per agent): the columns are actors
    [E*N] (env-major, global ids e*N + i), and a minibatch holds whole envs, each env's N
    actors side by side in agent order, [M, E*N/M], so that actor k of it is agent k % N.
    """
    T, M = num_steps, num_minibatches
    if recurrent and agents_together > 1:
        n = agents_together
        envs = minibatch_indices(key, env_ids.reshape(-1, n)[:, 0] // n, T, M, True)
        return (envs[..., None] * n + jnp.arange(n)).reshape(M, -1)
    if recurrent:
        groups = env_ids.reshape(-1, M)[:, 0] // M  # [E/M] global group ids
        perms = jax.vmap(lambda g: jax.random.permutation(jax.random.fold_in(key, g), M))(groups)
        cols = jnp.arange(env_ids.shape[0]).reshape(-1, M)
        return jnp.take_along_axis(cols, perms, axis=1).T
    perms = jax.vmap(lambda i: jax.random.permutation(jax.random.fold_in(key, i), T))(env_ids)
    return perms.T.reshape(M, T // M, -1)
