"""Brax environments by name (`env="brax:<name>"`, e.g. "brax:inverted_pendulum"), behind the
gymnax API that the rollout is written for.

A Brax env steps as `state = env.step(state, action)`, reports a real end in `state.done`, and
leaves time limits and resets to wrappers. Brax's own `AutoResetWrapper` resets to the state
the episode started from (the reset is drawn once per env) and overwrites the observation, so
the last observation of a time-limited episode is lost. `BraxEnv` does both itself, as a
gymnax env does: it counts the episode's steps against `params.max_steps_in_episode` (Brax's
`episode_length`, 1000 by default), returns `terminated` (Brax's `done`, a real end) apart
from `truncated` (the time limit, and not a real end), puts the observation before the reset
in `info["final_observation"]`, and on either end resets with the key jaxppo gives that env
step (a new random start every episode).

brax is imported only when a `brax:` env is built: `import jaxppo` does not load it.

The other suites' adapters (`jaxppo.envs.jumanji_suite`, `jaxppo.envs.craftax_suite`,
`jaxppo.envs.xminigrid_suite`) follow the same rules and share this module's helpers: `SUITES`
names every prefix, its package and its pip extra; `suite_of` says which suite an env name
belongs to; `import_suite` imports a suite's package or raises the ConfigError that names the
install; `unknown_env_error` lists the names a suite has.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxppo.errors import ConfigError

# ------------------------------------------------------------------ every suite
# suite -> (the package it needs, the pip extra that installs it). An env named
# "<suite>:<name>" is built by that suite's adapter (jaxppo.envs.make.make_env dispatches).
SUITES = {
    "brax": ("brax", "brax"),
    "jumanji": ("jumanji", "jumanji"),
    "craftax": ("craftax", "craftax"),
    "xminigrid": ("xminigrid", "xminigrid"),
}


def suite_of(env: Any) -> str | None:
    """The suite of an env named "<suite>:<name>" (e.g. "jumanji" for "jumanji:Snake-v1"),
    or None for any other env (a gymnax name, "module:Class", an object)."""
    if not isinstance(env, str):
        return None
    suite, sep, _ = env.partition(":")
    return suite if sep and suite in SUITES else None


def is_suite_env(env: Any) -> bool:
    """True for an env named "<suite>:<name>" that one of jaxppo's adapters builds."""
    return suite_of(env) is not None


def install_line(suite: str) -> str:
    """The pip command that installs a suite's package with the version jaxppo is tested on."""
    return f"pip install 'jaxppo[{SUITES[suite][1]}]'"


def import_suite(suite: str, module: str | None = None):
    """The suite's package (or its submodule `module`), or a ConfigError naming the install."""
    import importlib

    name = module or SUITES[suite][0]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"env='{suite}:...' needs the {SUITES[suite][0]} package "
                          f"({type(e).__name__}: {e}): {install_line(suite)}") from None


def unknown_env_error(path: str, names: list[str], what: str,
                      listing: str = "Available") -> ConfigError:
    """The ConfigError for "<suite>:<name>" whose name the suite does not have: the nearest
    names, then all of them (after `listing`), each with the prefix to paste."""
    prefix, _, name = path.partition(":")
    prefix += ":"
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    lowered = {n.lower(): n for n in names}
    if name.lower() in lowered:
        close = [lowered[name.lower()]]
    hint = f"; did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else "."
    return ConfigError(f"env={path!r}: {name!r} is not {what}{hint} "
                       f"{listing}: {', '.join(prefix + n for n in names)}")


def select_reset(done: jax.Array, reset: Any, stepped: Any) -> Any:
    """`reset` where the episode ended, else `stepped` (two trees of the same structure).
    Computed for every step and selected, as gymnax does: under vmap a cond would run both
    branches anyway."""
    return jax.tree.map(lambda r, s: jnp.where(done, r, s), reset, stepped)


def gymnax_spaces():
    """gymnax's spaces module (Box, Discrete), which every adapter's spaces are made of."""
    from jaxppo.envs.gymnax_import import import_gymnax

    return import_gymnax().environments.spaces


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (at most 300 characters)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


# ------------------------------------------------------------------ Brax
PREFIX = "brax:"
INSTALL = install_line("brax")
DEFAULT_EPISODE_LENGTH = 1000  # Brax's episode_length default (envs.create, ppo.train)


def import_brax_envs():
    """brax.envs, or a ConfigError naming the install."""
    # mujoco.mjx prints "Failed to import mujoco_warp" when the optional warp GPU backend
    # is absent; Brax's pipelines do not use it, so keep it out of the run's output.
    with contextlib.redirect_stdout(io.StringIO()):
        return import_suite("brax", "brax.envs")


def registered_brax_envs() -> list[str]:
    """Brax's registered env names (the <name> of "brax:<name>"; `brax.envs.register_environment`
    adds to them). Brax has no public list: this reads its registry dict."""
    return sorted(getattr(import_brax_envs(), "_envs", {}))


def make_brax_env(path: str, env_kwargs: dict) -> tuple["BraxEnv", dict]:
    """The `BraxEnv` "brax:<name>" names, built by `brax.envs.get_environment(name, **kwargs)`
    with the env_kwargs that are not fields of `BraxParams` (e.g. backend="positional").
    Returns (env, the other env_kwargs: params, which make_env sets)."""
    name = path[len(PREFIX):]
    envs = import_brax_envs()
    names = registered_brax_envs()
    if names and name not in names:  # (no names: a brax without the registry dict we read)
        raise unknown_env_error(path, names, "a registered Brax environment", "Registered")
    params = {k: v for k, v in env_kwargs.items() if k in _PARAM_FIELDS}
    kwargs = {k: v for k, v in env_kwargs.items() if k not in _PARAM_FIELDS}
    try:
        with warnings.catch_warnings():
            # Each mjcf.load warns that Brax's pipelines are no longer actively maintained
            # (upstream points to MJX); it says nothing about this run.
            warnings.filterwarnings("ignore", message=".*not actively being maintained.*")
            brax_env = envs.get_environment(name, **kwargs)
    except Exception as e:  # noqa: BLE001 - a bad kwarg or backend: one clear error
        call = ", ".join([repr(name)] + [f"{k}={v!r}" for k, v in kwargs.items()])
        hint = (" (the time limit is env_kwargs max_steps_in_episode, Brax's episode_length)"
                if "episode_length" in kwargs else "")
        raise ConfigError(f"env={path!r}: brax.envs.get_environment({call}) raised "
                          f"{type(e).__name__}: {first_line(e)}{hint}. env_kwargs other than "
                          f"{sorted(_PARAM_FIELDS)} go to it (e.g. backend='positional')") from None
    env = BraxEnv(brax_env, name=f"brax-{name}")
    trace_step(env, path, "brax", "Brax", jax.ShapeDtypeStruct((env._action_size,), jnp.float32))
    return env, params


def trace_step(env: Any, path: str, suite: str, label: str, action: Any, hint: str = "") -> None:
    """ConfigError when tracing the adapter's reset or step fails: suite code that does not
    run with this jax (brax 0.14.2's swimmer calls jnp.clip(a_min=...), which jax 0.10
    removed), or params it cannot take, is named before anything compiles. Tracing only
    (jax.eval_shape): a fraction of a second. `suite` is the package, `label` its name in
    the message ("Brax"), `action` an example action (an array or a ShapeDtypeStruct)."""
    import importlib.metadata

    params = env.default_params
    key = jax.random.PRNGKey(0)
    try:
        _, state = jax.eval_shape(lambda k: env.reset(k, params), key)
        jax.eval_shape(lambda k, s, a: env.step(k, s, a, params), key, state, action)
    except Exception as e:  # noqa: BLE001 - the suite's own code failing: one clear error
        versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in (suite, "jax"))
        raise ConfigError(f"env={path!r}: {label}'s own reset or step fails with {versions} "
                          f"({type(e).__name__}: {first_line(e)}): this {label} env does not run "
                          f"with these versions{hint}; use another one") from e


@struct.dataclass
class BraxParams:
    """What jaxppo's reset and step take for a Brax env: the episode's time limit."""

    max_steps_in_episode: int = DEFAULT_EPISODE_LENGTH


_PARAM_FIELDS = {"max_steps_in_episode"}


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
        reset_obs, reset_state = self.reset(key, params)
        next_state = select_reset(done, reset_state, BraxEnvState(stepped, time))
        obs = jnp.where(done, reset_obs, stepped.obs)
        info = {"final_observation": stepped.obs}
        return obs, next_state, stepped.reward, terminated, truncated, info

    def observation_space(self, params: BraxParams | None = None):
        spaces = gymnax_spaces()
        return spaces.Box(-jnp.inf, jnp.inf, self._obs_shape, self._obs_dtype)

    def action_space(self, params: BraxParams | None = None):
        spaces = gymnax_spaces()
        return spaces.Box(-1.0, 1.0, (self._action_size,), jnp.float32)

    def __repr__(self) -> str:
        return f"BraxEnv({type(self.brax_env).__name__}, backend={self.brax_env.backend!r})"


def _plain_state(state):
    """The Brax state with reward and done as float32 arrays (some envs' step returns Python
    floats, which would change the state's leaf types between reset and step)."""
    return state.replace(reward=jnp.asarray(state.reward, jnp.float32),
                         done=jnp.asarray(state.done, jnp.float32))
