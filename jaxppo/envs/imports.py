"""Where imports look, the same for `jaxppo ...` (the console script) and `python -m jaxppo ...`.

Python puts the current folder first on `sys.path` for `python -m` and not for a console
script, so the same command used to import different code. jaxppo now decides itself:

- `python -m jaxppo` takes the current folder off `sys.path` as it starts (`leave_out_cwd`),
  so nothing jaxppo imports later resolves to a file there by accident.
- An installed package jaxppo builds envs from (gymnax, gymnasium, Jumanji, Brax, Craftax,
  XLand-MiniGrid, envpool) is imported with the current folder left out of `sys.path`: a
  `jumanji.py` lying in the folder a command runs from (or shipped beside a run folder)
  cannot stand in for the real package.
- A module of the user's, named by the user (`env: my_envs:Corridor`, `network.module:
  my_nets:Net`), is looked up in the current folder first, as `python -m` and `python
  script.py` do; `--no-imports` / `trust_config=False` refuse such names before any import.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from types import ModuleType


def _is_cwd(entry: str, cwd: str) -> bool:
    if entry in ("", "."):
        return True
    try:
        return os.path.realpath(entry) == cwd
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _path_without_cwd():
    cwd = os.path.realpath(os.getcwd())
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if not _is_cwd(p, cwd)]
    try:
        yield
    finally:
        # What the import added to sys.path (.pth-style packages) stays; the folder comes back.
        added = [p for p in sys.path if p not in saved]
        sys.path[:] = saved + added


def import_package(name: str) -> ModuleType:
    """The installed package (or submodule) `name`, never a file of that name in the current
    folder. ImportError as importlib raises it."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    with _path_without_cwd():
        return importlib.import_module(name)


def import_user_module(name: str) -> ModuleType:
    """The user's module `name`, looked up in the current folder first (as `python -m`
    does), whichever way jaxppo was started. Exceptions as importlib raises them."""
    cwd = os.path.realpath(os.getcwd())
    if any(_is_cwd(p, cwd) for p in sys.path):
        return importlib.import_module(name)
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    finally:
        # Kept, last: the module's own later imports of its neighbours still work, and no
        # installed package is shadowed by the folder.
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)
        sys.path.append(cwd)


def leave_out_cwd() -> None:
    """Take the current folder off `sys.path` (`python -m jaxppo` put it first), so that the
    command imports what the console script `jaxppo` imports."""
    cwd = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if not _is_cwd(p, cwd)]
