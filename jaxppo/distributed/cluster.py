"""Ray as the cluster engine: connect, check the nodes, place one learner per node.

Only jaxppo.distributed imports Ray.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
from collections.abc import Callable
import logging
import os
import socket
import sys
import threading
import warnings
from pathlib import Path

import ray

from jaxppo.distributed.loopback import (AUTH_MODE_ENV, _is_gcs, cluster_auth_env,
                                        cluster_processes, keep_loopback)
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


# `ray start --head` records the address of the cluster it started in <temp dir>/ray_current_cluster:
# Ray's default temp dir, or `make ray-cluster`'s RAY_TEMP_DIR (/tmp/jaxppo-ray-<uid>-<port>).
RAY_ADDRESS_FILE = "ray_current_cluster"
MAKE_TEMP_DIRS = "/tmp/jaxppo-ray-{uid}-*"


def recorded_clusters() -> list[tuple[str, Path]]:
    """(address, file) for each cluster `ray start --head` recorded on this machine, the
    newest first (stopped ones included: see `running_gcs_addresses`)."""
    from ray._common.utils import get_default_ray_temp_dir

    files = [Path(get_default_ray_temp_dir()) / RAY_ADDRESS_FILE]
    files += sorted(Path("/").glob(MAKE_TEMP_DIRS.format(uid=os.getuid()).lstrip("/")
                                   + "/" + RAY_ADDRESS_FILE))
    found = []
    for f in files:
        try:
            found.append((f.stat().st_mtime, f.read_text().strip(), f))
        except OSError:
            continue
    return [(address, f) for _, address, f in sorted(found, key=lambda x: -x[0]) if address]


def running_gcs_addresses() -> set[str] | None:
    """The GCS addresses the Ray nodes running on this machine belong to (Ray's own search
    of the raylets' command lines); None when the processes cannot be listed."""
    try:
        from ray._private.services import find_gcs_addresses

        find_gcs_addresses.cache_clear()
        return set(find_gcs_addresses())
    except Exception:  # noqa: BLE001 - Ray's internals moved, or no process table
        return None


def _answers(address: str, timeout_s: float = 0.5) -> bool:
    hp = _split_address(address)
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return True
    except (OSError, TypeError):
        return False


def choose_address(address: str | None, env_address: str | None,
                   recorded: list[tuple[str, Path]],
                   running: set[str] | None) -> tuple[str | None, str]:
    """Which Ray cluster to join, as Ray users expect: `address` (--address), else
    `env_address` (RAY_ADDRESS), else the newest cluster `ray start` recorded on this machine
    that is still running (`recorded`, `running`: `recorded_clusters()`,
    `running_gcs_addresses()`; None: check its port instead), else a new local instance.

    Returns (address, or None for a new local instance; how it was chosen). "local" asks
    for a new instance, "auto" for a running one (ClusterUnreachableError when none is)."""
    if address and address not in ("auto", "local"):
        return address, "--address"
    if env_address and address != "local" and env_address not in ("auto", "local"):
        return env_address, "RAY_ADDRESS"
    wanted = address or env_address
    if wanted != "local":
        alive = [(a, f) for a, f in recorded
                 if (a in running if running is not None else _answers(a))]
        if alive:
            a, f = alive[0]
            others = [b for b, _ in alive[1:] if b != a]
            return a, (f"running on this machine, recorded by `ray start` in {f}"
                       + (f"; also running: {', '.join(others)}" if others else ""))
        if wanted == "auto":
            raise ClusterUnreachableError(
                "address 'auto': no Ray cluster started by `ray start` is running on this "
                "machine. Start one (`make ray-cluster`, or `ray start --head`), or give its "
                "address with --address or RAY_ADDRESS=<head-ip>:6379")
    if wanted == "local":
        return None, "--address local" if address == "local" else "RAY_ADDRESS=local"
    return None, "no --address, RAY_ADDRESS or running cluster on this machine"


_joined = {"what": None}


def joined_cluster() -> str:
    """What this process's Ray connection is, for messages: 'the Ray cluster at ...
    (RAY_ADDRESS)', 'a local single-node Ray instance started for this run', ..."""
    return _joined["what"] or "the Ray cluster this process is connected to (ray.init)"


def connect(address: str | None = None, timeout_s: float = 5.0,
            announce: Callable[[str], None] | None = None, nodes: int = 1) -> bool:
    """Connect to Ray: `address`, else RAY_ADDRESS, else a cluster `ray start` left running
    on this machine, else a new local instance (`choose_address`): one node, or with
    `nodes` > 1 a private loopback cluster of that many nodes on this machine (what
    `make ray-cluster` starts), stopped by `disconnect`. `announce` gets one line saying which.

    Returns True when this call initialised Ray (so the caller should `disconnect`).
    Raises ClusterUnreachableError within about `timeout_s` when nothing answers there.
    """
    if ray.is_initialized():
        return False
    address, how = choose_address(address, os.environ.get("RAY_ADDRESS"), recorded_clusters(),
                                  running_gcs_addresses())
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address is None and nodes > 1:
        _start_private_cluster(nodes, quiet)
        _joined["what"] = f"the private {nodes}-node loopback cluster started for this run"
        if announce is not None:
            announce(f"Ray: started a private cluster of {nodes} nodes on this machine's "
                     f"loopback for this run ({how}); it stops when the run ends (a cluster "
                     "that outlives runs: `make ray-cluster`, then --address or RAY_ADDRESS)")
        return True
    if address is None:
        # A private single-node instance, on loopback only.
        with keep_loopback("127.0.0.1", children=True), _quiet_fork_warning():
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                     **quiet)
        _joined["what"] = "a local single-node Ray instance started for this run"
        if announce is not None:
            announce(f"Ray: started a local single-node instance ({how}; a cluster of several "
                     "nodes: `make ray-cluster`, --address or RAY_ADDRESS)")
        return True
    found = how.startswith("running")
    if found:
        _agree_on_auth(address)
    _joined["what"] = f"the Ray cluster at {address}" + (
        " (RAY_ADDRESS)" if how == "RAY_ADDRESS" else " (running on this machine)" if found else "")
    _connect_to(address, timeout_s, quiet, how)
    if announce is not None:
        announce(f"Ray: joined the cluster at {address} ({how})")
    return True


# The private cluster `connect` started for this process (nodes > 1, no cluster given).
_private: dict = {"cluster": None}
PRIVATE_NODE = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=100 * 1024 ** 2)


def _start_private_cluster(nodes: int, quiet: dict) -> None:
    """`nodes` Ray nodes of one CPU each on 127.0.0.1 (Ray's own cluster_utils.Cluster, the
    head one of them), and ray.init on it; all its processes agree on RAY_AUTH_MODE
    (`cluster_auth_env`). Stopped by `disconnect`, or when this process exits."""
    from ray.cluster_utils import Cluster

    auth = cluster_auth_env()
    if auth:
        from ray._raylet import Config

        os.environ.update(auth)
        Config.initialize("")  # Ray's own way to make this process see a new RAY_AUTH_MODE
    cluster = None
    with keep_loopback("127.0.0.1", children=True), _quiet_fork_warning():
        try:
            cluster = Cluster(initialize_head=True,
                              head_node_args=dict(PRIVATE_NODE, include_dashboard=False))
            _private["cluster"] = cluster
            atexit.register(_stop_private_cluster)
            for _ in range(nodes - 1):
                cluster.add_node(**PRIVATE_NODE)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, **quiet)
        except BaseException:
            _stop_private_cluster()
            raise


def _stop_private_cluster() -> None:
    cluster, _private["cluster"] = _private["cluster"], None
    if cluster is not None:
        with contextlib.suppress(Exception):
            cluster.shutdown()


def disconnect() -> None:
    """Leave Ray (what `connect` started: `ray.shutdown`), and stop the private cluster
    `connect` started for this process, if any."""
    ray.shutdown()
    _stop_private_cluster()


def _agree_on_auth(address: str) -> None:
    """A cluster found running on this machine: unless RAY_AUTH_MODE is set here, take the
    one its GCS runs with (`make ray-cluster` gives every node one, `cluster_auth_env`), as
    Ray does when it finds a cluster itself. Read from the GCS process, not guessed from
    ~/.ray/auth_token, which a later local `ray.init()` may have written."""
    if os.environ.get(AUTH_MODE_ENV):
        return
    mode = running_auth_mode(address)
    if mode:
        from ray._raylet import Config

        os.environ[AUTH_MODE_ENV] = mode
        Config.initialize("")  # Ray's own way to make this process see a new RAY_AUTH_MODE


def running_auth_mode(address: str) -> str | None:
    """RAY_AUTH_MODE in the environment of the GCS at `address`, when it is this user's
    process on this machine and has one set; else None."""
    try:
        for pid in cluster_processes(address):
            if _is_gcs(pid):
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                for item in env:
                    if item.startswith(AUTH_MODE_ENV.encode() + b"="):
                        return item.split(b"=", 1)[1].decode() or None
                return None
    except (OSError, ValueError):
        pass
    return None


def _connect_to(address: str, timeout_s: float, quiet: dict, how: str) -> None:
    """ray.init at `address` (chosen as `how` says), after checking within `timeout_s` that a
    GCS answers there."""
    name = {"RAY_ADDRESS": f"RAY_ADDRESS={address}", "--address": f"--address {address}"}.get(
        how, f"{address} (found running on this machine)")
    fix = {"RAY_ADDRESS": "fix RAY_ADDRESS, or unset it",
           "--address": "fix --address, or leave it out"}.get(how, "or stop it (`make ray-stop`)")
    if address.startswith(("http://", "https://")):
        raise ClusterUnreachableError(
            f"{name} is a dashboard (job submission) address; the trainer "
            "connects to the cluster's GCS address, e.g. 127.0.0.1:6379. Submit with "
            "`ray job submit --address http://...:8265 -- python -m jaxppo.distributed ...` "
            "(the job gets the right RAY_ADDRESS), or set RAY_ADDRESS=<head-ip>:6379"
        )
    hp = _split_address(address)
    if hp is None:
        raise ClusterUnreachableError(
            f"{name} is not of the form host:port (e.g. 127.0.0.1:6379)")
    try:
        with socket.create_connection(hp, timeout=timeout_s) as sock:
            http = _speaks_http(sock, timeout_s)
    except OSError as e:
        raise ClusterUnreachableError(
            f"no Ray cluster reachable at {name} ({e.__class__.__name__}: "
            f"{e.strerror or e} within {timeout_s:g}s). Start one first (`make ray-cluster`, "
            "or `ray start --head --node-ip-address=127.0.0.1` on the head node), "
            f"{fix} to train on a local single-node Ray instance"
        ) from None
    if http:  # ray.init would wait about a minute for a GCS there
        raise ClusterUnreachableError(
            f"{name} answers HTTP: it is the dashboard (job submission) "
            "port, not the cluster's GCS port. Use the GCS address, e.g. "
            f"{hp[0]}:6379 (`ray start --head --port=...`), or submit the run as a job: "
            f"`ray job submit --address http://{hp[0]}:{hp[1]} -- python -m "
            "jaxppo.distributed ...`")
    if _refuses_credentials(address):
        raise ClusterUnreachableError(_auth_refused(address, name))
    log = _Fd2Capture()
    try:
        with keep_loopback(hp[0]), _quiet_fork_warning(), log:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
        said = f"{type(e).__name__} {e} {log.text}"
        if any(w in said for w in AUTH_REFUSED):
            raise ClusterUnreachableError(_auth_refused(address, name)) from None
        log.replay()
        raise ClusterUnreachableError(
            f"could not connect to a Ray cluster at {name}: {e}. Start one with "
            f"`make ray-cluster` (or `ray start --head`), or {fix}"
        ) from None
    log.replay()


# What Ray says (in its exception, or its C++ client's log lines) when a GCS refuses us.
AUTH_REFUSED = ("Authentication", "Unauthenticated", "InvalidAuthToken")


def _refuses_credentials(address: str) -> bool:
    """True when the GCS at `address` refuses this process's credentials (RAY_AUTH_MODE,
    the token): one client handshake, under a second, where ray.init repeats it once a
    second for about 20 s before it gives up. False for anything else, which ray.init then
    meets and reports as before."""
    try:
        from ray._raylet import GcsClient
    except ImportError:  # Ray's internals moved: ray.init finds it out, more slowly
        return False
    try:
        with _Fd2Capture():  # the client logs the refusal on fd 2
            GcsClient(address=address)
    except Exception as e:  # noqa: BLE001 - Ray raises its own classes, by version
        return any(w in f"{type(e).__name__} {e}" for w in AUTH_REFUSED)
    return False


def _auth_refused(address: str, name: str) -> str:
    """The message for a cluster that refused this process's credentials."""
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode != "token":
        how = f"RAY_AUTH_MODE={mode}" if mode else "RAY_AUTH_MODE is unset"
        return (f"the Ray cluster at {name} requires token authentication, which this process "
                f"does not use ({how}): run with RAY_AUTH_MODE=token (the "
                "token is read from ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; "
                "the cluster's own, as its head node has it)")
    return (f"the Ray cluster at {address} refused this process's authentication token: give "
            "the cluster's token (the head node's ~/.ray/auth_token) in ~/.ray/auth_token, "
            "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")


class _Fd2Capture:
    """While active, what is written to file descriptor 2 (Ray's C++ client logs its retries
    there, a line a second) goes to a temporary file; `text` is it, `replay` writes it to
    stderr after all (a connection that worked, or failed for another reason)."""

    def __init__(self):
        self.text = ""

    def __enter__(self):
        import tempfile

        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()
        return False

    def replay(self) -> None:
        if self.text:
            sys.stderr.write(self.text)
            sys.stderr.flush()


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


