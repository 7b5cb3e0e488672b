"""Policy evaluation: run a batch of eval envs until each has finished one episode.

`run_episodes` is a pure, jit-able function of arrays (it runs inside the training program
for in-training evaluation, and on its own for `jaxppo eval` and `Policy.evaluate`). Every
eval env plays exactly one episode; envs that finish early keep stepping (gymnax auto-resets)
but are masked, and a `lax.while_loop` stops once all are done or after `max_steps` steps.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.errors import ConfigError

# fold_in tag that turns a training key into an evaluation key without consuming it, so the
# training random stream is the same with evaluation on or off.
EVAL_KEY_TAG = 0x0E7A1

EVAL_METRIC_KEYS = ("eval_return_mean", "eval_return_std", "eval_length_mean")


class EpisodeStats(NamedTuple):
    """Per-episode results, one entry per eval env: returns [N] float32, lengths [N] int32."""

    returns: jax.Array
    lengths: jax.Array

    def metrics(self) -> dict:
        """eval_return_mean/std and eval_length_mean (scalars)."""
        return {
            "eval_return_mean": jnp.mean(self.returns),
            "eval_return_std": jnp.std(self.returns),
            "eval_length_mean": jnp.mean(self.lengths.astype(jnp.float32)),
        }


def run_episodes(
    step: Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]],
    env: Any,
    env_params: Any,
    key: jax.Array,
    num_episodes: int,
    max_steps: int,
    carry: Any = (),
    action_mask: Callable | None = None,
) -> EpisodeStats:
    """Play one episode in each of `num_episodes` envs; pure and jit-able.

    step(obs [N, *obs_shape], key, carry) -> (env actions [N, ...], carry): the policy, with
    the carry it keeps from step to step (a recurrent network's state, [N, ...], starting at
    `carry`; () for a feed-forward one). With `action_mask` (one env's `action_mask(state,
    params)`), step takes a fourth argument, the legal actions [N, A] of each env. An episode
    ends at the env's terminated or truncated flag, or after `max_steps` steps (whatever it
    has collected by then counts). A multi-agent env (obs [N, agents, ...], rewards [N,
    agents]) returns the team return, the sum of its agents' returns, as training reports it.
    """
    k_reset, k_loop = jax.random.split(key)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(k_reset, num_episodes), env_params)
    zeros_f = jnp.zeros((num_episodes,), jnp.float32)
    zeros_i = jnp.zeros((num_episodes,), jnp.int32)
    done0 = jnp.zeros((num_episodes,), bool)

    def cond(loop):
        t, _, _, _, _, _, _, done = loop
        return jnp.logical_and(t < max_steps, ~jnp.all(done))

    def body(loop):
        t, k, obs, env_state, carry, ret, length, done = loop
        k, k_act, k_step = jax.random.split(k, 3)
        if action_mask is None:
            action, carry = step(obs, k_act, carry)
        else:
            mask = jax.vmap(action_mask, in_axes=(0, None))(env_state, env_params)
            action, carry = step(obs, k_act, carry, mask)
        obs, env_state, reward, term, trunc, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(k_step, num_episodes), env_state, action, env_params)
        reward = reward.astype(jnp.float32)
        if reward.ndim > 1:  # a multi-agent env's [N, agents]: the team's reward
            reward = jnp.sum(reward, axis=-1)
        live = ~done
        ret = ret + jnp.where(live, reward, 0.0)
        length = length + live.astype(jnp.int32)
        done = jnp.logical_or(done, jnp.logical_or(term.astype(bool), trunc.astype(bool)))
        return t + 1, k, obs, env_state, carry, ret, length, done

    loop = (jnp.asarray(0, jnp.int32), k_loop, obs, env_state, carry, zeros_f, zeros_i, done0)
    out = jax.lax.while_loop(cond, body, loop)
    return EpisodeStats(out[5], out[6])


def eval_max_steps(config, env_params) -> int:
    """The bound on an eval episode: config.eval_max_steps, else the env's time limit."""
    if config.eval_max_steps is not None:
        return int(config.eval_max_steps)
    limit = getattr(env_params, "max_steps_in_episode", None)
    if limit is None:
        raise ConfigError(
            f"{config.env_name} has no max_steps_in_episode param, so evaluation needs a bound: "
            "set eval_max_steps (e.g. eval_max_steps=1000)"
        )
    return int(limit)


def summarize(stats: EpisodeStats) -> dict:
    """Host-side summary: mean/std of returns and lengths over the episodes (floats)."""
    r = np.asarray(stats.returns, np.float64)
    n = np.asarray(stats.lengths, np.float64)
    return {
        "episodes": int(r.size),
        "return_mean": float(r.mean()),
        "return_std": float(r.std()),
        "length_mean": float(n.mean()),
        "length_std": float(n.std()),
    }
