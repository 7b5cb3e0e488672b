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


class TunedStart(NamedTuple):
    path: Path  # the tuned config file
    env: str  # the env it was tuned on
    why: str  # "" when it is env's own, else why another env's config fits


ATARI_WHY = "CleanRL's Atari settings, the same for every game"
SMAX_WHY = "JaxMARL's IPPO settings for SMAX, the same for every map"


def tuned_start(env: str) -> TunedStart | None:
    """The tuned config a new run of `env` starts from, or None: its own or gymnax's of the
    same env (`jaxppo.config.tuned_config_for`); else, for an envpool Atari game, the Atari
    config (`ATARI_TUNED_ENV`), and for a SMAX map, 3m's (`SMAX_TUNED_ENV`)."""
    from jaxppo.config import tuned_config_for, tuned_config_path
    from jaxppo.envs import envpool_suite, jaxmarl_suite

    found = tuned_config_for(env)
    if found is not None:
        return TunedStart(*found, "" if found[1] == env else "gymnax's, the same env")
    family = None
    if env.startswith(envpool_suite.PREFIX) and SUITES_BY_PREFIX["envpool"].installed():
        if envpool_suite.is_atari_task(env[len(envpool_suite.PREFIX):]):
            family = envpool_suite.ATARI_TUNED_ENV, ATARI_WHY
    elif (env.startswith(jaxmarl_suite.PREFIX + jaxmarl_suite.SMAX_PREFIX)
          and SUITES_BY_PREFIX["jaxmarl"].installed()
          and env[len(jaxmarl_suite.PREFIX):] in SUITES_BY_PREFIX["jaxmarl"].names()):
        family = jaxmarl_suite.SMAX_TUNED_ENV, SMAX_WHY
    return None if family is None else TunedStart(tuned_config_path(family[0]), *family)


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
    from jaxppo.config import tuned_envs

    rows = [("suite", "env", "trains as", "installed")]
    for s in SUITE_CATALOG:
        rows.append((s.prefix, f"{s.prefix}:{s.name_form}", s.how,
                     "yes" if s.installed() else f"no: {s.install}"))
    rows.append(("your own", "module:Class", "an env with the gymnax API (compiled), or an "
                 "env object as env=", ""))
    others = textwrap.fill("Tuned configs of other suites: " + ", ".join(
        sorted(env for env in tuned_envs() if ":" in env)) + " (every other Atari game starts "
        "from Breakout-v5's, every other SMAX map from 3m's)", width=100, break_on_hyphens=False)
    return (f"Other suites, named <suite>:<name> (`jaxppo envs --suite SUITE` lists one's "
            f"names):\n{_columns(rows)}\n\n{others}")


def suite_table(prefix: str, names_only: bool = False) -> str:
    """Every env name of one suite, with its prefix, and which tuned config a new run of it
    starts from (its own; gymnax's of the same env for gymnasium's and envpool's; 3m's for a
    SMAX map), and for envpool and JaxMARL a last line on the Atari and SMAX families.

    Raises:
      ConfigError: the suite's package is not installed; the message names the install.
    """
    from jaxppo.config import tuned_config_for

    suite = SUITES_BY_PREFIX[prefix]
    if not suite.installed():
        raise ConfigError(f"the {prefix} suite needs the {suite.package} package: "
                          f"{suite.install}")
    envs = [f"{prefix}:{name}" for name in suite.names()]
    if names_only:
        return "\n".join(envs)
    from jaxppo.envs.envpool_suite import ATARI_TUNED_ENV
    from jaxppo.envs.jaxmarl_suite import SMAX_PREFIX, SMAX_TUNED_ENV

    rows = [("env", "tuned config")]
    for env in envs:
        tuned = tuned_config_for(env)  # (not tuned_start: envpool describes an Atari game slowly)
        if tuned is None and prefix == "jaxmarl" and env.startswith(f"jaxmarl:{SMAX_PREFIX}"):
            rows.append((env, f"{SMAX_TUNED_ENV}'s"))
            continue
        rows.append((env, "" if tuned is None else "yes" if tuned[1] == env
                     else f"gymnax's {tuned[1]}"))
    notes = {"envpool": f"Every other Atari game starts from {ATARI_TUNED_ENV}'s tuned config "
                        f"({ATARI_WHY}).",
             "jaxmarl": f"Every other SMAX map starts from {SMAX_TUNED_ENV}'s tuned config "
                        f"({SMAX_WHY})."}
    return _columns(rows) + (f"\n\n{notes[prefix]}" if prefix in notes else "")


def _columns(rows: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns two spaces apart (the last column unpadded)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(f"{c:<{w}}" for c, w in zip(r, widths)), r[-1]]).rstrip()
                     for r in rows)
