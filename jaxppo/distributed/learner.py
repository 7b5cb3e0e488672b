"""One host's learner: a process in a `jax.distributed` group that runs the run's program.

Every host runs the same compiled chunk (jaxppo.program) over an axis that spans all hosts'
devices; gradients and statistics are all-reduced inside it by XLA (gloo on CPU, NCCL on GPU).
An env that steps in Python runs in each host's own host loop (jaxppo.run.hostloop, or the
actor-learner's threads with max_policy_lag >= 1) on that host's share of the envs; the
learners' update is one program over every host's devices, all-reduced as the chunk's is.
The learner is a Ray actor started by jaxppo.distributed.group, but nothing here needs Ray
except `info` and `coordinator_address`, which ask Ray for the node's address.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
import time
import warnings

import jax
import jaxlib
import ray
from jax.experimental import multihost_utils

from jaxppo import cpu_devices
from jaxppo.distributed import loopback
from jaxppo.distributed.cluster import quiet_library_logs
from jaxppo.run.actorlearner import ActorLearnerRunner
from jaxppo.run.hostloop import HostLoopRunner
from jaxppo.run.runner import ChunkRunner
from jaxppo.program.build import build_program
from jaxppo.program.resolved import resolve
from jaxppo.process import __version__, enable_compilation_cache

logger = logging.getLogger("jaxppo.distributed")

def versions() -> dict:
    return {"python": sys.version.split()[0], "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "jaxppo": __version__}


@contextlib.contextmanager
def _checked_by_driver():
    """The config's warnings (e.g. total_timesteps not a multiple of the batch): the driver
    resolved the same config and has shown them once; every learner would repeat them in the
    job's log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _bind_gloo_to(ip: str) -> None:
    """Let gloo (the CPU collectives) listen on the node's address `ip`, as Ray and the
    coordinator do. JAX creates gloo's TCP device from the machine's hostname, whatever
    address that resolves to; no JAX option names it, so the CPU backend is registered here
    with collectives made for `ip`. Call after jax.distributed.initialize and before the
    backend starts; a no-op when collectives are not gloo's."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    client = distributed.global_state.client
    if client is None or jax.config.jax_cpu_collectives_implementation != "gloo":
        return
    collectives = _jax.make_gloo_tcp_collectives(distributed_client=client, hostname=ip)
    xla_bridge.register_backend_factory(
        "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
        priority=0)


def node_cores() -> int:
    """The cores a learner may use: those this process may run on (its affinity) and, of
    those, no more than its Ray node offers (`ray start --num-cpus`)."""
    cores = cpu_devices.affinity()
    node = ray.get_runtime_context().get_node_id()
    offered = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("NodeID") == node]
    return min(cores, int(offered[0])) if offered and offered[0] >= 1 else cores


class HostLearner:
    """Host `host_index` of `num_hosts`. The driver calls, in order: `info`, (host 0)
    `coordinator_address`, `initialize` on every host at once, `start`, then `train_chunk`
    per chunk.
    """

    def __init__(self, config, hp, host_index: int, num_hosts: int, use_gpu: bool = False,
                 cpus: list[int] | None = None, own_node: bool = True):
        # Nothing here may touch a JAX backend: jax.distributed.initialize must come first.
        self.config = config
        self.hp = hp
        self.host_index = host_index
        self.num_hosts = num_hosts
        self.use_gpu = use_gpu
        self.runner = None
        self.collectives: dict = {}
        quiet_library_logs()  # Ray forwards this process's output to the driver's log
        loopback.undo_worker_niceness()
        if cpus:
            loopback.pin_to_cpus(cpus)
        # One CPU device per core of the node when the learner is the node's only one
        # (placement STRICT_SPREAD), though Ray reserves a single CPU for it; else per CPU Ray
        # gave it, as for any Ray actor.
        cpu_devices.refit(node_cores() if own_node else None)

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"host_index": self.host_index, "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "versions": versions(), "cpus": sorted(os.sched_getaffinity(0)),
                "cpu_devices": cpu_devices.status["devices"]}

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
            # Host 0 serves the group's coordinator (gRPC, no authentication): on its node's
            # address only, the one the others were given, not on every interface (JAX's
            # default, [::]:port).
            jax.distributed.initialize(coordinator, num_processes=self.num_hosts,
                                       process_id=self.host_index,
                                       initialization_timeout=timeout_s,
                                       coordinator_bind_address=coordinator)
            _bind_gloo_to(ray.util.get_node_ip_address())
            jax.devices()  # start the backend here, where a failure can be named
        except Exception as e:  # JAX's own errors here can be a bare AssertionError
            platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "default"
            raise RuntimeError(
                f"host {self.host_index} could not join the group at {coordinator} or start "
                f"JAX (platforms: {platforms}): {type(e).__name__}: {e or 'no message'}. Check "
                "that the node's JAX install has that platform (jax[cuda12] for GPUs; "
                "JAX_PLATFORMS, --gpus-per-host) and that it can reach the coordinator") from None
        with _checked_by_driver():
            self.resolved = resolve(self.config, "hosts")
        local_devices = self.resolved.layout.local_devices
        return {"process_index": jax.process_index(), "local_devices": local_devices,
                "devices": [str(d) for d in jax.local_devices()[:local_devices]],
                "backend": jax.default_backend()}

    def start(self, restored, chunk_len: int) -> float:
        """Build and compile the program; start from `restored` (an unsharded state) or from
        the run's seed. Returns the seconds it took."""
        t0 = time.perf_counter()
        enable_compilation_cache(self.config.compilation_cache_dir)
        with _checked_by_driver():
            if self.resolved.host_loop:
                host = ActorLearnerRunner if self.config.max_policy_lag else HostLoopRunner
                self.runner = host(self.resolved, self.hp, restored)
            else:
                program = build_program(self.resolved, self.hp, chunk_len)
                self.runner = ChunkRunner(program, self.hp, jax.random.PRNGKey(self.config.seed),
                                          restored)
        multihost_utils.sync_global_devices("jaxppo learners ready")
        if self.resolved.layout.num_processes > 1 and jax.default_backend() == "cpu":
            self.collectives = loopback.quiet_gloo_poller()
        return time.perf_counter() - t0

    def train_chunk(self, start: int, stop: int, snapshot: bool = True):
        """Iterations start+1..stop. Returns (metrics, this host's part of the state after
        them or None); host 0's metrics are the run's (every host has the same)."""
        metrics = self.runner.train_chunk(start, stop)
        return (metrics if self.host_index == 0 else None), (self.snapshot() if snapshot else None)

    def snapshot(self):
        """This host's shards of the state; host 0's part also holds the replicated fields
        (params, optimiser, statistics, counters). No collective: the driver joins them."""
        return self.runner.local_part(replicated=self.host_index == 0)

    def leave(self) -> None:
        """Close the runner (a host loop's envs and actor threads), then leave the
        jax.distributed group (every host calls it together)."""
        if self.runner is not None:
            self.runner.close()
        jax.distributed.shutdown()

    def stats(self) -> dict:
        """For benchmarks: the all-reduce times measured at start (before and after quieting
        gloo's poller), the CPUs this host runs on."""
        return {**self.collectives, "cpus": sorted(os.sched_getaffinity(0)),
                "nice": os.getpriority(os.PRIO_PROCESS, 0)}

    def time_all_reduce(self, size: int, reps: int = 100) -> float:
        """Milliseconds per all-reduce of `size` floats across the group (every host at once)."""
        return loopback.collective_burst(size, reps)() * 1e3
