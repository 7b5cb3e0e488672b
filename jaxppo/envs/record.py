"""How a run's config.yaml names an env object or a network module so that a new process can
rebuild it."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import weakref
from collections.abc import Mapping

_ENV_RECORDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def env_record(env, env_kwargs: dict | None = None) -> str | None:
    """How config.yaml can name `env` so that a new process rebuilds it: a string as given;
    for an env object, "module:Class" when Class is importable at that path (not __main__,
    not a local class) and `Class()` builds an object with the same attributes (so no
    constructor argument is lost) taking none of env_kwargs; None otherwise (then only the
    env's name can be recorded and loading the run needs env=)."""
    if isinstance(env, str):
        return env
    try:
        return _ENV_RECORDS[env]
    except (KeyError, TypeError):  # not seen yet, or not weak-referenceable
        pass
    path = _importable_path(env, env_kwargs or {})
    try:
        _ENV_RECORDS[env] = path
    except TypeError:
        pass
    return path


def _importable_path(env, env_kwargs: dict) -> str | None:
    cls = type(env)
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", "")
    if not module or module in ("__main__", "builtins") or "<locals>" in qualname:
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if obj is not cls:
            return None
        takes = inspect.signature(cls).parameters
        if any(k in takes for k in env_kwargs):  # rebuilding would pass them to Class()
            return None
        fresh = cls()
    except Exception:  # not importable there, or Class() needs arguments: record the name
        return None
    if not _same_attrs(getattr(env, "__dict__", {}), getattr(fresh, "__dict__", {})):
        return None
    return f"{module}:{qualname}"


def _same_attrs(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        try:
            eq = a[k] == b[k]
            if not (eq if isinstance(eq, bool) else bool(eq.all())):
                return False
        except Exception:
            return False
    return True


# ---------------------------------------------------------------------- a user's network
_MODULE_ONLY = ("parent", "name")  # flax's own constructor fields, not the network's


def network_record(module) -> tuple[str, dict]:
    """How config.yaml names a user's flax module object so that a new process rebuilds it:
    ("module:Class", kwargs) when Class is importable at that path and each of its
    constructor fields holds its default (left out, as a config file leaves it out) or a plain
    value (numbers, strings, lists, mappings of them); else (a description without ':', {}), which names the class but
    cannot be built (loading the run then says why)."""
    cls = type(module)
    name, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", "")
    if not name or name in ("__main__", "builtins") or "<locals>" in qualname:
        return f"{qualname} (defined in {name}, not importable)", {}
    try:
        obj = importlib.import_module(name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - not importable where its class says
        obj = None
    if obj is not cls:
        return f"{qualname} (not importable as {name}:{qualname})", {}
    kwargs = {}
    for f in dataclasses.fields(module):
        if not f.init or f.name in _MODULE_ONLY:
            continue
        value = getattr(module, f.name)
        if _is_default(f, value):
            continue
        if _is_plain(value):
            kwargs[f.name] = listed(value)
        else:
            return f"{qualname} ({f.name}={value!r:.40} cannot be written in a config)", {}
    return f"{name}:{qualname}", kwargs


def _is_plain(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_is_plain(x) for x in v)
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _is_plain(x) for k, x in v.items())
    return False


def listed(v):
    """A plain value as YAML writes it: tuples as lists, frozen mappings as dicts."""
    if isinstance(v, (list, tuple)):
        return [listed(x) for x in v]
    if isinstance(v, Mapping):
        return {k: listed(x) for k, x in v.items()}
    return v


def _is_default(f: dataclasses.Field, value) -> bool:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False
    try:
        return bool(value is default or value == default)
    except Exception:  # noqa: BLE001 - an uncomparable value is not known to be the default
        return False
