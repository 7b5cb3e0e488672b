"""Two actor-critics of one's own that `NetworkConfig` cannot describe, as a user writes
them (docs/configuration.md, "Your own network"):

* `LayerNormActorCritic`: layer norm after each hidden layer, and a value trunk of its own
  widths;
* `LSTMActorCritic`: an LSTM core (flax's OptimizedLSTMCell) whose carry is a pair (c, h),
  restarted where `reset` marks an episode's first observation.

Train one with `PPOConfig(network=LayerNormActorCritic(value_hidden_sizes=(128, 128)))`, or from
a config file:

    network:
      module: jaxppo.examples.networks:LSTMActorCritic
      kwargs: {features: 32}

Both leave `action_dim` and `discrete` as None, which jaxppo fills from the env.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxppo.core.networks import orthogonal


def _dense(features: int, scale: float) -> nn.Dense:
    # jaxppo's orthogonal init: flax's own runs a batched QR when the init is vmapped over
    # seeds (num_seeds), which can hang the CPU backend.
    return nn.Dense(features, kernel_init=orthogonal(scale), bias_init=nn.initializers.zeros)


class _Heads(nn.Module):
    """Logits, or a Gaussian mean and one learned log std vector, from features."""

    action_dim: int
    discrete: bool

    @nn.compact
    def __call__(self, h):
        out = _dense(self.action_dim, 0.01)(h)
        if self.discrete:
            return out
        return out, self.param("log_std", nn.initializers.zeros, (self.action_dim,))


class LayerNormActorCritic(nn.Module):
    """Feed-forward: Dense -> LayerNorm -> tanh layers of `hidden_sizes` for the policy, and of
    `value_hidden_sizes` for the value (two trunks of different widths)."""

    hidden_sizes: Sequence[int] = (64, 64)
    value_hidden_sizes: Sequence[int] = (128, 128)
    action_dim: int | None = None  # filled from the env
    discrete: bool | None = None

    @nn.compact
    def __call__(self, obs, carry, reset):
        h = obs
        for width in self.hidden_sizes:
            h = jnp.tanh(nn.LayerNorm()(_dense(width, float(np.sqrt(2.0)))(h)))
        v = obs
        for width in self.value_hidden_sizes:
            v = jnp.tanh(nn.LayerNorm()(_dense(width, float(np.sqrt(2.0)))(v)))
        value = _dense(1, 1.0)(v)[..., 0]
        return _Heads(self.action_dim, self.discrete)(h), value, carry


class LSTMActorCritic(nn.Module):
    """Recurrent: a Dense encoder of `hidden_size`, an LSTM of `features` units (carry (c, h),
    each [..., features]), then the policy and value heads on its output."""

    features: int = 32
    hidden_size: int = 64
    action_dim: int | None = None  # filled from the env
    discrete: bool | None = None

    def initial_carry(self, batch_shape):
        """(c, h) zeros [*batch_shape, features]: the carry at an episode's start."""
        zeros = jnp.zeros(tuple(batch_shape) + (self.features,), jnp.float32)
        return zeros, zeros

    @nn.compact
    def __call__(self, obs, carry, reset):
        keep = (1.0 - reset.astype(jnp.float32))[..., None]  # restart where an episode starts
        carry = tuple(c * keep for c in carry)
        x = jnp.tanh(_dense(self.hidden_size, float(np.sqrt(2.0)))(obs))
        cell = nn.OptimizedLSTMCell(self.features, recurrent_kernel_init=orthogonal(1.0))
        carry, y = cell(carry, x)
        value = _dense(1, 1.0)(y)[..., 0]
        return _Heads(self.action_dim, self.discrete)(y), value, carry
