"""`resolve(config)`: everything a run derives from its config, worked out and checked once.

`resolve` validates the config (`PPOConfig.validate`: each field's declared check, then the
rules between fields), once per run. What needs more than the config (the env and its
spaces, the transforms, the network's torso, the devices the envs are split over, the bound
on an evaluation episode) is worked out here too, by `train`, `make_train`, `load_policy` and
the multi-host entry; the rest of the package takes the `Resolved` it returns and checks
nothing again. The device layout comes from jaxppo.program.layout, a user's network module
from jaxppo.program.user_network.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxppo.core import networks
from jaxppo.config import NetworkConfig, PPOConfig, own_critic_lr, require_config
from jaxppo.config_fields import did_you_mean
from jaxppo.envs.make import make_env
from jaxppo.envs.spec import EnvSpec
from jaxppo.envs.record import listed
from jaxppo.errors import ConfigError, warn
from jaxppo.core.evaluation import eval_max_steps
from jaxppo.envs.gymnasium_env import check_config as check_host_loop_config
from jaxppo.envs.gymnasium_env import check_hosts as check_host_loop_hosts
from jaxppo.envs.gymnasium_env import refuse_host_options
from jaxppo.envs.transforms import check_takes_agents, reward_hooks
from jaxppo.program.layout import (Layout, check_minibatches, check_split, describe_layout,
                                   host_layout, learner_layout, local_layout, splits_population)
from jaxppo.program.user_network import check_custom_network, user_module


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
        check_split(self.config, layout)
        check_minibatches(self.config, self.recurrent, layout, self.spec.num_agents)
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


def resolve(config: PPOConfig, layout: Layout | str | None = None) -> Resolved:
    """Check `config` completely and derive what a run needs; ConfigError otherwise.

    layout: None (one device: `make_train`, `load_policy`), "local" (config.num_devices of
    this host's devices, default all), "hosts" (the same on every process of a
    `jax.distributed` group) or a `Layout`.
    """
    config = require_config(config).validate()
    given_size, config = config.minibatch_size, _sized_minibatches(config)
    check_backend()
    hooks = tuple(reward_hooks(config))  # every transform entry checked
    spec = make_env(config)
    _check_for_env(config, spec)
    module = user_module(config.network) if config.network.custom else None
    network = networks.make_network(config, spec, module)
    if config.network.custom:
        check_custom_network(config, spec, network)
    if spec.host_loop:  # jaxppo.run.hostloop, run.actorlearner
        check_host_loop_config(config)
    else:
        refuse_host_options(config)
    recurrent = networks.is_recurrent(network)
    if spec.agents:  # the env wrappers were checked as make_env wrapped the env
        for hook in hooks:
            check_takes_agents(hook, config.env_name)
    _check_agent_options(config, spec)
    _check_networks_apart(config)
    if config.agent_params != "shared":
        groups = None
        if config.agent_params == "per_group":
            groups = networks.agent_groups(spec.agents)
        elif isinstance(config.agent_params, Mapping):
            groups = networks.agent_groups(spec.agents, _named_groups(config, spec))
        network = networks.PerAgentNetwork(network, spec.num_agents, spec.discrete, groups=groups)
    if layout is None:
        layout = Layout()
    elif layout == "local":
        layout = (learner_layout(config) if spec.host_loop else local_layout(config, recurrent))
    elif layout == "hosts":
        layout = host_layout(config, recurrent, spec.host_loop)
    if spec.host_loop:  # each host steps its share of the envs
        check_host_loop_hosts(config, layout.num_processes)
    check_split(config, layout)
    try:
        check_minibatches(config, recurrent, layout, spec.num_agents)
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
    batches is rounded down, when that drops more than 1% of it: a round budget such as 1e6
    rounded to whole batches of a tuned config is what the user asked for, and says nothing
    (loading a policy or a worker's own resolve says nothing either)."""
    if config.total_timesteps % config.batch_size > 0.01 * config.total_timesteps:
        warn(f"total_timesteps={config.total_timesteps} is not a multiple of the batch "
             f"(num_envs*num_steps = {config.batch_size}): the run does {config.num_iterations} "
             f"iteration(s) = {config.num_iterations * config.batch_size} env steps per seed")


def check_backend() -> None:
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


def _check_agent_options(config: PPOConfig, spec: EnvSpec) -> None:
    """critic_input, agent_id, critic_agent_id and agent_params need a multi-agent env, and
    critic_agent_id a centralised critic; a centralised critic needs the built-in network
    with a critic torso of its own, and "world_state" an env that gives one."""
    defaults = (("critic_input", "local"), ("agent_id", False), ("critic_agent_id", False),
                ("agent_params", "shared"))
    given = [f"{name}={getattr(config, name)!r}" for name, default in defaults
             if getattr(config, name) != default]
    if not given:
        return
    if not spec.agents:
        fix = ", ".join(f"{name}: {str(default).lower()}" for name, default in defaults
                        if getattr(config, name) != default)
        raise ConfigError(
            f"{' and '.join(given)} only {'apply' if len(given) > 1 else 'applies'} to "
            f"multi-agent envs (e.g. jaxmarl:MPE_simple_spread_v3), but {config.env_name} has "
            f"one agent; remove {'them' if len(given) > 1 else 'it'} ({fix})")
    if config.critic_input == "local":
        if config.critic_agent_id:
            raise ConfigError(
                "critic_agent_id=true appends the agent's one-hot index to a centralised "
                "critic's input, but critic_input='local' gives the critic the policy's input: "
                "use agent_id: true (the actor's and a local critic's input), or critic_input: "
                "world_state or joint_obs")
        _check_agent_id_network(config)
        return
    what = f"critic_input={config.critic_input!r}"
    if config.network.custom:
        raise ConfigError(
            f"{what} gives the built-in network's critic an input of its own, but "
            f"network.module={networks.module_name(config.network.module)} replaces that "
            "network; use critic_input: local, or the built-in network")
    if config.network.shared_trunk:
        raise ConfigError(
            f"{what} feeds the critic another input than the actor's, so they cannot share "
            "one torso: set network.shared_trunk: false (or critic_input: local)")
    if config.critic_input == "world_state":
        if spec.world_state is None:
            raise ConfigError(
                f"{what}, but {config.env_name} gives no world state (jaxppo has one for "
                "JaxMARL's SMAX and MPE envs); use critic_input: joint_obs (every agent's "
                "observation, concatenated) or local")
        if config.normalize_observations:
            raise ConfigError(
                f"{what} with normalize_observations=true: the world state is not normalised "
                "(only observations are); set normalize_observations: false, or use "
                "critic_input: joint_obs (built from the normalised observations)")
    _check_agent_id_network(config)


def _named_groups(config: PPOConfig, spec: EnvSpec) -> Mapping:
    """agent_params {group: [agent, ...]}, checked against the env's agents: each agent in
    exactly one group."""
    named, agents = config.agent_params, [str(a) for a in spec.agents]
    seen: dict[str, str] = {}
    for group, members in named.items():
        for m in members:
            if m not in agents:
                raise ConfigError(
                    f"agent_params: group {group!r} names {m!r}, which is not one of "
                    f"{config.env_name}'s agents {agents}{did_you_mean(m, agents)}")
            if m in seen:
                raise ConfigError(f"agent_params: {m!r} is in two groups, {seen[m]!r} and "
                                  f"{group!r}; put each agent in one group")
            seen[m] = group
    missing = [a for a in agents if a not in seen]
    if missing:
        raise ConfigError(
            f"agent_params: {', '.join(map(repr, missing))} in no group; every agent of "
            f"{config.env_name} ({agents}) needs one (a group of its own: {{{missing[0]}: "
            f"[{missing[0]}]}})")
    return named


def _check_networks_apart(config: PPOConfig) -> None:
    """Clipping the actor's and the critic's gradients apart, or stepping the critic with a
    learning rate of its own, needs the built-in network with no layer the two share."""
    if config.max_grad_norm_over != "all":
        what = ("max_grad_norm_over='each_network' clips the actor's and the critic's "
                "gradients apart")
        undo = "max_grad_norm_over: all"
    elif own_critic_lr(config):
        field = "critic_lr" if config.critic_lr is not None else "search.critic_lr"
        what = f"{field} gives the critic a learning rate of its own"
        undo = "critic_lr: null (lr for both)"
    else:
        return
    net = config.network
    if net.custom:
        raise ConfigError(
            f"{what}, which needs the built-in network (whose parameters say which they "
            f"are), but network.module={networks.module_name(net.module)} replaces it; use "
            f"{undo}")
    if net.shared_trunk:
        raise ConfigError(
            f"{what}, but network.shared_trunk=true gives them one torso; set "
            f"network.shared_trunk: false, or {undo}")
    if net.recurrent_size and config.critic_input == "local":
        raise ConfigError(
            f"{what}, but with network.recurrent_size={net.recurrent_size} they share one "
            "GRU unless the critic has an input of its own (critic_input: world_state or "
            f"joint_obs, on a multi-agent env); use {undo}")


def _check_agent_id_network(config: PPOConfig) -> None:
    """agent_id appends to the built-in network's input; a user's module reads the env's."""
    if config.agent_id and config.network.custom:
        raise ConfigError(
            "agent_id=true appends the agent's one-hot index to the built-in network's input, "
            f"but network.module={networks.module_name(config.network.module)} replaces that "
            "network; append it in your module, or remove agent_id")


def _is_real(v) -> bool:
    """A real number (Python, numpy or a 0-d array), not a bool or a string."""
    return (np.ndim(v) == 0 and not isinstance(v, (bool, str, bytes))
            and np.issubdtype(np.asarray(v).dtype, np.number))


def _plain_value(v):
    return v.item() if hasattr(v, "item") and np.ndim(v) == 0 else v


def _check_conv_options(config: PPOConfig, spec: EnvSpec) -> None:
    """network.conv_* only shape the configurable CNN torso, the fixed CNNs take no layer
    options, a kernel wider than the image is padding, and pooling must leave at least one
    pixel."""
    net, default = config.network, NetworkConfig()
    torso = networks.resolve_torso(config, spec)
    if torso in ("nature_cnn", "impala_cnn"):
        _check_fixed_cnn(config, torso)
        return
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


def _check_fixed_cnn(config: PPOConfig, torso: str) -> None:
    """The Nature and IMPALA CNNs are fixed architectures over raw pixels: the layer options
    of the other torsos, and observation normalisation before their own / 255, are errors."""
    net, default = config.network, NetworkConfig()
    given = [f"network.{name}={listed(getattr(net, name))!r}"
             for name in ("hidden_sizes", "activation", "conv_channels", "conv_kernel", "conv_pool")
             if getattr(net, name) != getattr(default, name)]
    if given:
        raise ConfigError(
            f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the 'mlp' and "
            f"'cnn' torsos, but network.torso={torso!r} is a fixed architecture (its own "
            "convolutions, Dense layer and ReLUs; docs/configuration.md); remove "
            f"{'them' if len(given) > 1 else 'it'}, or use network.torso='cnn' to choose layers")
    if config.normalize_observations:
        raise ConfigError(
            f"normalize_observations=true standardises the pixels that network.torso={torso!r} "
            "scales by 1/255 itself (as the Atari baselines do); set normalize_observations="
            "false")


def _default_limit(config: PPOConfig):
    try:
        return int(make_env(config.replace(env_kwargs={}, env_params=None)).env_params.max_steps_in_episode)
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"
