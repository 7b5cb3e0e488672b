"""Craftax environments by name (`env="craftax:<name>"`, e.g.
"craftax:Craftax-Classic-Symbolic-v1") behind the gymnax 1.x API: `CraftaxEnv` wraps
Craftax's env without auto-reset, splits its `done` into terminated (a real end) and truncated
(the time limit, `max_steps_in_episode`), and auto-resets keeping the last observation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxppo.envs import adapter
from jaxppo.errors import ConfigError

PREFIX = "craftax:"
# The names craftax.craftax_env.make_craftax_env_from_name builds without auto-reset.
NAMES = ("Craftax-Classic-Pixels-v1", "Craftax-Classic-Symbolic-v1", "Craftax-Pixels-v1",
         "Craftax-Symbolic-v1")
_NO_LIMIT = int(np.iinfo(np.int32).max)  # max_timesteps that no episode reaches


def registered_craftax_envs() -> list[str]:
    """The Craftax env names (the <name> of "craftax:<name>")."""
    return list(NAMES)


def make_craftax_env(path: str, env_kwargs: dict) -> tuple[CraftaxEnv, dict]:
    """Builds the env "craftax:<name>" names, without Craftax's auto-reset.

    Args:
      path: "craftax:<name>".
      env_kwargs: the config's; fields of Craftax's `EnvParams` (e.g. day_length) set those
        in the env's default params; the time limit is `max_steps_in_episode`.

    Returns:
      (env, the other env_kwargs: params, which make_env sets).

    Raises:
      ConfigError: an unknown name or env_kwargs key, or a constructor that fails.
    """
    name = path[len(PREFIX):]
    craftax_env_module = adapter.import_suite("craftax", "craftax.craftax_env")
    if name not in NAMES:
        raise adapter.unknown_env_error(path, list(NAMES), "a Craftax environment")
    try:
        craftax_env = craftax_env_module.make_craftax_env_from_name(name, auto_reset=False)
    except Exception as e:  # Craftax's own constructor: one clear error
        raise ConfigError(f"env={path!r}: craftax's make_craftax_env_from_name({name!r}, "
                          f"auto_reset=False) raised {type(e).__name__}: "
                          f"{adapter.first_line(e)}") from e
    craftax_params = craftax_env.default_params
    fields = {f.name for f in dataclasses.fields(craftax_params)} - {"max_timesteps"}
    if "max_timesteps" in env_kwargs:
        raise ConfigError(f"env={path!r}: the time limit is env_kwargs max_steps_in_episode "
                          "(Craftax's max_timesteps); rename the key")
    unknown = sorted(set(env_kwargs) - fields - adapter.PARAM_FIELDS)
    if unknown:
        raise ConfigError(f"env_kwargs keys {unknown} are neither Craftax's EnvParams fields "
                          f"nor params of {path}; settable: "
                          f"{sorted(fields | {'max_steps_in_episode'})}")
    craftax_params = craftax_params.replace(**{k: v for k, v in env_kwargs.items() if k in fields})
    env = CraftaxEnv(craftax_env, craftax_params, name=f"craftax-{name}")
    return env, adapter.split_env_kwargs(env_kwargs)[0]


@struct.dataclass
class CraftaxParams:
    """What jaxppo's reset and step take for a Craftax env: the episode's time limit (Craftax's
    max_timesteps) and Craftax's other params (`craftax`, its `EnvParams`)."""

    max_steps_in_episode: int
    craftax: Any


class CraftaxEnv:
    """A Craftax env without auto-reset (one env: jaxppo vmaps it) with the gymnax 1.x API.

    reset(key, params) -> (obs, state); step(key, state, action, params) -> (obs, state,
    reward, terminated, truncated, info), auto-resetting when the episode ends and keeping
    the observation before the reset in info["final_observation"]. The state is Craftax's
    own `EnvState`.

    Craftax's auto-reset envs overwrite the last observation with the reset's, hence the env
    without it. `terminated` is Craftax's `is_terminal` without the time limit (the player
    died, stood in lava or beat the final boss); `truncated` is the time limit, Craftax's
    `max_timesteps` (10,000 steps in Craftax-Classic, 100,000 in Craftax), when the episode
    did not really end on that step. The step's key is split as gymnax splits it: the step
    draws from the first half, the reset (a new world) from the second. Observations and
    Discrete actions are Craftax's own (the pixel envs' [H, W, 3] image gets the CNN torso).
    """

    def __init__(self, craftax_env, craftax_params=None, name: str | None = None):
        self.craftax_env = craftax_env
        self._craftax_params = (craftax_env.default_params if craftax_params is None
                                else craftax_params)
        self.name = name or f"craftax-{craftax_env.name}"

    @property
    def default_params(self) -> CraftaxParams:
        return CraftaxParams(int(self._craftax_params.max_timesteps), self._craftax_params)

    def _params(self, params: CraftaxParams | None):
        """Craftax's EnvParams with jaxppo's time limit."""
        params = self.default_params if params is None else params
        return params.craftax.replace(max_timesteps=params.max_steps_in_episode)

    def reset(self, key: jax.Array, params: CraftaxParams | None = None):
        return self.craftax_env.reset(key, self._params(params))

    def step(self, key: jax.Array, state, action: jax.Array,
             params: CraftaxParams | None = None):
        craftax_params = self._params(params)
        key_step, key_reset = jax.random.split(key)
        stepped_obs, stepped, reward, done, _ = self.craftax_env.step(
            key_step, state, action, craftax_params)
        terminated = jnp.asarray(
            self.craftax_env.is_terminal(stepped, craftax_params.replace(max_timesteps=_NO_LIMIT)),
            bool)
        done = jnp.asarray(done, bool)
        truncated = jnp.logical_and(done, ~terminated)
        obs, next_state, info = adapter.auto_reset(
            done, lambda: self.craftax_env.reset(key_reset, craftax_params), stepped_obs,
            stepped)
        reward = jnp.asarray(reward, jnp.float32)
        return obs, next_state, reward, terminated, truncated, info

    def observation_space(self, params: CraftaxParams | None = None):
        space = self.craftax_env.observation_space(self._params(params))
        return adapter.gymnax_spaces().Box(space.low, space.high, tuple(space.shape), space.dtype)

    def action_space(self, params: CraftaxParams | None = None):
        return adapter.gymnax_spaces().Discrete(int(self.craftax_env.num_actions))

    def __repr__(self) -> str:
        return f"CraftaxEnv({type(self.craftax_env).__name__})"
