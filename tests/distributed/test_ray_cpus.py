"""CPU devices in Ray workers: Ray reserves CPUs without pinning a process, so its affinity is
the whole machine; jaxppo gives a task or actor one CPU device per CPU Ray reserved for it,
and a host learner alone on its node one per CPU the node offers.

Its own file (not test_ray.py's shared cluster): it needs a node of 2 CPUs, and the tests'
one-device setting (conftest) left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from jaxppo.distributed import learner  # noqa: E402
from jaxppo.distributed.loopback import LOOPBACK_ENV  # noqa: E402

SCRIPT = textwrap.dedent("""
    import json, ray
    from jaxppo.distributed.learner import HostLearner
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"JAXPPO_CPU_DEVICES": "", "JAX_PLATFORMS": "cpu"}})

    @ray.remote(num_cpus=1, max_calls=1)  # a fresh worker: the count is fixed at jaxppo's import
    def task():
        from jaxppo import cpu_devices
        return cpu_devices.status["devices"]

    def learner(own_node):
        a = ray.remote(HostLearner).options(num_cpus=1).remote(None, None, 0, 1,
                                                                own_node=own_node)
        return a.info.remote()

    refs = {"task reserving 1 CPU": task.remote(),
            "learner sharing its node": learner(False),
            "learner alone on its node": learner(True)}
    out = {k: v if isinstance(v, int) else v["cpu_devices"] for k, v in
           zip(refs, ray.get(list(refs.values())))}
    print("DEVICES", json.dumps(out))
    ray.shutdown()
""")


def test_ray_workers_get_a_cpu_device_per_cpu_reserved(tmp_path):
    """On a node offering 2 CPUs of a machine of 2 or more cores: a task reserving 1 CPU gets
    one CPU device, not one per core; a host learner (1 CPU reserved) alone on its node takes
    the node's 2, one sharing it (a packed placement) its 1."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a machine of 2 or more cores to tell the counts apart")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k not in
           ("JAXPPO_CPU_DEVICES", "XLA_FLAGS")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", **LOOPBACK_ENV)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("DEVICES ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    assert json.loads(line[-1].split(" ", 1)[1]) == {
        "task reserving 1 CPU": 1, "learner sharing its node": 1, "learner alone on its node": 2}


@pytest.mark.parametrize("offered, cores, expected", [
    (1.0, {0, 1}, 1),        # `ray start --num-cpus=1` on a 2-core machine: one device
    (8.0, {0, 1}, 2),        # a node offering more than the process may run on: its cores
    (4.0, {0, 1, 2, 3}, 4),
    (None, {0, 1}, 2),       # a node that offers no CPU resource: its cores
])
def test_a_learner_alone_on_its_node_takes_the_cpus_the_node_offers(monkeypatch, offered,
                                                                    cores, expected):
    nodes = [{"NodeID": "other", "Resources": {"CPU": 64.0}},
             {"NodeID": "mine", "Resources": {} if offered is None else {"CPU": offered}}]
    monkeypatch.setattr(learner.os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(learner.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(learner.ray, "get_runtime_context",
                        lambda: SimpleNamespace(get_node_id=lambda: "mine"))
    assert learner.node_cores() == expected
