"""`resolve(config)`: everything a run derives from its config, worked out and checked once.

`resolve` validates the config (`PPOConfig.validate`: each field's declared check, then the
rules between fields), once per run. What needs more than the config (the env and its
spaces, the transforms, the network's torso, the devices the envs are split over, the bound
on an evaluation episode) is worked out here too, by `train`, `make_train`, `load_policy` and
the multi-host entry; the rest of the package takes the `Resolved` it returns and checks
nothing again.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxppo.core import networks
from jaxppo.config import NetworkConfig, PPOConfig, divisors, require_config
from jaxppo.envs.make import EnvSpec, make_env
from jaxppo.errors import ConfigError
from jaxppo.core.evaluation import eval_max_steps
from jaxppo.envs.gymnasium_env import check_config as check_host_loop_config
from jaxppo.envs.transforms import resolve_transforms


@dataclass(frozen=True)
class Layout:
    """`local_devices` devices on each of `num_processes` processes; this is `process_index`.
    The envs are split into `shards = local_devices * num_processes` equal parts."""

    local_devices: int = 1
    num_processes: int = 1
    process_index: int = 0

    @property
    def shards(self) -> int:
        return self.local_devices * self.num_processes

    @property
    def first_shard(self) -> int:
        return self.process_index * self.local_devices


@dataclass(frozen=True)
class Resolved:
    """A checked config and what it derives: the env, the network, the device layout."""

    config: PPOConfig
    spec: EnvSpec
    network: Any  # a flax module with __call__(obs, carry, reset) -> (dist, value, carry)
    layout: Layout
    eval_max_steps: int | None  # bound on an evaluation episode; None if the env has none

    def with_layout(self, layout: Layout | None) -> "Resolved":
        """The same run on another layout (None: one device), checked for it."""
        layout = layout or Layout()
        _check_split(self.config, layout)
        _check_minibatches(self.config, self.recurrent, layout)
        return dataclasses.replace(self, layout=layout)

    @property
    def host_loop(self) -> bool:
        """True when the env steps in Python (gymnasium): `jaxppo.run.hostloop` runs the run."""
        return self.spec.host_loop

    @property
    def recurrent(self) -> bool:
        """True when the network carries a state from step to step (a GRU core)."""
        return bool(self.network.carry_size)

    @property
    def num_iterations(self) -> int:
        return self.config.num_iterations

    @property
    def splits_population(self) -> bool:
        """True when the shards hold different members of a PBT population (each member's
        envs all on one shard) rather than parts of every member's envs."""
        return splits_population(self.config, self.layout)

    @property
    def local_envs(self) -> int:
        """Envs on each shard (device) of the layout (of each member on it)."""
        return self.config.num_envs if self.splits_population else self.config.num_envs // self.layout.shards


def splits_population(config: PPOConfig, layout: Layout) -> bool:
    """A PBT run on several devices or hosts splits its members between them: members never
    combine gradients, so each trains where it lives, and shards exchange learner states only
    at exploit steps (jaxppo.search.pbt)."""
    return config.pbt is not None and layout.shards > 1


def resolve(config: PPOConfig, layout: Layout | str | None = None) -> Resolved:
    """Check `config` completely and derive what a run needs; ConfigError otherwise.

    layout: None (one device: `make_train`, `load_policy`), "local" (config.num_devices of
    this host's devices, default all), "hosts" (the same on every process of a
    `jax.distributed` group) or a `Layout`.
    """
    config = require_config(config).validate()
    _check_backend()
    if config.transforms:
        resolve_transforms(config.transforms)
    spec = make_env(config)
    _check_for_env(config, spec)
    network = networks.make_network(config, spec)
    if spec.host_loop:  # one process, one device (jaxppo.run.hostloop)
        check_host_loop_config(config, layout)
        layout = None
    if layout is None:
        layout = Layout()
    elif layout == "local":
        layout = _local_layout(config)
    elif layout == "hosts":
        layout = _host_layout(config)
    _check_split(config, layout)
    _check_minibatches(config, bool(network.carry_size), layout)
    bound = None
    if config.eval_every or config.eval_max_steps is not None or hasattr(
            spec.env_params, "max_steps_in_episode"):
        bound = eval_max_steps(config, spec.env_params)
    return Resolved(config, spec, network, layout, bound)


def note_partial_batch(config: PPOConfig) -> None:
    """Say once, where a run starts training, that a budget which is not a whole number of
    batches is rounded down (loading a policy or a worker's own resolve says nothing)."""
    if config.total_timesteps % config.batch_size:
        warnings.warn(
            f"total_timesteps={config.total_timesteps} is not a multiple of the batch "
            f"(num_envs*num_steps = {config.batch_size}): the run does {config.num_iterations} "
            f"iteration(s) = {config.num_iterations * config.batch_size} env steps per seed",
            stacklevel=3)


def _check_backend() -> None:
    """JAX's backend starts, or a ConfigError that says why (JAX's own error for a platform
    this machine lacks, e.g. JAX_PLATFORMS=cuda without a GPU, can be a bare AssertionError)."""
    try:
        jax.devices()
    except Exception as e:  # noqa: BLE001 - any failure here means the same to the user
        platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(
            "JAX cannot start a backend" + (f" for JAX_PLATFORMS={platforms!r}" if platforms else "")
            + f" ({reason}). Unset JAX_PLATFORMS (or set it to cpu) to train on this machine's "
            "CPU, or install jax for that platform (e.g. pip install 'jax[cuda12]' for an NVIDIA "
            "GPU)") from None


def _check_for_env(config: PPOConfig, spec: EnvSpec) -> None:
    """Options that mean nothing for this env are errors, not silently ignored."""
    net = config.network
    if spec.discrete:
        given = [f"network.{name}={getattr(net, name)!r}" for name, default in
                 (("state_dependent_std", False), ("log_std_init", 0.0))
                 if getattr(net, name) != default]
        if given:
            raise ConfigError(
                f"{' and '.join(given)} only {'apply' if len(given) > 1 else 'applies'} to the "
                "Gaussian of continuous actions, but "
                f"{config.env_name} has {spec.action_dim} discrete actions; remove "
                f"{'them' if len(given) > 1 else 'it'}")
    steps = getattr(spec.env_params, "max_steps_in_episode", None)
    if steps is not None and (not _is_real(steps) or steps < 1):
        raise ConfigError(
            f"max_steps_in_episode={_plain_value(steps)!r} (env_kwargs/env_params) must be >= "
            f"1: it is the episode's time limit in steps (the {config.env_name} default is "
            f"{_default_limit(config)})")
    _check_conv_options(config, spec)


def _is_real(v) -> bool:
    """A real number (Python, numpy or a 0-d array), not a bool or a string."""
    return (np.ndim(v) == 0 and not isinstance(v, (bool, str, bytes))
            and np.issubdtype(np.asarray(v).dtype, np.number))


def _listed(v):
    return list(v) if isinstance(v, tuple) else v


def _plain_value(v):
    return v.item() if hasattr(v, "item") and np.ndim(v) == 0 else v


def _check_conv_options(config: PPOConfig, spec: EnvSpec) -> None:
    """network.conv_* only shape a CNN torso, a kernel wider than the image is padding, and
    pooling must leave at least one pixel."""
    net, default = config.network, NetworkConfig()
    torso = networks.resolve_torso(config, spec)
    if torso != "cnn":
        given = [f"network.{name}={_listed(getattr(net, name))!r}"
                 for name in ("conv_channels", "conv_kernel", "conv_pool")
                 if getattr(net, name) != getattr(default, name)]
        if given:
            why = ("network.torso is 'mlp'" if net.torso == "mlp" else
                   f"{config.env_name}'s observations {spec.obs_shape} are not images [H, W, C], "
                   "so network.torso='auto' is the MLP")
            raise ConfigError(
                f"{' and '.join(given)} only {'shape' if len(given) > 1 else 'shapes'} a CNN "
                f"torso, but {why}; remove "
                f"{'them' if len(given) > 1 else 'it'}")
        return
    side = max(spec.obs_shape[:2])
    if net.conv_kernel > side:
        raise ConfigError(
            f"network.conv_kernel={net.conv_kernel} is wider than {config.env_name}'s "
            f"{spec.obs_shape[0]}x{spec.obs_shape[1]} images (each window would be mostly "
            f"padding); use a kernel of at most {side}, e.g. 3")
    h, w = spec.obs_shape[:2]
    for _ in net.conv_channels:
        h, w = h // net.conv_pool, w // net.conv_pool
    if min(h, w) < 1:
        raise ConfigError(
            f"network.conv_pool={net.conv_pool} after each of {len(net.conv_channels)} conv "
            f"layer(s) shrinks {config.env_name}'s {spec.obs_shape[0]}x{spec.obs_shape[1]} "
            "images to nothing; use fewer conv layers or a smaller conv_pool")


def _default_limit(config: PPOConfig):
    try:
        return int(make_env(config.replace(env_kwargs={}, env_params=None)).env_params.max_steps_in_episode)
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"


def _local_layout(config: PPOConfig) -> Layout:
    available = jax.local_device_count()
    n = config.num_devices if config.num_devices is not None else available
    if config.num_devices is not None:
        _check_split(config, Layout(n))
    if n > available:
        raise ConfigError(
            f"num_devices={n} but this host has {available} local device(s) "
            f"({jax.default_backend()}); set num_devices <= {available} or leave it unset")
    if config.num_devices is None and config.pbt is not None and n > 1 and config.num_seeds % n:
        raise ConfigError(
            f"pbt splits its {config.num_seeds} members over this host's {n} devices, but "
            f"{n} does not divide {config.num_seeds}; set num_devices to one of "
            f"{[d for d in divisors(n) if config.num_seeds % d == 0]} or num_seeds to a "
            f"multiple of {n}")
    if config.num_devices is None and config.pbt is None and config.num_envs % n:
        raise ConfigError(
            f"num_envs={config.num_envs} cannot be split evenly over this host's {n} devices; "
            f"set num_devices to one of {[d for d in divisors(n) if config.num_envs % d == 0]} or "
            f"use num_envs a multiple of {n}")
    return Layout(n)


def _host_layout(config: PPOConfig) -> Layout:
    available = jax.local_device_count()
    n = config.num_devices if config.num_devices is not None else available
    if n > available:
        raise ConfigError(
            f"num_devices={n} but host {jax.process_index()} has {available} local device(s) "
            f"({jax.default_backend()}); set num_devices <= {available} or leave it unset")
    return Layout(n, jax.process_count(), jax.process_index())


def _check_split(config: PPOConfig, layout: Layout) -> None:
    """The envs split evenly over the layout's shards (a PBT population: its members)."""
    shards = layout.shards
    where = (f"num_devices={shards}" if layout.num_processes == 1 else
             f"{layout.num_processes} hosts x {layout.local_devices} device(s) = {shards} shards")
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


def _check_minibatches(config: PPOConfig, recurrent: bool, layout: Layout) -> None:
    """Minibatches are cut so that the global minibatch is the same set of transitions on
    any layout: feed-forward ones take num_steps/M steps of every env, recurrent ones whole
    env sequences, one env of every M consecutive ones on each shard (or of all the envs,
    with sync="batch", where each shard updates on the whole batch)."""
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
    split = layout.shards > 1 and config.sync != "batch" and config.pbt is None
    envs = config.num_envs // layout.shards if split else config.num_envs
    if envs % M == 0:
        return
    where = (f"the envs on each device (num_envs={config.num_envs} / {layout.shards} "
             f"devices = {envs})" if split else f"num_envs={config.num_envs}")
    raise ConfigError(
        f"num_minibatches={M} does not divide {where}: with network.recurrent_size="
        f"{config.network.recurrent_size} each minibatch holds whole env sequences; choose "
        f"num_minibatches from {divisors(envs)}" + (", or sync='batch'" if split else ""))
