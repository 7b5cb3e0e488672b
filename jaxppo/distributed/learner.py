"""One host's learner: a process in a `jax.distributed` group that runs the run's program.

Every host runs the same compiled chunk (jaxppo.program) over an axis that spans all hosts'
devices; gradients and statistics are all-reduced inside it by XLA (gloo on CPU, NCCL on GPU).
The learner is a Ray actor started by jaxppo.distributed.group, but nothing here needs Ray
except `info` and `coordinator_address`, which ask Ray for the node's address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import ray
from jax.experimental import multihost_utils

from jaxppo.distributed.cluster import quiet_library_logs
from jaxppo.program import ChunkRunner, build_program
from jaxppo.resolve import resolve
from jaxppo.process import __version__, enable_compilation_cache

logger = logging.getLogger("jaxppo.distributed")

# Set JAXPPO_GLOO_POLLER_IDLE=0 to leave gloo's network thread at normal priority.
POLLER_ENV = "JAXPPO_GLOO_POLLER_IDLE"


def versions() -> dict:
    return {"python": sys.version.split()[0], "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "jaxppo": __version__}


def _thread_ticks() -> dict[int, int]:
    """CPU ticks (user + system) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return out


def collective_burst(size: int = 16, reps: int = 100):
    """A compiled function that runs `reps` all-reduces (pmean) of `size` floats over every
    device of the group, one after the other, and returns its wall time in seconds per
    all-reduce. A collective: every host must call it at the same time."""
    n = jax.local_device_count()

    def body(x):
        return jax.lax.scan(lambda c, _: (jax.lax.pmean(c, "all") + 1.0, None), x, None,
                            length=reps)[0]

    fn = jax.pmap(body, axis_name="all")
    x = jnp.zeros((n, size), jnp.float32)
    jax.block_until_ready(fn(x))  # compile

    def run() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        return (time.perf_counter() - t0) / reps

    return run


def quiet_gloo_poller() -> dict:
    """Give gloo's network thread SCHED_IDLE priority; returns what was measured and done.

    gloo's network thread busy-polls its sockets while a collective is in flight. When it
    shares a core with the thread that must post the next receive, it takes the core from
    it, and each all-reduce costs ~2-4 ms instead of ~0.15 ms (measured on loopback; see
    README, "Multi-host"). At SCHED_IDLE it runs only when the core is otherwise idle, i.e.
    exactly while the compute thread waits for the network. No JAX or gloo option controls
    the polling, so the thread is found by what it does: the thread other than this one that
    uses the most CPU during a burst of all-reduces. The change is kept only if the next
    burst is faster; otherwise it is undone. A collective (every host calls it together);
    Linux only; JAXPPO_GLOO_POLLER_IDLE=0 turns it off.
    """
    import threading

    burst = collective_burst()
    before_s = burst()
    out = {"all_reduce_ms_before": before_s * 1e3, "all_reduce_ms": before_s * 1e3, "thread": None}
    off = os.environ.get(POLLER_ENV, "1") == "0" or not hasattr(os, "sched_setscheduler")
    t0, ticks0 = time.perf_counter(), _thread_ticks()
    burst()
    seconds, ticks1 = time.perf_counter() - t0, _thread_ticks()
    me = {os.getpid(), threading.get_native_id()}
    used = sorted(((ticks1[t] - ticks0.get(t, ticks1[t]), t) for t in ticks1 if t not in me),
                  reverse=True)
    hz = os.sysconf("SC_CLK_TCK")
    tid = used[0][1] if used and used[0][0] / hz >= 0.25 * seconds else None
    if off or tid is None:
        burst()  # every host runs the same number of bursts
        return out
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        burst()
        return out
    after_s = burst()
    if after_s < before_s:
        out.update(all_reduce_ms=after_s * 1e3, thread=tid)
    else:  # not the poller after all: put it back
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass
    out["all_reduce_ms_after"] = after_s * 1e3
    return out


def undo_worker_niceness() -> bool:
    """Ray starts worker processes at nice 15 (raylet's worker_niceness), which hands the
    learner's core to any other process, Ray's own agents included. Put this process's
    threads back to 0 where allowed (root, CAP_SYS_NICE); else `RAY_worker_niceness=0` in
    the environment of `ray start` does it. Returns True when the learner runs at 0."""
    ok = True
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > 0:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except (OSError, PermissionError):
            ok = False
    return ok


@contextlib.contextmanager
def _checked_by_driver():
    """The config's warnings (e.g. total_timesteps not a multiple of the batch): the driver
    resolved the same config and has shown them once; every learner would repeat them in the
    job's log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def pin_to_cpus(cpus: list[int]) -> None:
    """Pin the calling thread, and so the threads it starts later (JAX's and XLA's: the
    backend starts after this), to `cpus`. Ray's own threads, started before, stay free to
    run elsewhere, off the learner's core."""
    os.sched_setaffinity(0, cpus)


class HostLearner:
    """Host `host_index` of `num_hosts`. The driver calls, in order: `info`, (host 0)
    `coordinator_address`, `initialize` on every host at once, `start`, then `run` per chunk.
    """

    def __init__(self, config, hp, host_index: int, num_hosts: int, use_gpu: bool = False,
                 cpus: list[int] | None = None):
        # Nothing here may touch a JAX backend: jax.distributed.initialize must come first.
        self.config = config
        self.hp = hp
        self.host_index = host_index
        self.num_hosts = num_hosts
        self.use_gpu = use_gpu
        self.runner = None
        self.collectives: dict = {}
        quiet_library_logs()  # Ray forwards this process's output to the driver's log
        undo_worker_niceness()
        if cpus:
            pin_to_cpus(cpus)

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"host_index": self.host_index, "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "versions": versions(), "cpus": sorted(os.sched_getaffinity(0))}

    def coordinator_address(self, port: int = 0) -> str:
        """host:port for jax.distributed's coordinator on this node: `port`, or a free one."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError as e:
                raise RuntimeError(
                    f"coordinator port {port} on {ip} is not free ({e.strerror}); pass another "
                    "--coordinator-port, or 0 to pick a free one") from None
            return f"{ip}:{s.getsockname()[1]}"

    def initialize(self, coordinator: str, timeout_s: int) -> dict:
        """Join the jax.distributed group (collectives: gloo on CPU) and check the layout."""
        if not self.use_gpu and not os.environ.get("JAX_PLATFORMS"):
            # No GPU reserved for this learner: stay off any GPU the node has.
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(coordinator, num_processes=self.num_hosts,
                                       process_id=self.host_index,
                                       initialization_timeout=timeout_s)
            jax.devices()  # start the backend here, where a failure can be named
        except Exception as e:  # JAX's own errors here can be a bare AssertionError
            platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "default"
            raise RuntimeError(
                f"host {self.host_index} could not join the group at {coordinator} or start "
                f"JAX (platforms: {platforms}): {type(e).__name__}: {e or 'no message'}. Check "
                "that the node's JAX install has that platform (jax[cuda12] for GPUs; "
                "JAX_PLATFORMS, --gpus-per-host) and that it can reach the coordinator") from None
        with _checked_by_driver():
            self.run_spec = resolve(self.config, "hosts")
        local_devices = self.run_spec.layout.local_devices
        return {"process_index": jax.process_index(), "local_devices": local_devices,
                "devices": [str(d) for d in jax.local_devices()[:local_devices]],
                "backend": jax.default_backend()}

    def start(self, restored, chunk_len: int) -> float:
        """Build and compile the program; start from `restored` (an unsharded state) or from
        the run's seed. Returns the seconds it took."""
        t0 = time.perf_counter()
        enable_compilation_cache(self.config.compilation_cache_dir)
        with _checked_by_driver():
            program = build_program(self.run_spec, self.hp, chunk_len)
        self.runner = ChunkRunner(program, self.hp, jax.random.PRNGKey(self.config.seed), restored)
        multihost_utils.sync_global_devices("jaxppo learners ready")
        if self.run_spec.layout.num_processes > 1 and jax.default_backend() == "cpu":
            self.collectives = quiet_gloo_poller()
        return time.perf_counter() - t0

    def run(self, start: int, stop: int, snapshot: bool = True):
        """Iterations start+1..stop. Returns (metrics, this host's part of the state after
        them or None); host 0's metrics are the run's (every host has the same)."""
        metrics = self.runner.run(start, stop)
        return (metrics if self.host_index == 0 else None), (self.snapshot() if snapshot else None)

    def snapshot(self):
        """This host's shards of the state; host 0's part also holds the replicated fields
        (params, optimiser, statistics, counters). No collective: the driver joins them."""
        return self.runner.local_part(replicated=self.host_index == 0)

    def leave(self) -> None:
        """Leave the jax.distributed group (every host calls it together)."""
        jax.distributed.shutdown()

    def stats(self) -> dict:
        """For benchmarks: the all-reduce times measured at start (before and after quieting
        gloo's poller), the CPUs this host runs on."""
        return {**self.collectives, "cpus": sorted(os.sched_getaffinity(0)),
                "nice": os.getpriority(os.PRIO_PROCESS, 0)}

    def time_all_reduce(self, size: int, reps: int = 100) -> float:
        """Milliseconds per all-reduce of `size` floats across the group (every host at once)."""
        return collective_burst(size, reps)() * 1e3
