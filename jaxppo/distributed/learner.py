"""One host's learner: a process in a `jax.distributed` group that runs the run's program.

Every host runs the same compiled chunk (jaxppo.layouts) over an axis that spans all hosts'
devices; gradients and statistics are all-reduced inside it by XLA (gloo on CPU, NCCL on GPU).
The learner is a Ray actor started by jaxppo.distributed.group, but nothing here needs Ray
except `info` and `coordinator_address`, which ask Ray for the node's address.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

logger = logging.getLogger("jaxppo.distributed")

# Set JAXPPO_GLOO_POLLER_IDLE=0 to leave gloo's network thread at normal priority.
POLLER_ENV = "JAXPPO_GLOO_POLLER_IDLE"


def versions() -> dict:
    import jax
    import jaxlib

    from jaxppo import __version__

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


def quiet_busy_threads(window_s: float = 0.3, min_share: float = 0.3) -> list[int]:
    """Give threads that burn CPU while this process does nothing SCHED_IDLE priority.

    gloo's network thread busy-polls its sockets. When a learner shares a core with it, it
    takes the core from the thread that must post the next receive, and each all-reduce
    costs ~2-4 ms instead of ~0.15 ms (measured on loopback, see README "Multi-host"). At
    SCHED_IDLE it runs only when the core is otherwise idle, i.e. exactly while the compute
    thread waits for the network. It is found by what it does: called right after a
    collective, while the process is idle, it is the thread that used the most CPU in the
    window (threads below `min_share` of the window are left alone). Linux only; returns
    the thread ids changed.
    """
    if os.environ.get(POLLER_ENV, "1") == "0" or not hasattr(os, "sched_setscheduler"):
        return []
    try:
        before = _thread_ticks()
        time.sleep(window_s)
        after = _thread_ticks()
    except OSError:
        return []
    hz = os.sysconf("SC_CLK_TCK")
    main = os.getpid()
    busy = [tid for tid, t in after.items()
            if tid != main and (t - before.get(tid, t)) / hz >= min_share * window_s]
    changed = []
    for tid in busy:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            changed.append(tid)
        except (OSError, PermissionError):
            pass
    return changed


def pin_to_cpus(cpus: list[int]) -> None:
    """Pin every thread of this process (and the threads it starts later) to `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


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
        self.poller_threads: list[int] = []
        if cpus:
            pin_to_cpus(cpus)

    def info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"host_index": self.host_index, "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "versions": versions(), "cpus": sorted(os.sched_getaffinity(0))}

    def coordinator_address(self, port: int = 0) -> str:
        """host:port for jax.distributed's coordinator on this node: `port`, or a free one."""
        import ray

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
        import jax

        from jaxppo.layouts import host_layout

        if not self.use_gpu and not os.environ.get("JAX_PLATFORMS"):
            # No GPU reserved for this learner: stay off any GPU the node has.
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=self.num_hosts,
                                   process_id=self.host_index, initialization_timeout=timeout_s)
        self.layout = host_layout(self.config)
        return {"process_index": jax.process_index(), "local_devices": self.layout.local_devices,
                "devices": [str(d) for d in jax.local_devices()[:self.layout.local_devices]],
                "backend": jax.default_backend()}

    def start(self, restored, chunk_len: int) -> float:
        """Build and compile the program; start from `restored` (an unsharded state) or from
        the run's seed. Returns the seconds it took."""
        import jax
        from jax.experimental import multihost_utils

        from jaxppo.envs import make_env
        from jaxppo.layouts import ChunkRunner, build_program
        from jaxppo.train import enable_compilation_cache

        t0 = time.perf_counter()
        enable_compilation_cache(self.config.compilation_cache_dir)
        program = build_program(self.config, make_env(self.config), self.hp, self.layout, chunk_len)
        self.runner = ChunkRunner(program, self.hp, jax.random.PRNGKey(self.config.seed), restored)
        multihost_utils.sync_global_devices("jaxppo learners ready")  # a first collective
        self.poller_threads = quiet_busy_threads()
        return time.perf_counter() - t0

    def run(self, start: int, stop: int, snapshot: bool = True):
        """Iterations start+1..stop. Host 0 returns (metrics, unsharded state or None); the
        others None (the snapshot is a collective, so every host takes part)."""
        metrics = self.runner.run(start, stop)
        state = self.runner.snapshot() if snapshot else None
        return (metrics, state) if self.host_index == 0 else None

    def stats(self) -> dict:
        """What the benchmark reports: threads given SCHED_IDLE, the CPUs this host runs on."""
        return {"poller_threads": self.poller_threads, "cpus": sorted(os.sched_getaffinity(0))}
