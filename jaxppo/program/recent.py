"""The programs of this process's last few runs, reused by a run of the same config.

A notebook that trains a config again, a script that resumes a run it just stopped, a loop
that trains one config in several run folders: each would trace, lower and compile (or load
from the persistent compilation cache) the program the previous run had in memory. A run on
one process whose config names only jaxppo's own code (an env by name, jaxppo's networks and
transforms) takes the program of an earlier run with the same config, layout, chunk length
and devices instead; JAX's jit cache then holds its compiled code. A config that carries
Python objects or names a user's code (an env object or "module:Class", a network module, a
reward hook, env_params, a transform registered by the user) is built afresh every time:
that code can change between runs without the config changing.
"""

from __future__ import annotations

import collections
import json

import jax

from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.adapter import is_suite_env
from jaxppo.envs.make import is_gymnax_name
from jaxppo.envs.transforms import BUILTIN_TRANSFORMS, TRANSFORMS
from jaxppo.program.build import Program, build_program, is_batched
from jaxppo.program.resolved import Resolved

KEPT = 4  # programs kept, the most recently used

_recent: collections.OrderedDict[str, Program] = collections.OrderedDict()


def program(resolved: Resolved, hp: HyperParams, chunk_len: int) -> Program:
    """`build_program(resolved, hp, chunk_len)`, or the same program an earlier run of this
    process built (module docstring)."""
    key = _key(resolved, hp, chunk_len)
    if key is None:
        return build_program(resolved, hp, chunk_len)
    built = _recent.pop(key, None) or build_program(resolved, hp, chunk_len)
    _recent[key] = built
    while len(_recent) > KEPT:
        _recent.popitem(last=False)
    return built


def forget() -> None:
    """Drop every kept program (their compiled code goes with JAX's own caches)."""
    _recent.clear()


def _key(resolved: Resolved, hp: HyperParams, chunk_len: int) -> str | None:
    """What the program is built from, as text; None when the config names a user's code."""
    config, layout = resolved.config, resolved.layout
    if not _only_own_code(config) or layout.num_processes > 1:
        return None
    try:
        return json.dumps([config.to_dict(), repr(layout), chunk_len,
                           is_batched(hp, config.num_seeds),
                           [id(d) for d in jax.local_devices()]], sort_keys=True)
    except TypeError:  # a value that is not plain data (in env_kwargs, say)
        return None


def _only_own_code(config) -> bool:
    env = config.env
    if not (is_gymnax_name(env) or is_suite_env(env)):
        return False
    if config.env_params is not None or config.network.module is not None:
        return False
    for entry in config.transforms or ():
        name = entry if isinstance(entry, str) else (
            next(iter(entry)) if isinstance(entry, dict) and len(entry) == 1 else None)
        if name is None or TRANSFORMS.get(name) is not BUILTIN_TRANSFORMS.get(name):
            return False
    return True
