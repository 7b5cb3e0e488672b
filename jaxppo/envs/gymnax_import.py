"""Import gymnax without paying for its rendering dependencies.

gymnax imports matplotlib.pyplot, matplotlib.colors and seaborn (and with it scipy) at module
level, only for `render`; that is about a second of every run's start. We register a
stand-in for each that imports the real module on first attribute access, so rendering
still works and nothing is loaded unless it is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from jaxppo.envs.imports import import_package

_RENDER_ONLY = ("matplotlib.pyplot", "matplotlib.colors", "seaborn")


class _Deferred(types.ModuleType):
    """A module whose real import happens when one of its attributes is first read."""

    def __getattr__(self, attr):
        real = sys.modules.get(self.__name__)
        if real is None or real is self:
            sys.modules.pop(self.__name__, None)
            real = importlib.import_module(self.__name__)
        return getattr(real, attr)


def import_gymnax():
    """gymnax, with its render-only imports deferred until first used."""
    if "gymnax" not in sys.modules:
        for name in _RENDER_ONLY:
            if name not in sys.modules and importlib.util.find_spec(name.split(".")[0]) is not None:
                stub = _Deferred(name)
                stub.__spec__ = None
                sys.modules[name] = stub
    return import_package("gymnax")
