"""Starting a bare Ray head node on loopback for a test (tests/distributed/)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(port: int, temp_dir: Path | str, env: dict) -> None:
    """`ray start --head` (through jaxppo's loopback wrapper) on 127.0.0.1:`port`, no CPUs,
    no dashboard, its files in `temp_dir`, the environment `env`."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxppo.distributed.loopback", "start", "--head",
         f"--port={port}", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1",
         "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats",
         "--object-store-memory=80000000", f"--ray-client-server-port={free_port()}",
         "--dashboard-agent-listen-port=0"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
