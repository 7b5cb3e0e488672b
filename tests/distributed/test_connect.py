"""Connecting to Ray: `--hosts N` with no cluster to join starts a private N-node loopback
cluster for the run. (A cluster that wants a token is named as such: tests/distributed/test_ray.py,
with `make ray-cluster`'s.)

README's multi-host line (`python -m jaxppo train --hosts 2 --env CartPole-v1`) must run as
written on a fresh machine: the driver starts N Ray nodes on 127.0.0.1, says so, trains on
them, and stops every process of that cluster when the run ends.
"""

from __future__ import annotations

import json
import shutil
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from jaxppo.distributed.cluster import choose_address  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _processes_naming(text: str) -> list[int]:
    """This user's processes whose command line mentions `text`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_no_cluster_to_join_chooses_a_new_one():
    # Nothing given, nothing recorded running: a new cluster, which connect() makes of
    # --hosts nodes.
    assert choose_address(None, None, [], set())[0] is None


@pytest.mark.slow
def test_hosts_without_a_cluster_start_a_private_one_and_stop_it(tmp_path):
    # A short Ray temp dir of its own (Unix socket paths have a length limit): this run's
    # cluster is told from any other on the machine by it. `--address local` asks for a new
    # cluster, which is what no --address does when none is running (test above); given
    # here so that a cluster another test runs meanwhile is not joined instead.
    ray_tmp = tempfile.mkdtemp(prefix="jxr-", dir="/tmp")
    try:
        _train_on_a_private_cluster(tmp_path, ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _train_on_a_private_cluster(tmp_path: Path, ray_tmp: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "jaxppo", "train", "--hosts", "2", "--env", "CartPole-v1",
           "--address", "local", "--runs-dir", str(tmp_path), "--run-name", "run", "--set",
           "num_envs=4", "num_steps=16", "num_minibatches=2", "num_epochs=1",
           "total_timesteps=192", "network.hidden_sizes=[16]"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Ray: started a private cluster of 2 nodes on this machine's loopback" in out.stderr
    assert "it stops when the run ends" in out.stderr
    hosts = [line for line in out.stderr.splitlines() if line.startswith("host ")]
    assert len(hosts) == 2 and all("node 127.0.0.1" in h for h in hosts), out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["hosts"] == 2 and summary["env_steps"] == 192
    # The cluster lived in that temp dir (its session folders are there), and every process
    # of it (they name the dir) is gone.
    assert list(Path(ray_tmp).glob("ray/session_*")), list(Path(ray_tmp).rglob("*"))[:20]
    deadline = time.monotonic() + 30
    while _processes_naming(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_naming(ray_tmp) == []
