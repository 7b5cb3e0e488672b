"""Where a run's envs (or seeds, or PBT members) live: the `Layout` of devices and hosts they
are split over, the one "auto" picks (`auto_layout`), one line saying what runs where
(`describe_layout`), and the checks that a config splits evenly over a layout.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import jax

from jaxppo import cpu_devices
from jaxppo.config import PPOConfig, divisors, is_auto_devices
from jaxppo.errors import ConfigError
from jaxppo.core.networks import module_name


@dataclass(frozen=True)
class Layout:
    """`local_devices` devices on each of `num_processes` processes; this is `process_index`.
    The envs are split into `shards = local_devices * num_processes` equal parts, or, with
    `by_seed` (one process only), the seeds are: each shard trains num_seeds / shards whole
    seeds, with no collective between shards."""

    local_devices: int = 1
    num_processes: int = 1
    process_index: int = 0
    by_seed: bool = False

    @property
    def shards(self) -> int:
        return self.local_devices * self.num_processes

    @property
    def first_shard(self) -> int:
        return self.process_index * self.local_devices


def splits_population(config: PPOConfig, layout: Layout) -> bool:
    """A PBT run on several devices or hosts splits its members between them: members never
    combine gradients, so each trains where it lives, and shards exchange learner states only
    at exploit steps (jaxppo.search.pbt)."""
    return config.pbt is not None and layout.shards > 1


# Envs split over devices (gradients all-reduced every minibatch) only pay with enough envs
# on each device: with 2 per device the collectives and the smaller per-device batches cost
# about what the second core brings; from 4 on the split ran 1.4-1.6x faster (CartPole,
# PureJaxRL's config on 2 CPU cores, the cheapest case: heavier envs and networks pay more
# readily). 8 leaves a margin (docs/performance.md).
MIN_ENVS_PER_DEVICE = 8


def auto_layout(num_seeds: int, num_envs: int, devices: int, pbt: bool = False,
                env_multiple: int = 1) -> Layout:
    """The layout "auto" picks on one host of `devices` devices (a pure function):

    1. PBT: the members over the most devices that divide num_seeds (as many each);
    2. several seeds (or a sweep's members): likewise, each device training whole seeds with
       no collective, unless splitting the envs would use more devices;
    3. the envs over the most devices that divide num_envs and leave each at least
       MIN_ENVS_PER_DEVICE envs (a multiple of `env_multiple`: a recurrent policy's
       minibatches of whole env sequences);
    4. else one device.
    """
    def most(n: int, ok=lambda d: True) -> int:
        return max(d for d in range(1, min(devices, n) + 1) if n % d == 0 and ok(d))

    if pbt and num_seeds > 1:
        return Layout(most(num_seeds))
    by_seed = most(num_seeds) if num_seeds > 1 else 1
    by_env = most(num_envs, lambda d: d == 1 or (num_envs // d >= MIN_ENVS_PER_DEVICE
                                                  and (num_envs // d) % env_multiple == 0))
    if by_seed > 1 and by_seed >= by_env:
        return Layout(by_seed, by_seed=True)
    return Layout(by_env)


def describe_layout(config: PPOConfig, layout: Layout, platform: str | None = None,
                    sweep: bool = False) -> str:
    """One line: what runs where, e.g. "16 seeds over 2 CPU devices (8 each, no collectives)"
    (`sweep`: the seeds are a sweep's members, each with its own hyperparameters)."""
    platform = (platform or jax.default_backend()).upper()
    shards, seeds = layout.shards, config.num_seeds
    sweep = sweep or config.pbt is not None or config.search is not None
    what = "members" if sweep else "seeds"
    if shards == 1:
        many = f"{seeds} {what}, vmapped, " if seeds > 1 else ""
        return f"{many}one {platform} device"
    where = (f"{shards} {platform} devices" if layout.num_processes == 1 else
             f"{layout.num_processes} hosts x {layout.local_devices} {platform} device(s)")
    if layout.by_seed:
        return f"{seeds} {what} over {where} ({seeds // shards} each, no collectives)"
    if config.pbt is not None:
        return (f"{seeds} PBT members over {where} ({seeds // shards} each; learner states "
                "exchanged at exploit steps only)")
    per = f"{config.num_envs // shards} each"
    sync = "rollouts all-gathered" if config.sync == "batch" else "gradients all-reduced"
    many = f", {seeds} {what} vmapped on each" if seeds > 1 else ""
    return f"{config.num_envs} envs over {where} ({per}, {sync}{many})"


def _env_multiple(config: PPOConfig, recurrent: bool) -> int:
    """What each device's env count must be a multiple of when the envs are split: a
    recurrent policy's minibatches hold whole env sequences."""
    return config.num_minibatches if recurrent and config.sync != "batch" else 1


def local_layout(config: PPOConfig, recurrent: bool = False) -> Layout:
    available = jax.local_device_count()
    if is_auto_devices(config.num_devices):
        layout = auto_layout(config.num_seeds, config.num_envs, available, config.pbt is not None,
                             _env_multiple(config, recurrent))
        if available == 1 and jax.default_backend() == "cpu":
            would = auto_layout(config.num_seeds, config.num_envs, cpu_devices.status["devices"],
                                config.pbt is not None, _env_multiple(config, recurrent))
            note = cpu_devices.started_early_note(available, would.shards)
            if note:
                print(note, file=sys.stderr, flush=True)
        return layout
    n = config.num_devices
    check_split(config, Layout(n))
    if n > available:
        raise ConfigError(
            f"num_devices={n} but this host has {available} local device(s) "
            f"({jax.default_backend()}); set num_devices <= {available} or num_devices=\"auto\"")
    return Layout(n)


def learner_layout(config: PPOConfig) -> Layout:
    """The learner's devices for an env that steps in Python (jaxppo.run.hostloop): an integer
    num_devices splits the update's batch (its envs) over that many of this host's devices, as
    the compiled path splits its envs; "auto" keeps one device. There the Python env steps,
    not the update, usually bound the run (docs/environments.md), and one device keeps
    today's numbers bit for bit."""
    if is_auto_devices(config.num_devices):
        return Layout()
    return local_layout(config)


def host_layout(config: PPOConfig, recurrent: bool = False, host_loop: bool = False) -> Layout:
    """Every process's layout in a jax.distributed group: the envs (PBT: members) over
    num_devices local devices of each. "auto" takes every local device, except on a CPU
    whose devices are jaxppo's own (one per core): there, as many as pay for the envs
    (`auto_layout`, counting every host's); and for an env that steps in Python
    (`host_loop`), one learner device per host, as `learner_layout` keeps one."""
    available = jax.local_device_count()
    hosts = jax.process_count()
    n = config.num_devices
    if is_auto_devices(n) and host_loop:
        n = 1
    elif is_auto_devices(n):
        n = available
        if jax.default_backend() == "cpu" and cpu_devices.status["action"] == "set":
            if config.pbt is not None:
                n = max(d for d in range(1, available + 1) if config.num_seeds % (d * hosts) == 0)
            else:
                m = _env_multiple(config, recurrent)
                n = max(d for d in range(1, available + 1) if d == 1 or (
                    config.num_envs % (d * hosts) == 0
                    and config.num_envs // (d * hosts) >= MIN_ENVS_PER_DEVICE
                    and (config.num_envs // (d * hosts)) % m == 0))
    if n > available:
        raise ConfigError(
            f"num_devices={n} but host {jax.process_index()} has {available} local device(s) "
            f"({jax.default_backend()}); set num_devices <= {available} or num_devices=\"auto\"")
    return Layout(n, hosts, jax.process_index())


def check_split(config: PPOConfig, layout: Layout) -> None:
    """The envs split evenly over the layout's shards (a PBT population: its members)."""
    shards = layout.shards
    where = (f"num_devices={shards}" if layout.num_processes == 1 else
             f"{layout.num_processes} hosts x {layout.local_devices} device(s) = {shards} shards")
    if layout.by_seed and shards > 1:
        if layout.num_processes > 1:
            raise ConfigError("seeds split over devices is a layout of one process; over "
                              "several hosts the envs are split")
        if config.num_seeds % shards:
            raise ConfigError(
                f"num_seeds={config.num_seeds} cannot be split evenly over {where}; use "
                f"num_devices from {divisors(config.num_seeds)}")
        return
    if config.pbt is not None:
        if config.num_seeds % shards == 0:
            return
        raise ConfigError(
            f"pbt splits its num_seeds={config.num_seeds} members over {where}, each shard "
            f"training the same number; use a num_seeds (and search.population) that is a "
            f"multiple of {shards} (e.g. {shards * max(1, config.num_seeds // shards)})"
            + (f" or num_devices from {divisors(config.num_seeds)}" if layout.num_processes == 1
               else " or another number of hosts"))
    if config.num_envs % shards == 0:
        return
    raise ConfigError(
        f"num_envs={config.num_envs} cannot be split evenly over {where}; use a num_envs "
        f"that is a multiple of {shards} (e.g. {shards * max(1, config.num_envs // shards)})"
        + (f" or num_devices from {divisors(config.num_envs)}" if layout.num_processes == 1 else ""))


def check_minibatches(config: PPOConfig, recurrent: bool, layout: Layout, agents: int = 1) -> None:
    """Minibatches are cut so that the global minibatch is the same set of transitions on
    any layout: feed-forward ones take num_steps/M steps of every env, recurrent ones whole
    actor sequences (an env's, or one agent's of a multi-agent env: `agents` per env; with
    agent_params per_agent or per_group an env's agents together), one of every M consecutive ones on each
    shard (or of all of them, with sync="batch", where each
    shard updates on the whole batch)."""
    M = config.num_minibatches
    if not recurrent:
        if config.num_steps % M:
            options = [d for d in divisors(config.num_steps) if d <= 64]
            raise ConfigError(
                f"num_minibatches={M} does not divide the batch of num_envs*num_steps = "
                f"{config.num_envs}*{config.num_steps} = {config.batch_size} transitions into "
                f"minibatches of whole rollout steps (num_steps={config.num_steps} must be a "
                f"multiple of num_minibatches); choose num_minibatches from {options} or "
                "change num_steps")
        return
    split = (layout.shards > 1 and config.sync != "batch" and config.pbt is None
             and not layout.by_seed)
    envs = config.num_envs // layout.shards if split else config.num_envs
    # A network per agent keeps each env's agents together: whole envs per minibatch.
    per_env = agents > 1 and config.agent_params != "shared"
    units = envs if per_env else envs * agents
    if units % M == 0:
        return
    where = (f"the envs on each device (num_envs={config.num_envs} / {layout.shards} "
             f"devices = {envs})" if split else f"num_envs={config.num_envs}")
    if agents > 1 and not per_env:
        where = f"the actors of {where} x {agents} agents = {envs * agents}"
    net = (f"network.module={module_name(config.network.module)} (recurrent)"
           if config.network.custom else f"network.recurrent_size={config.network.recurrent_size}")
    raise ConfigError(
        f"num_minibatches={M} does not divide {where}: with {net} each minibatch holds whole "
        f"{'actor' if agents > 1 and not per_env else 'env'} sequences"
        + (f" (with agent_params={config.agent_params}, each env's agents together)"
           if per_env else "")
        + f"; choose num_minibatches from {divisors(units)}"
        + (", or sync='batch'" if split else ""))
