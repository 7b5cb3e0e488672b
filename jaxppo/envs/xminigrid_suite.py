"""XLand-MiniGrid environments by name (`env="xminigrid:<name>"`, e.g.
"xminigrid:MiniGrid-Empty-5x5"), behind the gymnax API that the rollout is written for.

An xminigrid env steps as `timestep = env.step(params, timestep, action)` (reset:
`env.reset(params, key)`); the timestep carries the state and says how an episode ended, as
dm_env does: `step_type` LAST ends it, with `discount` 0 when the agent reached the goal (a
real end) and 1 when the step count reached `params.max_steps` (the time limit). It does
not reset itself. `XMiniGridEnv` gives it jaxppo's semantics:

* `terminated` is a LAST step with discount 0, `truncated` a LAST step with discount 1 (the
  time limit, bootstrapped). The time limit is xminigrid's own `max_steps`, which jaxppo
  calls `max_steps_in_episode` (e.g. 100 steps for MiniGrid-Empty-5x5: 4 * height * width);
  the goal's reward, 1 - 0.9 * steps / max_steps, uses the same number.
* The observation before the reset is in `info["final_observation"]`; on either end the env
  resets with the key jaxppo gives that env step (a new layout every episode where the env
  draws one, e.g. MiniGrid-EmptyRandom-5x5).
* Observations are xminigrid's own: the agent's view, a uint8 [view_size, view_size, 2]
  grid of (tile, colour) ids (7x7 by default: the policy's torso is then the CNN; set
  network.torso=mlp for an MLP over the flattened view). Actions are Discrete (6: forward,
  turn right, turn left, pick up, put down, toggle).

xminigrid is imported only when an `xminigrid:` env is built: `import jaxppo` does not load it.
"""

from __future__ import annotations

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
    trace_step,
    unknown_env_error,
)

PREFIX = "xminigrid:"
_LAST = 2  # xminigrid.types.StepType.LAST


def registered_xminigrid_envs() -> list[str]:
    """xminigrid's registered env names (the <name> of "xminigrid:<name>")."""
    return list(import_suite("xminigrid").registered_environments())


def make_xminigrid_env(path: str, env_kwargs: dict) -> tuple[XMiniGridEnv, dict]:
    """The `XMiniGridEnv` "xminigrid:<name>" names, built by `xminigrid.make(name, **kwargs)`
    with the env_kwargs that are not fields of `XMiniGridParams` (they set xminigrid's
    EnvParams, e.g. view_size=5). Returns (env, the other env_kwargs: params, which make_env
    sets)."""
    name = path[len(PREFIX):]
    xminigrid = import_suite("xminigrid")
    names = registered_xminigrid_envs()
    if name not in names:
        raise unknown_env_error(path, names, "a registered xminigrid environment")
    if "max_steps" in env_kwargs:
        raise ConfigError(f"env={path!r}: the time limit is env_kwargs max_steps_in_episode "
                          "(xminigrid's max_steps); rename the key")
    params = {k: v for k, v in env_kwargs.items() if k in _PARAM_FIELDS}
    kwargs = {k: v for k, v in env_kwargs.items() if k not in _PARAM_FIELDS}
    try:
        xminigrid_env, xminigrid_params = xminigrid.make(name, **kwargs)
    except Exception as e:  # noqa: BLE001 - a bad kwarg: one clear error
        call = ", ".join([repr(name)] + [f"{k}={v!r}" for k, v in kwargs.items()])
        raise ConfigError(f"env={path!r}: xminigrid.make({call}) raised {type(e).__name__}: "
                          f"{first_line(e)}. env_kwargs other than {sorted(_PARAM_FIELDS)} set "
                          "xminigrid's EnvParams (e.g. view_size=5)") from None
    env = XMiniGridEnv(xminigrid_env, xminigrid_params, name=f"xminigrid-{name}")
    trace_step(env, path, "xminigrid", "xminigrid", jnp.zeros((), jnp.int32), ' and env_kwargs')
    return env, params


class XMiniGridParams(struct.PyTreeNode):
    """What jaxppo's reset and step take for an xminigrid env: the episode's time limit
    (xminigrid's max_steps; static, as xminigrid's params are) and xminigrid's other params
    (`xminigrid`, its `EnvParams`)."""

    max_steps_in_episode: int = struct.field(pytree_node=False)
    xminigrid: Any = None


_PARAM_FIELDS = {"max_steps_in_episode"}


class XMiniGridEnv:
    """An xminigrid env (one env: jaxppo vmaps it) with the gymnax 1.x API.

    reset(key, params) -> (obs, state); step(key, state, action, params) -> (obs, state,
    reward, terminated, truncated, info), auto-resetting with `key` when the episode ends and
    keeping the observation before the reset in info["final_observation"]. The state is
    xminigrid's `TimeStep` (which holds its `State`).
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
        last = stepped.step_type == _LAST
        terminated = jnp.logical_and(last, stepped.discount == 0)
        truncated = jnp.logical_and(last, ~terminated)
        reset_obs, reset_state = self.reset(key, params)
        next_state = select_reset(last, reset_state, stepped)
        obs = jnp.where(last, reset_obs, stepped.observation)
        info = {"final_observation": stepped.observation}
        return obs, next_state, stepped.reward, terminated, truncated, info

    def observation_space(self, params: XMiniGridParams | None = None):
        shape = tuple(int(s) for s in self.xminigrid_env.observation_shape(self._params(params)))
        return gymnax_spaces().Box(0, 255, shape, jnp.uint8)

    def action_space(self, params: XMiniGridParams | None = None):
        return gymnax_spaces().Discrete(int(self.xminigrid_env.num_actions(self._params(params))))

    def __repr__(self) -> str:
        return f"XMiniGridEnv({type(self.xminigrid_env).__name__}, {self.name!r})"


def _plain(timestep):
    """The timestep with reward and discount as float32 arrays (xminigrid's reset gives weakly
    typed ones, which would change the state's leaf types between reset and step)."""
    return timestep.replace(reward=jnp.asarray(timestep.reward, jnp.float32),
                            discount=jnp.asarray(timestep.discount, jnp.float32))
