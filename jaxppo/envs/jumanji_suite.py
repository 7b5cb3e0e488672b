"""Jumanji environments by name (`env="jumanji:<Id>"`, e.g. "jumanji:Snake-v1") behind the
gymnax API: `JumanjiEnv` splits dm_env's LAST step into terminated (discount 0) and truncated
(discount 1, or jaxppo's own time limit), auto-resets, flattens the observation tree into one
float32 vector and maps (multi-)discrete action specs to one Discrete action.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxppo.envs import adapter
from jaxppo.envs.spec import MAX_JOINT_ACTIONS
from jaxppo.errors import ConfigError

PREFIX = "jumanji:"
DEFAULT_EPISODE_LENGTH = 1000  # jaxppo's limit for an env without a `time_limit` of its own


def registered_jumanji_envs() -> list[str]:
    """Jumanji's registered env ids (the <Id> of "jumanji:<Id>")."""
    return sorted(adapter.import_suite("jumanji").registered_environments())


def make_jumanji_env(path: str, env_kwargs: dict) -> tuple[JumanjiEnv, dict]:
    """Builds the env "jumanji:<Id>" names with `jumanji.make`.

    Args:
      path: "jumanji:<Id>".
      env_kwargs: the config's; those that are not fields of `JumanjiParams` go to
        `jumanji.make` (e.g. num_rows=6 for Snake).

    Returns:
      (env, the other env_kwargs: params, which make_env sets).

    Raises:
      ConfigError: an unknown id, a failing constructor, or an env jaxppo cannot adapt.
    """
    name = path[len(PREFIX):]
    jumanji = adapter.import_suite("jumanji")
    names = registered_jumanji_envs()
    if name not in names:
        raise adapter.unknown_env_error(path, names, "a registered Jumanji environment")
    params, kwargs = adapter.split_env_kwargs(env_kwargs)
    jumanji_env = adapter.construct(path, "jumanji.make", jumanji.make, name, kwargs,
                                    "go to the env's constructor (e.g. num_rows=6 for Snake-v1)")
    env = JumanjiEnv(jumanji_env, name=f"jumanji-{name}")
    adapter.trace_step(env, path, "jumanji", "Jumanji", jnp.zeros((), jnp.int32))
    return env, params


@struct.dataclass
class JumanjiParams:
    """What jaxppo's reset and step take for a Jumanji env: jaxppo's time limit (steps after
    which an episode that has not ended is truncated)."""

    max_steps_in_episode: int = DEFAULT_EPISODE_LENGTH


@struct.dataclass
class JumanjiEnvState:
    """A Jumanji env's state and the steps taken in the current episode."""

    jumanji_state: Any
    time: jax.Array  # int32 []
    # The observation's action_mask as one bool per jaxppo action ([n]); () when it has none.
    action_mask: Any = ()


class JumanjiEnv:
    """A Jumanji env (`jumanji.env.Environment`, one env: jaxppo vmaps it) with the gymnax
    API.

    reset(key, params) -> (obs, state); step(key, state, action, params) -> (obs, state,
    reward, terminated, truncated, info), auto-resetting with `key` when the episode ends and
    keeping the observation before the reset in info["final_observation"].

    * Ends: `terminated` is a LAST step with discount 0, `truncated` a LAST step with
      discount 1 or a step that reaches `params.max_steps_in_episode` (the env's
      `time_limit` by default, else 1000) without a real end. Jumanji's single-agent envs
      end their own `time_limit` with discount 0, a real end as Jumanji says (their
      observations carry the step count); set max_steps_in_episode below it for a time
      limit that is bootstrapped.
    * Observations: every leaf of the observation tree in `jax.tree.leaves` order,
      flattened (C order), cast to float32 (bools 0/1) and concatenated into one vector;
      `obs_parts` names each part and its shape. Image-like grids are flattened too, so the
      torso is the MLP.
    * Actions: one integer (`action_space(params).n` of them). A `DiscreteArray` spec is
      `Discrete(num_values)`; a 1-D `MultiDiscreteArray` spec (e.g. Minesweeper's [row,
      col]) is one Discrete over all combinations (at most `MAX_JOINT_ACTIONS`), index i
      meaning `jnp.unravel_index(i, num_values)`. Other specs are a ConfigError.
    * Action masks: when the observation has an `action_mask` with one entry per action
      (Snake's [4], Knapsack's [items], Minesweeper's [rows, cols], flattened C order like
      the joint action), `action_mask(state, params)` gives it for the state's observation,
      and jaxppo masks the policy with it (`mask_actions`). It also stays in the observation
      vector, as every leaf does. A state whose mask allows nothing (Snake boxed in) allows
      every action instead: Jumanji steps any action there, and each ends the episode.
    """

    def __init__(self, jumanji_env, name: str | None = None):
        self.jumanji_env = jumanji_env
        self.name = name or f"jumanji-{type(jumanji_env).__name__}"
        self._action_map = _action_map(jumanji_env, self.name)
        for what in ("reward", "discount"):
            shape = tuple(getattr(jumanji_env, f"{what}_spec").shape)
            if shape != ():
                raise ConfigError(
                    f"{self.name}: its {what} is an array of shape {shape} (one per agent); "
                    "jaxppo takes Jumanji envs with one scalar reward and discount")
        _, timestep = jax.eval_shape(jumanji_env.reset, jax.random.PRNGKey(0))
        leaves = jax.tree_util.tree_flatten_with_path(timestep.observation)[0]
        self.obs_parts = tuple((jax.tree_util.keystr(p).lstrip("."), tuple(x.shape))
                               for p, x in leaves)
        self._obs_size = int(sum(math.prod(s) for _, s in self.obs_parts))
        mask = getattr(timestep.observation, "action_mask", None)
        self._has_mask = mask is not None and math.prod(mask.shape) == self._action_map.n
        limit = getattr(jumanji_env, "time_limit", None)
        self._time_limit = (int(limit) if isinstance(limit, (int, np.integer))
                            and not isinstance(limit, bool) and limit > 0 else None)

    @property
    def default_params(self) -> JumanjiParams:
        return JumanjiParams(self._time_limit or DEFAULT_EPISODE_LENGTH)

    def reset(self, key: jax.Array, params: JumanjiParams | None = None):
        state, timestep = self.jumanji_env.reset(key)
        return _flat(timestep.observation), JumanjiEnvState(
            state, jnp.zeros((), jnp.int32), self._mask_of(timestep.observation))

    def _mask_of(self, observation):
        """The observation's action mask as [n] bool, () when the env gives none. A Jumanji
        mask with no legal action (a Snake boxed in by its own body) still lets the env step
        with any action, which ends the episode: every action is allowed there."""
        if not self._has_mask:
            return ()
        mask = jnp.ravel(jnp.asarray(observation.action_mask)).astype(bool)
        return jnp.where(jnp.any(mask), mask, True)

    @property
    def action_mask(self):
        """`action_mask(state, params) -> bool [n]` of the state's observation
        (AttributeError when the env's observation has no mask of one entry per action)."""
        if not self._has_mask:
            raise AttributeError("action_mask")
        return lambda state, params=None: state.action_mask

    def step(self, key: jax.Array, state: JumanjiEnvState, action: jax.Array,
             params: JumanjiParams | None = None):
        params = self.default_params if params is None else params
        stepped, timestep = self.jumanji_env.step(state.jumanji_state, self._action_map(action))
        time = state.time + 1
        last = timestep.step_type == adapter.LAST
        terminated = jnp.logical_and(last, timestep.discount == 0)
        truncated = jnp.logical_and(
            jnp.logical_or(last, time >= params.max_steps_in_episode), ~terminated)
        done = jnp.logical_or(terminated, truncated)
        stepped_obs = _flat(timestep.observation)
        obs, next_state, info = adapter.auto_reset(
            done, lambda: self.reset(key, params), stepped_obs,
            JumanjiEnvState(stepped, time, self._mask_of(timestep.observation)))
        reward = jnp.asarray(timestep.reward, jnp.float32)
        return obs, next_state, reward, terminated, truncated, info

    def observation_space(self, params: JumanjiParams | None = None):
        return adapter.gymnax_spaces().Box(-jnp.inf, jnp.inf, (self._obs_size,), jnp.float32)

    def action_space(self, params: JumanjiParams | None = None):
        return adapter.gymnax_spaces().Discrete(self._action_map.n)

    def __repr__(self) -> str:
        return f"JumanjiEnv({type(self.jumanji_env).__name__}, {self.name!r})"


def _flat(observation) -> jax.Array:
    """A Jumanji observation (a tree of arrays) as one float32 vector (see `JumanjiEnv`)."""
    return jnp.concatenate([jnp.ravel(jnp.asarray(x)).astype(jnp.float32)
                            for x in jax.tree.leaves(observation)])


class _ActionMap:
    """jaxppo's action (one integer in [0, n)) -> the action Jumanji's step takes."""

    def __init__(self, n: int, num_values: tuple[int, ...] | None, dtype):
        self.n, self.num_values, self.dtype = n, num_values, dtype

    def __call__(self, action: jax.Array) -> jax.Array:
        action = jnp.asarray(action, jnp.int32)
        if self.num_values is None:
            return action.astype(self.dtype)
        return jnp.stack(jnp.unravel_index(action, self.num_values), axis=-1).astype(self.dtype)


def _action_map(jumanji_env, name: str) -> _ActionMap:
    """How jaxppo's Discrete action maps to the env's action spec, or a ConfigError."""
    specs = adapter.import_suite("jumanji", "jumanji.specs")
    spec = jumanji_env.action_spec
    if isinstance(spec, specs.DiscreteArray):
        return _ActionMap(int(spec.num_values), None, spec.dtype)
    if isinstance(spec, specs.MultiDiscreteArray) and len(spec.shape) == 1:
        num_values = tuple(int(v) for v in np.asarray(spec.num_values).reshape(-1))
        n = math.prod(num_values)
        if n <= MAX_JOINT_ACTIONS:
            return _ActionMap(n, num_values, spec.dtype)
        raise ConfigError(
            f"{name}: its action spec {type(spec).__name__} with num_values {list(num_values)} "
            f"has {n} combinations; jaxppo makes one Discrete action of the combinations "
            f"of a MultiDiscreteArray only up to {MAX_JOINT_ACTIONS} (use a smaller instance "
            "of the env through env_kwargs, or another env)")
    raise ConfigError(
        f"{name}: its action spec is {type(spec).__name__}(shape={tuple(spec.shape)}, "
        f"dtype={np.dtype(spec.dtype)}); jaxppo's Jumanji adapter takes a DiscreteArray or a "
        "1-D MultiDiscreteArray (each a Discrete action); use an env with one of those")
