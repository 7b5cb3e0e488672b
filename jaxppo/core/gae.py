"""Generalised advantage estimation with correct time-limit handling.

A terminated step (the MDP ended) bootstraps with 0. A truncated step (a time limit cut the
episode) bootstraps with V(final_observation), the value of the state the env really
reached, and cuts the trace there so the next episode's advantages do not leak in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compute_gae(
    rewards: jax.Array,
    values: jax.Array,
    next_values: jax.Array,
    terminated: jax.Array,
    truncated: jax.Array,
    gamma: float | jax.Array,
    gae_lambda: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Advantages and value targets for a rollout (arrays time-major, [T, E]).

    Args:
      rewards: [T, E] r_t.
      values: [T, E] V(s_t) under the critic that acted.
      next_values: [T, E] V(s'_t) of the true successor of step t: the final (pre-reset)
        observation for a finished episode, else the next observation.
      terminated: [T, E] bool, the episode really ended at step t (bootstrap with 0).
      truncated: [T, E] bool, a time limit cut it (bootstrap with next_values, cut the
        trace); terminated wins where both are set.
      gamma: the discount, a scalar.
      gae_lambda: GAE's lambda, a scalar.

    Returns:
      (advantages [T, E], value_targets = advantages + values [T, E]).
    """
    terminated = terminated.astype(values.dtype)
    done = jnp.maximum(terminated, truncated.astype(values.dtype))
    deltas = rewards + gamma * next_values * (1.0 - terminated) - values
    decay = gamma * gae_lambda * (1.0 - done)

    def step(carry, x):
        delta, d = x
        carry = delta + d * carry
        return carry, carry

    _, advantages = jax.lax.scan(
        step, jnp.zeros_like(values[0]), (deltas, decay), reverse=True
    )
    return advantages, advantages + values
