"""The tunable scalars of a run (`HyperParams`) and their piecewise-linear schedules.

`HyperParams` has one leaf per field that jaxppo.config declares tunable, in declaration
order (`config.HYPERPARAM_LEAVES`; tests/test_config.py keeps the two the same): a schedule
(`lr`, `entropy_coeff`) becomes its points (`lr_points`, `entropy_points`), any other field
its float32 value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxppo.config import HYPERPARAM_LEAVES, SCHEDULES, PPOConfig, check_fields, require_config
from jaxppo.errors import ConfigError

# A critic_lr schedule's value that means "lr" (critic_lr null).
FOLLOWS_LR = -1.0

# What from_config reads: the tunable fields, the fields giving their schedules' form, and
# the budget a linear schedule anneals over.
_READS = (*HYPERPARAM_LEAVES.values(), *SCHEDULES.values(), "total_timesteps")


@struct.dataclass
class HyperParams:
    """The tunable scalars of a run: pytree leaves, so `jax.vmap` can sweep any of them.

    The leaves are named after the config's tunable fields (`clip_param`, `gamma`, ...),
    except schedules: `lr_points`/`entropy_points` are piecewise-linear schedules over env
    steps, [K, 2] arrays of (env_step, value); a constant is one point, a linear anneal two.
    `vf_clip_param` null (no value clipping) is 0, `critic_lr` null (lr) lr's points
    with the value FOLLOWS_LR (`follows_lr`). `kl_coeff` is the initial value; the live
    one is in TrainState.
    """

    # In the order of config.HYPERPARAM_LEAVES, which checkpoints and sweeps keep.
    lr_points: jax.Array  # [K, 2] learning-rate schedule
    entropy_points: jax.Array  # [K, 2] entropy-coefficient schedule
    clip_param: jax.Array  # PPO's ratio clip epsilon
    vf_clip_param: jax.Array  # clip of the value change; 0 = unclipped
    vf_coeff: jax.Array  # weight of the value loss
    kl_coeff: jax.Array  # initial KL-penalty coefficient
    kl_target: jax.Array  # the KL the coefficient adapts towards
    max_grad_norm: jax.Array  # global-norm gradient clipping
    critic_lr_points: jax.Array  # [K, 2] the critic's learning-rate schedule; below 0 = lr
    gamma: jax.Array  # discount
    gae_lambda: jax.Array  # GAE lambda

    # leaves holding schedule points ([K, 2]) and leaves holding one value
    point_leaves = tuple(leaf for leaf, name in HYPERPARAM_LEAVES.items() if name in SCHEDULES)
    scalar_leaves = tuple(leaf for leaf, name in HYPERPARAM_LEAVES.items() if name not in SCHEDULES)

    @classmethod
    def from_config(cls, config: PPOConfig) -> "HyperParams":
        """The config's tunable values. ConfigError for a bad value of a field it reads (the
        whole config is validated by `jaxppo.resolve`, once per run)."""
        config = require_config(config)
        check_fields(config, _READS)
        leaves = {}
        for leaf, name in HYPERPARAM_LEAVES.items():
            value = getattr(config, name)
            if name in SCHEDULES and value is None:  # critic_lr null: lr's points, below 0
                leaves[leaf] = follows_lr(leaves["lr_points"])
            elif name in SCHEDULES:
                leaves[leaf] = _schedule_points(value, getattr(config, SCHEDULES[name]),
                                                config.total_timesteps)
            else:
                leaves[leaf] = jnp.asarray(0.0 if value is None else value, jnp.float32)
        return cls(**leaves)

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
        shapes = {tuple(np.shape(getattr(h, leaf)) for leaf in cls.point_leaves) for h in items}
        if len({np.shape(getattr(h, cls.scalar_leaves[0])) for h in items}) != 1:
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


def is_follows_lr(points) -> bool:
    """Whether schedule points are critic_lr null's (`follows_lr`): every value FOLLOWS_LR."""
    return bool(np.all(np.asarray(points)[..., 1] == FOLLOWS_LR))


def follows_lr(lr_points) -> jax.Array:
    """critic_lr null as schedule points: lr's env steps, each with the value FOLLOWS_LR (the
    same number of points as a critic_lr of lr's form has, so the two stack in a sweep)."""
    pts = np.array(lr_points, np.float32)
    pts[..., 1] = FOLLOWS_LR
    return jnp.asarray(pts)


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


def reanchor_points(points, step: int, old_total: int, new_total: int) -> np.ndarray:
    """Schedule points ([..., K, 2]) continued from `step` when the run's total_timesteps
    changes from `old_total` to `new_total` (an extended run).

    The value at `step` is kept, and what the schedule does after it is stretched so that
    what came at `old_total` comes at `new_total`: a linear anneal to 0 at the old total
    goes on from its current value to 0 at the new one. Each schedule keeps its number of
    points (the last point at or before `step` moves to `step`), so a batch of them stacks
    as before. A run already past its old schedule's end (`step >= old_total`) moves the
    points after `step` by `new_total - old_total`.
    """
    pts = np.asarray(points, np.float32)
    flat = pts.reshape(-1, *pts.shape[-2:])
    out = np.stack([_reanchor_one(p, float(step), float(old_total), float(new_total))
                    for p in flat])
    return out.reshape(pts.shape).astype(np.float32)


def _reanchor_one(p: np.ndarray, s0: float, t_old: float, t_new: float) -> np.ndarray:
    # the value at s0 as the step computes it (float32), so the continuation starts there
    now = float(schedule_value(jnp.asarray(p), jnp.asarray(s0, jnp.float32)))
    x, y = p[:, 0].astype(np.float64), p[:, 1].astype(np.float64)
    later = x > s0
    if s0 < t_old:
        x[later] = s0 + (x[later] - s0) * (t_new - s0) / (t_old - s0)
    else:
        x[later] += t_new - t_old
    before = np.flatnonzero(~later)
    if before.size:
        x[before[-1]], y[before[-1]] = s0, now
    return np.stack([x, y], axis=-1)


def describe_schedule(points, step: int, total: int) -> str:
    """What a schedule ([K, 2] points) does from env step `step` to `total`, in words:
    "constant 0.01", "linear from 1.7e-05 at step 500,000 to 0 at step 1,000,000", or for
    more points "from A at step X, linear to B at step Y, then held at B to step Z"."""
    pts = jnp.asarray(np.asarray(points, np.float32))
    xs = [float(step)] + sorted({float(x) for x in np.asarray(pts[:, 0]) if step < x < total})
    xs.append(float(max(total, step)))
    vs = [float(schedule_value(pts, jnp.asarray(x, jnp.float32))) for x in xs]
    if max(vs) == min(vs):
        return f"constant {vs[0]:.3g}"
    if len(xs) == 2:
        return (f"linear from {vs[0]:.3g} at step {int(xs[0]):,} to {vs[1]:.3g} at step "
                f"{int(xs[1]):,}")
    parts = [f"from {vs[0]:.3g} at step {int(xs[0]):,}"]
    for i in range(1, len(xs)):
        how = "held at" if vs[i] == vs[i - 1] else ("linear to" if i == 1 else "then to")
        parts.append(f"{how} {vs[i]:.3g} at step {int(xs[i]):,}")
    return ", ".join(parts)
