"""How a run's config.yaml names an env object so that a new process can rebuild it."""

from __future__ import annotations

import importlib
import inspect
import weakref

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
