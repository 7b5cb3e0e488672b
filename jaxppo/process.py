"""Process-level facts and settings: the package version, process uptime, the persistent
compilation cache, handing freed memory back to the OS. A leaf module (imports only
jaxppo.errors)."""

from __future__ import annotations

import ctypes
import functools
import os
import time

import jax

from jaxppo.errors import warn

__version__ = "0.1.0"

_IMPORT_TIME = time.perf_counter()


def process_uptime() -> float:
    """Seconds since this process started (from /proc where available)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORT_TIME


# compilation_cache_dir's default; JAX's own setting from the environment takes its place.
DEFAULT_CACHE_DIR = "~/.cache/jaxppo/xla"
JAX_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def enable_compilation_cache(path: str | None) -> None:
    """Turns on JAX's persistent compilation cache, so a repeated run skips most compiling.

    Args:
      path: the cache folder (~ expanded); None or "" leaves the cache as it is. The default
        folder (DEFAULT_CACHE_DIR) gives way to JAX's own environment variable: with
        JAX_COMPILATION_CACHE_DIR set, that folder is used (a cluster's shared cache, a
        test suite's). A folder that cannot be created or written (a read-only HOME) leaves
        the cache off, with a warning: training does not need it.
    """
    if not path:
        return
    if path == DEFAULT_CACHE_DIR and os.environ.get(JAX_CACHE_ENV):
        path = os.environ[JAX_CACHE_ENV]
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
        reason = "not writable"
    except OSError as e:
        writable, reason = False, e.strerror or str(e)
    if not writable:
        warn(f"the compilation cache is off for this run: {path} cannot be used ({reason}); "
             "set compilation_cache_dir to a writable folder, or null to silence this")
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


# A trim walks every arena (about 5 ms in a process with JAX loaded, nothing to give back):
# after work of at least this long it costs under 1% of it.
TRIM_AFTER_SECONDS = 0.5


def release_free_memory(after_seconds: float | None = None) -> bool:
    """Hands the memory the C allocator holds free back to the OS (glibc's `malloc_trim(0)`);
    False where there is no such call, or when `after_seconds` (how long the work that freed
    the memory took, e.g. an update) is under TRIM_AFTER_SECONDS: a host-loop CartPole
    update of ~10 ms would otherwise be slowed by half.

    XLA frees what a compile or a program's run allocated, but glibc keeps those pages
    resident in the arena of each thread that touched them, for that thread to reuse: after
    compiling an Atari actor-learner's programs that was about 250-450 MB, counted in the
    process's memory until it exits (docs/design.md). Releasing it changes no number.
    """
    trim = _malloc_trim()
    if trim is None or (after_seconds is not None and after_seconds < TRIM_AFTER_SECONDS):
        return False
    trim(0)
    return True
