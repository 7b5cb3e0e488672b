"""How a config field is declared: `field(default, doc, role=..., check=...)`.

A field's declaration carries, in its `dataclasses.field` metadata (a `Spec`), everything
said about it: the one-line meaning `train --help` shows, its role (a tunable `HyperParams`
leaf, a shape of the program that a resume keeps and a search cannot vary, or a run-time
setting), and the check of its value. Its type annotation gives the stored form of a value
(`int`: a whole float such as YAML's 5e5 becomes an int). The checks below raise a
ConfigError that names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jaxppo.errors import ConfigError

TUNABLE = "tunable"  # a HyperParams leaf: vmapped in a sweep, drawn in a search, changed on resume
SHAPE = "shape"  # shapes the compiled program or the saved state: locked on resume, never searched
RUN = "run"  # run-time only: logging, checkpoints, devices, evaluation

MAX_TIMESTEPS = 2**31 - 1  # env steps per seed: the step counter is int32
# Seeds become PRNG keys through a 64-bit integer.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1
# The largest float32: hyperparameters live in float32 inside the compiled program, where a
# larger value becomes inf (and training NaN at its first step).
FLOAT32_MAX = 3.4028234663852886e38

Check = Callable[[str, Any], None]  # check(name, value): ConfigError unless value is valid


@dataclass(frozen=True)
class Spec:
    """What a field's declaration says besides its type and default."""

    doc: str  # its meaning in one line (train --help)
    role: str = RUN  # TUNABLE, SHAPE or RUN
    check: Check | None = None  # its own bounds; rules between fields are config._rules
    section: str | None = None  # the heading of the group of keys it opens in train --help
    leaf: str | None = None  # TUNABLE: the HyperParams leaf's name when not the field's
    kind: str | None = None  # TUNABLE schedule: the field giving its form, swept along with it
    # A path of the machine that runs (True: the value; a key: that key of a mapping value):
    # never taken from a run folder or an untrusted config file (`PPOConfig.machine_paths_from`).
    machine_path: bool | str = False


def field(default: Any = dataclasses.MISSING, doc: str = "", *, role: str = RUN,
          check: Check | None = None, section: str | None = None, leaf: str | None = None,
          kind: str | None = None, factory: Callable[[], Any] | None = None,
          machine_path: bool | str = False) -> Any:
    """A config field: `default` (or `factory` for a mutable one) and its `Spec`."""
    if role not in (TUNABLE, SHAPE, RUN):
        raise ValueError(f"role={role!r} is not one of {(TUNABLE, SHAPE, RUN)}")
    meta = {"spec": Spec(doc, role, check, section, leaf, kind, machine_path)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def spec(f: dataclasses.Field) -> Spec:
    return f.metadata["spec"]


def declared(obj_or_cls) -> bool:
    """True for a config class (or instance) whose fields carry a Spec."""
    if not dataclasses.is_dataclass(obj_or_cls):
        return False
    fields = dataclasses.fields(obj_or_cls)
    return bool(fields) and all("spec" in f.metadata for f in fields)


def names_with(cls, role: str) -> tuple[str, ...]:
    """The fields of `cls` declared with `role`, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls) if spec(f).role == role)


def check_declared(obj, prefix: str = "", names=None) -> None:
    """Run each field's declared check (of `names` only, when given), in declaration order;
    a nested config (network) is checked field by field, its keys named `network.<field>`."""
    for f in dataclasses.fields(obj):
        if names is not None and f.name not in names:
            continue
        value, check = getattr(obj, f.name), spec(f).check
        if check is not None:
            check(prefix + f.name, value)
        if declared(value) and not isinstance(value, type):
            check_declared(value, f"{prefix}{f.name}.")


def normalize(obj) -> None:
    """Store each field of a frozen config in one form: numpy / jax scalars as Python
    numbers, whole floats of int fields as ints, lists of tuple fields as tuples, schedule
    points as lists (so a config read back from its own config.yaml compares equal)."""
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, _stored(str(f.type), getattr(obj, f.name)))


def _stored(annotation: str, v):
    if annotation == "Schedule" and isinstance(v, (list, tuple)):
        return [list(p) if isinstance(p, (list, tuple)) else p for p in v]
    if annotation == "tuple[int, ...]" and isinstance(v, (list, tuple)):
        return tuple(whole(plain(x)) for x in v)
    if annotation == "tuple" and isinstance(v, list):
        return tuple(v)
    v = plain(v)
    return whole(v) if annotation in ("int", "int | None") else v


def keys(cls, prefix: str = "") -> list[tuple[str | None, str, Any, str]]:
    """(section, key, default, meaning) of every field, a nested config's fields in its place
    under its own section (`network.hidden_sizes`, ...)."""
    out = []
    for f in dataclasses.fields(cls):
        s = spec(f)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if declared(default):
            nested = keys(type(default), f"{prefix}{f.name}.")
            out += [(f.name if i == 0 else section, *rest) for i, (section, *rest) in enumerate(nested)]
        else:
            out.append((s.section, prefix + f.name, default, s.doc))
    return out


# ---------------------------------------------------------------------- value helpers
def plain(v):
    """A numpy or jax scalar (or 0-d array) as the Python number it holds; anything else as is."""
    if hasattr(v, "ndim") and hasattr(v, "item") and getattr(v, "ndim", None) == 0:
        return v.item()
    return v


def whole(v):
    """A float with a whole value (YAML writes 5e5 as one) as an int; anything else as is."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def listed(v):
    """A list field's value for a message: as a list when it is one, else as given."""
    return list(v) if isinstance(v, (list, tuple)) else repr(v)


def short_repr(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def did_you_mean(word: str, candidates, prefix: str = "") -> str:
    close = difflib.get_close_matches(str(word), list(candidates), n=3, cutoff=0.5)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(prefix + c) for c in close) + "?"


def nested_fields(cls) -> dict[str, tuple[str, type]]:
    """{field name: (the field holding it, its config class)} of the fields of `cls`'s
    nested configs: hidden_sizes -> ("network", NetworkConfig)."""
    out: dict[str, tuple[str, type]] = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if declared(default) and not isinstance(default, type):
            for g in dataclasses.fields(default):
                out.setdefault(g.name, (f.name, type(default)))
    return out


def nested_hint(key: str, cls, keyword: bool = False, exact: bool = True) -> str:
    """"; did you mean 'network.hidden_sizes'? ..." for an unknown top-level key that is
    (exact=True) or nearly is (exact=False) the name of a field of one of `cls`'s nested
    configs, saying how to set it there (keyword: in Python, else in a file or --set); "" for
    any other key."""
    nested = nested_fields(cls)
    names = ([key] if key in nested else []) if exact else difflib.get_close_matches(
        str(key), list(nested), n=1, cutoff=0.75)
    if not names:
        return ""
    name = names[0]
    section, kind = nested[name]
    if keyword:
        return (f"; did you mean {section}.{name}? It is a field of {section}: "
                f"{section}={kind.__name__}({name}=...)")
    default = next(f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else f.default for f in dataclasses.fields(kind) if f.name == name)
    return (f"; did you mean '{section}.{name}'? It is a field of {section}: --set "
            f"{section}.{name}={_example(default)}, or in a file {name} under {section}:")


def _example(value) -> str:
    """A value as --set takes it without quoting: true, null, [64,64], tanh."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(map(_example, value)) + "]"
    return str(value)


# ---------------------------------------------------------------------- checks
def integer(minimum: int, hint: str | None = None, most: tuple[int, str] | None = None) -> Check:
    """An int >= minimum (and <= most[0], most[1] saying why)."""
    hint = (", e.g. 4" if minimum >= 1 else "") if hint is None else hint

    def check(name, v):
        if not is_int(v) or v < minimum:
            raise ConfigError(f"{name}={v!r} must be an integer >= {minimum}{hint}")
        if most is not None and v > most[0]:
            raise ConfigError(f"{name}={v} is more than {most[0]} (2**31 - 1), {most[1]}")
    return check


def optional(check: Check) -> Check:
    """None, or a value `check` accepts."""
    return lambda name, v: None if v is None else check(name, v)


def boolean(name, v) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{name}={v!r} must be true or false (a YAML boolean, not a string)")


def one_of(choices: tuple, hint: str = "") -> Check:
    def check(name, v):
        if not isinstance(v, str) or v not in choices:
            raise ConfigError(f"{name}={v!r} is not one of {choices}{hint}"
                              f"{did_you_mean(str(v), choices)}")
    return check


def unit_interval(name, v) -> None:
    if not is_number(v) or not 0.0 <= v <= 1.0:
        raise ConfigError(f"{name}={v!r} must be a number in [0, 1], e.g. {name}=0.99")


def _float32(name, v, example) -> None:
    if is_number(v) and abs(v) > FLOAT32_MAX:
        raise ConfigError(f"{name}={v!r} is beyond the float32 range (about ±3.4e38) the "
                          f"compiled program computes in, where it would be inf; use e.g. {example}")


def positive(fix: str = "") -> Check:
    """A finite number > 0 that float32 holds."""
    def check(name, v):
        _float32(name, v, "0.2")
        if not is_number(v) or v <= 0:
            raise ConfigError(f"{name}={v!r} must be a positive number{(' ' + fix) if fix else ''}")
    return check


def nonnegative(float32: bool = True) -> Check:
    """A finite number >= 0 (that float32 holds, unless float32=False)."""
    def check(name, v):
        if float32:
            _float32(name, v, "0.5")
        if not is_number(v) or v < 0:
            raise ConfigError(f"{name}={v!r} must be a number >= 0")
    return check


def finite(example: str) -> Check:
    def check(name, v):
        if not is_number(v):
            raise ConfigError(f"{name}={v!r} must be a finite number, {example}")
    return check


def schedule(positive: bool) -> Check:
    """A number, or piecewise-linear [[env_step, value], ...] points; values > 0 (positive)
    or >= 0."""
    bound = "> 0" if positive else ">= 0"
    ok = (lambda x: x > 0) if positive else (lambda x: x >= 0)

    def check(name, v):
        _float32(name, v, f"{name}=2.5e-4")
        if is_number(v):
            if not ok(v):
                raise ConfigError(f"{name}={v!r} must be {bound}, e.g. {name}=2.5e-4")
            return
        if not (isinstance(v, (list, tuple)) and v and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(is_number(x) for x in p)
                for p in v)):
            raise ConfigError(
                f"{name}={v!r} must be a number or a piecewise schedule [[env_step, value], ...], "
                f"e.g. {name}=[[0, 3e-4], [1e6, 1e-5]]")
        for p in v:
            _float32(name, p[1], f"{name}=[[0, 3e-4], [1e6, 1e-5]]")
        steps = [p[0] for p in v]
        if steps != sorted(steps) or steps[0] < 0:
            raise ConfigError(f"{name}={v!r}: the env_step of each [env_step, value] point must "
                              "be >= 0 and increasing")
        if not all(ok(p[1]) for p in v):
            raise ConfigError(f"{name}={v!r}: every value must be {bound}")
    return check


def positive_ints(example: str, empty: bool = False) -> Check:
    """A tuple of ints >= 1 (layer widths), non-empty unless `empty`."""
    def check(name, v):
        if (not isinstance(v, tuple) or not (v or empty)
                or any(not is_int(h) or h < 1 for h in v)):
            raise ConfigError(f"{name}={listed(v)} must be a {'' if empty else 'non-empty '}"
                              f"list of positive layer widths, {example}")
    return check


def of_type(kind: type | tuple[type, ...], fix: str) -> Check:
    def check(name, v):
        if not isinstance(v, kind):
            raise ConfigError(f"{name}={short_repr(v)} must be {fix}")
    return check


def is_flax_module(v) -> bool:
    """True for a flax.linen.Module object (flax is not imported to ask: none exists unless
    it was)."""
    import sys

    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(v, linen.Module)


def network_module(name, v) -> None:
    """None, "module:Class" or a flax.linen.Module object (what it names is checked where it
    is built: jaxppo.program.user_network.user_module)."""
    if v is None or is_flax_module(v):
        return
    if isinstance(v, str) and v.partition(":")[0] and v.partition(":")[2]:
        return
    why = ""
    if isinstance(v, str):
        why = (" (a config records a network object it cannot name importably by a description:"
               " its class was defined in __main__ or inside a function, or it was built with "
               "arguments a config file cannot hold; load such a run's policy with "
               "jaxppo.load_policy(run_dir, network=YourNetwork(...)))")
    raise ConfigError(
        f"{name}={short_repr(v)} must be the import path \"module:Class\" of a flax.linen.Module "
        f"subclass (e.g. \"jaxppo.examples.networks:LayerNormActorCritic\"), a module object in "
        f"Python, or null for the built-in network{why}")


def check_seed(v, name: str) -> None:
    """ConfigError unless `v` is an integer a PRNG key can be made of (64-bit)."""
    if not is_int(v) or not SEED_MIN <= v <= SEED_MAX:
        raise ConfigError(f"{name}={v!r} must be an integer from -2**63 to 2**63 - 1 (it seeds "
                          "a 64-bit PRNG key), e.g. 0")


def seed(name, v) -> None:
    check_seed(v, name)


def folder_or_null(name, v) -> None:
    if v is not None and not isinstance(v, (str, Path)):
        raise ConfigError(f"{name}={v!r} must be a folder path (e.g. ~/.cache/jaxppo/xla) or "
                          "null to turn the compilation cache off")


WANDB_KEYS = ("project", "mode", "entity", "name", "dir", "group", "tags", "notes")
WANDB_MODES = ("online", "offline", "disabled")


def wandb_settings(name, value) -> None:
    """None, or a mapping of WANDB_KEYS with a project."""
    if value is None:
        return
    example = "e.g. wandb={'project': 'jaxppo', 'mode': 'offline'} (--set wandb.project=jaxppo)"
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r} must be a mapping of W&B settings or null, {example}")
    for key in value:
        if key not in WANDB_KEYS:
            raise ConfigError(
                f"unknown config key 'wandb.{key}'{did_you_mean(str(key), WANDB_KEYS, 'wandb.')}; "
                f"valid keys: {', '.join('wandb.' + k for k in WANDB_KEYS)}")
    project = value.get("project")
    if not isinstance(project, str) or not project.strip():
        raise ConfigError(f"wandb.project={project!r} must be the name of a W&B project, {example}")
    mode = value.get("mode")
    if mode is not None and mode not in WANDB_MODES:
        raise ConfigError(
            f"wandb.mode={mode!r} is not one of {WANDB_MODES}{did_you_mean(str(mode), WANDB_MODES)}"
            " (or leave it out: WANDB_MODE, else online); offline writes the run under "
            "wandb.dir for `wandb sync` later")
    for key in ("entity", "name", "dir", "group", "notes"):
        v = value.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ConfigError(f"wandb.{key}={v!r} must be a non-empty string (or left out)")
    tags = value.get("tags")
    if tags is not None and (not isinstance(tags, (list, tuple))
                             or not all(isinstance(t, str) and t for t in tags)):
        raise ConfigError(f"wandb.tags={tags!r} must be a list of strings, e.g. [baseline, cpu]")
