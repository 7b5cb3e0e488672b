"""Operations for a Ray cluster on one machine's loopback interface (127.0.0.1), kept out
of the training path: `make ray-cluster` / `make ray-stop`, and a learner on such a cluster.

`python -m jaxppo.distributed.loopback <ray CLI args>` runs the `ray` CLI with loopback
addresses kept as given (Ray rewrites them to the machine's outward IP otherwise);
`... stop-cluster --address=127.0.0.1:6379 [--temp-dir=DIR]` stops that one cluster.
For learners sharing a machine's cores: `undo_worker_niceness`, `pin_to_cpus`,
`quiet_gloo_poller`. Only for single-machine clusters; on real clusters use `ray` itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Set JAXPPO_GLOO_POLLER_IDLE=0 to leave gloo's network thread at normal priority.
POLLER_ENV = "JAXPPO_GLOO_POLLER_IDLE"


# ---------------------------------------------------------------------- connecting
@contextlib.contextmanager
def keep_loopback(host: str | None, children: bool = False):
    """Let `ray.init` use a cluster bound to loopback (`--node-ip-address=127.0.0.1`).

    Ray rewrites a 127.0.0.1/localhost address to this machine's outward IP and then looks
    for a raylet with that IP; a loopback-only cluster has neither. For a loopback `host`
    only, Ray takes 127.0.0.1 as this machine's IP while `ray.init` runs (its own switch for
    single-machine clusters, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER); with `children` the Ray
    processes started meanwhile inherit the switch. Other hosts are left alone.
    """
    if host not in LOOPBACK:
        yield
        return
    try:
        import ray._private.ray_constants as ray_constants
    except ImportError:  # pragma: no cover - layout of a future Ray
        yield
        return
    old = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    old_env = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    ray_constants.ENABLE_RAY_CLUSTER = False
    if children:
        os.environ.update(LOOPBACK_ENV)
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------- a learner's process
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

    gloo's network thread busy-polls its sockets while a collective is in flight; sharing a
    core with the thread that must post the next receive, it takes the core from it (see
    docs/design.md, "Run path and loopback operations"). At SCHED_IDLE it runs only when the
    core is otherwise idle, i.e. exactly while the compute thread waits for the network. No JAX or gloo option controls
    the polling, so the thread is found by what it does: the thread other than this one that
    uses the most CPU during a burst of all-reduces. The change is kept only if the next
    burst is faster; otherwise it is undone. A collective (every host calls it together);
    Linux only; JAXPPO_GLOO_POLLER_IDLE=0 turns it off.
    """
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


def pin_to_cpus(cpus: list[int]) -> None:
    """Pin the calling thread, and so the threads it starts later (JAX's and XLA's: the
    backend starts after this), to `cpus`. Ray's own threads, started before, stay free to
    run elsewhere, off the learner's core."""
    os.sched_setaffinity(0, cpus)


# ---------------------------------------------------------------------- what a process listens on
def _hex_address(text: str) -> str:
    """An address of /proc/net/tcp{,6} ('0100007F' or 32 hex digits) as text."""
    import ipaddress

    raw = bytes.fromhex(text)
    # The kernel prints each 32-bit word in host order (little-endian here).
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    return str(ip)


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process `pid` holds open,
    IPv4 and IPv6 ('0.0.0.0' or '::' for all interfaces). Linux (/proc); the caller must be
    allowed to read the process's fds (same user)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].rsplit(":", 1)
                out.append((_hex_address(address), int(port, 16)))
    return sorted(set(out))


# ---------------------------------------------------------------------- stopping one cluster
def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _open_paths(pid: int, limit: int = 256) -> list[str]:
    """Files this process has open (the first `limit` descriptors: stdout/stderr come first)."""
    out = []
    try:
        fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=lambda x: int(x) if x.isdigit() else 0)
    except OSError:
        return out
    for fd in fds[:limit]:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def _belongs(pid: int, host: str, port: int, temp_dir: str | None) -> bool:
    """Does this process's command line (or an open log file) name the cluster: its GCS
    address or port, or its temp dir?"""
    argv = _argv(pid)
    if not argv or not (argv[0].startswith("ray::") or any(
            "/ray/" in a or a.startswith("ray.") for a in argv[:3])):
        return False  # not a Ray process (e.g. `less` of one of its logs)
    gcs = f"{host}:{port}"
    for a in argv:
        if a in (f"--gcs_server_port={port}", f"--gcs-address={gcs}", f"--gcs_address={gcs}"):
            return True  # gcs_server; raylets, dashboard, monitors, agents
        if a == f"--address={gcs}" and "ray.util.client.server" in argv:
            return True  # the Ray client server of the head
    if temp_dir:
        prefix = temp_dir + "/"
        if any(prefix in a or a == temp_dir or a.endswith("=" + temp_dir) for a in argv):
            return True
        # Workers rename themselves (ray::IDLE, ray::HostLearner); their logs are under it.
        if any(p.startswith(prefix) for p in _open_paths(pid)):
            return True
    return False


def cluster_processes(address: str, temp_dir: str | None = None) -> dict[int, int]:
    """{pid: start time} of this user's processes that belong to the Ray cluster whose GCS is
    at `address` (host:port): those whose command line names its GCS address/port or
    `temp_dir` (the cluster's own `--temp-dir`; give one only when no other cluster uses it),
    or that have a log file under `temp_dir` open, and all their descendants (workers, job
    drivers, the dashboard's subprocesses). Never this process or its ancestors. Linux (/proc).
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address {address!r} must be host:port, e.g. 127.0.0.1:6379")
    temp_dir = os.path.abspath(temp_dir).rstrip("/") if temp_dir else None
    uid = os.getuid()
    procs: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        st = _stat(pid)
        if st is not None:
            procs[pid] = st
    mine, p = set(), os.getpid()  # this process and its ancestors (make, the shell, ...)
    while p and p not in mine:
        mine.add(p)
        p = procs.get(p, (0, 0))[0]
    roots = [pid for pid in procs if pid not in mine and _belongs(pid, host, int(port), temp_dir)]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in found or pid in mine:
            continue
        found.add(pid)
        todo.extend(children.get(pid, []))
    return {pid: procs[pid][1] for pid in sorted(found)}


def _alive(pids: dict[int, int]) -> dict[int, int]:
    """Those still running as the same process (not reused pids, not zombies)."""
    out = {}
    for pid, start in pids.items():
        st = _stat(pid)
        if st is None or st[1] != start:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out[pid] = start
    return out


def _signal(pids: dict[int, int], sig: int) -> None:
    for pid in _alive(pids):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _is_gcs(pid: int) -> bool:
    argv = _argv(pid)
    return bool(argv) and os.path.basename(argv[0]) == "gcs_server"


def stop_cluster(address: str, temp_dir: str | None = None, grace_s: float = 10.0) -> tuple[int, int]:
    """Stop the Ray cluster at `address` (see `cluster_processes`) and nothing else: SIGTERM to
    everything but its GCS, then (once they are gone) to the GCS, each step given up to
    `grace_s` seconds, then SIGKILL (raylets stopped together with their GCS hang in their
    goodbye to it). Processes the cluster starts meanwhile are found and stopped too. Returns
    (processes found, processes still running)."""
    found: dict[int, int] = {}
    termed: set[tuple[int, int]] = set()
    for last_step in (False, True):
        deadline = time.monotonic() + grace_s
        while True:
            now = {p: s for p, s in cluster_processes(address, temp_dir).items()
                   if last_step or not _is_gcs(p)}
            found.update(now)
            _signal({p: s for p, s in now.items() if (p, s) not in termed}, signal.SIGTERM)
            termed.update(now.items())
            if not _alive(now) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    for _ in range(3):
        left = _alive({**found, **cluster_processes(address, temp_dir)})
        if not left:
            break
        found.update(left)
        _signal(left, signal.SIGKILL)
        time.sleep(0.5)
    return len(found), len(_alive(found))


def _stop_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxppo.distributed.loopback stop-cluster",
        description="Stop one Ray cluster on this machine (its GCS, raylets, dashboard, agents, "
                    "workers and job drivers), found by its GCS address and temp dir; other "
                    "Ray clusters are left alone (`ray stop` would stop every Ray process).")
    p.add_argument("--address", required=True, help="the cluster's GCS address, e.g. 127.0.0.1:6379")
    p.add_argument("--temp-dir", help="the cluster's own --temp-dir (as given to `ray start`)")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds to wait after SIGTERM before SIGKILL")
    args = p.parse_args(argv)
    try:
        found, left = stop_cluster(args.address, args.temp_dir, args.grace_period)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = f"the Ray cluster at {args.address}" + (f" ({args.temp_dir})" if args.temp_dir else "")
    if not found:
        print(f"no processes of {where}: nothing to stop", file=sys.stderr)
        return 0
    if left:
        print(f"error: {left} of {found} processes of {where} are still running", file=sys.stderr)
        return 1
    print(f"stopped {where}: {found} processes", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------- token authentication
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def cluster_auth_env() -> dict[str, str]:
    """RAY_AUTH_MODE for every process of a cluster this wrapper starts or talks to, so that
    they all agree: as given when set, else "token" when a token is at hand (~/.ray/auth_token,
    RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN), else "disabled".

    Without it Ray 2.60 decides per command: `ray start --head` turns token authentication on
    when ~/.ray/auth_token exists (any local `ray.init()` writes one), `ray start --address`
    and `ray job submit` do not, and the worker nodes are refused by their own head
    (AuthenticationError)."""
    if os.environ.get(AUTH_MODE_ENV):
        return {}
    from ray._raylet import AuthenticationTokenLoader

    has_token = AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)
    return {AUTH_MODE_ENV: "token" if has_token else "disabled"}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["stop-cluster"]:
        return _stop_main(args[1:])
    import ray._private.ray_constants  # noqa: F401  (reads the env before we change it)
    import ray._private.services as services

    resolve = services.resolve_ip_for_localhost

    def keep_loopback(host: str):
        return host if host in LOOPBACK else resolve(host)

    services.resolve_ip_for_localhost = keep_loopback
    os.environ.update(LOOPBACK_ENV)  # inherited by the GCS, raylets, agents, workers, jobs
    auth = cluster_auth_env()
    if auth:
        from ray._raylet import Config

        os.environ.update(auth)
        Config.initialize("")  # Ray's own way to make this process see a new RAY_AUTH_MODE
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *args]
    return ray_main()


if __name__ == "__main__":
    raise SystemExit(main())
