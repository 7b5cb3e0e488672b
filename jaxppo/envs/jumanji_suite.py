"""Jumanji environments by name (`env="jumanji:<Id>"`, e.g. "jumanji:Snake-v1"), behind the
gymnax API that the rollout is written for.

A Jumanji env steps as `state, timestep = env.step(state, action)` (reset: `env.reset(key)`),
and says how an episode ended in the timestep, as dm_env does: `step_type` LAST ends it, and
its `discount` tells a real end (0) from a cut one (1, a truncation). It does not reset
itself. `JumanjiEnv` gives it jaxppo's semantics:

* `terminated` is a LAST step with discount 0 and `truncated` a LAST step with discount 1.
  Jumanji 1.1.2's single-agent envs end their own time limit (`time_limit`, e.g. Snake's
  4000 steps) with discount 0, so that counts as terminated, as Jumanji says (their
  observations carry the step count). jaxppo adds its own limit,
  `params.max_steps_in_episode` (the env's `time_limit` by default, else 1000 steps): a step
  that reaches it without a real end is truncated, and bootstrapped. Set it below
  `time_limit` for a time limit that is not a death.
* The observation before the reset is in `info["final_observation"]`; on either end the env
  resets with the key jaxppo gives that env step (a new random start every episode; within
  an episode the env draws from the key its state carries, as Jumanji does).
* Observations, a tree of arrays (e.g. Snake's `Observation(grid, step_count,
  action_mask)`), become one float32 vector: every leaf in `jax.tree.leaves` order (a
  NamedTuple's fields in order, a chex dataclass's fields sorted by name), flattened
  (C order) and cast to float32 (bools are 0/1), concatenated. `JumanjiEnv.obs_parts`
  names each part and its shape in that order. Image-like grids are flattened too, so the
  policy's torso is the MLP.
* Actions: a `DiscreteArray` spec is `Discrete(num_values)`; a `MultiDiscreteArray` spec
  (e.g. Minesweeper's [row, col]) is one `Discrete` over all combinations (at most
  `MAX_JOINT_ACTIONS`), index i meaning `jnp.unravel_index(i, num_values)`. Other action
  specs (continuous, several agents' rewards) are a ConfigError.

jumanji is imported only when a `jumanji:` env is built: `import jaxppo` does not load it.
"""

from __future__ import annotations

import math
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

PREFIX = "jumanji:"
DEFAULT_EPISODE_LENGTH = 1000  # jaxppo's limit for an env without a `time_limit` of its own
MAX_JOINT_ACTIONS = 4096  # a MultiDiscreteArray spec with more combinations is refused
_LAST = 2  # jumanji.types.StepType.LAST


def registered_jumanji_envs() -> list[str]:
    """Jumanji's registered env ids (the <Id> of "jumanji:<Id>")."""
    return sorted(import_suite("jumanji").registered_environments())


def make_jumanji_env(path: str, env_kwargs: dict) -> tuple[JumanjiEnv, dict]:
    """The `JumanjiEnv` "jumanji:<Id>" names, built by `jumanji.make(id, **kwargs)` with the
    env_kwargs that are not fields of `JumanjiParams` (e.g. num_rows=6 for Snake). Returns
    (env, the other env_kwargs: params, which make_env sets)."""
    name = path[len(PREFIX):]
    jumanji = import_suite("jumanji")
    names = registered_jumanji_envs()
    if name not in names:
        raise unknown_env_error(path, names, "a registered Jumanji environment")
    params = {k: v for k, v in env_kwargs.items() if k in _PARAM_FIELDS}
    kwargs = {k: v for k, v in env_kwargs.items() if k not in _PARAM_FIELDS}
    try:
        jumanji_env = jumanji.make(name, **kwargs)
    except Exception as e:  # noqa: BLE001 - a bad kwarg, a level file it cannot fetch: one error
        call = ", ".join([repr(name)] + [f"{k}={v!r}" for k, v in kwargs.items()])
        raise ConfigError(f"env={path!r}: jumanji.make({call}) raised {type(e).__name__}: "
                          f"{first_line(e)}. env_kwargs other than {sorted(_PARAM_FIELDS)} go "
                          "to the env's constructor (e.g. num_rows=6 for Snake-v1)") from None
    env = JumanjiEnv(jumanji_env, name=f"jumanji-{name}")
    trace_step(env, path, "jumanji", "Jumanji", jnp.zeros((), jnp.int32))
    return env, params


@struct.dataclass
class JumanjiParams:
    """What jaxppo's reset and step take for a Jumanji env: jaxppo's time limit (steps after
    which an episode that has not ended is truncated)."""

    max_steps_in_episode: int = DEFAULT_EPISODE_LENGTH


_PARAM_FIELDS = {"max_steps_in_episode"}


@struct.dataclass
class JumanjiEnvState:
    """A Jumanji env's state and the steps taken in the current episode."""

    jumanji_state: Any
    time: jax.Array  # int32 []


class JumanjiEnv:
    """A Jumanji env (`jumanji.env.Environment`, one env: jaxppo vmaps it) with the gymnax
    API.

    reset(key, params) -> (obs, state); step(key, state, action, params) -> (obs, state,
    reward, terminated, truncated, info), auto-resetting with `key` when the episode ends and
    keeping the observation before the reset in info["final_observation"]. Observations are
    the flattened float32 vector the module docstring describes (`obs_parts` lists its
    parts); actions are one integer (`action_space(params).n` of them).
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
        limit = getattr(jumanji_env, "time_limit", None)
        self._time_limit = (int(limit) if isinstance(limit, (int, np.integer))
                            and not isinstance(limit, bool) and limit > 0 else None)

    @property
    def default_params(self) -> JumanjiParams:
        return JumanjiParams(self._time_limit or DEFAULT_EPISODE_LENGTH)

    def reset(self, key: jax.Array, params: JumanjiParams | None = None):
        state, timestep = self.jumanji_env.reset(key)
        return _flat(timestep.observation), JumanjiEnvState(state, jnp.zeros((), jnp.int32))

    def step(self, key: jax.Array, state: JumanjiEnvState, action: jax.Array,
             params: JumanjiParams | None = None):
        params = self.default_params if params is None else params
        stepped, timestep = self.jumanji_env.step(state.jumanji_state, self._action_map(action))
        time = state.time + 1
        last = timestep.step_type == _LAST
        terminated = jnp.logical_and(last, timestep.discount == 0)
        truncated = jnp.logical_and(
            jnp.logical_or(last, time >= params.max_steps_in_episode), ~terminated)
        done = jnp.logical_or(terminated, truncated)
        stepped_obs = _flat(timestep.observation)
        reset_obs, reset_state = self.reset(key, params)
        next_state = select_reset(done, reset_state, JumanjiEnvState(stepped, time))
        obs = jnp.where(done, reset_obs, stepped_obs)
        reward = jnp.asarray(timestep.reward, jnp.float32)
        return obs, next_state, reward, terminated, truncated, {"final_observation": stepped_obs}

    def observation_space(self, params: JumanjiParams | None = None):
        return gymnax_spaces().Box(-jnp.inf, jnp.inf, (self._obs_size,), jnp.float32)

    def action_space(self, params: JumanjiParams | None = None):
        return gymnax_spaces().Discrete(self._action_map.n)

    def __repr__(self) -> str:
        return f"JumanjiEnv({type(self.jumanji_env).__name__}, {self.name!r})"


def _flat(observation) -> jax.Array:
    """A Jumanji observation (a tree of arrays) as one float32 vector (module docstring)."""
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
    specs = import_suite("jumanji", "jumanji.specs")
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
