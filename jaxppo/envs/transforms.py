"""User transforms inside the one compiled program: env wrappers (`EnvWrapper`: frame
stacking, discretised actions; for envs that step in Python, their numpy forms in
jaxppo.envs.host_transforms) and reward hooks over the rollout batch (`RewardHook`: a count
bonus), listed in order in `PPOConfig.transforms`, e.g.

    transforms=[{"frame_stack": {"k": 4}}, {"count_bonus": {"scale": 0.1, "power": 0.5}}]
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.config import FUNCTION_HOOK, is_function_hook
from jaxppo.envs.spec import MAX_JOINT_ACTIONS
from jaxppo.errors import ConfigError


# ---------------------------------------------------------------------- base classes
class EnvWrapper:
    """An env wrapper: `wrap(env)` returns a gymnax-API env (reset, step, observation_space,
    action_space) whose observations or action space are transformed.

    `make_env` wraps the env with the config's wrappers, the first entry innermost, so the
    rollout, evaluation and `load_policy` all see the transformed env. A wrapper keeps what
    it needs (e.g. the last k frames) in the env state.

    `takes_agents`: True when the wrapper handles a multi-agent env's agent axis (its
    observations [N, ...] and actions [N, ...], one done for every agent); a wrapper that
    does not say so is refused on a multi-agent env.
    """

    name = "env_wrapper"
    takes_agents = False

    def wrap(self, env):
        raise NotImplementedError

    def wrap_host(self, env):
        """The wrapper for an env that steps in Python (jaxppo.envs.host_transforms): the same
        transform on the host vector env's outputs; None when the wrapper has no such form."""
        return None

    def to_config(self):
        return _dataclass_config(self)


class RewardHook:
    """A jittable hook over the rollout batch before GAE.

    `init(spec)` gives the hook's initial state (a pytree, identical on every device);
    `__call__(hook_state, traj, axis_name=None)` returns (hook_state, rewards [T, E]).
    `axis_name` names the pmap axis when the batch is split over devices: a hook that keeps
    global statistics reduces over it (`lax.psum`) so every device holds the same state.

    Hooks run in order before GAE and before reward normalisation, each seeing the rewards of
    the one before in `traj.reward`; their states live in `TrainState.hook_state` (one entry
    per hook) from iteration to iteration. Episode-return metrics stay the env's own.

    `takes_agents`: True when the hook handles a multi-agent env's batch, whose columns are
    actors [T, E*N] (actor e * N + i is agent i of env e; `init` gets the spec, whose
    `agents` names them); a hook that does not say so is refused on a multi-agent env.
    """

    name = "reward_hook"
    takes_agents = False

    def init(self, spec) -> Any:
        return ()

    def __call__(self, hook_state, traj, axis_name=None):
        raise NotImplementedError

    def to_config(self):
        return _dataclass_config(self)


class FunctionHook(RewardHook):
    """A plain function `fn(hook_state, traj) -> (hook_state, rewards)` with initial state
    `init_state` (default: none)."""

    def __init__(self, fn: Callable, init_state: Any = ()):
        self.fn = fn
        self.init_state = init_state
        self.name = getattr(fn, "__name__", "function_hook")

    def init(self, spec):
        return self.init_state

    def __call__(self, hook_state, traj, axis_name=None):
        return self.fn(hook_state, traj)

    def to_config(self):
        return {FUNCTION_HOOK: self.name}


def _dataclass_config(t):
    if dataclasses.is_dataclass(t):
        return {t.name: {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}}
    return t.name


# ---------------------------------------------------------------------- frame stacking
@dataclass(frozen=True)
class FrameStack(EnvWrapper):
    """Observe the last `k` observations, oldest first.

    Frames go on a new last axis ([*obs_shape] -> [*obs_shape, k]), except image observations
    [H, W, C], whose channels are concatenated ([H, W, k*C]) so the CNN torso sees k*C
    channels. At an episode's start every slot holds the first observation. A multi-agent
    env's agents each stack their own observations ([N, *obs_shape] -> [N, *obs_shape, k]);
    their episode starts together.
    """

    k: int = 4
    name = "frame_stack"
    takes_agents = True

    def __post_init__(self):
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ConfigError(f"frame_stack k={self.k!r} must be an integer >= 1, e.g. k=4")

    def wrap(self, env):
        return FrameStackEnv(env, self.k)

    def wrap_host(self, env):
        from jaxppo.envs.host_transforms import HostFrameStackEnv

        return HostFrameStackEnv(env, self.k)


class FrameStackState(NamedTuple):
    env_state: Any
    frames: jax.Array  # [k, *obs_shape], oldest first


class FrameStackEnv:
    """A gymnax env whose observations are the last k of the wrapped env's.

    `info["final_observation"]` is the stack ending in the wrapped env's pre-reset
    observation, so the value bootstrap of a truncated step sees the right frames.
    Anything else (name, default_params, num_actions, ...) is the wrapped env's.
    """

    def __init__(self, env, k: int):
        self._env = env
        self.k = k
        self._by_agent = bool(getattr(env, "agents", ()))

    def __getattr__(self, name):
        return getattr(self._env, name)

    def _layout(self, frames: jax.Array) -> jax.Array:
        """[k, *obs_shape] (a multi-agent env's [k, N, *obs_shape]) -> the stacked
        observation (each agent's own)."""
        if self._by_agent:
            return jax.vmap(_stack_frames, in_axes=1)(frames)
        return _stack_frames(frames)

    def reset(self, key, params=None):
        obs, env_state = self._env.reset(key, params)
        frames = jnp.repeat(obs[None], self.k, axis=0)
        return self._layout(frames), FrameStackState(env_state, frames)

    def step(self, key, state: FrameStackState, action, params=None):
        obs, env_state, reward, terminated, truncated, info = self._env.step(
            key, state.env_state, action, params)
        done = jnp.logical_or(terminated, truncated)
        final_frames = jnp.concatenate([state.frames[1:], info["final_observation"][None]])
        frames = jnp.where(done, jnp.repeat(obs[None], self.k, axis=0),
                           jnp.concatenate([state.frames[1:], obs[None]]))
        info = {**info, "final_observation": self._layout(final_frames)}
        return self._layout(frames), FrameStackState(env_state, frames), reward, terminated, truncated, info

    def step_env(self, key, state: FrameStackState, action, params=None):
        """The wrapped env's step without auto-reset: the new frame joins the stack."""
        obs, env_state, reward, done, info = self._env.step_env(key, state.env_state, action, params)
        frames = jnp.concatenate([state.frames[1:], obs[None]])
        return self._layout(frames), FrameStackState(env_state, frames), reward, done, info

    @property
    def action_mask(self):
        """The wrapped env's action mask of the current frame's state (AttributeError when
        it has none)."""
        return _of_inner_state(self._env, "action_mask")

    @property
    def world_state(self):
        """A multi-agent env's world state of the current frame's state (AttributeError when
        it has none): the critic's input stays the env's, unstacked."""
        return _of_inner_state(self._env, "world_state")

    def observation_space(self, params):
        """One observation's (one agent's) stacked space."""
        from gymnax.environments import spaces

        inner = self._env.observation_space(params)
        shape = tuple(int(s) for s in inner.shape)
        stacked = lambda b: b if np.ndim(b) == 0 else _stack_frames(  # noqa: E731
            jnp.repeat(jnp.broadcast_to(jnp.asarray(b), shape)[None], self.k, axis=0))
        new_shape = jax.eval_shape(_stack_frames, jax.ShapeDtypeStruct((self.k,) + shape, inner.dtype)).shape
        return spaces.Box(stacked(inner.low), stacked(inner.high), tuple(new_shape), inner.dtype)

    def action_space(self, params=None):
        return self._env.action_space(params)

    def __repr__(self):
        return f"FrameStackEnv({self._env!r}, k={self.k})"


def _stack_frames(frames: jax.Array) -> jax.Array:
    """One observation's last k [k, *obs_shape] -> its stack: [*obs_shape, k], or for images
    [k, H, W, C] -> [H, W, k*C]."""
    if frames.ndim == 4:  # images [k, H, W, C] -> [H, W, k*C]
        k, h, w, c = frames.shape
        return jnp.transpose(frames, (1, 2, 0, 3)).reshape(h, w, k * c)
    return jnp.moveaxis(frames, 0, -1)


def _of_inner_state(env, name: str):
    """`env.<name>(state, params)` of a wrapper's state (`state.env_state`), or
    AttributeError(name) when the wrapped env has no such function."""
    inner = getattr(env, name, None)
    if not callable(inner):
        raise AttributeError(name)
    return lambda state, params=None: inner(state.env_state, params)


# ---------------------------------------------------------------------- discretised actions
@dataclass(frozen=True)
class DiscretizeActions(EnvWrapper):
    """Turn a continuous (Box) action space into a discrete one of `bins` evenly spaced
    values per dimension, from low to high inclusive; the policy becomes a categorical over
    the bins**D joint actions. A categorical can put its mass on two separate torques where a
    Gaussian can only average them, which matters where the best action switches sharply
    (e.g. which way to swing a pendulum hanging at rest). On a multi-agent env with Box
    actions every agent's action is discretised alike.
    """

    bins: int = 11
    name = "discretize_actions"
    takes_agents = True
    MAX_JOINT_ACTIONS = MAX_JOINT_ACTIONS

    def __post_init__(self):
        if not isinstance(self.bins, int) or isinstance(self.bins, bool) or self.bins < 2:
            raise ConfigError(f"discretize_actions bins={self.bins!r} must be an integer >= 2, "
                              "e.g. bins=11")

    def wrap(self, env):
        return DiscreteActionEnv(env, self.bins)

    def wrap_host(self, env):
        from jaxppo.envs.host_transforms import HostDiscreteActionEnv

        return HostDiscreteActionEnv(env, self.bins, DiscreteActionEnv(env, self.bins))


class DiscreteActionEnv:
    """A gymnax env with a Box action space seen through Discrete(bins**D) actions: action
    index i has base-`bins` digits (first dimension most significant), digit j of dimension d
    meaning low[d] + j * (high[d] - low[d]) / (bins - 1)."""

    def __init__(self, env, bins: int):
        self._env = env
        self.bins = bins

    def __getattr__(self, name):
        return getattr(self._env, name)

    def _box(self, params):
        space = self._env.action_space(params)
        if hasattr(space, "n") or not hasattr(space, "low"):
            raise ConfigError(
                f"discretize_actions needs a continuous (Box) action space, but the env has "
                f"{space!r}; remove the transform for discrete-action envs")
        shape = tuple(space.shape)
        dim = int(np.prod(shape)) if shape else 1
        if self.bins ** dim > DiscretizeActions.MAX_JOINT_ACTIONS:
            raise ConfigError(
                f"discretize_actions bins={self.bins} over {dim} action dimensions makes "
                f"{self.bins}**{dim} = {self.bins ** dim} joint actions (at most "
                f"{DiscretizeActions.MAX_JOINT_ACTIONS}); use fewer bins or the Gaussian policy")
        low, high = box_bounds(space, dim)
        if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))):
            raise ConfigError("discretize_actions needs finite action bounds, but the env's are "
                              f"low={low.tolist()} high={high.tolist()}")
        return shape, dim, low, high

    def continuous_action(self, index: jax.Array, params=None) -> jax.Array:
        """The Box actions [..., *action_shape] for discrete action indices [...] (a
        multi-agent env's [N], one per agent)."""
        shape, dim, low, high = self._box(params)
        powers = self.bins ** np.arange(dim - 1, -1, -1)
        digits = (jnp.asarray(index)[..., None] // jnp.asarray(powers)) % self.bins
        values = jnp.asarray(low) + digits * jnp.asarray((high - low) / (self.bins - 1))
        return values.reshape(jnp.shape(index) + shape).astype(jnp.float32)

    def reset(self, key, params=None):
        return self._env.reset(key, params)

    def step(self, key, state, action, params=None):
        return self._env.step(key, state, self.continuous_action(action, params), params)

    def step_env(self, key, state, action, params=None):
        """The wrapped env's step without auto-reset, for a discrete action."""
        return self._env.step_env(key, state, self.continuous_action(action, params), params)

    def observation_space(self, params):
        return self._env.observation_space(params)

    def action_space(self, params=None):
        from gymnax.environments import spaces

        _, dim, _, _ = self._box(params)
        return spaces.Discrete(self.bins ** dim)

    def __repr__(self):
        return f"DiscreteActionEnv({self._env!r}, bins={self.bins})"


# ---------------------------------------------------------------------- count bonus
@dataclass(frozen=True)
class CountBonus(RewardHook):
    """Count-based intrinsic reward: r + scale / N(s')**power.

    N(s') counts visits to the discretised successor observation s' (the pre-reset
    `final_obs` of each step) in a hashed table of `buckets` entries, updated with the whole
    batch before the bonus is computed (so N >= 1). power=0.5 is the classic
    scale/sqrt(N) bonus (MBIE-EB, #Exploration), power=1 is scale/N. Observations are
    discretised as round(obs / resolution). Counts are global: under pmap the batch's counts
    are summed over devices, so every device holds the same table. On a multi-agent env each
    agent counts its own observations in a table of its own ([N, buckets]): an agent's bonus
    is for what is new to it, as each agent of independent PPO learns from its own view.
    """

    scale: float = 0.1
    power: float = 0.5
    buckets: int = 2 ** 16
    resolution: float = 1.0
    name = "count_bonus"
    takes_agents = True

    def __post_init__(self):
        for f in ("scale", "power", "resolution"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v < 0 \
                    or (f == "resolution" and v == 0):
                raise ConfigError(f"count_bonus {f}={v!r} must be a number "
                                  f"{'> 0' if f == 'resolution' else '>= 0'}")
        b = self.buckets
        if not isinstance(b, int) or isinstance(b, bool) or b < 2 or b & (b - 1):
            raise ConfigError(f"count_bonus buckets={b!r} must be a power of two >= 2, e.g. 65536")

    def init(self, spec):
        agents = len(getattr(spec, "agents", ()) or ())
        return jnp.zeros((agents, self.buckets) if agents else (self.buckets,), jnp.int32)

    def bucket(self, obs: jax.Array, obs_ndim: int) -> jax.Array:
        """Table index [...] of observations [..., *obs_shape] (obs_ndim trailing axes)."""
        lead = obs.shape[: obs.ndim - obs_ndim]
        flat = jnp.round(obs.reshape(lead + (-1,)).astype(jnp.float32) / self.resolution)
        return hash_rows(flat.astype(jnp.int32)) & jnp.uint32(self.buckets - 1)

    def __call__(self, counts, traj, axis_name=None):
        obs_ndim = traj.final_obs.ndim - traj.reward.ndim
        idx = self.bucket(traj.final_obs, obs_ndim).astype(jnp.int32)
        if counts.ndim == 2:  # a table per agent: actor k (env-major) is agent k % N
            idx = idx + (jnp.arange(idx.shape[-1]) % counts.shape[0]) * self.buckets
        table = counts.reshape(-1)
        visits = jnp.zeros_like(table).at[idx.reshape(-1)].add(1)
        if axis_name is not None:
            visits = jax.lax.psum(visits, axis_name)
        table = table + visits
        n = table[idx].astype(jnp.float32)
        bonus = self.scale * jnp.power(n, -self.power)
        return table.reshape(counts.shape), traj.reward + bonus


def hash_rows(x: jax.Array) -> jax.Array:
    """uint32 hash of each integer row x[..., D]: a random odd multiplier per position, summed
    (mod 2**32), then MurmurHash3's finaliser to spread the bits. Vectorised, so it costs one
    multiply-add per element rather than a sequential loop."""
    d = x.shape[-1]
    mult = np.random.RandomState(0x5EED).randint(1, 2 ** 31, size=d, dtype=np.int64) * 2 + 1
    h = jnp.sum(x.astype(jnp.uint32) * jnp.asarray(mult.astype(np.uint32)), axis=-1, dtype=jnp.uint32)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


# ---------------------------------------------------------------------- registry
TRANSFORMS: dict[str, type] = {"frame_stack": FrameStack, "discretize_actions": DiscretizeActions,
                               "count_bonus": CountBonus}
BUILTIN_TRANSFORMS: dict[str, type] = dict(TRANSFORMS)  # jaxppo's own, whatever is registered


def register_transform(name: str, cls: type) -> None:
    """Make `cls(**kwargs)` available to configs as `name` (e.g. {"my_bonus": {...}})."""
    TRANSFORMS[name] = cls


def resolve_transforms(entries) -> list:
    """The transform objects of a config's `transforms` entries.

    Args:
      entries: each a registered name ("frame_stack"), a one-key mapping {name: kwargs}, a
        pair (name, kwargs), or a transform object (an `EnvWrapper`, a `RewardHook`, or a
        function `hook(hook_state, traj) -> (hook_state, rewards)` with empty state).

    Returns:
      The transforms, in order.

    Raises:
      ConfigError: an unknown name, a malformed entry or arguments the transform does not
        take.
    """
    out = []
    for entry in entries or ():
        if isinstance(entry, (EnvWrapper, RewardHook)):
            out.append(entry)
            continue
        if callable(entry) and not isinstance(entry, type):
            out.append(FunctionHook(entry))
            continue
        if is_function_hook(entry):
            raise ConfigError(
                f"transforms: the reward hook {entry[FUNCTION_HOOK]!r} was a Python function, which "
                "a config file records by name only and cannot turn back into code. Give the "
                "function again from Python (jaxppo.train(config.replace(transforms=[...]), "
                "resume=RUN_DIR) with the function in its place), or make it a transform of its "
                "own (jaxppo.envs.transforms.register_transform) to use it from files and the "
                "command line. Acting with the policy needs no reward hook: load_policy, "
                "`jaxppo eval` and `jaxppo export` leave it out")
        if isinstance(entry, str):
            name, kwargs = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            (name, kwargs), = entry.items()
        elif isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str):
            name, kwargs = entry
        else:
            raise ConfigError(
                f"transforms entry {entry!r} must be a name, {{name: {{arg: value}}}} or "
                "[name, {arg: value}], e.g. {'frame_stack': {'k': 4}}"
            )
        kwargs = {} if kwargs is None else kwargs
        if name not in TRANSFORMS:
            close = difflib.get_close_matches(str(name), list(TRANSFORMS), n=2, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"unknown transform {name!r}{hint} Known: {', '.join(TRANSFORMS)} "
                              "(add your own with jaxppo.envs.transforms.register_transform)")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"transform {name!r}: arguments {kwargs!r} must be a mapping")
        try:
            out.append(TRANSFORMS[name](**kwargs))
        except TypeError as e:
            cls = TRANSFORMS[name]
            accepted = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else "?"
            raise ConfigError(f"transform {name!r} does not take {kwargs!r} ({e}); "
                              f"its arguments: {accepted}") from None
    return out


def env_wrappers(config) -> list[EnvWrapper]:
    """The config's env wrappers, in order."""
    return [t for t in resolve_transforms(config.transforms) if isinstance(t, EnvWrapper)]


def reward_hooks(config) -> list[RewardHook]:
    """The config's reward hooks, in order."""
    return [t for t in resolve_transforms(config.transforms) if isinstance(t, RewardHook)]


# ---------------------------------------------------------------------- hook points
def wrap_env(env, config):
    """The env wrapped by the config's observation transforms (first entry innermost); an env
    that steps in Python by their host forms (`EnvWrapper.wrap_host`).

    Raises:
      ConfigError: a transform without a form for this env (a host loop's, or a
        multi-agent env's agent axis: `check_takes_agents`).
    """
    agents = getattr(env, "agents", ())
    for t in env_wrappers(config):
        if agents:
            check_takes_agents(t, config.env_name)
        if getattr(env, "host_loop", False):
            wrapped = t.wrap_host(env)
            if wrapped is None:
                raise ConfigError(
                    f"transform {type(t).__name__} wraps a gymnax env and has no form for "
                    f"env={config.env!r}, which steps in Python; give it a `wrap_host(env)` "
                    "(see jaxppo.envs.host_transforms), or use the env's own wrappers")
            env = wrapped
        else:
            env = t.wrap(env)
    return env


def check_takes_agents(transform, env_name: str) -> None:
    """Checks that `transform` handles a multi-agent env's agent axis (`takes_agents`).

    Raises:
      ConfigError: it does not say so; names it, why, and the fix.
    """
    if getattr(transform, "takes_agents", False):
        return
    name = getattr(transform, "name", type(transform).__name__)
    if isinstance(transform, FunctionHook):
        raise ConfigError(
            f"transforms: the reward hook function {name!r} on {env_name}, a multi-agent env: "
            "its batch's columns are actors [T, E*N] (actor e * N + i is agent i of env e), "
            "and a plain function cannot say that it handles them. Make it a RewardHook "
            "subclass with takes_agents = True (jaxppo.envs.transforms), or remove it")
    sees = ("observations [N, ...] and actions [N, ...] with an agent axis"
            if isinstance(transform, EnvWrapper) else
            "a batch whose columns are actors [T, E*N] (actor e * N + i is agent i of env e)")
    raise ConfigError(
        f"transform {name!r} ({type(transform).__name__}) on {env_name}, a multi-agent env, "
        f"would see {sees}, and it does not say that it handles them; remove it, or, if it "
        "does, set takes_agents = True on its class (docs/environments.md, \"Many agents\"). "
        f"Built-in transforms that take agents: "
        f"{', '.join(n for n, c in TRANSFORMS.items() if getattr(c, 'takes_agents', False))}")


def box_bounds(space, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """A Box space's low and high as float32 vectors [dim] (scalar bounds broadcast)."""
    return tuple(np.broadcast_to(np.asarray(b, np.float32), (dim,)).copy()
                 for b in (space.low, space.high))
