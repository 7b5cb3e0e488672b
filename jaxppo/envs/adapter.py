"""What the suite adapters share: the suites by prefix ("brax:", "jumanji:", "craftax:",
"xminigrid:", "jaxmarl:"), importing a suite's package, the errors for an unknown name or a failing
constructor, and gymnax's auto-reset of a stepped env.

A suite's package is imported only when one of its envs is built: `import jaxppo` loads none.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxppo.envs.gymnax_import import import_gymnax
from jaxppo.envs.imports import import_package
from jaxppo.envs.spec import reset_if_needed
from jaxppo.errors import ConfigError

# suite -> (the package it needs, the pip extra that installs it). An env named
# "<suite>:<name>" is built by that suite's adapter (jaxppo.envs.make.make_env dispatches).
SUITES = {
    "brax": ("brax", "brax"),
    "jumanji": ("jumanji", "jumanji"),
    "craftax": ("craftax", "craftax"),
    "xminigrid": ("xminigrid", "xminigrid"),
    "jaxmarl": ("jaxmarl", "jaxmarl"),
}
# The env_kwargs every adapter takes as jaxppo's params rather than the suite's.
PARAM_FIELDS = {"max_steps_in_episode"}
LAST = 2  # dm_env's StepType.LAST, which Jumanji's and xminigrid's timesteps use


def suite_of(env: Any) -> str | None:
    """The suite of an env named "<suite>:<name>" ("jumanji" for "jumanji:Snake-v1"), else None."""
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
    """A suite's package (or its submodule `module`, e.g. "brax.envs"), imported.

    Raises:
      ConfigError: the package is not installed; the message names the install.
    """
    name = module or SUITES[suite][0]
    try:
        return import_package(name)
    except ImportError as e:
        raise ConfigError(f"env='{suite}:...' needs the {SUITES[suite][0]} package "
                          f"({type(e).__name__}: {e}): {install_line(suite)}") from None


def unknown_env_error(path: str, names: list[str], what: str,
                      listing: str = "Available") -> ConfigError:
    """The ConfigError for "<suite>:<name>" whose name is not among `names` (`what` it is
    not: "a registered Jumanji environment"): the nearest names, then all of them after
    `listing`, each with the prefix to paste."""
    prefix, _, name = path.partition(":")
    prefix += ":"
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    lowered = {n.lower(): n for n in names}
    if name.lower() in lowered:
        close = [lowered[name.lower()]]
    hint = f"; did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else "."
    return ConfigError(f"env={path!r}: {name!r} is not {what}{hint} "
                       f"{listing}: {', '.join(prefix + n for n in names)}")


def split_env_kwargs(env_kwargs: dict) -> tuple[dict, dict]:
    """(the env_kwargs that are jaxppo's params (`PARAM_FIELDS`), the others)."""
    params = {k: v for k, v in env_kwargs.items() if k in PARAM_FIELDS}
    return params, {k: v for k, v in env_kwargs.items() if k not in PARAM_FIELDS}


def construct(path: str, label: str, make: Callable, name: str, kwargs: dict, rest: str,
              hint: str = ""):
    """`make(name, **kwargs)`, a suite's constructor (`label` in messages: "jumanji.make").

    Raises:
      ConfigError: `make` raised; the message shows the call, its error (then `hint`) and
        what the env_kwargs other than `PARAM_FIELDS` do (`rest`).
    """
    try:
        return make(name, **kwargs)
    except Exception as e:  # noqa: BLE001 - a bad kwarg, a file it cannot fetch: one clear error
        call = ", ".join([repr(name)] + [f"{k}={v!r}" for k, v in kwargs.items()])
        raise ConfigError(f"env={path!r}: {label}({call}) raised {type(e).__name__}: "
                          f"{first_line(e)}{hint}. env_kwargs other than {sorted(PARAM_FIELDS)} "
                          f"{rest}") from None


def auto_reset(done: jax.Array, reset: Callable[[], tuple], obs: Any, state: Any) -> tuple:
    """gymnax's auto-reset of one stepped env: (obs, state, info), the (obs, state) `reset()`
    gives where `done` (bool []), else the step's; info["final_observation"] is the step's
    obs.

    Both are selected between, as gymnax does (under vmap a per-env branch runs both sides
    anyway); stepped as a batch by a rollout (`jaxppo.envs.spec.step_batch`), the reset is
    computed only on steps where an env of the batch ended (`reset_if_needed`).
    """
    reset_obs, reset_state = reset_if_needed(done, reset)
    next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), reset_state, state)
    return jnp.where(done, reset_obs, obs), next_state, {"final_observation": obs}


def gymnax_spaces():
    """gymnax's spaces module (Box, Discrete), which every adapter's spaces are made of."""
    return import_gymnax().environments.spaces


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (at most 300 characters)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def trace_step(env: Any, path: str, suite: str, label: str, action: Any, hint: str = "") -> None:
    """Traces an adapter's reset and step with an example `action` (jax.eval_shape: a
    fraction of a second), so suite code that does not run with this jax (brax 0.14.2's
    swimmer calls jnp.clip(a_min=...), which jax 0.10 removed) is named before compiling.

    Raises:
      ConfigError: the reset or step fails; the message gives `suite`'s and jax's versions.
    """
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
