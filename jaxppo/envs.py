"""Environments: gymnax envs by name (or a user's gymnax-API object) and their spaces.

gymnax 1.x `step` returns `obs, state, reward, terminated, truncated, info`, auto-resets,
and puts the pre-reset observation in `info["final_observation"]`; the rollout relies on it.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo._imports import import_gymnax
from jaxppo.errors import ConfigError
from jaxppo.transforms import box_bounds, wrap_env


class EnvSpec(NamedTuple):
    """An environment and what the networks need to know about it."""

    env: Any
    env_params: Any
    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int  # number of actions (discrete) or action vector size (continuous)
    action_low: np.ndarray | None  # continuous bounds, broadcast to [action_dim]
    action_high: np.ndarray | None

    @property
    def obs_dim(self) -> int:
        return int(np.prod(self.obs_shape))


def registered_env_names() -> list[str]:
    gymnax = import_gymnax()

    return list(gymnax.registered_envs)


def check_env_name(name: str) -> None:
    names = registered_env_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    lowered = {n.lower(): n for n in names}
    if name.lower() in lowered:
        close = [lowered[name.lower()]]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(
        f"env={name!r} is not a registered gymnax environment{hint or '.'} "
        f"Registered: {', '.join(names)}. Or pass an env object with the gymnax API as env="
    )


def make_env(config) -> EnvSpec:
    """Build the env named in `config.env` (or take the object given) with its params.

    `env_kwargs` keys that are fields of the env's params (e.g. `max_steps_in_episode`)
    set those params; the rest go to the env's constructor.
    """
    env_kwargs = dict(config.env_kwargs or {})
    if isinstance(config.env, str):
        gymnax = import_gymnax()

        check_env_name(config.env)
        factory = gymnax.registration._registry[config.env]
        # Build once with no kwargs to learn which keys are params, not constructor args.
        default_params = factory().default_params
        param_fields = _param_fields(default_params)
        param_kwargs = {k: env_kwargs.pop(k) for k in list(env_kwargs) if k in param_fields}
        try:
            env, env_params = gymnax.make(config.env, **env_kwargs)
        except TypeError as e:
            raise ConfigError(
                f"env_kwargs={config.env_kwargs!r} not accepted by {config.env}: {e}. "
                f"Params you can set through env_kwargs: {sorted(param_fields)}"
            ) from None
    else:
        env = config.env
        missing = [a for a in ("reset", "step", "action_space", "observation_space",
                               "default_params") if not hasattr(env, a)]
        if missing:
            raise ConfigError(
                f"env={env!r} is neither a registered gymnax name nor an object with the "
                f"gymnax API: it has no {', '.join(missing)} (needed: reset, step, "
                "action_space, observation_space, default_params)")
        env_params = env.default_params
        param_fields = _param_fields(env_params)
        param_kwargs = {k: env_kwargs.pop(k) for k in list(env_kwargs) if k in param_fields}
        if env_kwargs:
            raise ConfigError(
                f"env_kwargs keys {sorted(env_kwargs)} are not params of {config.env_name}; "
                f"settable params: {sorted(param_fields)}"
            )
    if config.env_params is not None:
        env_params = config.env_params
    if param_kwargs:
        env_params = env_params.replace(**param_kwargs)
    if config.transforms:
        env = wrap_env(env, config)  # observation transforms (frame stacking, ...)

    obs_space = env.observation_space(env_params)
    act_space = env.action_space(env_params)
    obs_shape = tuple(int(s) for s in obs_space.shape)
    if hasattr(act_space, "n"):
        return EnvSpec(env, env_params, obs_shape, True, int(act_space.n), None, None)
    if not hasattr(act_space, "low"):
        raise ConfigError(
            f"{config.env_name} has action space {act_space!r}; jaxppo supports Discrete and Box"
        )
    shape = tuple(act_space.shape) or (1,)
    if len(shape) != 1:
        raise ConfigError(f"{config.env_name}: Box actions must be a vector, got shape {shape}")
    dim = int(shape[0])
    low, high = box_bounds(act_space, dim)
    return EnvSpec(env, env_params, obs_shape, False, dim, low, high)


def _param_fields(params) -> set[str]:
    if dataclasses.is_dataclass(params):
        return {f.name for f in dataclasses.fields(params)}
    return set()


def env_action(spec: EnvSpec, action: jax.Array) -> jax.Array:
    """Map a policy action [.., action_dim] to what env.step expects (clipped to bounds)."""
    if spec.discrete:
        return action
    action = jnp.clip(action, spec.action_low, spec.action_high)
    if spec.env.action_space(spec.env_params).shape == ():
        return action[..., 0]
    return action


def flatten_obs(obs: jax.Array, obs_shape: tuple[int, ...]) -> jax.Array:
    """[..., *obs_shape] -> [..., prod(obs_shape)] float32."""
    lead = obs.shape[: obs.ndim - len(obs_shape)]
    return obs.reshape(lead + (-1,)).astype(jnp.float32)
