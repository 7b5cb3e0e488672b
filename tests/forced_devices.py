"""Run a test file as a script in a subprocess with N forced CPU devices (XLA's host platform
device count), and read back the JSON its last `RESULT ` line prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_with_devices(script: str, devices: int = 2, timeout: float = 900) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                         + f" --xla_force_host_platform_device_count={devices}")}
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])
