"""`python -m jaxppo.distributed.loopback <ray CLI args>`: the `ray` CLI for a cluster that
lives entirely on this machine's loopback interface (127.0.0.1).

Ray rewrites 127.0.0.1/localhost, both in `--node-ip-address` and in `--address`, to the
machine's outward IP (so that other machines could reach it), and so do the Ray processes
it starts whenever they connect by a loopback address (the dashboard's job agent, a job's
driver). A local multi-node test cluster should never leave loopback. This wrapper

* runs the `ray` CLI with loopback addresses kept as given, and
* starts every Ray process with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's own switch for
  "this machine's address is 127.0.0.1" (the CLI itself still allows `ray start --address`).

`make ray-cluster` starts the head and two worker nodes with it:

    python -m jaxppo.distributed.loopback start --head --node-ip-address=127.0.0.1 --port=6379 ...
    python -m jaxppo.distributed.loopback start --address=127.0.0.1:6379 \\
        --node-ip-address=127.0.0.1 --num-cpus=1 --dashboard-agent-listen-port=0

Only use it for single-machine clusters; on real clusters use the plain `ray` CLI.

`python -m jaxppo.distributed.loopback stop-cluster --address=127.0.0.1:6379 [--temp-dir=DIR]`
stops one such cluster (`make ray-stop`): `ray stop` has no way to choose a cluster and stops
every Ray process of the user on the machine. See `stop_cluster`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


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
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *args]
    return ray_main()


if __name__ == "__main__":
    raise SystemExit(main())
