"""The tunable scalars of a run (`HyperParams`) and their piecewise-linear schedules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxppo.config import PPOConfig, require_config
from jaxppo.errors import ConfigError


@struct.dataclass
class HyperParams:
    """The tunable scalars of a run: pytree leaves, so `jax.vmap` can sweep any of them.

    `lr_points`/`entropy_points` are piecewise-linear schedules over env steps, [K, 2] arrays
    of (env_step, value); a constant is one point, a linear anneal two.
    """

    lr_points: jax.Array
    entropy_points: jax.Array
    clip_param: jax.Array
    vf_clip_param: jax.Array
    vf_coeff: jax.Array
    kl_coeff: jax.Array  # initial value; the live one is in TrainState
    kl_target: jax.Array
    max_grad_norm: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array

    @classmethod
    def from_config(cls, config: PPOConfig) -> "HyperParams":
        config = require_config(config).validate()
        f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        return cls(
            lr_points=_schedule_points(config.lr, config.lr_schedule, config.total_timesteps),
            entropy_points=_schedule_points(
                config.entropy_coeff, config.entropy_schedule, config.total_timesteps
            ),
            clip_param=f(config.clip_param),
            vf_clip_param=f(config.vf_clip_param if config.vf_clip_param is not None else 0.0),
            vf_coeff=f(config.vf_coeff),
            kl_coeff=f(config.kl_coeff),
            kl_target=f(config.kl_target),
            max_grad_norm=f(config.max_grad_norm),
            gamma=f(config.gamma),
            gae_lambda=f(config.gae_lambda),
        )

    @classmethod
    def stack(cls, items: "list[HyperParams]") -> "HyperParams":
        """One batched HyperParams (leading axis len(items)) for `vmap`: a sweep.

        Schedules must have the same number of points in every item (e.g. all constant or
        all linear).
        """
        if not isinstance(items, (list, tuple)) or not items:
            raise ConfigError(
                f"HyperParams.stack takes a non-empty list of HyperParams, got "
                f"{'an empty list' if isinstance(items, (list, tuple)) else type(items).__name__}; "
                "e.g. HyperParams.stack("
                "[HyperParams.from_config(config.replace(lr=lr)) for lr in (1e-4, 3e-4)])")
        wrong = next((i for i, h in enumerate(items) if not isinstance(h, HyperParams)), None)
        if wrong is not None:
            raise ConfigError(
                f"HyperParams.stack: item {wrong} is {type(items[wrong]).__name__} "
                f"{repr(items[wrong])[:40]}, not a HyperParams; make each with "
                "HyperParams.from_config(config)")
        shapes = {tuple(np.shape(h.lr_points)) + tuple(np.shape(h.entropy_points)) for h in items}
        if len({np.shape(h.clip_param) for h in items}) != 1:
            raise ConfigError(
                "HyperParams.stack: some items are already stacked (a leading axis) and some "
                "are not; stack single HyperParams (HyperParams.from_config) only")
        if len(shapes) != 1:
            raise ConfigError(
                "HyperParams.stack: lr/entropy schedules have different numbers of points "
                "across the sweep; use the same schedule form (constant, linear or the same "
                "number of [env_step, value] points) in every config"
            )
        return jax.tree.map(lambda *xs: jnp.stack(xs), *items)


def _schedule_points(value, kind: str, total_timesteps: int) -> jax.Array:
    if isinstance(value, (list, tuple)):
        pts = np.asarray(value, np.float32)
    elif kind == "linear":
        pts = np.asarray([[0.0, value], [float(total_timesteps), 0.0]], np.float32)
    else:
        pts = np.asarray([[0.0, value]], np.float32)
    return jnp.asarray(pts)


def schedule_value(points: jax.Array, env_steps: jax.Array) -> jax.Array:
    """Piecewise-linear interpolation, constant beyond the first and last points.

    The arithmetic of `jnp.interp`, whose search over the points is a while loop; a
    schedule has a few points, so comparing against all of them is cheaper to compile and
    to run, and gives the same numbers."""
    x = env_steps.astype(jnp.float32)
    xp, fp = points[:, 0], points[:, 1]
    i = jnp.clip(jnp.searchsorted(xp, x, side="right", method="compare_all"), 1, len(xp) - 1)
    df, dx, delta = fp[i] - fp[i - 1], xp[i] - xp[i - 1], x - xp[i - 1]
    flat = jnp.abs(dx) <= np.spacing(np.finfo(np.float32).eps)
    f = jnp.where(flat, fp[i - 1], fp[i - 1] + (delta / jnp.where(flat, 1, dx)) * df)
    return jnp.where(x > xp[-1], fp[-1], jnp.where(x < xp[0], fp[0], f))
