"""The custom-env checker: `check_env` runs a user's env briefly before anything is compiled
and raises a ConfigError naming the problem and the fix where it breaks the contract the
rollout relies on (gymnax 1.x `step` with terminated and truncated apart,
`info["final_observation"]`, auto-reset).
"""

from __future__ import annotations

import os
import traceback
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.envs.gymnax_import import import_gymnax
from jaxppo.envs.transforms import box_bounds
from jaxppo.errors import ConfigError

CHECK_STEPS = 512  # random steps of the auto-reset check (two envs, one jitted lax.scan)

_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # env -> params that passed

_GYMNAX_HINT = ("Subclassing gymnax.environments.environment.Environment and writing "
                "step_env(key, state, action, params) -> (obs, state, reward, terminated, info) "
                "and reset_env(key, params) -> (obs, state) gives all of this (its step splits "
                "off truncation at params.max_steps_in_episode and auto-resets).")


def check_env(env, params, name: str, steps: int = CHECK_STEPS) -> None:
    """Checks a user's env against the contract the rollout relies on.

    The contract: reset -> (obs, state); step -> (obs, state, reward, terminated, truncated,
    info) with info["final_observation"]; observations as observation_space says; and
    auto-reset (after a step that ends an episode, the next step starts a new one). Traces
    reset and step once (jax.eval_shape), then runs `steps` random steps of two envs in one
    jitted lax.scan; an env object that passed with the same params is not checked again.

    Args:
      env: the env (gymnax API).
      params: the params its reset and step take.
      name: the env's name in messages.
      steps: random steps of the auto-reset check.

    Raises:
      ConfigError: the env breaks the contract; the message names the problem and the fix.
    """
    try:
        passed = _CHECKED.setdefault(env, set())
        token = repr(params)
    except TypeError:  # not weak-referenceable
        passed, token = set(), None
    if token in passed:
        return
    _check_own_params(env, params, name)
    obs_space = _call(lambda: env.observation_space(params), name, "observation_space(params)")
    act_space = _call(lambda: env.action_space(params), name, "action_space(params)")
    key = jax.random.PRNGKey(0)
    out = _call(lambda: jax.eval_shape(lambda k: env.reset(k, params), key), name,
                "reset(key, params)")
    if not isinstance(out, tuple) or len(out) != 2:
        raise ConfigError(f"{name}: reset(key, params) must return (obs, state), not "
                          f"{_describe(out)}. {_GYMNAX_HINT}")
    obs, state = out
    _check_obs(obs, obs_space, name)
    sample = _action_sampler(act_space)
    if sample is None:
        return  # an action space jaxppo does not take: make_env says so
    out = _call(lambda: jax.eval_shape(
        lambda k, s: env.step(k, s, sample(k), params), key, state), name,
        "step(key, state, action, params)")
    _check_step_output(out, obs, state, name)
    _check_auto_reset(env, params, sample, name, steps)
    passed.add(token)


def _check_own_params(env, params, name: str) -> None:
    """An env that inherits gymnax's default_params gets EnvParams(max_steps_in_episode=1):
    every episode would be cut after one step."""
    import_gymnax()
    from gymnax.environments import environment

    if (type(params) is environment.EnvParams and params.max_steps_in_episode == 1
            and getattr(type(env), "default_params", None) is environment.Environment.default_params):
        raise ConfigError(
            f"{name} has no default_params of its own: the one it inherits from gymnax's "
            "Environment is EnvParams(max_steps_in_episode=1), which cuts every episode after "
            "one step. Add a default_params property that returns your params (e.g. a "
            "flax.struct.dataclass subclassing EnvParams with max_steps_in_episode: int = 500), "
            "or set env_kwargs={'max_steps_in_episode': 500}")


def _check_obs(obs, space, name: str) -> None:
    if not (hasattr(obs, "shape") and hasattr(obs, "dtype")):
        raise ConfigError(f"{name}: reset returns an observation that is {_describe(obs)}; "
                          "jaxppo needs one array per env (concatenate or flatten the parts)")
    space_shape = getattr(space, "shape", None)
    if space_shape is None:
        raise ConfigError(f"{name}: observation_space(params) gives {space!r}, which has no "
                          "shape; use a gymnax spaces.Box")
    space_shape = tuple(int(s) for s in space_shape)
    space_dtype = getattr(space, "dtype", None)
    dtype = obs.dtype if space_dtype is None else jax.dtypes.canonicalize_dtype(space_dtype)
    if tuple(obs.shape) != space_shape or obs.dtype != dtype:
        raise ConfigError(
            f"{name}: reset returns observations {obs.dtype}{list(obs.shape)}, but "
            f"observation_space(params) says {np.dtype(dtype)}{list(space_shape)}; the network "
            "is built from the space, so make them agree (e.g. "
            f"spaces.Box(low, high, {tuple(obs.shape)}, jnp.{obs.dtype}), or cast the "
            "observation)")


def _check_step_output(out, obs, state, name: str) -> None:
    n = len(out) if isinstance(out, tuple) else None
    if n == 5:
        raise ConfigError(
            f"{name}: step(key, state, action, params) returns 5 values; jaxppo needs 6, "
            "(obs, state, reward, terminated, truncated, info) as in gymnax 1.x, so that a "
            "time limit is not taken for a real end (a truncated step is bootstrapped from its "
            "final observation). If yours returns (obs, state, reward, done, info) as older "
            "gymnax did, split done: terminated = the episode really ended (goal, failure); "
            "truncated = it was cut by a time limit (e.g. state.time >= "
            "params.max_steps_in_episode) and did not end; and put the observation before the "
            "reset in info['final_observation']. (A gymnasium env, whose step returns (obs, "
            "reward, terminated, truncated, info) and keeps its state inside the object, "
            f"cannot be jitted; port it to this functional API.) {_GYMNAX_HINT}")
    if n != 6:
        raise ConfigError(
            f"{name}: step(key, state, action, params) must return (obs, state, reward, "
            f"terminated, truncated, info), not {_describe(out)}. {_GYMNAX_HINT}")
    obs2, state2, reward, term, trunc, info = out
    if _spec(obs2) != _spec(obs):
        raise ConfigError(f"{name}: step returns observations {_describe(obs2)} but reset "
                          f"returns {_describe(obs)}; they must have the same shape and dtype")
    bad = _state_difference(state, state2)
    if bad:
        raise ConfigError(
            f"{name}: step returns a state that differs from the one reset returns ({bad}); "
            "training carries the state through jax.lax.scan, so step must keep its structure, "
            "shapes and dtypes (start values with the dtype they keep, e.g. jnp.float32(0.0))")
    for what, v in (("reward", reward), ("terminated", term), ("truncated", trunc)):
        if getattr(v, "shape", None) != ():
            raise ConfigError(f"{name}: step returns {what} {_describe(v)}; it must be a "
                              "scalar (one env: jaxppo vmaps the env itself)")
    if not isinstance(info, dict) or "final_observation" not in info:
        got = f"keys {sorted(map(str, info))}" if isinstance(info, dict) else _describe(info)
        raise ConfigError(
            f"{name}: step's info has no 'final_observation' ({got}). jaxppo needs the "
            "observation before the auto-reset there, to bootstrap the value of a truncated "
            f"step: return info={{..., 'final_observation': obs_before_reset}}. {_GYMNAX_HINT}")
    if _spec(info["final_observation"]) != _spec(obs):
        raise ConfigError(
            f"{name}: info['final_observation'] is {_describe(info['final_observation'])} but "
            f"observations are {_describe(obs)}; it must be the observation before the reset")


def _check_auto_reset(env, params, sample, name: str, steps: int) -> None:
    """Step two envs `steps` times with random actions. An env that does not reset itself
    shows one of two symptoms once an episode has ended: every later step ends an episode
    again (the terminal condition still holds: episodes of length 1), or a gymnax-style
    `state.time` that does not go back to what reset gives."""
    n = 2

    def run(key):
        k_reset, k_probe, k_steps = jax.random.split(key, 3)
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k_reset, n), params)
        _, probe = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k_probe, 8), params)

        def body(state, k):
            k_act, k_env = jax.random.split(k)
            actions = jax.vmap(sample)(jax.random.split(k_act, n))
            _, state, _, term, trunc, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_env, n), state, actions, params)
            done = jnp.logical_or(jnp.asarray(term).astype(bool), jnp.asarray(trunc).astype(bool))
            return state, (done, _time(state, n))

        _, (done, time) = jax.lax.scan(body, state, jax.random.split(k_steps, steps))
        return done, time, _time(probe, 8)

    done, time, reset_time = _call(
        lambda: jax.device_get(jax.jit(run)(jax.random.PRNGKey(0))), name,
        "step under jax.vmap and jax.lax.scan (as training runs it)")
    done = np.asarray(done)
    symptom = None
    reset_time = np.asarray(reset_time)
    time = np.asarray(time)
    if reset_time.size and time.shape == done.shape and np.all(reset_time == reset_time[0]):
        stale = done & (time != reset_time[0])
        if stale.any():
            t, e = map(int, np.argwhere(stale)[0])
            symptom = (f"after step {t + 1} ended an episode, state.time was {time[t, e]} "
                       f"instead of the {reset_time[0]} that reset gives")
    for e in range(n):
        d = done[:, e]
        first = int(np.argmax(d))
        if symptom is None and d.any() and first >= 1 and steps - first >= 16 and d[first:].all():
            symptom = (f"the first episode ended at step {first + 1}, and every step after it "
                       "ended an episode again (episodes of length 1)")
    if symptom:
        raise ConfigError(
            f"{name} does not start a new episode when one ends: in {steps} random steps, "
            f"{symptom}. jaxppo never calls reset during training: when terminated or truncated "
            "is true, step itself must return reset's obs and state (and the observation "
            f"before the reset in info['final_observation']). {_GYMNAX_HINT}")


def _time(state, n: int):
    """state.time [n] of a gymnax-style state, or an empty array."""
    t = getattr(state, "time", None)
    if hasattr(t, "shape") and tuple(t.shape) == (n,) and jnp.issubdtype(t.dtype, jnp.number):
        return t
    return jnp.zeros((0,), jnp.int32)


def _action_sampler(space):
    """A random action of the kind jaxppo's rollout passes to step, or None."""
    try:
        if hasattr(space, "n"):
            n = int(space.n)
            return lambda k: jax.random.randint(k, (), 0, n)
        shape = tuple(space.shape)
        if not hasattr(space, "low") or len(shape) > 1:
            return None
        dim = int(shape[0]) if shape else 1
        low, high = box_bounds(space, dim)
    except Exception:
        return None
    low, high = np.where(np.isfinite(low), low, -1.0), np.where(np.isfinite(high), high, 1.0)

    def sample(k):
        a = jax.random.uniform(k, (dim,), minval=low, maxval=high)
        return a if shape else a[0]

    return sample


def _call(fn, name: str, what: str):
    """fn(), with any exception from the user's env as a ConfigError naming the method."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as e:
        tracer_errors = tuple(getattr(jax.errors, c) for c in (
            "ConcretizationTypeError", "TracerBoolConversionError", "TracerArrayConversionError",
            "TracerIntegerConversionError", "NonConcreteBooleanIndexError") if hasattr(jax.errors, c))
        hint = (" (jaxppo runs reset and step under jax.jit and jax.vmap: branch with "
                "jnp.where or jax.lax.cond, not Python if, and use jnp, not numpy, on arrays)"
                if isinstance(e, tracer_errors) else "")
        raise ConfigError(f"{name}: env.{what} raised {error_summary(e)}{hint}") from e


def error_summary(e: BaseException) -> str:
    """An exception from a user's code in one line: "TypeError: <first line> (at file.py:12)"."""
    return _last_line(e) + _where(e)


def _last_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _where(e: BaseException) -> str:
    """ ' (at file:line)' of the innermost frame outside jax, jaxppo's envs and installed packages."""
    skip = (os.sep + "site-packages" + os.sep, os.sep + os.path.join("jaxppo", "envs", ""))
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not any(s in frame.filename for s in skip) and not frame.filename.startswith("<"):
            return f" (at {os.path.basename(frame.filename)}:{frame.lineno})"
    return ""


def _spec(x):
    return (tuple(x.shape), np.dtype(x.dtype)) if hasattr(x, "shape") and hasattr(x, "dtype") else None


def _describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{np.dtype(x.dtype)}{list(x.shape)}"
    if isinstance(x, tuple):
        return f"a tuple of {len(x)} values"
    return f"a {type(x).__name__}"


def _state_difference(before, after) -> str:
    """'' when the two states have the same structure and leaf shapes/dtypes (a weakly typed
    leaf of `before` may change dtype: lax.scan promotes it); else what differs."""
    paths, tree = jax.tree_util.tree_flatten_with_path(before)
    if jax.tree_util.tree_structure(after) != tree:
        return (f"reset's state is {jax.tree_util.tree_structure(before)}, step's is "
                f"{jax.tree_util.tree_structure(after)}")[:400]
    for (path, a), b in zip(paths, jax.tree_util.tree_leaves(after)):
        if tuple(a.shape) != tuple(b.shape) or (
                a.dtype != b.dtype and not getattr(a, "weak_type", False)):
            return (f"state{jax.tree_util.keystr(path)} is {_describe(a)} after reset, "
                    f"{_describe(b)} after step")
    return ""
