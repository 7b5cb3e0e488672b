"""The PPO loss and the adaptive KL-coefficient rule, as pure functions of arrays."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxppo.core import networks
from jaxppo.core.networks import DistParams


class Batch(NamedTuple):
    """Training samples: the iteration's batch (leading axes [T, E]) or a minibatch cut from
    it ([B], or [T, B] whole sequences for a recurrent network). Shapes below for [B]."""

    # [B, obs_dim], already normalised if observation normalisation is on; in a batch made
    # with raw observations (`ppo.make_batch(raw_obs=True)`), those [B, *obs_shape] until
    # `ppo.learn` cuts a minibatch
    obs: jax.Array
    actions: jax.Array  # [B] int (discrete) or [B, D] float (unclipped policy sample)
    old_log_probs: jax.Array  # [B]
    old_dist: DistParams  # acting policy: loc [B, A|D], log_std [A|D] or [B, A|D]
    old_values: jax.Array  # [B]
    advantages: jax.Array  # [B], already standardised when that is on
    value_targets: jax.Array  # [B]
    # What replaying a recurrent network needs (None for feed-forward): the carry was zeroed
    # before step t ([T, E]), and each env's carry at the rollout's start ([E, ...]).
    reset: jax.Array | None = None
    carry0: jax.Array | None = None
    # The legal actions of each sample's state ([B, A] bool) when the policy masks; the new
    # policy is restricted to them before its log-probs, entropy and KL (None: unmasked).
    action_mask: jax.Array | None = None
    # A centralised critic's input ([B, C], `critic_input` world_state / joint_obs); None:
    # the critic reads `obs`.
    critic_obs: jax.Array | None = None


def shares_log_std(dist: DistParams) -> bool:
    """True when `log_std` is one vector for every sample (batching leaves it unsliced)."""
    return dist.log_std.ndim < dist.loc.ndim


def map_dist(fn, dist: DistParams) -> DistParams:
    """fn applied to `loc`, and to `log_std` only when it is per sample."""
    return DistParams(fn(dist.loc), dist.log_std if shares_log_std(dist) else fn(dist.log_std))


def unstack_shared_log_std(dist: DistParams) -> DistParams:
    """A scan over time stacks a shared log_std [D] into equal rows [T, D]: keep one."""
    if dist.log_std.ndim == dist.loc.ndim - 1:
        return dist._replace(log_std=dist.log_std[0])
    return dist


def map_samples(fn, batch: Batch) -> Batch:
    """Apply fn to every per-sample array of a Batch ([T, E] or [B] leading axes), passing
    a shared old log_std and the per-env `carry0` through unchanged."""
    shared = shares_log_std(batch.old_dist)
    kept = batch.old_dist.log_std if shared else None
    stripped = batch._replace(carry0=None)
    if shared:
        stripped = stripped._replace(old_dist=batch.old_dist._replace(log_std=None))
    out = jax.tree.map(fn, stripped)._replace(carry0=batch.carry0)
    return out._replace(old_dist=out.old_dist._replace(log_std=kept)) if shared else out


class LossTerms(NamedTuple):
    """The loss and its terms (scalars), as `ppo_loss_terms` returns them."""

    total: jax.Array
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    kl: jax.Array  # mean analytic KL(old || new)
    approx_kl: jax.Array  # mean of (ratio - 1) - log(ratio), the low-variance estimator
    clip_fraction: jax.Array


def ppo_loss_terms(
    discrete: bool,
    new_dist: DistParams,
    new_values: jax.Array,
    batch: Batch,
    *,
    clip_param,
    vf_clip_param,
    vf_coeff,
    entropy_coeff,
    kl_coeff,
    use_kl_loss: bool,
    use_vf_clip: bool,
) -> LossTerms:
    """PPO's loss and its terms for one minibatch.

    total = policy_loss + vf_coeff*value_loss - entropy_coeff*entropy (+ kl_coeff*kl when
    use_kl_loss), where policy_loss = -mean(min(r*A, clip(r, 1-eps, 1+eps)*A)) with
    r = exp(logp_new - logp_old), and value_loss = 0.5*mean((V - target)^2), or with value
    clipping 0.5*mean(max((V - target)^2, (V_old + clip(V - V_old, -c, c) - target)^2)).

    Args:
      discrete: the actions are discrete (else Gaussian).
      new_dist: the current policy's distribution over the batch, loc [B, A|D].
      new_values: [B] the current critic's values.
      batch: the minibatch (old log-probs, values, advantages, targets).
      clip_param: eps, the policy ratio's clip range.
      vf_clip_param: c, the value clip range (with use_vf_clip).
      vf_coeff: the value loss's weight.
      entropy_coeff: the entropy bonus's weight.
      kl_coeff: the KL penalty's weight (with use_kl_loss).
      use_kl_loss: add the KL penalty.
      use_vf_clip: clip the value loss.

    Returns:
      LossTerms of scalars: the total and each term, with KL and clip-fraction diagnostics.
    """
    log_probs = networks.log_prob(discrete, new_dist, batch.actions)
    log_ratio = log_probs - batch.old_log_probs
    ratio = jnp.exp(log_ratio)
    adv = batch.advantages
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_param, 1.0 + clip_param) * adv)
    policy_loss = -jnp.mean(surrogate)

    value_err = jnp.square(new_values - batch.value_targets)
    if use_vf_clip:
        clipped = batch.old_values + jnp.clip(new_values - batch.old_values, -vf_clip_param, vf_clip_param)
        value_err = jnp.maximum(value_err, jnp.square(clipped - batch.value_targets))
    value_loss = 0.5 * jnp.mean(value_err)

    ent = jnp.mean(networks.entropy(discrete, new_dist))
    kl = jnp.mean(networks.kl_divergence(discrete, batch.old_dist, new_dist))
    total = policy_loss + vf_coeff * value_loss - entropy_coeff * ent
    if use_kl_loss:
        total = total + kl_coeff * kl
    approx_kl = jnp.mean((ratio - 1.0) - log_ratio)
    clip_fraction = jnp.mean((jnp.abs(ratio - 1.0) > clip_param).astype(jnp.float32))
    return LossTerms(total, policy_loss, value_loss, ent, kl, approx_kl, clip_fraction)


def update_kl_coeff(kl_coeff: jax.Array, mean_kl: jax.Array, kl_target) -> jax.Array:
    """RLlib's rule: x1.5 when the KL is above 2*target, x0.5 when below target/2."""
    return jnp.where(
        mean_kl > 2.0 * kl_target,
        kl_coeff * 1.5,
        jnp.where(mean_kl < 0.5 * kl_target, kl_coeff * 0.5, kl_coeff),
    )
