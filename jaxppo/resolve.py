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
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core import networks
from jaxppo import cpu_devices
from jaxppo.config import (NetworkConfig, PPOConfig, divisors, is_auto_devices,
                           require_config)
from jaxppo.envs.make import make_env
from jaxppo.envs.spec import EnvSpec
from jaxppo.envs.record import listed
from jaxppo.errors import ConfigError
from jaxppo.core.evaluation import eval_max_steps
from jaxppo.envs.gymnasium_env import check_config as check_host_loop_config
from jaxppo.envs.transforms import reward_hooks


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


@dataclass(frozen=True)
class Resolved:
    """A checked config and what it derives: the env, the network, the device layout, the
    reward hooks."""

    config: PPOConfig
    spec: EnvSpec
    network: Any  # a flax module with __call__(obs, carry, reset) -> (dist, value, carry)
    layout: Layout
    eval_max_steps: int | None  # bound on an evaluation episode; None if the env has none
    reward_hooks: tuple = ()  # the config's reward hooks (jaxppo.envs.transforms), in order

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
        """True when the network carries a state from step to step (a GRU core, or a user's
        module with an initial_carry)."""
        return networks.is_recurrent(self.network)

    @property
    def num_iterations(self) -> int:
        return self.config.num_iterations

    @property
    def splits_population(self) -> bool:
        """True when the shards hold different members of a PBT population (each member's
        envs all on one shard) rather than parts of every member's envs."""
        return splits_population(self.config, self.layout)

    @property
    def splits_seeds(self) -> bool:
        """True when the shards hold different seeds (or sweep members), whole."""
        return self.layout.by_seed and self.layout.shards > 1

    @property
    def local_envs(self) -> int:
        """Envs on each shard (device) of the layout (of each member on it)."""
        if self.splits_population or self.splits_seeds:
            return self.config.num_envs
        return self.config.num_envs // self.layout.shards

    @property
    def layout_text(self) -> str:
        """What the layout does, in one line (`describe_layout`)."""
        return describe_layout(self.config, self.layout)


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
    given_size, config = config.minibatch_size, _sized_minibatches(config)
    _check_backend()
    hooks = tuple(reward_hooks(config))  # every transform entry checked
    spec = make_env(config)
    _check_for_env(config, spec)
    network = networks.make_network(config, spec)
    if config.network.custom:
        check_custom_network(config, spec, network)
    if spec.host_loop:  # one process, one device (jaxppo.run.hostloop)
        check_host_loop_config(config, layout)
        layout = None
    recurrent = networks.is_recurrent(network)
    if layout is None:
        layout = Layout()
    elif layout == "local":
        layout = _local_layout(config, recurrent)
    elif layout == "hosts":
        layout = _host_layout(config, recurrent)
    _check_split(config, layout)
    try:
        _check_minibatches(config, recurrent, layout)
    except ConfigError as e:
        if given_size is None:
            raise
        raise ConfigError(f"minibatch_size={given_size} makes num_minibatches="
                          f"{config.num_minibatches} ({config.batch_size} / {given_size}): "
                          f"{e}") from None
    bound = None
    if config.eval_every or config.eval_max_steps is not None or hasattr(
            spec.env_params, "max_steps_in_episode"):
        bound = eval_max_steps(config, spec.env_params)
    return Resolved(config, spec, network, layout, bound, hooks)


def _sized_minibatches(config: PPOConfig) -> PPOConfig:
    """A config sized by minibatch_size as the same config sized by num_minibatches (num_envs
    * num_steps / minibatch_size), which is what the rest of the package reads."""
    if config.minibatch_size is None:
        return config
    return config.replace(num_minibatches=config.batch_size // config.minibatch_size,
                          minibatch_size=None)


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


def _plain_value(v):
    return v.item() if hasattr(v, "item") and np.ndim(v) == 0 else v


def _check_conv_options(config: PPOConfig, spec: EnvSpec) -> None:
    """network.conv_* only shape a CNN torso, a kernel wider than the image is padding, and
    pooling must leave at least one pixel."""
    net, default = config.network, NetworkConfig()
    torso = networks.resolve_torso(config, spec)
    if torso != "cnn":
        given = [f"network.{name}={listed(getattr(net, name))!r}"
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


def _local_layout(config: PPOConfig, recurrent: bool = False) -> Layout:
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
    _check_split(config, Layout(n))
    if n > available:
        raise ConfigError(
            f"num_devices={n} but this host has {available} local device(s) "
            f"({jax.default_backend()}); set num_devices <= {available} or num_devices=\"auto\"")
    return Layout(n)


def _host_layout(config: PPOConfig, recurrent: bool = False) -> Layout:
    """Every process's layout in a jax.distributed group: the envs (PBT: members) over
    num_devices local devices of each. "auto" takes every local device, except on a CPU
    whose devices are jaxppo's own (one per core): there, as many as pay for the envs
    (`auto_layout`, counting every host's)."""
    available = jax.local_device_count()
    hosts = jax.process_count()
    n = config.num_devices
    if is_auto_devices(n):
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


def _check_split(config: PPOConfig, layout: Layout) -> None:
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
    split = (layout.shards > 1 and config.sync != "batch" and config.pbt is None
             and not layout.by_seed)
    envs = config.num_envs // layout.shards if split else config.num_envs
    if envs % M == 0:
        return
    where = (f"the envs on each device (num_envs={config.num_envs} / {layout.shards} "
             f"devices = {envs})" if split else f"num_envs={config.num_envs}")
    net = (f"network.module={_module_name(config.network.module)} (recurrent)"
           if config.network.custom else f"network.recurrent_size={config.network.recurrent_size}")
    raise ConfigError(
        f"num_minibatches={M} does not divide {where}: with {net} each minibatch holds whole "
        "env sequences; choose "
        f"num_minibatches from {divisors(envs)}" + (", or sync='batch'" if split else ""))


# ---------------------------------------------------------------------- a user's network
def check_custom_network(config: PPOConfig, spec: EnvSpec, network) -> None:
    """Checks a user's module (`networks.CustomNetwork`) against the network contract by
    tracing its init and apply (jax.eval_shape: nothing is computed or compiled) on
    observations of batch shapes (1,), (2,) and (3, 2), as training calls it.

    Raises:
      ConfigError: what the contract expects and what came out (or what the module raised):
        params that are not float arrays in the "params" collection, outputs of another
        structure or shape, a value of another shape, or a carry that changes.
    """
    name = f"network.module={_module_name(config.network.module)}"
    if spec.host_loop and network.recurrent:
        raise ConfigError(
            f"{name} is recurrent, but env={config.env!r} steps in Python (a host loop), "
            "which runs feed-forward policies only; use a module without initial_carry")
    obs1 = jax.ShapeDtypeStruct((1, spec.obs_dim), jnp.float32)
    variables = _traced(name, "init(key, obs [1, obs_dim], carry, reset)",
                        network.init, jax.random.PRNGKey(0), obs1)
    _check_params(name, variables)
    for batch in ((2,), (3, 2)):
        obs = jax.ShapeDtypeStruct(batch + (spec.obs_dim,), jnp.float32)
        carry = _traced(name, f"initial_carry({batch})", lambda b=batch: network.initial_carry(b))
        reset = jax.ShapeDtypeStruct(batch, jnp.bool_)
        out = _traced(name, f"apply(params, obs {list(obs.shape)}, carry, reset)",
                      network.module.apply, variables, obs, carry, reset)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ConfigError(
                f"{name}: __call__(obs, carry, reset) must return (outputs, value, new_carry), "
                f"got {_described(out)}")
        outputs, value, new_carry = out
        _check_outputs(name, spec, batch, outputs)
        if not _is_float(value) or tuple(value.shape) != batch:
            raise ConfigError(
                f"{name}: the value must be a float array of shape {list(batch)} (the batch "
                f"shape of obs {list(obs.shape)}, no trailing 1), got {_described(value)}; "
                "e.g. return nn.Dense(1)(h)[..., 0]")
        _check_carry(name, network, batch, carry, new_carry)


def _module_name(module) -> str:
    return repr(module) if isinstance(module, str) else type(module).__name__


def _traced(name: str, call: str, fn, *args):
    """jax.eval_shape(fn, *args); what the user's code raises becomes a ConfigError."""
    try:
        return jax.eval_shape(fn, *args)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is the config's
        reason = (str(e).strip().splitlines() or [""])[0][:300].rstrip(".")
        raise ConfigError(
            f"{name}: {call} raised {type(e).__name__}: {reason}. The module must take "
            "observations [..., obs_dim] with any leading axes, its carry and reset [...] "
            '(docs/configuration.md, "Your own network")') from None


def _check_params(name: str, variables) -> None:
    collections = sorted(variables) if hasattr(variables, "keys") else None
    if collections != ["params"]:
        got = collections if collections is not None else _described(variables)
        raise ConfigError(
            f"{name}: init must give only the 'params' collection (PPO trains params and "
            f"updates nothing else, e.g. no BatchNorm statistics), got collections {got}")
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"])[0]:
        if not _is_float(leaf):
            raise ConfigError(
                f"{name}: every param must be a float array (the optimiser updates them all), "
                f"but params{jax.tree_util.keystr(path)} is {_described(leaf)}")


def _check_outputs(name: str, spec: EnvSpec, batch: tuple, outputs) -> None:
    """Logits [*batch, A] for discrete actions; (mean [*batch, D], log_std [D] or
    [*batch, D]) for continuous ones."""
    A = spec.action_dim
    if spec.discrete:
        if not _is_float(outputs) or tuple(outputs.shape) != batch + (A,):
            raise ConfigError(
                f"{name}: for the env's {A} discrete actions the outputs must be the logits, a "
                f"float array of shape {list(batch + (A,))}, got {_described(outputs)}")
        return
    ok = (isinstance(outputs, (tuple, list)) and len(outputs) == 2
          and all(_is_float(x) for x in outputs) and tuple(outputs[0].shape) == batch + (A,)
          and tuple(outputs[1].shape) in ((A,), batch + (A,)))
    if not ok:
        raise ConfigError(
            f"{name}: for the env's {A}-dimensional continuous actions the outputs must be "
            f"(mean, log_std): mean a float array of shape {list(batch + (A,))}, log_std of "
            f"shape [{A}] (one for every state) or {list(batch + (A,))}, got "
            f"{_described(outputs)}")


def _check_carry(name: str, network, batch: tuple, carry, new_carry) -> None:
    """A feed-forward module returns no arrays as its carry; a recurrent one returns a carry
    of the structure, shapes and dtypes of the one it was given."""
    if not network.recurrent:
        if jax.tree.leaves(new_carry):
            raise ConfigError(
                f"{name}: a module without initial_carry is feed-forward and must return the "
                f"carry () it is given, got {_described(new_carry)}; a recurrent module "
                "defines initial_carry(batch_shape) -> its carry at an episode's start")
        return
    same = jax.tree.structure(carry) == jax.tree.structure(new_carry) and all(
        _is_float(b) == _is_float(a) and getattr(b, "shape", None) == a.shape
        and getattr(b, "dtype", None) == a.dtype
        for a, b in zip(jax.tree.leaves(carry), jax.tree.leaves(new_carry)))
    if not same:
        raise ConfigError(
            f"{name}: the new carry must have the structure, shapes and dtypes of the carry "
            f"it is given (initial_carry({batch}) = {_described(carry)}), got "
            f"{_described(new_carry)}; a carry that changes shape cannot be carried from step "
            "to step")


def _is_float(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _described(x) -> str:
    """A pytree of arrays as types and shapes, e.g. "(float32[2, 3], float32[3])"."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{np.dtype(x.dtype).name}{list(x.shape)}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_described(v) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if hasattr(x, "items"):
        return "{" + ", ".join(f"{k!r}: {_described(v)}" for k, v in x.items()) + "}"
    return f"{type(x).__name__} {x!r:.60}"
