"""Environments by name: `make_env(config)` builds a gymnax env, a suite's adapter
("brax:<name>", ...), a gymnasium env, an envpool task or a user's gymnax-API env
("module:Class" or an object, checked by `jaxppo.envs.check`), and returns it with its params
and spaces as an `EnvSpec`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.envs.gymnax_import import import_gymnax
from jaxppo.envs.imports import import_user_module
from jaxppo.errors import ConfigError
from jaxppo.envs.check import check_env, error_summary
from jaxppo.envs.envpool_suite import is_envpool_env, make_envpool_env, registered_envpool_envs
from jaxppo.envs.gymnasium_env import is_gymnasium_env, make_gymnasium_env
from jaxppo.envs.adapter import SUITES, is_suite_env, suite_of
from jaxppo.envs.catalog import prefixes_text
from jaxppo.envs.brax_suite import make_brax_env, registered_brax_envs
from jaxppo.envs.craftax_suite import make_craftax_env, registered_craftax_envs
from jaxppo.envs.jaxmarl_suite import make_jaxmarl_env, registered_jaxmarl_envs
from jaxppo.envs.jumanji_suite import make_jumanji_env, registered_jumanji_envs
from jaxppo.envs.xminigrid_suite import make_xminigrid_env, registered_xminigrid_envs
from jaxppo.envs.spec import EnvSpec, mask_in_info
from jaxppo.envs.transforms import box_bounds, wrap_env


def registered_env_names() -> list[str]:
    """gymnax's registered env names."""
    gymnax = import_gymnax()

    return list(gymnax.registered_envs)


def is_gymnax_name(env) -> bool:
    """True when `env` names a gymnax env: a string without a suite's or module's "prefix:"."""
    return isinstance(env, str) and ":" not in env


def check_env_name(name: str) -> None:
    """Checks that `name` is a registered gymnax env.

    Raises:
      ConfigError: it is not; the message gives the nearest names (or the suite that has
        it, as "<suite>:<name>"), every registered name and the other kinds of env.
    """
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
        f"Registered: {', '.join(names)}. Other suites by prefix: {prefixes_text()} "
        "(`jaxppo envs` lists them); or module:Class of your own env, or an env object with "
        "the gymnax API as env="
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
    "jaxmarl": (lambda n: n.startswith(("MPE_", "smax:", "overcooked:")), registered_jaxmarl_envs),
    # Atari's "Breakout-v5", ...; envpool's own names of other suites' envs come after theirs.
    "envpool": (lambda n: _looks_like_envpool(n), registered_envpool_envs),
}


def _looks_like_envpool(name: str) -> bool:
    """An id of envpool's look ("Breakout-v5") whose env gymnax does not have under another
    version: "CartPole-v0" is a typo of gymnax's "CartPole-v1", though envpool has it too."""
    if re.fullmatch(r"[A-Z][\w/-]*-v\d+", name) is None:
        return False
    unversioned = {n.rpartition("-v")[0] for n in registered_env_names()}
    return name.rpartition("-v")[0] not in unversioned


def _suite_with_name(name: str) -> str | None:
    """The suite that is installed and has an env called `name` (then it is meant as
    "<suite>:<name>"), or None. Only suites whose names look like `name` are imported."""
    import importlib.util

    for suite, (looks_like, registered) in _SUITE_NAMES.items():
        package = SUITES[suite][0] if suite in SUITES else suite  # envpool: its own name
        if not looks_like(name) or importlib.util.find_spec(package) is None:
            continue
        try:
            found = name in registered()
        except Exception:  # noqa: BLE001 - a suggestion only: a broken suite suggests nothing
            found = False
        if found:
            return suite
    return None


def check_recorded_env(config, run_dir, fix: str) -> None:
    """Checks that a run folder's config names an env that can be rebuilt.

    Raises:
      ConfigError: the env is named only by a name that is neither registered nor
        "module:Class" (a custom env the folder cannot rebuild); `fix` says what to do.
    """
    env = config.env
    if not isinstance(env, str) or ":" in env or env in registered_env_names():
        return
    raise ConfigError(
        f"{run_dir} was trained on a custom env that its config.yaml names only as {env!r} "
        "(it could not be recorded as 'module:Class': its class was defined in __main__ or "
        f"inside a function, or was built with constructor arguments). {fix}. To make run "
        "folders self-contained, define the env in an importable module and train with "
        "env='module:Class'")


def imported_module(env) -> str | None:
    """The module of the user's that building `env` imports: "module" of "module:Class" or
    of "gymnasium:module:Id"; None for a registered gymnax name, a suite's env (envpool's
    included) or an object."""
    if not isinstance(env, str) or is_envpool_env(env):
        return None
    if is_gymnasium_env(env):
        module = env.partition(":")[2].rpartition(":")[0]
        return module or None
    if is_suite_env(env) or ":" not in env:
        return None
    return env.partition(":")[0] or None


def imported_network_module(network) -> str | None:
    """The module of the user's that building `network` (a NetworkConfig, or a config file's
    `network` mapping) imports: "module" of its `module: "module:Class"`; None otherwise."""
    path = network.get("module") if isinstance(network, dict) else getattr(network, "module", None)
    if isinstance(path, str) and ":" in path:
        return path.partition(":")[0] or None
    return None


def refuse_imports(env, source: str, fix: str, network=None) -> None:
    """Checks that building `env` and `network` (its NetworkConfig or mapping), as `source`
    (a run folder's config.yaml, a config file) names them, imports no module
    (trust_config=False, --no-imports: a folder or file of someone else's).

    Raises:
      ConfigError: it would; names the module, and `fix` says how to go on.
    """
    for key, value, module in (("env", env, imported_module(env)),
                               ("network.module", getattr(network, "module", None)
                                if not isinstance(network, dict) else network.get("module"),
                                imported_network_module(network))):
        if module is None:
            continue
        raise ConfigError(
            f"{source} names {key}={value!r}, which would import the module {module!r} "
            "(importing a module runs its code), and imports named by a config are refused "
            f"here (--no-imports / trust_config=False). {fix}")


def make_env(config) -> EnvSpec:
    """Builds the config's env with its params.

    `config.env` is a registered gymnax name, "<suite>:<name>", "gymnasium:<id>",
    "envpool:<task>", "module:Class" or an env object; a user's env is checked first
    (`check_env`). The `env_kwargs` keys that are fields of the env's params (e.g.
    `max_steps_in_episode`) set those params; the rest go to the env's constructor (for
    "module:Class", the constructor's arguments go to it and the rest set params).
    `config.transforms` wrap the env last.

    Args:
      config: a validated PPOConfig.

    Returns:
      The EnvSpec of the built env.

    Raises:
      ConfigError: an unknown env, env_kwargs it does not take, params of another type, or
        a user's env that breaks the contract the rollout relies on.
    """
    env_kwargs = dict(config.env_kwargs or {})
    if is_gymnasium_env(config.env) or is_envpool_env(config.env):  # steps in Python
        make = make_gymnasium_env if is_gymnasium_env(config.env) else make_envpool_env
        env, env_params = make(config)
        if config.transforms:
            env = wrap_env(env, config)  # their numpy forms (jaxppo.envs.host_transforms)
        return _env_spec(config, env, env_params)
    if is_gymnax_name(config.env):
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
        if is_suite_env(config.env):  # "<suite>:<name>": a suite adapter, gymnax API
            env, env_kwargs = make_suite_env(config.env, env_kwargs)
        elif isinstance(config.env, str):  # "module:Class" or "module:NAME"
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
        # gymnax's own envs and the suite adapters are trusted: their tests check them, and
        # the check's compiling would slow every run (docs/design.md, Env adapters).
        if not type(env).__module__.startswith("gymnax.environments."):
            check_env(env, env_params, config.env_name)
    if config.transforms:
        env = wrap_env(env, config)  # observation transforms (frame stacking, ...)
    return _env_spec(config, env, env_params)


_SUITE_MAKERS = {"brax": make_brax_env, "jumanji": make_jumanji_env,
                 "craftax": make_craftax_env, "xminigrid": make_xminigrid_env,
                 "jaxmarl": make_jaxmarl_env}


def make_suite_env(path: str, env_kwargs: dict) -> tuple[Any, dict]:
    """The adapter env "<suite>:<name>" names: (env, the env_kwargs that are its params)."""
    return _SUITE_MAKERS[suite_of(path)](path, env_kwargs)


def _env_spec(config, env, env_params) -> EnvSpec:
    """The EnvSpec of a built env: its observation shape and action space."""
    obs_space = env.observation_space(env_params)
    act_space = env.action_space(env_params)
    obs_shape = tuple(int(s) for s in obs_space.shape)
    if hasattr(act_space, "n"):
        n = int(act_space.n)
        agents = tuple(getattr(env, "agents", ()))
        mask = env_action_mask(config, env, env_params, n, len(agents))
        world_state = getattr(env, "world_state", None) if agents else None
        return EnvSpec(env, env_params, obs_shape, True, n, None, None, mask, agents,
                       world_state if callable(world_state) else None)
    if config.mask_actions:
        raise ConfigError(
            f"mask_actions=true, but {config.env_name} has continuous actions "
            f"({act_space!r}); action masks apply to discrete actions only: leave mask_actions "
            "unset")
    if not hasattr(act_space, "low"):
        raise ConfigError(
            f"{config.env_name} has action space {act_space!r}; jaxppo supports Discrete and Box"
        )
    shape = tuple(act_space.shape) or (1,)
    if len(shape) != 1:
        raise ConfigError(f"{config.env_name}: Box actions must be a vector, got shape {shape}")
    dim = int(shape[0])
    low, high = box_bounds(act_space, dim)
    agents = tuple(getattr(env, "agents", ()))
    world_state = getattr(env, "world_state", None) if agents else None
    return EnvSpec(env, env_params, obs_shape, False, dim, low, high, None, agents,
                   world_state if callable(world_state) else None)


def env_action_mask(config, env, env_params, num_actions: int, num_agents: int = 0):
    """The env's `action_mask(state, params)` when the policy masks with it, else None.

    `config.mask_actions`: None uses the env's mask when it defines one, False never, True
    requires one. The mask is checked on a reset state's shape (bool or 0/1 [num_actions],
    [num_agents, num_actions] for a multi-agent env) without running the env.

    Raises:
      ConfigError: mask_actions=true for an env without a mask, or a mask of another shape
        or type.
    """
    fn = getattr(env, "action_mask", None)
    if config.mask_actions is False:
        return None
    host = getattr(env, "host_loop", False)
    if host and getattr(env, "gives_action_mask", False):
        return mask_in_info
    if not callable(fn) or host:
        if config.mask_actions:
            raise ConfigError(
                f"mask_actions=true, but {config.env_name} gives no action mask: an env masks "
                "its illegal actions by defining `action_mask(state, params) -> bool "
                "[num_actions]` (true = legal) for the state whose observation the policy "
                "sees (docs/environments.md, \"Action masks\"); Jumanji envs whose "
                "observation has an action_mask give it; a gymnasium env gives it as "
                "info['action_mask'] of its reset and step, by an action_masks() method, or "
                "as the 'action_mask' entry of a Dict observation, [num_actions] of a "
                "Discrete action space. Leave mask_actions unset to train "
                "without one")
        return None
    try:
        out = jax.eval_shape(lambda k: fn(env.reset(k, env_params)[1], env_params),
                             jax.random.PRNGKey(0))
    except Exception as e:  # noqa: BLE001 - the env's code: any failure is named
        raise ConfigError(
            f"{config.env_name}.action_mask(state, params) failed on a reset state: "
            f"{type(e).__name__}: {str(e)[:300]}; it must return bool [{num_actions}] "
            "(true = legal) for one env's state, or set mask_actions=false to ignore it"
        ) from None
    shape = (num_agents, num_actions) if num_agents else (num_actions,)
    if (not isinstance(out, jax.ShapeDtypeStruct) or tuple(out.shape) != shape
            or not (out.dtype == jnp.bool_ or jnp.issubdtype(out.dtype, jnp.integer))):
        got = (f"{out.dtype}{list(out.shape)}" if isinstance(out, jax.ShapeDtypeStruct)
               else type(out).__name__)
        raise ConfigError(
            f"{config.env_name}.action_mask(state, params) returned {got}; it must be bool "
            f"{list(shape)} (one entry per action of its Discrete({num_actions}) space, true "
            "= legal; an integer mask counts nonzero as legal) for one env's state, or set "
            "mask_actions=false to ignore it")
    return lambda state, params: jnp.asarray(fn(state, params)).astype(bool)


# ---------------------------------------------------------------------- a user's own env
_API = ("reset", "step", "action_space", "observation_space", "default_params")


def import_env(path: str, env_kwargs: dict) -> tuple[Any, dict, list[str]]:
    """Imports and builds a user's env.

    Args:
      path: "module:Class" (a class with the gymnax API) or "module:NAME" (an env object).
      env_kwargs: the config's; those the constructor takes by name go to it.

    Returns:
      (env, the other env_kwargs, the constructor's argument names).

    Raises:
      ConfigError: the module, the attribute or the constructor fails, naming which, or the
        attribute is neither an env class nor an env object (checked before anything is
        called).
    """
    import inspect

    if not path.partition(":")[0] or not path.partition(":")[2]:
        raise ConfigError(f"env={path!r} must have the form 'module:Class' (e.g. "
                          "'my_envs:Corridor') or be a registered gymnax name")
    obj = import_attribute(path, "env")
    if not isinstance(obj, type) and all(hasattr(obj, a) for a in ("reset", "step")):
        # An env object the module holds: nothing is called with the config's arguments
        # (make_env checks it has the whole API before use).
        return obj, env_kwargs, []
    _check_env_class(obj, path)
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


def import_attribute(path: str, key: str):
    """The object "module:attr.sub" names, imported (the caller checks its kind before calling
    it). `key` names the config key in the messages ("env", "network.module").

    Raises:
      ConfigError: no such module (with the fix), importing it failed, or no such attribute
        (with the nearest names).
    """
    module_name, _, attr = path.partition(":")
    import_gymnax()  # the installed one, before the user's module (looked up in the cwd) imports it
    try:
        module = import_user_module(module_name)
    except Exception as e:
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(
                f"{key}={path!r}: there is no module {module_name!r} to import. Run from the "
                "folder that holds it or add that folder to PYTHONPATH") from None
        raise ConfigError(f"{key}={path!r}: importing module {module_name!r} failed with "
                          f"{error_summary(e)}") from e
    obj = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            owner = ".".join([module_name, *parts[:i]])
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"{key}={path!r}: {owner!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _check_env_class(obj, path: str) -> None:
    """ConfigError unless `obj` is a class with the gymnax env API: a config (a shared run
    folder's, say) then cannot call any other function with its env_kwargs (`os:system`)."""
    if isinstance(obj, type):
        missing = [a for a in _API if not hasattr(obj, a)]
        if not missing:
            return
        raise ConfigError(
            f"env={path!r} is a class without the gymnax env API (no {', '.join(missing)}); "
            f"'module:Class' must name an env class with {', '.join(_API)} (a subclass of "
            "gymnax's Environment has them), and jaxppo calls nothing else a config names")
    fix = (f". To build the env with {path.rpartition(':')[2]}, wrap it in a class, or pass "
           f"the env object from Python: PPOConfig(env={path.rpartition(':')[2]}())"
           if callable(obj) else "")
    raise ConfigError(
        f"env={path!r} is a {'function' if callable(obj) else type(obj).__name__}, not an env "
        f"class: 'module:Class' must name a class with the gymnax env API ({', '.join(_API)}) "
        f"or an env object of that module, and jaxppo calls nothing else a config names{fix}")


def _build_env(cls, kwargs: dict, path: str):
    try:
        return cls(**kwargs)
    except Exception as e:
        call = f"{path.partition(':')[2]}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        raise ConfigError(
            f"env={path!r}: {call} raised {error_summary(e)}. env_kwargs keys that are "
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
        raise ConfigError(f"{name}: env.default_params raised {error_summary(e)}; it "
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
