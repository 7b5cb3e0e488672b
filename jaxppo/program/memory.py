"""Whether the training program fits in memory: a lower bound of what it holds, by the config
field that sizes each part, checked before anything is allocated or compiled
(`check_memory_estimate`), and XLA's own figure checked after compiling (`check_memory`);
either refusal names the part that dominates and the field to lower.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxppo.core.hyperparams import HyperParams
from jaxppo.errors import ConfigError
from jaxppo.program.build import Program
from jaxppo.program.shards import PER_ENV_FIELDS


def check_memory_estimate(program: Program, key: jax.Array, hp: HyperParams) -> None:
    """Before anything is allocated or compiled: a ConfigError when a lower bound of what the
    program holds (`memory_parts` of the state's shapes) exceeds the free memory, naming
    the part that dominates and the field to lower."""
    free = free_memory()
    if free is None:
        return
    try:
        shapes = jax.eval_shape(program.init, key, hp)
        parts = memory_parts(program, shapes)
    except Exception:  # noqa: BLE001 - no estimate for this program: the check after compiling stands
        return
    needed = sum(p.nbytes for p in parts)
    if jax.devices()[0].platform != "cpu":  # each device has its own memory
        needed //= program.layout.local_devices
    if needed > free:
        raise ConfigError(memory_message(f"at least {_size(needed)}", needed, free, parts,
                                         program.algorithm.config))


def check_memory(compiled, program: Program, state) -> None:
    """Before the first call: a ConfigError when the compiled program needs more memory than
    the device has free (XLA's own figure from compiling; running would fail with an
    allocation error deep inside, or get the process killed)."""
    try:
        m = compiled.memory_analysis()
        needed = int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - no analysis on this backend: nothing to check
        return
    if jax.devices()[0].platform == "cpu":  # CPU "devices" share the host's memory
        needed *= program.layout.local_devices
    free = free_memory()
    if free is None or needed <= free:
        return
    raise ConfigError(memory_message(f"about {_size(needed)} of working memory beyond its state",
                                     needed, free, memory_parts(program, state),
                                     program.algorithm.config))


class MemoryPart(NamedTuple):
    """One part of what the training program holds at once (all seeds on this process)."""

    what: str  # e.g. "the rollout buffer and live envs"
    cause: str  # the fields that size it, e.g. "num_envs*num_steps = 2,048 transitions"
    field: str  # the field to lower to shrink it
    nbytes: int
    count: int = 0  # the field's value when the part grows linearly with it, else 0


def memory_parts(program: Program, state) -> list[MemoryPart]:
    """A lower bound of the program's memory on this process, by the field that sizes each
    part, largest first: network params with their gradients and optimizer state, the
    rollout buffer with the live envs, and (with eval_every) the evaluation envs. `state`:
    the program's state, or its shapes (`jax.eval_shape(program.init, ...)`)."""
    algo, cfg = program.algorithm, program.algorithm.config
    params, opt = _nbytes(state.params), _nbytes(state.opt_state)
    live = sum(_nbytes(getattr(state, n)) for n in PER_ENV_FIELDS)
    obs_dims = len(algo.spec.obs_shape)
    envs = int(np.prod(state.last_obs.shape[:state.last_obs.ndim - obs_dims]))  # all copies
    copies = max(1, envs // algo.local_envs)  # seeds x devices on this process
    per_env, obs = live / envs, _nbytes(state.last_obs) / envs
    widths = int(sum(cfg.network.hidden_sizes) + sum(cfg.network.head_sizes))
    torsos = 1 if cfg.network.shared_trunk else 2
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params)) // copies
    # Per transition: the observation, action, log prob, value, reward, done, advantage and
    # return (4 bytes each), and an update's activations of one minibatch row per layer.
    per_row = obs + 7 * 4 + widths * 4 * torsos / cfg.num_minibatches
    rollout = envs * cfg.num_steps * per_row + live
    sizes = cfg.network.hidden_sizes
    shaped_by = ("network.kwargs" if cfg.network.custom  # a user's module: its own arguments
                 else f"network.hidden_sizes={list(sizes)}")
    parts = [
        MemoryPart("network parameters, gradients and optimizer state",
                   f"{shaped_by}: {n_params:,} parameters per seed",
                   shaped_by.partition("=")[0], 2 * params + opt),
        MemoryPart("the rollout buffer and live envs",
                   f"num_envs*num_steps = {cfg.batch_size:,} transitions per iteration",
                   "num_envs", int(rollout), cfg.num_envs),
    ]
    if cfg.eval_every:  # each eval env: its state, observation and one layer's activations
        widest = max(cfg.network.hidden_sizes)
        parts.append(MemoryPart(
            "the evaluation envs", f"eval_episodes={cfg.eval_episodes:,} envs run at once",
            "eval_episodes", int(copies * cfg.eval_episodes * (per_env + obs + widest * 4)),
            cfg.eval_episodes))
    return sorted(parts, key=lambda p: -p.nbytes)


def memory_message(need: str, needed: int, free: int, parts: list[MemoryPart], config) -> str:
    """One paragraph: what the program needs, its largest parts with the fields that size
    them, and the field to lower (with how far, where the part grows with it)."""
    seeds = config.num_seeds
    listed = "; ".join(f"{p.what} {_size(p.nbytes)} ({p.cause})" for p in parts if p.nbytes)
    where = jax.devices()[0].device_kind
    text = (f"the training program needs {need}, but {_size(free)} is free on {where}. Its "
            f"largest parts{f', for all {seeds:,} seeds' if seeds > 1 else ''}: {listed}. ")
    top = parts[0]
    fixes = []
    if seeds > 1 and needed / seeds <= free:  # one seed fits: the seed count is the lever
        fixes.append(f"lower num_seeds (at most about {max(1, int(free / (needed / seeds))):,} "
                     "would fit)")
    if top.count:
        rest = needed - top.nbytes  # what lowering the field leaves
        fits = int((free - rest) / (top.nbytes / top.count)) if free > rest else 0
        fixes.append(f"lower {top.field}"
                     + (f" (at most about {fits:,} would fit)" if fits >= 1 else ""))
    else:
        fixes.append(f"use fewer or narrower layers in {top.field}")
    advice = " or ".join(fixes)
    return text + advice[0].upper() + advice[1:] + "."


def free_memory() -> int | None:
    """Bytes free for the program: the accelerator's free memory, or the host's available
    memory on a CPU; None where it cannot be known."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _size(nbytes: float) -> str:
    """Bytes as GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"
