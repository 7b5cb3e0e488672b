"""XLand-MiniGrid environments by name (`env="xminigrid:<name>"`, e.g.
"xminigrid:MiniGrid-Empty-5x5") behind the gymnax 1.x API: `XMiniGridEnv` splits dm_env's LAST
step into terminated (discount 0: the goal) and truncated (discount 1: xminigrid's `max_steps`,
jaxppo's `max_steps_in_episode`) and auto-resets, keeping the last observation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxppo.envs import adapter
from jaxppo.errors import ConfigError

PREFIX = "xminigrid:"


def registered_xminigrid_envs() -> list[str]:
    """xminigrid's registered env names (the <name> of "xminigrid:<name>")."""
    return list(adapter.import_suite("xminigrid").registered_environments())


def make_xminigrid_env(path: str, env_kwargs: dict) -> tuple[XMiniGridEnv, dict]:
    """Builds the env "xminigrid:<name>" names with `xminigrid.make`.

    Args:
      path: "xminigrid:<name>".
      env_kwargs: the config's; those that are not fields of `XMiniGridParams` set
        xminigrid's EnvParams (e.g. view_size=5).

    Returns:
      (env, the other env_kwargs: params, which make_env sets).

    Raises:
      ConfigError: an unknown name, xminigrid's `max_steps` given, a constructor that fails
        or an env that does not trace.
    """
    name = path[len(PREFIX):]
    xminigrid = adapter.import_suite("xminigrid")
    names = registered_xminigrid_envs()
    if name not in names:
        raise adapter.unknown_env_error(path, names, "a registered xminigrid environment")
    if "max_steps" in env_kwargs:
        raise ConfigError(f"env={path!r}: the time limit is env_kwargs max_steps_in_episode "
                          "(xminigrid's max_steps); rename the key")
    params, kwargs = adapter.split_env_kwargs(env_kwargs)
    xminigrid_env, xminigrid_params = adapter.construct(
        path, "xminigrid.make", xminigrid.make, name, kwargs,
        "set xminigrid's EnvParams (e.g. view_size=5)")
    env = XMiniGridEnv(xminigrid_env, xminigrid_params, name=f"xminigrid-{name}")
    adapter.trace_step(env, path, "xminigrid", "xminigrid", jnp.zeros((), jnp.int32),
                       ' and env_kwargs')
    return env, params


class XMiniGridParams(struct.PyTreeNode):
    """What jaxppo's reset and step take for an xminigrid env: the episode's time limit
    (xminigrid's max_steps; static, as xminigrid's params are) and xminigrid's other params
    (`xminigrid`, its `EnvParams`)."""

    max_steps_in_episode: int = struct.field(pytree_node=False)
    xminigrid: Any = None


class XMiniGridEnv:
    """An xminigrid env (one env: jaxppo vmaps it) with the gymnax 1.x API.

    reset(key, params) -> (obs, state); step(key, state, action, params) -> (obs, state,
    reward, terminated, truncated, info), auto-resetting with `key` when the episode ends and
    keeping the observation before the reset in info["final_observation"]. The state is
    xminigrid's `TimeStep` (which holds its `State`).

    The time limit is xminigrid's `max_steps` (e.g. 100 for MiniGrid-Empty-5x5: 4 * height
    * width), which its goal reward, 1 - 0.9 * steps / max_steps, uses too. Observations are
    xminigrid's own: the agent's view, a uint8 [view_size, view_size, 2] grid of (tile,
    colour) ids (the torso is then the CNN; network.torso=mlp flattens it). Actions are
    Discrete (6: forward, turn right, turn left, pick up, put down, toggle).
    """

    def __init__(self, xminigrid_env, xminigrid_params, name: str | None = None):
        self.xminigrid_env = xminigrid_env
        self._xminigrid_params = xminigrid_params
        self.name = name or f"xminigrid-{type(xminigrid_env).__name__}"

    @property
    def default_params(self) -> XMiniGridParams:
        return XMiniGridParams(int(self._xminigrid_params.max_steps), self._xminigrid_params)

    def _params(self, params: XMiniGridParams | None):
        """xminigrid's EnvParams with jaxppo's time limit."""
        params = self.default_params if params is None else params
        limit = params.max_steps_in_episode
        if not isinstance(limit, (int, np.integer)) or isinstance(limit, bool):
            raise ConfigError(f"{self.name}: max_steps_in_episode={limit!r} must be a Python int "
                              "(xminigrid's max_steps is a static param, not an array)")
        return params.xminigrid.replace(max_steps=int(limit))

    def reset(self, key: jax.Array, params: XMiniGridParams | None = None):
        timestep = self.xminigrid_env.reset(self._params(params), key)
        return timestep.observation, _plain(timestep)

    def step(self, key: jax.Array, state, action: jax.Array,
             params: XMiniGridParams | None = None):
        xminigrid_params = self._params(params)
        stepped = _plain(self.xminigrid_env.step(xminigrid_params, state, action))
        last = stepped.step_type == adapter.LAST
        terminated = jnp.logical_and(last, stepped.discount == 0)
        truncated = jnp.logical_and(last, ~terminated)
        obs, next_state, info = adapter.auto_reset(last, lambda: self.reset(key, params),
                                                   stepped.observation, stepped)
        return obs, next_state, stepped.reward, terminated, truncated, info

    def observation_space(self, params: XMiniGridParams | None = None):
        shape = tuple(int(s) for s in self.xminigrid_env.observation_shape(self._params(params)))
        return adapter.gymnax_spaces().Box(0, 255, shape, jnp.uint8)

    def action_space(self, params: XMiniGridParams | None = None):
        num_actions = self.xminigrid_env.num_actions(self._params(params))
        return adapter.gymnax_spaces().Discrete(int(num_actions))

    def __repr__(self) -> str:
        return f"XMiniGridEnv({type(self.xminigrid_env).__name__}, {self.name!r})"


def _plain(timestep):
    """The timestep with reward and discount as float32 arrays (xminigrid's reset gives weakly
    typed ones, which would change the state's leaf types between reset and step)."""
    return timestep.replace(reward=jnp.asarray(timestep.reward, jnp.float32),
                            discount=jnp.asarray(timestep.discount, jnp.float32))
