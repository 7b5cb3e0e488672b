"""Running mean/variance (Chan et al. parallel merge) for observation and reward scaling.

Batch moments are passed in already reduced, so the caller decides what "the batch" is: one
device, or (under pmap) the mean over all devices, which keeps the statistics global.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class RunningStats:
    """Running mean and variance of a stream of batches (elementwise, of `shape`)."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array

    @classmethod
    def create(cls, shape, count: float = 1e-4) -> "RunningStats":
        """Mean 0, variance 1, and a tiny count so the first batch sets both."""
        return cls(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32),
                   jnp.asarray(count, jnp.float32))

    def merge(self, batch_mean, batch_var, batch_count) -> "RunningStats":
        """The statistics with a batch's mean, (population) variance and count merged in."""
        delta = batch_mean - self.mean
        total = self.count + batch_count
        mean = self.mean + delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        return RunningStats(mean, m2 / total, total)


def normalize(stats: RunningStats, x: jax.Array, clip: float = 10.0) -> jax.Array:
    """x [..., *shape] standardised by the statistics and clipped to [-clip, clip]."""
    return jnp.clip((x - stats.mean) / jnp.sqrt(stats.var + 1e-8), -clip, clip)
