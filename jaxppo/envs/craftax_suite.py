"""Craftax environments by name (`env="craftax:<name>"`, e.g.
"craftax:Craftax-Classic-Symbolic-v1"), behind the gymnax API that the rollout is written for.

Craftax's envs have gymnax's older API: `step(key, state, action, params) -> (obs, state,
reward, done, info)`, one `done` for every end. Its auto-reset envs (`auto_reset=True`)
overwrite the last observation with the reset's, so `CraftaxEnv` wraps the env without
auto-reset (`make_craftax_env_from_name(name, auto_reset=False)`) and does, as a gymnax 1.x
env does:

* `terminated` is a real end (Craftax's `is_terminal` without the time limit: the player
  died, stood in lava or, in full Craftax, beat the final boss); `truncated` is the time
  limit, Craftax's `params.max_timesteps`, which jaxppo calls `max_steps_in_episode`
  (10,000 steps in Craftax-Classic, 100,000 in Craftax), when the episode did not really
  end on that step. Craftax's own `done` is their union.
* The observation before the reset is in `info["final_observation"]`; on either end the env
  resets with a key split from the one jaxppo gives that env step (a new world every
  episode). As gymnax does: `key_step, key_reset = jax.random.split(key)`, the step draws
  from `key_step`.
* Observations and actions are Craftax's own: the symbolic envs' float32 vector (1345 values
  in Craftax-Classic), the pixel envs' [H, W, 3] image (the policy's torso is then the CNN),
  and Discrete actions (17 in Craftax-Classic, 43 in Craftax).

A step computes a reset too (selected where the episode ended, as gymnax does), so a step
costs about a world generation more than Craftax's step alone.

craftax is imported only when a `craftax:` env is built: `import jaxppo` does not load it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxppo.errors import ConfigError
from jaxppo.envs.brax_suite import (
    first_line,
    gymnax_spaces,
    import_suite,
    select_reset,
    unknown_env_error,
)

PREFIX = "craftax:"
# The names craftax.craftax_env.make_craftax_env_from_name builds without auto-reset.
NAMES = ("Craftax-Classic-Pixels-v1", "Craftax-Classic-Symbolic-v1", "Craftax-Pixels-v1",
         "Craftax-Symbolic-v1")
_NO_LIMIT = int(np.iinfo(np.int32).max)  # max_timesteps that no episode reaches


def registered_craftax_envs() -> list[str]:
    """The Craftax env names (the <name> of "craftax:<name>")."""
    return list(NAMES)


def make_craftax_env(path: str, env_kwargs: dict) -> tuple[CraftaxEnv, dict]:
    """The `CraftaxEnv` "craftax:<name>" names. env_kwargs that are fields of Craftax's
    `EnvParams` (e.g. day_length) set those in the env's default params; the time limit is
    `max_steps_in_episode`. Returns (env, the other env_kwargs: params, which make_env sets)."""
    name = path[len(PREFIX):]
    craftax_env_module = import_suite("craftax", "craftax.craftax_env")
    if name not in NAMES:
        raise unknown_env_error(path, list(NAMES), "a Craftax environment")
    try:
        craftax_env = craftax_env_module.make_craftax_env_from_name(name, auto_reset=False)
    except Exception as e:  # Craftax's own constructor: one clear error
        raise ConfigError(f"env={path!r}: craftax's make_craftax_env_from_name({name!r}, "
                          f"auto_reset=False) raised {type(e).__name__}: {first_line(e)}") from e
    craftax_params = craftax_env.default_params
    fields = {f.name for f in dataclasses.fields(craftax_params)} - {"max_timesteps"}
    if "max_timesteps" in env_kwargs:
        raise ConfigError(f"env={path!r}: the time limit is env_kwargs max_steps_in_episode "
                          "(Craftax's max_timesteps); rename the key")
    unknown = sorted(set(env_kwargs) - fields - _PARAM_FIELDS)
    if unknown:
        raise ConfigError(f"env_kwargs keys {unknown} are neither Craftax's EnvParams fields "
                          f"nor params of {path}; settable: "
                          f"{sorted(fields | {'max_steps_in_episode'})}")
    craftax_params = craftax_params.replace(**{k: v for k, v in env_kwargs.items() if k in fields})
    env = CraftaxEnv(craftax_env, craftax_params, name=f"craftax-{name}")
    params = {k: v for k, v in env_kwargs.items() if k in _PARAM_FIELDS}
    return env, params


@struct.dataclass
class CraftaxParams:
    """What jaxppo's reset and step take for a Craftax env: the episode's time limit (Craftax's
    max_timesteps) and Craftax's other params (`craftax`, its `EnvParams`)."""

    max_steps_in_episode: int
    craftax: Any


_PARAM_FIELDS = {"max_steps_in_episode"}


class CraftaxEnv:
    """A Craftax env without auto-reset (one env: jaxppo vmaps it) with the gymnax 1.x API.

    reset(key, params) -> (obs, state); step(key, state, action, params) -> (obs, state,
    reward, terminated, truncated, info), auto-resetting when the episode ends and keeping
    the observation before the reset in info["final_observation"]. The state is Craftax's
    own `EnvState`.
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
        reset_obs, reset_state = self.craftax_env.reset(key_reset, craftax_params)
        next_state = select_reset(done, reset_state, stepped)
        obs = jnp.where(done, reset_obs, stepped_obs)
        reward = jnp.asarray(reward, jnp.float32)
        return obs, next_state, reward, terminated, truncated, {"final_observation": stepped_obs}

    def observation_space(self, params: CraftaxParams | None = None):
        space = self.craftax_env.observation_space(self._params(params))
        return gymnax_spaces().Box(space.low, space.high, tuple(space.shape), space.dtype)

    def action_space(self, params: CraftaxParams | None = None):
        return gymnax_spaces().Discrete(int(self.craftax_env.num_actions))

    def __repr__(self) -> str:
        return f"CraftaxEnv({type(self.craftax_env).__name__})"
