"""What a config's `search` and `pbt` mean, checked, and the population's first
hyperparameters drawn from them.

A search is a vmapped sweep whose settings are drawn, not listed, e.g. `search: {population:
8, lr: {loguniform: [1.0e-4, 1.0e-2]}, gamma: {choice: [0.99, 0.995]}}`: P settings of
num_seeds / P seeds each, drawn with numpy from the config's seed. Nothing here imports JAX
or the config (config validation passes the tunable fields and their checks in).
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from jaxppo.errors import ConfigError

DISTRIBUTIONS = ("uniform", "loguniform", "choice")
SEARCH_EXAMPLE = ("e.g. search: {population: 8, lr: {loguniform: [1.0e-4, 1.0e-2]}, "
                  "clip_param: {uniform: [0.1, 0.3]}, gamma: {choice: [0.99, 0.995]}}")

PBT_KEYS = {
    "interval": None,  # iterations between exploit/explore steps (required, >= 1)
    "fraction": 0.25,  # the worst fraction copy one of the best fraction, in (0, 0.5]
    "perturb": [0.8, 1.2],  # factors a copied member's continuous values are multiplied by
    "resample_probability": 0.25,  # chance a value is redrawn from its distribution instead
    "fitness": "return",  # "return": mean episode return since the last step; "eval": last evaluation
}
FITNESS_KINDS = ("return", "eval")
PBT_EXAMPLE = "e.g. pbt: {interval: 10, fraction: 0.25}"

_SEARCH_TAG = 0x5EA4C4  # separates the search's draws from every other use of the seed


class Dist:
    """One searched field: `kind` in DISTRIBUTIONS, `args` its two bounds or its choices."""

    def __init__(self, field: str, kind: str, args: tuple[float, ...]):
        self.field, self.kind, self.args = field, kind, args

    @property
    def low(self) -> float:
        return min(self.args)

    @property
    def high(self) -> float:
        return max(self.args)

    def sample(self, rng: np.random.Generator) -> float:
        if self.kind == "uniform":
            return float(rng.uniform(self.args[0], self.args[1]))
        if self.kind == "loguniform":
            return float(math.exp(rng.uniform(math.log(self.args[0]), math.log(self.args[1]))))
        return float(self.args[rng.integers(len(self.args))])

    def to_config(self) -> dict:
        return {self.kind: list(self.args)}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_search(search: Any, tunable: Iterable[str] | None = None
                 ) -> tuple[int | None, dict[str, Dist]]:
    """(population or None, {field: Dist}) of a config's `search`; ConfigError naming the fix.

    tunable: the fields a search may vary (the config's tunable fields: everything else shapes
    the program, so members cannot differ in it inside one vmapped program); None for a
    search already checked.
    """
    if not isinstance(search, dict) or not search:
        raise ConfigError(f"search={search!r} must be a mapping of tunable fields to "
                          f"distributions, {SEARCH_EXAMPLE}")
    population = search.get("population")
    if population is not None and (not isinstance(population, int) or isinstance(population, bool)
                                   or population < 2):
        raise ConfigError(f"search.population={population!r} must be an integer >= 2 (the "
                          "number of settings drawn), or left out for one setting per seed")
    dists: dict[str, Dist] = {}
    for name, spec in search.items():
        if name == "population":
            continue
        if tunable is not None and name not in tunable:
            _not_tunable(name, tuple(tunable))
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
            raise ConfigError(
                f"search.{name}={spec!r} must be one distribution: {{uniform: [low, high]}}, "
                f"{{loguniform: [low, high]}} or {{choice: [v1, v2, ...]}}")
        kind, args = next(iter(spec.items()))
        if not isinstance(args, (list, tuple)) or not all(_number(a) for a in args):
            raise ConfigError(f"search.{name}.{kind}={args!r} must be a list of numbers")
        if kind == "choice":
            if not args:
                raise ConfigError(f"search.{name}.choice is empty: list at least one value")
        else:
            if len(args) != 2 or not args[0] < args[1]:
                raise ConfigError(f"search.{name}.{kind}={list(args)} must be [low, high] "
                                  "with low < high")
            if kind == "loguniform" and args[0] <= 0:
                raise ConfigError(f"search.{name}.loguniform={list(args)} needs low > 0 (a "
                                  "log scale); use uniform for a range that includes 0")
        dists[name] = Dist(name, kind, tuple(float(a) for a in args))
    if not dists:
        raise ConfigError(f"search names no field to search over, {SEARCH_EXAMPLE}")
    return population, dists


def _not_tunable(name, tunable: tuple[str, ...]) -> None:
    close = difflib.get_close_matches(str(name), tunable + ("population",), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    shaped = (" it shapes the compiled program (every member of a search runs in one "
              "vmapped program), so search over it with separate runs;"
              if not close and isinstance(name, str) else "")
    raise ConfigError(f"search.{name} is not a tunable field{hint};{shaped} tunable "
                      f"fields: {', '.join(tunable)} (and search.population)")


def check_search(config, tunable: Mapping[str, Callable[[str, Any], None]]) -> None:
    """A config's `search` against the rest of it: known fields, sensible distributions, a
    population that divides num_seeds, and every bound a valid value of its field.

    tunable: each tunable field's check (name, value) -> None, from its declaration.
    """
    if config.search is None:
        return
    population, dists = parse_search(config.search, tunable)
    for name in dists:
        value = getattr(config, name)
        if isinstance(value, list):  # a schedule's points
            raise ConfigError(
                f"search.{name} needs {name} to be a number (a constant or linear schedule "
                f"from it), not the points {value}: a searched value replaces that number")
    for name, d in dists.items():
        for v in (d.args if d.kind == "choice" else (d.low, d.high)):
            try:
                tunable[name](name, v)
            except ConfigError as e:
                raise ConfigError(f"search.{name}: {v:g} is not a valid {name}: {e}") from None
    members = config.num_seeds
    if members < 2:
        raise ConfigError(
            f"search needs a population of at least 2 members, but num_seeds={members}; set "
            f"num_seeds (e.g. --seeds 8) or search.population (num_seeds follows it)")
    if population is not None and members % population:
        raise ConfigError(
            f"search.population={population} does not divide num_seeds={members}: each "
            f"setting trains num_seeds / population seeds; set num_seeds to a multiple of "
            f"{population} (e.g. {population * max(1, members // population)})")


def check_pbt(config) -> None:
    """A config's `pbt`: known keys with sensible values, and what PBT needs around it."""
    pbt = config.pbt
    if pbt is None:
        return
    if not isinstance(pbt, dict):
        raise ConfigError(f"pbt={pbt!r} must be a mapping, {PBT_EXAMPLE}, or null")
    unknown = [k for k in pbt if k not in PBT_KEYS]
    if unknown:
        raise ConfigError(f"unknown config key 'pbt.{unknown[0]}'; valid keys: "
                          + ", ".join("pbt." + k for k in PBT_KEYS))
    s = pbt_settings(pbt)
    interval = s["interval"]
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(f"pbt.interval={interval!r} must be an integer >= 1 (iterations "
                          f"between exploit/explore steps), {PBT_EXAMPLE}")
    fraction = s["fraction"]
    if not _number(fraction) or not 0 < fraction <= 0.5:
        raise ConfigError(f"pbt.fraction={fraction!r} must be in (0, 0.5]: the worst fraction "
                          "of members copy the best fraction, e.g. 0.25")
    perturb = s["perturb"]
    if (not isinstance(perturb, (list, tuple)) or not perturb
            or not all(_number(f) and f > 0 for f in perturb)):
        raise ConfigError(f"pbt.perturb={perturb!r} must be a list of positive factors, "
                          "e.g. [0.8, 1.2]")
    p = s["resample_probability"]
    if not _number(p) or not 0 <= p <= 1:
        raise ConfigError(f"pbt.resample_probability={p!r} must be in [0, 1]")
    if s["fitness"] not in FITNESS_KINDS:
        raise ConfigError(f"pbt.fitness={s['fitness']!r} is not one of {FITNESS_KINDS}")
    if config.search is None:
        raise ConfigError(
            "pbt explores the fields of `search` (their distributions bound and redraw them); "
            f"add one, {SEARCH_EXAMPLE}")
    population, _ = parse_search(config.search)
    if population is not None and population != config.num_seeds:
        raise ConfigError(
            f"with pbt every member is its own lineage, so search.population={population} must "
            f"equal num_seeds={config.num_seeds} (or be left out)")
    if s["fitness"] == "eval" and (not config.eval_every or interval % config.eval_every):
        raise ConfigError(
            f"pbt.fitness='eval' ranks members by the in-loop evaluation, so eval_every "
            f"(={config.eval_every}) must be > 0 and divide pbt.interval={interval}")
    if interval >= config.num_iterations:
        raise ConfigError(
            f"pbt.interval={interval} is not below the run's {config.num_iterations} "
            "iterations, so no exploit/explore step would happen; lower it")


def pbt_settings(pbt: dict) -> dict:
    """pbt's keys with their defaults filled in."""
    return {k: pbt.get(k, default) for k, default in PBT_KEYS.items()}


def search_space(config) -> dict[str, Dist]:
    return parse_search(config.search)[1]


def settings_per_member(config) -> int:
    """Members sharing one drawn setting (seeds of it)."""
    population, _ = parse_search(config.search)
    return 1 if population is None else config.num_seeds // population


def draw_settings(config) -> list[dict[str, float]]:
    """Each member's values of the searched fields (num_seeds entries; members that are seeds
    of one setting get the same values), drawn from the config's seed."""
    dists = search_space(config)
    per = settings_per_member(config)
    rng = np.random.default_rng([_SEARCH_TAG, config.seed])
    settings = []
    for _ in range(config.num_seeds // per):
        values = {name: d.sample(rng) for name, d in dists.items()}
        settings += [values] * per
    return settings
