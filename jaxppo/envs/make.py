"""Environments: gymnax envs by name, a user's gymnax-API env (an object or "module:Class"),
and their spaces.

gymnax 1.x `step` returns `obs, state, reward, terminated, truncated, info`, auto-resets,
and puts the pre-reset observation in `info["final_observation"]`; the rollout relies on it,
so a user's env is checked for exactly that before anything is compiled (`check_env`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.envs.gymnax_import import import_gymnax
from jaxppo.errors import ConfigError
from jaxppo.envs.gymnasium_env import is_gymnasium_env, make_gymnasium_env
from jaxppo.envs.brax_suite import SUITES, is_suite_env, make_brax_env, registered_brax_envs, suite_of
from jaxppo.envs.craftax_suite import make_craftax_env, registered_craftax_envs
from jaxppo.envs.jumanji_suite import make_jumanji_env, registered_jumanji_envs
from jaxppo.envs.xminigrid_suite import make_xminigrid_env, registered_xminigrid_envs
from jaxppo.envs.transforms import box_bounds, wrap_env


class EnvSpec(NamedTuple):
    """An environment and what the networks need to know about it."""

    env: Any
    env_params: Any
    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int  # number of actions (discrete) or action vector size (continuous)
    action_low: np.ndarray | None  # continuous bounds, broadcast to [action_dim]
    action_high: np.ndarray | None

    @property
    def obs_dim(self) -> int:
        return int(np.prod(self.obs_shape))

    @property
    def host_loop(self) -> bool:
        """True when the env steps in Python (a gymnasium env: jaxppo.run.hostloop runs it)."""
        return bool(getattr(self.env, "host_loop", False))


def registered_env_names() -> list[str]:
    gymnax = import_gymnax()

    return list(gymnax.registered_envs)


def check_env_name(name: str) -> None:
    names = registered_env_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    lowered = {n.lower(): n for n in names}
    if name.lower() in lowered:
        close = [lowered[name.lower()]]
    suite = _suite_with_name(name)
    if suite:
        close = [f"{suite}:{name}"]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(
        f"env={name!r} is not a registered gymnax environment{hint or '.'} "
        f"Registered: {', '.join(names)}. Other suites by prefix: brax:<name>, jumanji:<Id>, "
        "craftax:<name>, xminigrid:<name>, gymnasium:<id>; or module:Class of your own env, "
        "or an env object with the gymnax API as env="
    )


# suite -> (its names' look: a gymnax typo loads no suite package, its registered names)
_SUITE_NAMES = {
    # Brax's names are lower case ("halfcheetah"), gymnax's not.
    "brax": (lambda n: n == n.lower() and "-" not in n, registered_brax_envs),
    "jumanji": (lambda n: re.fullmatch(r"[A-Z][\w-]*-v\d+", n) is not None,
                registered_jumanji_envs),
    "craftax": (lambda n: n.startswith("Craftax-"), registered_craftax_envs),
    "xminigrid": (lambda n: n.startswith(("MiniGrid-", "XLand-MiniGrid-")),
                  registered_xminigrid_envs),
}


def _suite_with_name(name: str) -> str | None:
    """The suite that is installed and has an env called `name` (then it is meant as
    "<suite>:<name>"), or None. Only suites whose names look like `name` are imported."""
    import importlib.util

    for suite, (looks_like, registered) in _SUITE_NAMES.items():
        if not looks_like(name) or importlib.util.find_spec(SUITES[suite][0]) is None:
            continue
        try:
            found = name in registered()
        except Exception:  # noqa: BLE001 - a suggestion only: a broken suite suggests nothing
            found = False
        if found:
            return suite
    return None


def check_recorded_env(config, run_dir, fix: str) -> None:
    """ConfigError when a run folder's config names its env only by a name that is neither
    registered nor "module:Class": a custom env that cannot be rebuilt from the folder."""
    env = config.env
    if not isinstance(env, str) or ":" in env or env in registered_env_names():
        return
    raise ConfigError(
        f"{run_dir} was trained on a custom env that its config.yaml names only as {env!r} "
        "(it could not be recorded as 'module:Class': its class was defined in __main__ or "
        f"inside a function, or was built with constructor arguments). {fix}. To make run "
        "folders self-contained, define the env in an importable module and train with "
        "env='module:Class'")


def make_env(config) -> EnvSpec:
    """Build the env named in `config.env` (a registered gymnax name or "module:Class"), or
    take the object given, with its params; a user's env is checked first (`check_env`).

    `env_kwargs` keys that are fields of the env's params (e.g. `max_steps_in_episode`)
    set those params; the rest go to the env's constructor (for "module:Class", the
    constructor's arguments go to it and the rest set params).
    """
    env_kwargs = dict(config.env_kwargs or {})
    if is_gymnasium_env(config.env):  # steps in Python, outside the compiled program
        env, env_params = make_gymnasium_env(config)
        return _env_spec(config, env, env_params)
    if isinstance(config.env, str) and ":" not in config.env:
        gymnax = import_gymnax()

        check_env_name(config.env)
        factory = gymnax.registration._registry[config.env]
        # Build once with no kwargs to learn which keys are params, not constructor args.
        default_params = factory().default_params
        param_fields = _param_fields(default_params)
        param_kwargs = {k: env_kwargs.pop(k) for k in list(env_kwargs) if k in param_fields}
        try:
            env, env_params = gymnax.make(config.env, **env_kwargs)
        except TypeError as e:
            raise ConfigError(
                f"env_kwargs={config.env_kwargs!r} not accepted by {config.env}: {e}. "
                f"Params you can set through env_kwargs: {sorted(param_fields)}"
            ) from None
        _check_params_type(config.env_params, default_params, config.env_name)
    else:
        ctor_args: list[str] | None = None
        if is_suite_env(config.env):  # "<suite>:<name>": jaxppo.envs.brax_suite*' adapters, gymnax API
            env, env_kwargs = make_suite_env(config.env, env_kwargs)
        elif isinstance(config.env, str):  # "module:Class" or "module:function"
            env, env_kwargs, ctor_args = import_env(config.env, env_kwargs)
        else:
            env = config.env
        env_params = _default_params(env, config.env_name,
                                     config.env if isinstance(config.env, str) else None)
        param_fields = _param_fields(env_params)
        param_kwargs = {k: env_kwargs.pop(k) for k in list(env_kwargs) if k in param_fields}
        if env_kwargs:
            where = f"params of {config.env_name}"
            if ctor_args is not None:
                where += f" nor arguments of {config.env} (its arguments: {ctor_args})"
            raise ConfigError(f"env_kwargs keys {sorted(env_kwargs)} are not {where}; "
                              f"settable params: {sorted(param_fields)}")
        _check_params_type(config.env_params, env_params, config.env_name)
    if config.env_params is not None:
        env_params = config.env_params
    if param_kwargs:
        _check_param_values(param_kwargs, env_params, config.env_name)
        env_params = env_params.replace(**param_kwargs)
    if (not isinstance(config.env, str) or ":" in config.env) and not is_suite_env(config.env):
        # gymnax's own envs and the suite adapters (tests/test_brax.py etc. check them; the
        # check would add ~6 s of compiling to every Brax run on a CPU) are trusted.
        if not type(env).__module__.startswith("gymnax.environments."):
            check_env(env, env_params, config.env_name)
    if config.transforms:
        env = wrap_env(env, config)  # observation transforms (frame stacking, ...)
    return _env_spec(config, env, env_params)


_SUITE_MAKERS = {"brax": make_brax_env, "jumanji": make_jumanji_env,
                 "craftax": make_craftax_env, "xminigrid": make_xminigrid_env}


def make_suite_env(path: str, env_kwargs: dict) -> tuple[Any, dict]:
    """The adapter env "<suite>:<name>" names (jaxppo.envs.brax_suite and jaxppo.suites_<suite>), built
    with the env_kwargs its suite takes. Returns (env, the other env_kwargs: params)."""
    return _SUITE_MAKERS[suite_of(path)](path, env_kwargs)


def _env_spec(config, env, env_params) -> EnvSpec:
    """The EnvSpec of a built env: its observation shape and action space."""
    obs_space = env.observation_space(env_params)
    act_space = env.action_space(env_params)
    obs_shape = tuple(int(s) for s in obs_space.shape)
    if hasattr(act_space, "n"):
        return EnvSpec(env, env_params, obs_shape, True, int(act_space.n), None, None)
    if not hasattr(act_space, "low"):
        raise ConfigError(
            f"{config.env_name} has action space {act_space!r}; jaxppo supports Discrete and Box"
        )
    shape = tuple(act_space.shape) or (1,)
    if len(shape) != 1:
        raise ConfigError(f"{config.env_name}: Box actions must be a vector, got shape {shape}")
    dim = int(shape[0])
    low, high = box_bounds(act_space, dim)
    return EnvSpec(env, env_params, obs_shape, False, dim, low, high)


# ---------------------------------------------------------------------- a user's own env
_API = ("reset", "step", "action_space", "observation_space", "default_params")
CHECK_STEPS = 512  # random steps of the auto-reset check (two envs, one jitted lax.scan)
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # env -> params that passed
_GYMNAX_HINT = ("Subclassing gymnax.environments.environment.Environment and writing "
                "step_env(key, state, action, params) -> (obs, state, reward, terminated, info) "
                "and reset_env(key, params) -> (obs, state) gives all of this (its step splits "
                "off truncation at params.max_steps_in_episode and auto-resets).")


def import_env(path: str, env_kwargs: dict) -> tuple[Any, dict, list[str]]:
    """The env "module:Class" names (or "module:function", a factory, or "module:NAME", an
    env object), built with the env_kwargs its constructor takes by name. Returns (env, the
    other env_kwargs, the constructor's argument names)."""
    import importlib
    import inspect

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"env={path!r} must have the form 'module:Class' (e.g. "
                          "'my_envs:Corridor') or be a registered gymnax name")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(
                f"env={path!r}: there is no module {module_name!r} to import. Run from the "
                "folder that holds it or add that folder to PYTHONPATH") from None
        raise ConfigError(f"env={path!r}: importing module {module_name!r} failed with "
                          f"{_last_line(e)}{_where(e)}") from e
    obj = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            owner = ".".join([module_name, *parts[:i]])
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"env={path!r}: {owner!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not isinstance(obj, type) and all(hasattr(obj, a) for a in ("reset", "step")):
        return obj, env_kwargs, []  # an env object the module holds
    if not callable(obj):
        raise ConfigError(f"env={path!r} is a {type(obj).__name__}, not an env class, a "
                          "function that returns an env, or an env object")
    try:
        ps = inspect.signature(obj).parameters.values()
        named = [p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        var_kw = any(p.kind == p.VAR_KEYWORD for p in ps)
    except (TypeError, ValueError):
        named, var_kw = [], True
    ctor = {k: v for k, v in env_kwargs.items() if k in named}
    rest = {k: v for k, v in env_kwargs.items() if k not in named}
    env = _build_env(obj, ctor, path)
    if var_kw and rest:  # **kwargs: what is not a param goes to the constructor too
        fields = _param_fields(_default_params(env, path, path))
        extra = {k: v for k, v in rest.items() if k not in fields}
        if extra:
            rest = {k: v for k, v in rest.items() if k in fields}
            env = _build_env(obj, {**ctor, **extra}, path)
    return env, rest, named


def _build_env(factory, kwargs: dict, path: str):
    try:
        return factory(**kwargs)
    except Exception as e:
        call = f"{path.partition(':')[2]}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        raise ConfigError(
            f"env={path!r}: {call} raised {_last_line(e)}{_where(e)}. env_kwargs keys that are "
            "arguments of the constructor go to it; the others set the env's params") from e


def _default_params(env, name: str, source: str | None = None):
    """The env's default_params, after checking it has the gymnax API."""
    missing = [a for a in _API[:-1] if not hasattr(env, a)]
    params = None
    try:
        params = env.default_params
    except AttributeError:
        missing.append("default_params")
    except Exception as e:
        raise ConfigError(f"{name}: env.default_params raised {_last_line(e)}{_where(e)}; it "
                          "must return the env's params (what reset and step take)") from e
    if missing:
        what = (f"env={source!r} gives {env!r}, which is not an env with the gymnax API"
                if source else f"env={env!r} is neither a registered gymnax name nor an "
                "object with the gymnax API")
        fix = (" (default_params: the env's params object, e.g. a flax.struct.dataclass "
               "with max_steps_in_episode, which jaxppo passes to reset and step)"
               if "default_params" in missing else "")
        raise ConfigError(f"{what}: it has no {', '.join(missing)}{fix}; needed: reset, "
                          "step, action_space, observation_space, default_params")
    return params


def _check_params_type(given, default, name: str) -> None:
    """ConfigError when config.env_params is not the kind of params the env takes."""
    if given is None or default is None or isinstance(given, type(default)):
        return
    field = "max_steps_in_episode" if "max_steps_in_episode" in _param_fields(default) else None
    example = f"env.default_params.replace({field}=500)" if field else "env.default_params.replace(...)"
    hint = (f"; to set params by name use env_kwargs={given!r}" if isinstance(given, dict) else "")
    raise ConfigError(
        f"env_params={_short(given)} is a {type(given).__name__}, but {name} takes "
        f"{type(default).__name__} params (its default_params: {_short(default)}); pass "
        f"params of that type, e.g. {example}, or leave env_params unset{hint}")


def check_env(env, params, name: str, steps: int = CHECK_STEPS) -> None:
    """ConfigError naming the problem and the fix when a user's env breaks the contract the
    rollout relies on: reset -> (obs, state); step -> (obs, state, reward, terminated,
    truncated, info) with info["final_observation"]; observations as observation_space says;
    and auto-reset (after a step that ends an episode, the next step starts a new one).

    Traces reset and step once (jax.eval_shape), then runs `steps` random steps of two envs
    in one jitted lax.scan (a fraction of a second for a small env); an env object that
    passed with the same params is not checked again."""
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
        raise ConfigError(f"{name}: env.{what} raised {_last_line(e)}{_where(e)}{hint}") from e


def _last_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _where(e: BaseException) -> str:
    """ ' (at file:line)' of the innermost frame outside jax, jaxppo and installed packages."""
    import os
    import traceback

    skip = (os.sep + "site-packages" + os.sep, os.sep + "jaxppo" + os.sep + "envs.py")
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


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def _check_param_values(values: dict, params, name: str) -> None:
    """ConfigError when an env_kwargs value meant for a numeric env param is not a number
    (e.g. max_steps_in_episode='abc'): it would fail deep inside the compiled program."""
    for key, value in values.items():
        default = getattr(params, key, None)
        if default is None or np.ndim(default) != 0:
            continue
        if not np.issubdtype(np.asarray(default).dtype, np.number):
            continue
        if (isinstance(value, (bool, str, bytes)) or np.ndim(value) != 0
                or not np.issubdtype(np.asarray(value).dtype, np.number)):
            plain = default.item() if hasattr(default, "item") else default
            raise ConfigError(
                f"env_kwargs {key}={value!r} must be a number: it sets {name}'s param {key} "
                f"(default {plain!r}), e.g. env_kwargs={{{key!r}: {plain!r}}}")


def _param_fields(params) -> set[str]:
    if dataclasses.is_dataclass(params):
        return {f.name for f in dataclasses.fields(params)}
    return set()


def env_action(spec: EnvSpec, action: jax.Array) -> jax.Array:
    """Map a policy action [.., action_dim] to what env.step expects (clipped to bounds)."""
    if spec.discrete:
        return action
    action = jnp.clip(action, spec.action_low, spec.action_high)
    if spec.env.action_space(spec.env_params).shape == ():
        return action[..., 0]
    return action


def flatten_obs(obs: jax.Array, obs_shape: tuple[int, ...]) -> jax.Array:
    """[..., *obs_shape] -> [..., prod(obs_shape)] float32."""
    lead = obs.shape[: obs.ndim - len(obs_shape)]
    return obs.reshape(lead + (-1,)).astype(jnp.float32)
