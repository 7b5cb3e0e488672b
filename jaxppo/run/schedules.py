"""The lr and entropy schedules across a resume: what a checkpoint records of the schedules a
run trains with (`schedule_record`), and the schedules a resumed run continues with, with the
lines that say so (`continue_schedules`; when total_timesteps changed, those of a run started
with the new total, or re-anchored at the checkpoint: `PPOConfig.schedule_on_extend`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxppo.core.hyperparams import (HyperParams, describe_schedule, is_follows_lr,
                                     reanchor_points, schedule_value)
from jaxppo.config import HYPERPARAM_LEAVES, SCHEDULES, PPOConfig


def schedule_record(hp: HyperParams, config: PPOConfig) -> dict:
    """What a checkpoint records of the schedules a run trains with (`continue_schedules`
    reads it back): HyperParams' point leaves as lists; nothing for PBT, whose
    exploit/explore steps rebuild its schedules from the config."""
    if config.pbt is not None:
        return {}
    return {"schedules": {leaf: np.asarray(getattr(hp, leaf), np.float32).tolist()
                          for leaf in HyperParams.point_leaves}}


def continue_schedules(hp: HyperParams, meta: dict, config: PPOConfig, *, given: bool,
                       from_record: bool, labels: list[str] | None = None
                       ) -> tuple[HyperParams, list[str]]:
    """The schedules (lr, entropy_coeff) a resumed run continues with, and lines saying what
    they do from the checkpoint on.

    A schedule that the resume leaves as it was continues as the checkpoint recorded it while
    total_timesteps is unchanged. When total_timesteps changed, `config.schedule_on_extend`
    says what it becomes: "new_total", the schedule a run started with the new total has (a
    linear anneal from its start value at step 0 to 0 at the new total; points as given);
    "continue", the recorded one re-anchored at the checkpoint's step
    (`jaxppo.core.hyperparams.reanchor_points`): its value there is kept and the rest is
    stretched to the new total. A schedule the resume changes (a new lr in the config, or
    `hparams` passed to train) is used as given, over the run's env steps. PBT rebuilds its
    searched schedules itself and is left as it is.

    Args:
        hp: the hyperparameters as configured (config, sweep.json, or `hparams`).
        meta: the checkpoint's record (its config, env steps and recorded schedules).
        config: the config the run continues with.
        given: `hp` was passed to train by the caller.
        from_record: `hp` comes from the folder's sweep.json.
        labels: a sweep's member labels, to name members in the lines.
    """
    saved = meta.get("config") or {}
    step, total = int(meta.get("env_steps", 0)), config.total_timesteps
    old_total = int(saved.get("total_timesteps", total))
    if config.pbt is not None:
        return hp, [f"resuming at env step {step:,} of {total:,}"]
    now, recorded = config.to_dict(), meta.get("schedules") or {}
    carry_on = config.schedule_on_extend == "continue"
    legacy = HyperParams.from_config(config.replace(total_timesteps=old_total))
    changes, notes, before = {}, [], {}
    for leaf in HyperParams.point_leaves:
        name = HYPERPARAM_LEAVES[leaf]
        fields = (name, SCHEDULES[name])
        changed = given or (not from_record and any(
            f in saved and saved[f] != now[f] for f in fields))
        if changed:
            notes.append((name, "as now configured"))
            continue
        configured = np.asarray(getattr(hp if from_record else legacy, leaf), np.float32)
        base = configured
        if leaf in recorded and np.shape(recorded[leaf]) == base.shape:
            base = np.asarray(recorded[leaf], np.float32)
        before[name] = base
        if old_total != total and not carry_on:  # as a run started with the new total
            base = configured if _as_points(config, name) else _over(configured, total)
        elif old_total != total:
            base = reanchor_points(base, step, old_total, total)
        changes[leaf] = jnp.asarray(base)
    hp = hp.replace(**changes)
    head = f"resuming at env step {step:,} of {total:,}"
    if old_total != total and carry_on:
        head += (f" (total_timesteps was {old_total:,}: each schedule goes on from its value "
                 "at the checkpoint, stretched to the new total)")
    elif old_total != total:
        head += (f" (total_timesteps was {old_total:,}: each schedule is now the one a run "
                 "started with the new total has, a linear anneal going from its start value at "
                 "step 0 to 0 at the new total; schedule_on_extend=continue goes on from the "
                 "checkpoint's values instead)")
    lines = [head + ":"]
    why = dict(notes)
    for leaf in HyperParams.point_leaves:
        name = HYPERPARAM_LEAVES[leaf]
        if is_follows_lr(getattr(hp, leaf)):
            continue  # critic_lr null: the critic follows lr
        for text in _describe(np.asarray(getattr(hp, leaf)), step, total, labels):
            lines.append(f"  {name}: {text}" + (f" ({why[name]})" if name in why else ""))
    lr = before.get("lr")
    if old_total != total and carry_on and lr is not None and _fading(lr, step):
        lines.append(
            f"  (the lr schedule had nearly run out; to train the extension, let it anneal over "
            f"the new total (schedule_on_extend=new_total) or give it as points from here, e.g. "
            f"--set 'lr=[[{step}, {_first_lr(lr):g}], [{total}, {_first_lr(lr) / 100:g}]]')")
    return hp, lines


def _as_points(config: PPOConfig, name: str) -> bool:
    """Whether the config gives schedule `name` as [env_step, value] points."""
    return isinstance(getattr(config, name), (list, tuple))


def _over(points: np.ndarray, total: int) -> np.ndarray:
    """`points` ([..., K, 2]) with each linear anneal ([[0, start], [end, 0]], as
    `*_schedule: linear` makes it; a sweep member's own) ending at `total` instead."""
    out = np.array(points, np.float32)
    if out.shape[-2] == 2:
        anneal = (out[..., 0, 0] == 0) & (out[..., 1, 1] == 0)
        out[..., 1, 0] = np.where(anneal, np.float32(total), out[..., 1, 0])
    return out


def _describe(points: np.ndarray, step: int, total: int, labels) -> list[str]:
    """One description per distinct schedule of `points` ([K, 2], or [N, K, 2] for a sweep
    whose members are named by `labels`)."""
    if points.ndim == 2:
        return [describe_schedule(points, step, total)]
    texts: dict[str, list[str]] = {}
    for i, p in enumerate(points):
        texts.setdefault(describe_schedule(p, step, total), []).append(
            labels[i] if labels else f"seed {i}")
    if len(texts) == 1:
        return list(texts)
    return [f"{text} [{', '.join(dict.fromkeys(who))}]" for text, who in texts.items()]


def _fading(lr: np.ndarray, step: int) -> bool:
    """Whether every lr schedule in `lr` is below a tenth of its first value at `step`."""
    pts = lr.reshape(-1, *lr.shape[-2:])
    return all(float(schedule_value(jnp.asarray(p), jnp.asarray(step, jnp.float32)))
               < 0.1 * float(np.max(p[:, 1])) for p in pts)


def _first_lr(lr: np.ndarray) -> float:
    return float(np.max(lr.reshape(-1, *lr.shape[-2:])[0, :, 1]))
