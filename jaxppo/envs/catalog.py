"""Every kind of env a config can name, for `jaxppo envs` and for the errors that list them:
the suites by prefix, how each trains, whether its package is installed (without importing
it), the pip line that installs it, and its env names (importing it).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import textwrap
from pathlib import Path
from typing import NamedTuple

from jaxppo.envs.adapter import SUITES
from jaxppo.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Suite:
    prefix: str  # env: "<prefix>:<name>"
    name_form: str  # how its names look in the prefix's place holder: "<name>", "<Id>", ...
    package: str  # the package whose presence makes it usable
    extra: str  # jaxppo's pip extra that installs it
    how: str  # how a run trains on it, in a few words
    lister: str  # "module:function" that returns its env names (importing the package)

    @property
    def install(self) -> str:
        return f"pip install 'jaxppo[{self.extra}]'"

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def names(self) -> list[str]:
        """Its env names (the <name> of "<prefix>:<name>"); ConfigError with the install line
        when its package is missing."""
        module, _, function = self.lister.partition(":")
        return list(getattr(importlib.import_module(module), function)())


COMPILED = "JAX: compiled into the training program"
HOST = "steps on the host: synchronous loop, or actor-learner (max_policy_lag)"

# Every suite but gymnax's own names (which take no prefix), in the order errors list them.
SUITE_CATALOG = (
    Suite("brax", "<name>", *SUITES["brax"], COMPILED,
          "jaxppo.envs.brax_suite:registered_brax_envs"),
    Suite("jumanji", "<Id>", *SUITES["jumanji"], COMPILED,
          "jaxppo.envs.jumanji_suite:registered_jumanji_envs"),
    Suite("craftax", "<name>", *SUITES["craftax"], COMPILED,
          "jaxppo.envs.craftax_suite:registered_craftax_envs"),
    Suite("xminigrid", "<name>", *SUITES["xminigrid"], COMPILED,
          "jaxppo.envs.xminigrid_suite:registered_xminigrid_envs"),
    Suite("jaxmarl", "<name>", *SUITES["jaxmarl"], COMPILED + ", multi-agent",
          "jaxppo.envs.jaxmarl_suite:registered_jaxmarl_envs"),
    Suite("gymnasium", "<id>", "gymnasium", "gymnasium", HOST,
          "jaxppo.envs.gymnasium_env:registered_gymnasium_envs"),
    Suite("envpool", "<task>", "envpool", "envpool", HOST,
          "jaxppo.envs.envpool_suite:registered_envpool_envs"),
)
SUITES_BY_PREFIX = {s.prefix: s for s in SUITE_CATALOG}


def lacks_env(env) -> bool:
    """True when `env` is "<suite>:<name>" and the suite is not installed or does not list
    the name: building it would fail (a typo), and the CLI builds it before naming a run
    folder, to tell the suite's own error first. False for names a suite lists, gymnax names,
    a user's "module:Class" and a gymnasium env of a user's module (only building it tells)."""
    prefix, sep, name = env.partition(":") if isinstance(env, str) else ("", "", "")
    suite = SUITES_BY_PREFIX.get(prefix) if sep else None
    if suite is None or (prefix == "gymnasium" and ":" in name):
        return False
    if not suite.installed():
        return True
    try:
        return name not in suite.names()
    except Exception:  # noqa: BLE001 - a broken listing: building the env says what fails
        return True


class TunedStart(NamedTuple):
    path: Path  # the tuned config file
    env: str  # the env it was tuned on
    why: str  # "" when it is env's own, else why another env's config fits


def tuned_start(env: str) -> TunedStart | None:
    """The tuned config a new run of `env` starts from, or None: its own or gymnax's of the
    same env (`jaxppo.config.tuned_config_for`); else its family's (`TUNED_FAMILIES`: an
    envpool Atari game, Breakout-v5's; a SMAX map, 3m's)."""
    from jaxppo.config import TUNED_FAMILIES, tuned_config_for, tuned_config_path

    found = tuned_config_for(env)
    if found is not None:
        return TunedStart(*found, "" if found[1] == env else "gymnax's, the same env")
    family = next((f for f in TUNED_FAMILIES if env.startswith(f.prefix)), None)
    if family is None or not _in_family(family.prefix, env):
        return None
    return TunedStart(tuned_config_path(family.env), family.env, family.why)


def _in_family(prefix: str, env: str) -> bool:
    """Whether `env` (named with a family's prefix) belongs to it: an Atari game of envpool's,
    a SMAX map of JaxMARL's (each suite installed)."""
    suite, _, name = env.partition(":")
    if not SUITES_BY_PREFIX[suite].installed():
        return False
    if suite == "envpool":
        from jaxppo.envs.envpool_suite import is_atari_task
        return is_atari_task(name)
    return name in SUITES_BY_PREFIX[suite].names()


def prefixes_text() -> str:
    """"brax:<name>, jumanji:<Id>, ...": every suite as an env names it."""
    return ", ".join(f"{s.prefix}:{s.name_form}" for s in SUITE_CATALOG)


# ---------------------------------------------------------------------- `jaxppo envs`
# gymnax envs that are listed but not built for the table (building them downloads data).
_DOWNLOADS = {"MNISTBandit-bsuite": "downloads MNIST when first built"}


def gymnax_table() -> str:
    """Every registered gymnax env: observation and action space, and whether jaxppo ships a
    tuned config for it (`train --env NAME` then starts from that config)."""
    from jaxppo.config import tuned_env_names
    from jaxppo.envs.gymnax_import import import_gymnax

    gymnax = import_gymnax()
    tuned = set(tuned_env_names())
    rows = [("env", "observation", "action", "tuned config")]
    for name in gymnax.registered_envs:
        if name in _DOWNLOADS:
            rows.append((name, "-", "-", _DOWNLOADS[name]))
            continue
        try:
            env, params = gymnax.make(name)
            obs, act = env.observation_space(params), env.action_space(params)
        except Exception as e:  # noqa: BLE001 - an env gymnax cannot build here: say so
            rows.append((name, "-", "-", f"cannot be built: {str(e)[:60]}"))
            continue
        rows.append((name, _space(obs), _space(act), "yes" if name in tuned else ""))
    return _columns(rows)


def _space(space) -> str:
    kind = type(space).__name__
    if kind == "Discrete":
        return f"Discrete({space.n})"
    shape = "x".join(str(d) for d in getattr(space, "shape", ())) or "scalar"
    return f"{kind}({shape})"


def suites_table() -> str:
    """The other suites: how each is named and trains, whether it is installed (else the
    install line), and the tuned configs that ship for them."""
    from jaxppo.config import TUNED_FAMILIES, tuned_envs

    rows = [("suite", "env", "trains as", "installed")]
    for s in SUITE_CATALOG:
        rows.append((s.prefix, f"{s.prefix}:{s.name_form}", s.how,
                     "yes" if s.installed() else f"no: {s.install}"))
    rows.append(("your own", "module:Class", "an env with the gymnax API (compiled), or an "
                 "env object as env=", ""))
    first, *rest = TUNED_FAMILIES
    families = ", ".join([f"every other {first.noun} starts from {_short(first.env)}'s",
                          *(f"every other {f.noun} from {_short(f.env)}'s" for f in rest)])
    others = textwrap.fill("Tuned configs of other suites: " + ", ".join(
        sorted(env for env in tuned_envs() if ":" in env)) + f" ({families})",
        width=100, break_on_hyphens=False)
    return (f"Other suites, named <suite>:<name> (`jaxppo envs --suite SUITE` lists one's "
            f"names):\n{_columns(rows)}\n\n{others}")


def suite_table(prefix: str, names_only: bool = False) -> str:
    """Every env name of one suite, with its prefix, and which tuned config a new run of it
    starts from (its own; gymnax's of the same env for gymnasium's and envpool's; 3m's for a
    SMAX map), and for envpool and JaxMARL a last line on the Atari and SMAX families.

    Raises:
      ConfigError: the suite's package is not installed; the message names the install.
    """
    from jaxppo.config import TUNED_FAMILIES, tuned_config_for

    suite = SUITES_BY_PREFIX[prefix]
    if not suite.installed():
        raise ConfigError(f"the {prefix} suite needs the {suite.package} package: "
                          f"{suite.install}")
    envs = [f"{prefix}:{name}" for name in suite.names()]
    if names_only:
        return "\n".join(envs)
    family = next((f for f in TUNED_FAMILIES if f.prefix.startswith(f"{prefix}:")), None)
    rows = [("env", "tuned config")]
    for env in envs:
        tuned = tuned_config_for(env)  # (not tuned_start: envpool describes an Atari game slowly)
        # every SMAX name is a member; envpool's names are not all Atari, and envpool tells
        # which are slowly: its family is the note below the table
        if tuned is None and family is not None and prefix != "envpool" \
                and env.startswith(family.prefix):
            rows.append((env, f"{family.env}'s"))
            continue
        rows.append((env, "" if tuned is None else "yes" if tuned[1] == env
                     else f"gymnax's {tuned[1]}"))
    if family is None:
        return _columns(rows)
    return (f"{_columns(rows)}\n\nEvery other {family.noun} starts from {family.env}'s tuned "
            f"config ({family.why}).")


def _short(env: str) -> str:
    """An env's name without its suite's prefix ("envpool:Breakout-v5" -> "Breakout-v5")."""
    return env.rpartition(":")[2]


def _columns(rows: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns two spaces apart (the last column unpadded)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(f"{c:<{w}}" for c, w in zip(r, widths)), r[-1]]).rstrip()
                     for r in rows)
