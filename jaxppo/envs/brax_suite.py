"""Brax environments by name (`env="brax:<name>"`, e.g. "brax:inverted_pendulum") behind
the gymnax API: `BraxEnv` counts the time limit itself (`max_steps_in_episode`, Brax's
`episode_length`), reports `terminated` (Brax's `done`) apart from `truncated`, and
auto-resets with a new random start every episode, keeping the last observation.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxppo.envs import adapter
from jaxppo.errors import ConfigError

PREFIX = "brax:"
INSTALL = adapter.install_line("brax")
DEFAULT_EPISODE_LENGTH = 1000  # Brax's episode_length default (envs.create, ppo.train)


def import_brax_envs():
    """brax.envs, or a ConfigError naming the install."""
    # mujoco.mjx prints "Failed to import mujoco_warp" when the optional warp GPU backend
    # is absent; Brax's pipelines do not use it, so keep it out of the run's output.
    with contextlib.redirect_stdout(io.StringIO()):
        return adapter.import_suite("brax", "brax.envs")


def registered_brax_envs() -> list[str]:
    """Brax's registered env names (the <name> of "brax:<name>")."""
    # Brax has no public list (`brax.envs.register_environment` adds to a dict): read the dict.
    return sorted(getattr(import_brax_envs(), "_envs", {}))


def make_brax_env(path: str, env_kwargs: dict) -> tuple["BraxEnv", dict]:
    """Builds the env "brax:<name>" names with `brax.envs.get_environment`.

    Args:
      path: "brax:<name>".
      env_kwargs: the config's; those that are not fields of `BraxParams` go to
        `get_environment` (e.g. backend="positional").

    Returns:
      (env, the other env_kwargs: params, which make_env sets).

    Raises:
      ConfigError: an unknown name, a constructor that fails, or an env that does not trace.
    """
    name = path[len(PREFIX):]
    envs = import_brax_envs()
    names = registered_brax_envs()
    if names and name not in names:  # (no names: a brax without the registry dict we read)
        raise adapter.unknown_env_error(path, names, "a registered Brax environment", "Registered")
    params, kwargs = adapter.split_env_kwargs(env_kwargs)

    def get_environment(name, **kwargs):
        with warnings.catch_warnings():
            # Each mjcf.load warns that Brax's pipelines are no longer actively maintained
            # (upstream points to MJX); it says nothing about this run.
            warnings.filterwarnings("ignore", message=".*not actively being maintained.*")
            return envs.get_environment(name, **kwargs)

    hint = (" (the time limit is env_kwargs max_steps_in_episode, Brax's episode_length)"
            if "episode_length" in kwargs else "")
    brax_env = adapter.construct(path, "brax.envs.get_environment", get_environment, name, kwargs,
                                 "go to it (e.g. backend='positional')", hint)
    env = BraxEnv(brax_env, name=f"brax-{name}")
    adapter.trace_step(env, path, "brax", "Brax",
                       jax.ShapeDtypeStruct((env._action_size,), jnp.float32))
    return env, params


@struct.dataclass
class BraxParams:
    """What jaxppo's reset and step take for a Brax env: the episode's time limit."""

    max_steps_in_episode: int = DEFAULT_EPISODE_LENGTH


@struct.dataclass
class BraxEnvState:
    """A Brax env's state (`brax.envs.State`: physics state, obs, reward, done, metrics, info)
    and the steps taken in the current episode."""

    brax_state: Any
    time: jax.Array  # int32 []


class BraxEnv:
    """A Brax env (`brax.envs.Env`, one env: jaxppo vmaps it) with the gymnax API.

    reset(key, params) -> (obs, state); step(key, state, action, params) -> (obs, state,
    reward, terminated, truncated, info), auto-resetting with `key` when the episode ends and
    keeping the observation before the reset in info["final_observation"]. Actions are in
    [-1, 1] (Brax envs scale them to their actuators' ranges).

    Brax's own wrappers are not used: its AutoResetWrapper resets to the state the episode
    started from and overwrites the last observation of a time-limited episode.
    """

    def __init__(self, brax_env, name: str | None = None):
        self.brax_env = brax_env
        self.name = name or f"brax-{type(brax_env).__name__}"
        reset = jax.eval_shape(brax_env.reset, jax.random.PRNGKey(0))
        obs = reset.obs
        if not isinstance(obs, jax.ShapeDtypeStruct) or len(obs.shape) != 1:
            raise ConfigError(f"{self.name}: observations are {jax.tree.map(jnp.shape, obs)}; "
                              "jaxppo takes Brax envs whose observation is one vector")
        self._obs_shape = tuple(obs.shape)
        self._obs_dtype = obs.dtype
        self._action_size = int(brax_env.action_size)

    @property
    def default_params(self) -> BraxParams:
        return BraxParams()

    def reset(self, key: jax.Array, params: BraxParams | None = None):
        state = self.brax_env.reset(key)
        return state.obs, BraxEnvState(_plain_state(state), jnp.zeros((), jnp.int32))

    def step(self, key: jax.Array, state: BraxEnvState, action: jax.Array,
             params: BraxParams | None = None):
        params = self.default_params if params is None else params
        stepped = _plain_state(self.brax_env.step(state.brax_state, action))
        time = state.time + 1
        terminated = stepped.done > 0.5  # Brax's done: 1.0 when the episode really ended
        truncated = jnp.logical_and(time >= params.max_steps_in_episode, ~terminated)
        done = jnp.logical_or(terminated, truncated)
        obs, next_state, info = adapter.auto_reset(
            done, lambda: self.reset(key, params), stepped.obs, BraxEnvState(stepped, time))
        return obs, next_state, stepped.reward, terminated, truncated, info

    def observation_space(self, params: BraxParams | None = None):
        spaces = adapter.gymnax_spaces()
        return spaces.Box(-jnp.inf, jnp.inf, self._obs_shape, self._obs_dtype)

    def action_space(self, params: BraxParams | None = None):
        spaces = adapter.gymnax_spaces()
        return spaces.Box(-1.0, 1.0, (self._action_size,), jnp.float32)

    def __repr__(self) -> str:
        return f"BraxEnv({type(self.brax_env).__name__}, backend={self.brax_env.backend!r})"


def _plain_state(state):
    """The Brax state with reward and done as float32 arrays (some envs' step returns Python
    floats, which would change the state's leaf types between reset and step)."""
    return state.replace(reward=jnp.asarray(state.reward, jnp.float32),
                         done=jnp.asarray(state.done, jnp.float32))
