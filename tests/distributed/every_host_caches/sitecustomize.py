"""Every process of a multi-process JAX program writes its persistent compilation cache entries
(the Ray tests' learners, through PYTHONPATH; see the `cluster` fixture of test_ray.py).

JAX writes entries only from process 0, so that processes do not contend for one entry on a
shared file system. On CPU the processes' entries never coincide: each key holds the process's
own CPU topology, so host 1's learner of a 2-host group never found a program in the cache and
compiled it at every group start (about 6 of the 13-17 CPU seconds a start costs), though the
tests start the same programs again and again (restarts after a lost host, resumed runs). Here
a process other than 0 writes its own entries too; what it loads from them is what process 0
already loads from its own. Nothing is imported until JAX itself imports its compiler.
"""

import importlib.abc
import importlib.util
import sys

_MODULE = "jax._src.compiler"


def _write_from_every_process(compiler) -> None:
    write = getattr(compiler, "_cache_write", None)
    if write is None:  # another JAX: left as it is
        return

    def _cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                     host_callbacks):
        if (compiler.distributed.global_state.process_id == 0 or host_callbacks
                or compile_time_secs < compiler.config.persistent_cache_min_compile_time_secs.value):
            return write(cache_key, compile_time_secs, module_name, backend, executable,
                         host_callbacks)
        compiler.compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs))

    compiler._cache_write = _cache_write


class _OnCompilerImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _write_from_every_process(module)

        spec.loader.exec_module = exec_module
        return spec


if _MODULE not in sys.modules:
    sys.meta_path.insert(0, _OnCompilerImport())
