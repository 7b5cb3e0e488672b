"""Ray as the cluster engine: connect, check the nodes, place one learner per node.

Only jaxppo.distributed imports Ray.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import warnings
from pathlib import Path

import ray

from jaxppo.distributed.loopback import keep_loopback
from jaxppo.errors import ConfigError

# ---------------------------------------------------------------------- errors
class DistributedError(RuntimeError):
    """Multi-host training cannot start or continue; the message names problem and fix."""


class ClusterUnreachableError(DistributedError):
    """No Ray cluster answers at the given address."""


class NotEnoughNodesError(DistributedError):
    """The cluster has fewer suitable nodes than hosts were asked for."""


class HostsConfigError(ConfigError):
    """`hosts` does not fit the config (num_envs not divisible, several seeds, ...)."""


# Libraries that log routine steps at INFO or below: orbax (through absl) a dozen lines per
# checkpoint, JAX its backend probing. A run's output is jaxppo's progress and warnings.
LIBRARY_LOGGERS = ("absl", "orbax", "jax")


def quiet_library_logs(level: int = logging.WARNING) -> None:
    """Let LIBRARY_LOGGERS through only from `level` up, whatever the root logger's level and
    handlers (a job's driver, a learner: Ray forwards the learners' output to the driver)."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < level:
            logger.setLevel(level)


HOSTS_LOG = "hosts.log"


class HostsOutput:
    """What Ray forwards to the driver from the cluster (the learners' stdout and stderr,
    Ray's own processes' error lines) goes to `path` (RUN_DIR/hosts.log), not the terminal.

    After a host loss that is ~100 lines of C++ abort traces, Ray's complaints about the lost
    node and its raylet's state dump, which would bury the driver's own lines ("lost host 1
    ...; continuing on 1 host"). `install` takes over Ray's printers of forwarded output and
    of the cluster's error messages (`ray.init(log_to_driver=True)`); lines are kept in memory until `attach` (the run folder is created only once
    the group has started), and written to stderr as before when the run never got a folder.
    `close` gives Ray its printer back (call it before `ray.shutdown`).
    """

    HANDLER = "ray_print_logs"  # the name of Ray's handler in its dispatcher

    def __init__(self, path: str | Path, max_buffered: int = 10_000):
        self.path = Path(path)
        self.buffer: collections.deque[str] = collections.deque(maxlen=max_buffered)
        self.file = None
        self.lines = 0
        self._lock = threading.Lock()
        self._ray_handler = self._ray_printer = None

    def install(self) -> HostsOutput:
        dispatcher = _log_dispatcher()
        self._ray_handler = dict(dispatcher.handlers).get(self.HANDLER)
        if self._ray_handler is not None:  # log_to_driver: Ray prints the cluster's output
            dispatcher.remove_handler(self.HANDLER)
            dispatcher.add_handler(self.HANDLER, self.emit)
            # The cluster's error messages (a dead raylet's state dump, ...) take another way.
            from ray._private import worker

            self._ray_printer = worker.print_to_stdstream
            worker.print_to_stdstream = self._print_to_stdstream
        return self

    def _print_to_stdstream(self, data: dict, ignore_prefix: bool = False) -> None:
        self.emit(data)

    def emit(self, data: dict) -> None:
        """One batch of forwarded lines (Ray's dict: pid, ip, actor_name, lines, ...)."""
        name = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({name + ' ' if name else ''}pid={data.get('pid')}, ip={data.get('ip')}) "
        lines = [prefix + line for line in data.get("lines", [])]
        with self._lock:
            self.lines += len(lines)
            if self.file is not None:
                self.file.write("".join(line + "\n" for line in lines))
                self.file.flush()
            else:
                self.buffer.extend(lines)

    def attach(self) -> None:
        """Start writing to `path` (its folder must exist), the lines so far first."""
        with self._lock:
            if self.file is None:
                self.file = open(self.path, "a")  # noqa: SIM115 (open until close)
                self.file.write("".join(line + "\n" for line in self.buffer))
                self.file.flush()
                self.buffer.clear()

    def close(self) -> None:
        """Give Ray its printer back; lines never written to a file go to stderr."""
        dispatcher = _log_dispatcher()
        if self._ray_handler is not None:
            from ray._private import worker

            worker.print_to_stdstream = self._ray_printer
            if dict(dispatcher.handlers).get(self.HANDLER) == self.emit:
                dispatcher.remove_handler(self.HANDLER)
                if ray.is_initialized():
                    dispatcher.add_handler(self.HANDLER, self._ray_handler)
        with self._lock:
            if self.file is not None:
                self.file.close()
            elif self.buffer:
                sys.stderr.write("".join(line + "\n" for line in self.buffer))
            self.buffer.clear()


def _log_dispatcher():
    """Ray's dispatcher of the output it forwards to the driver (handlers by name)."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    return global_worker_stdstream_dispatcher


def _split_address(address: str) -> tuple[str, int] | None:
    addr = address
    for scheme in ("ray://", "http://", "https://"):
        if addr.startswith(scheme):
            addr = addr[len(scheme):]
    addr = addr.rstrip("/")
    if ":" not in addr:
        return None
    host, port = addr.rsplit(":", 1)
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


@contextlib.contextmanager
def _quiet_fork_warning():
    # Ray starts its daemons with subprocess (fork + exec at once), which JAX's
    # "os.fork() was called" warning cannot tell from a bare fork.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                category=RuntimeWarning)
        yield


def connect(address: str | None = None, timeout_s: float = 5.0) -> bool:
    """Connect to Ray: `address`, else RAY_ADDRESS, else a new local instance.

    Returns True when this call initialised Ray (so the caller should shut it down).
    Raises ClusterUnreachableError within about `timeout_s` when nothing answers there.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address is None or address == "local":
        # A private single-node instance, on loopback only.
        with keep_loopback("127.0.0.1", children=True), _quiet_fork_warning():
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
        return True
    if address.startswith(("http://", "https://")):
        raise ClusterUnreachableError(
            f"RAY_ADDRESS={address!r} is a dashboard (job submission) address; the trainer "
            "connects to the cluster's GCS address, e.g. 127.0.0.1:6379. Submit with "
            "`ray job submit --address http://...:8265 -- python -m jaxppo.distributed ...` "
            "(the job gets the right RAY_ADDRESS), or set RAY_ADDRESS=<head-ip>:6379"
        )
    if address != "auto":
        hp = _split_address(address)
        if hp is None:
            raise ClusterUnreachableError(
                f"RAY_ADDRESS={address!r} is not of the form host:port (e.g. 127.0.0.1:6379)")
        try:
            with socket.create_connection(hp, timeout=timeout_s) as sock:
                http = _speaks_http(sock, timeout_s)
        except OSError as e:
            raise ClusterUnreachableError(
                f"no Ray cluster reachable at RAY_ADDRESS={address} ({e.__class__.__name__}: "
                f"{e.strerror or e} within {timeout_s:g}s). Start one first (`make ray-cluster`, "
                "or `ray start --head --node-ip-address=127.0.0.1` on the head node), fix "
                "RAY_ADDRESS, or unset it to train on a local single-node Ray instance"
            ) from None
        if http:  # ray.init would wait about a minute for a GCS there
            raise ClusterUnreachableError(
                f"RAY_ADDRESS={address} answers HTTP: it is the dashboard (job submission) "
                "port, not the cluster's GCS port. Use the GCS address, e.g. "
                f"{hp[0]}:6379 (`ray start --head --port=...`), or submit the run as a job: "
                f"`ray job submit --address http://{hp[0]}:{hp[1]} -- python -m "
                "jaxppo.distributed ...`")
    try:
        hp = _split_address(address)
        with keep_loopback(hp[0] if hp else None), _quiet_fork_warning():
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
        if "Authentication" in f"{type(e).__name__} {e}" and "RAY_AUTH_MODE" not in os.environ:
            raise ClusterUnreachableError(
                f"the Ray cluster at {address!r} requires token authentication; run with "
                "RAY_AUTH_MODE=token (the token is read from ~/.ray/auth_token, "
                "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)") from None
        raise ClusterUnreachableError(
            f"could not connect to a Ray cluster at {address!r}: {e}. Start one with "
            "`make ray-cluster` (or `ray start --head`), or unset RAY_ADDRESS"
        ) from None
    return True


def _speaks_http(sock: socket.socket, timeout_s: float) -> bool:
    """True when the server behind `sock` answers an HTTP/1 request (Ray's dashboard does;
    its GCS speaks gRPC, HTTP/2, and answers with binary frames or not at all)."""
    try:
        sock.settimeout(min(timeout_s, 2.0))
        sock.sendall(b"GET /api/version HTTP/1.0\r\nHost: ray\r\n\r\n")
        return sock.recv(5) == b"HTTP/"
    except OSError:
        return False


def _node_summary(nodes) -> str:
    return ", ".join(
        f"{n.get('NodeManagerAddress', '?')}:{n.get('NodeManagerPort', '?')} "
        f"(CPU {n['Resources'].get('CPU', 0):g}, GPU {n['Resources'].get('GPU', 0):g})"
        for n in nodes
    ) or "none"


