"""Shared test setup.

JAX's persistent compilation cache goes to a folder under pytest's cache (`.pytest_cache/d/`),
shared by both workers and every process the suite starts (CLI runs, forced-device workers,
Ray's learners: through JAX's own JAX_COMPILATION_CACHE_DIR, which jaxppo's default cache
folder gives way to), so a program compiled once is loaded by the others, and a rerun of the
suite skips most XLA compiling. Nothing depends on it: with an empty cache (or `pytest -p
no:cacheprovider`, which disables it) every test compiles from scratch and passes. Nothing
writes to the user's home cache: test configs set `compilation_cache_dir=None` (jaxppo.train
leaves the setting alone) or this folder, and a run folder resumed has the default back.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jaxlib
import pytest

# The suite runs on one CPU device, JAX's default, whatever the machine's cores: its compile
# costs and numbers do not change with them. `import jaxppo` would otherwise give JAX one CPU
# device per core (jaxppo.cpu_devices); the tests of that start processes of their own
# (tests/core/test_layout.py), and subprocesses that force a device count through XLA_FLAGS
# keep it.
os.environ["JAXPPO_CPU_DEVICES"] = "1"

# XLA's CPU collectives abort the process when one device's thread reaches an all-reduce more
# than 40 s after the others (xla_cpu_collective_call_terminate_timeout_seconds). A subprocess
# with forced host devices beside the other worker on 2 cores can fall that far behind (seen
# once in a cold `make test`), so every process the suite starts waits up to 10 minutes, the
# subprocesses' own limit: the verdict never depends on the machine's speed. Subprocesses that
# force a device count add it to these XLA_FLAGS.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()


# Most tests train tiny programs for a few iterations: XLA's compile was ~70% of the test
# workers' own CPU time (a cold run), the programs' run time little. Those tests compile with
# XLA's backend optimisation off (JAX's `jax_disable_most_optimizations`: LLVM at -O0, no
# expensive passes), which halves their compile; what they check (numbers against references
# within tolerances, equality of two runs of one program, errors) does not depend on it. A
# file carries `pytestmark = pytest.mark.full_optimization` and compiles as users' runs do
# when its programs run long enough for their speed to matter (the learning tests) or when it
# compares two different programs to the last bit (the suites' adapters against the suites'
# own steps: -O0 code can differ between them by one ulp); a test that trains that long or
# compares two programs so, in a file that is not marked, carries the mark itself (a page's
# snippets that train longest, a test parameter's marks). Measured on 2 cores, a whole cold
# suite took 3,250 CPU seconds with full optimisation everywhere and 1,758 with it off
# everywhere (five tests that compare two programs to the last bit then fail); the learning
# tests alone took 65 CPU seconds with it and 162 without.
# Set JAXPPO_TEST_FULL_OPTIMIZATION=1 to compile every test as users' runs do. Processes a
# test starts (CLI runs, forced-device workers, the Ray cluster's nodes) take the setting of
# the file they start in through JAX_DISABLE_MOST_OPTIMIZATIONS (and XLA_FLAGS, below).
FULL_OPTIMIZATION_EVERYWHERE = os.environ.get("JAXPPO_TEST_FULL_OPTIMIZATION", "") not in ("", "0")

# With optimisation off, half of what is left of a tiny program's compile is XLA's CPU fusion
# emitters (MLIR, the default); XLA's older emitters compile the same programs in about half
# the time (measured: 9.1 s against 4.6 s of XLA compile, 20 against 12 CPU seconds, for
# three small training programs), and run them slower, which the long programs of the
# full-optimisation files would feel. So the files that compile with optimisation off use
# the older emitters too: in the worker, an override added to each compile's options while
# jax_disable_most_optimizations is on; in the processes they start, the same XLA flag.
# Known in jaxlib 0.10 (constraints.txt); another jaxlib compiles with its defaults (XLA
# aborts a process whose XLA_FLAGS name a flag it does not know).
OLDER_EMITTERS = jaxlib.__version__.startswith("0.10.")
_EMITTERS_OPTION = "xla_cpu_use_fusion_emitters"
_EMITTERS_FLAG = f"--{_EMITTERS_OPTION}=false"


def _with_older_emitters_when_unoptimised(get_compile_options):
    @functools.wraps(get_compile_options)
    def wrapper(*args, **kwargs):
        options = get_compile_options(*args, **kwargs)
        if jax.config.read("jax_disable_most_optimizations"):
            options.env_option_overrides = [*options.env_option_overrides,
                                            (_EMITTERS_OPTION, False)]
        return options
    return wrapper


if OLDER_EMITTERS:
    from jax._src import compiler as _compiler

    _compiler.get_compile_options = _with_older_emitters_when_unoptimised(
        _compiler.get_compile_options)


@contextlib.contextmanager
def _optimisation(full: bool):
    """Programs compiled meanwhile, here and in the processes started meanwhile, with XLA's
    full optimisation or with it off (and XLA's older fusion emitters)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0" if full else "1")
        if OLDER_EMITTERS:
            jax.devices()  # this process's backend reads XLA_FLAGS once: before any change
            flags = os.environ.get("XLA_FLAGS", "").replace(_EMITTERS_FLAG, "").split()
            mp.setenv("XLA_FLAGS", " ".join(flags if full else [*flags, _EMITTERS_FLAG]))
        before = jax.config.read("jax_disable_most_optimizations")
        _set_unoptimised(not full)
        try:
            yield full
        finally:
            _set_unoptimised(before)


@pytest.fixture(scope="session")
def fully_optimised():
    """`with fully_optimised():` programs compiled within, in a fixture of a file that is not
    marked `full_optimization`, compile as users' runs do: for the one fixture of a file
    whose runs are compared to the last bit with another program's."""
    return lambda: _optimisation(True)


def _set_unoptimised(off: bool) -> None:
    """JAX's setting, and none of the programs this process compiled under the other one:
    JAX keeps compiled programs in memory by function and arguments, not by this setting, so
    a test would otherwise run some programs compiled the other way (which can differ in the
    last bit). Compiled again, they come from the persistent cache."""
    if jax.config.read("jax_disable_most_optimizations") != off:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", off)


@pytest.fixture(scope="module", autouse=True)
def programs_of_this_file_only():
    """jaxppo.train reuses the program of an earlier run of the same config in the process
    (jaxppo.program.recent): within a file, not from files that ran before it on the same
    worker, so a file's tests see the same programs whatever ran before them."""
    from jaxppo.program import recent

    recent.forget()
    yield
    recent.forget()


@pytest.fixture(scope="module", autouse=True)
def xla_optimization(request):
    """XLA's backend optimisation for this file's programs (see FULL_OPTIMIZATION_EVERYWHERE)."""
    with _optimisation(FULL_OPTIMIZATION_EVERYWHERE
                       or request.node.get_closest_marker("full_optimization") is not None) as full:
        yield full


@pytest.fixture(autouse=True)
def xla_optimization_of_the_test(request, xla_optimization):
    """A test marked `full_optimization` itself, in a file that is not, compiles as users'
    runs do (its file's module-scoped fixtures keep the file's setting)."""
    if xla_optimization or not any(m.name == "full_optimization" for m in request.node.own_markers):
        yield xla_optimization
        return
    with _optimisation(True):
        yield True


def pytest_configure(config):
    cache = getattr(config, "cache", None)
    if cache is None or os.environ.get("JAXPPO_TEST_NO_COMPILE_CACHE"):
        return
    path = cache.mkdir("jax-xla")
    settings = {"jax_compilation_cache_dir": str(path),
                "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": -1}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # for the processes the tests start


# The files that take longest on 2 cores (a cold `make test --durations=0`), longest first.
LONGEST_FILES = ("test_ray.py", "test_custom_network.py", "test_pbt.py", "test_readme.py",
                 "test_checkpoint.py", "test_masking.py", "test_learning.py", "test_suites.py",
                 "test_pmap.py", "test_layout.py", "test_train.py", "test_recurrent.py")


def pytest_collection_modifyitems(config, items):
    """The longest files go first, the Ray tests before all: with `pytest -n N --dist loadfile
    --no-loadscope-reorder` (what `make test` runs) the other workers share out the remaining
    files meanwhile, and the suite does not end waiting on one long file started last. Stable
    sort: every other order is unchanged."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def compile_cache_dir(pytestconfig):
    """The folder the persistent compilation cache uses (None when disabled)."""
    if getattr(pytestconfig, "cache", None) is None or os.environ.get("JAXPPO_TEST_NO_COMPILE_CACHE"):
        return None
    return str(pytestconfig.cache.mkdir("jax-xla"))
