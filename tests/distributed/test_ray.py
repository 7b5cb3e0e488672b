"""Multi-host training over Ray, on a 2-node local cluster (1 CPU each) on loopback.

Every host is a separate process joined by jax.distributed (gloo collectives), running the
same compiled chunk as a single process; so each test compares a multi-host run with
`jaxppo.train` on one device at the same global batch.

One cluster (head with the dashboard + one worker node) serves the whole module. Everything
binds 127.0.0.1: the nodes get node_ip_address=127.0.0.1 and every Ray process inherits
jaxppo.distributed.loopback.LOOPBACK_ENV, so no Ray process swaps in the outward IP.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml

ray = pytest.importorskip("ray")

import jaxppo  # noqa: E402
from jaxppo import NetworkConfig, PPOConfig  # noqa: E402
from jaxppo.config import ConfigError  # noqa: E402
from jaxppo.distributed import (DistributedError, HostsConfigError,  # noqa: E402
                                NotEnoughNodesError, train_distributed)
from jaxppo.distributed.cluster import _quiet_fork_warning, connect  # noqa: E402
from jaxppo.distributed.loopback import LOOPBACK_ENV, listening_sockets  # noqa: E402
from ray_heads import free_port, start_head  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
COMPARED = ("episode_return_mean", "episodes", "episode_length_mean", "policy_loss",
            "value_loss", "entropy", "kl", "clip_fraction", "explained_variance", "grad_norm",
            "kl_coeff", "lr", "env_steps")


def tiny(cache_dir=None, **kw) -> PPOConfig:
    base = dict(env="CartPole-v1", num_envs=4, num_steps=16, num_minibatches=2, num_epochs=2,
                total_timesteps=4 * 16 * 2, network=NetworkConfig((16, 16)),
                compilation_cache_dir=cache_dir)
    base.update(kw)
    return PPOConfig(**base)


HEALTH_CHECK_ENV = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "2000", "RAY_health_check_failure_threshold": "4"}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        for k, v in LOOPBACK_ENV.items():
            mp.setenv(k, v)
        # Ray notices a dead node after missed health checks (by default ~15-30 s); checked
        # more often here, the lost-node tests spend seconds, not half a minute, waiting.
        for k, v in HEALTH_CHECK_ENV.items():
            mp.setenv(k, v)
        # Ray 2.60 reads and writes a token in ~/.ray; the tests' cluster uses none.
        mp.setenv("RAY_AUTH_MODE", "disabled")
        # Every learner writes the programs it compiles to the compilation cache, host 1's
        # too (JAX writes from process 0 only): the module's runs start the same programs
        # again and again (every_host_caches/sitecustomize.py).
        mp.setenv("PYTHONPATH", str(Path(__file__).parent / "every_host_caches"),
                  prepend=os.pathsep)
        port = free_port()
        with _quiet_fork_warning():
            c = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=True,
                dashboard_host="127.0.0.1", dashboard_port=port,
                object_store_memory=100 * 1024 * 1024))
        try:
            with _quiet_fork_warning():
                c.add_node(num_cpus=1, node_ip_address="127.0.0.1",
                           object_store_memory=100 * 1024 * 1024)
            c.wait_for_nodes()
            connect(c.address)
            yield SimpleNamespace(cluster=c, dashboard=f"http://127.0.0.1:{port}")
        finally:
            ray.shutdown()
            c.shutdown()


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(multi, single, atol=1e-5):
    """Metrics and final params of a multi-host run equal those of one process."""
    for k in COMPARED:
        np.testing.assert_allclose(np.asarray(multi.metrics[k], np.float64),
                                   np.asarray(single.metrics[k], np.float64),
                                   rtol=1e-4, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(multi.params), jax.tree.leaves(single.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)


# ---------------------------------------------------------------------- exactness
# The one 2-host run compared with one process, with everything that could differ on hosts in
# play: every global statistic (observation and reward normalisation, advantage moments, the KL
# penalty and its coefficient), a clipped value loss, a GRU policy (whole env sequences per
# minibatch on each shard) with a count-bonus reward hook (global visit counts), and 2 forced
# CPU devices on each host (an axis over hosts x local devices). Shard invariance of each of
# these on one host's devices is checked in tests/core/test_pmap.py; sync="batch" on hosts, in
# the resumed run below (ray_runs).
EXACT = dict(env="MemoryChain-bsuite", network=NetworkConfig((16,), recurrent_size=8),
             transforms=[{"count_bonus": {"scale": 0.1}}], num_envs=8,
             normalize_observations=True, normalize_rewards=True, use_kl_loss=True,
             vf_clip_param=10.0, total_timesteps=8 * 16 * 6, log_every=2)
TWO_DEVICES = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}


@pytest.fixture(scope="module")
def two_host_run(cluster, compile_cache_dir, tmp_path_factory):
    """The module's 2-host run (2 devices each) and the same config in one process; after its
    first chunk the TCP sockets every learner and the driver listen on are recorded
    (`listening`: {"driver" or learner pid: [(address, port)]}). The failure tests restart
    runs of this config (learner_env: the same programs, from the compilation cache) and
    compare them with `single`."""
    from ray.util.state import list_actors

    run = tmp_path_factory.mktemp("hosts") / "run"
    cfg = tiny(compile_cache_dir, **EXACT)
    listening = {}

    def record_listeners(rows):
        if not listening:
            for actor in list_actors(filters=[("class_name", "=", "HostLearner"),
                                              ("state", "=", "ALIVE")]):
                listening[actor.pid] = listening_sockets(actor.pid)
            listening["driver"] = listening_sockets()

    return SimpleNamespace(cfg=cfg, run=run, listening=listening, learner_env=TWO_DEVICES,
                           result=train_distributed(cfg, hosts=2, run_dir=run, progress=False,
                                                    plot=False, callback=record_listeners,
                                                    learner_env=TWO_DEVICES),
                           single=jaxppo.train(cfg, progress=False))


def test_two_hosts_match_one_process(two_host_run):
    """2 hosts x 2 devices x 2 envs == 1 process x 8 envs: a GRU policy with a count-bonus
    reward hook, and every global statistic in play; no special code for any of it on hosts."""
    r = two_host_run
    assert r.result.hosts == 2 and r.result.num_devices == 4 and not r.result.host_failures
    _assert_same_run(r.result, r.single)
    # The driver wrote the whole run folder, through the same run loop as `jaxppo train`.
    for name in ("config.yaml", "metrics.jsonl", "params.msgpack", "summary.json"):
        assert (r.run / name).exists(), name
    assert [row["iteration"] for row in _rows(r.run)] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((r.run / "summary.json").read_text())
    assert summary["hosts"] == 2 and summary["envs_per_host"] == 4
    # Params are replicated: every shard of the final state holds the same ones.
    for leaf in jax.tree.leaves(r.result.state.params):
        for shard in leaf[1:]:
            np.testing.assert_array_equal(leaf[0], shard)
    # The result's policy acts with one copy of them.
    assert np.isfinite(r.result.evaluate(episodes=2, max_steps=20)["return_mean"])


def test_a_run_listens_on_the_cluster_address_only(two_host_run):
    """Every socket the learners and the driver listen on during a run (the jax.distributed
    coordinator, gloo, Ray's servers in them) is on the nodes' address, 127.0.0.1 here:
    none on all interfaces (0.0.0.0, ::), where JAX binds its coordinator by default."""
    listening = two_host_run.listening
    learners = [pid for pid in listening if pid != "driver"]
    assert len(learners) == 2, listening
    # host 0 serves the coordinator and gloo besides Ray's servers: more than one socket
    assert max(len(listening[pid]) for pid in learners) >= 2, listening
    for who, sockets in listening.items():
        assert sockets, (who, listening)
        assert all(address == "127.0.0.1" for address, _ in sockets), (who, sockets)


def test_listening_sockets_names_the_bound_address():
    """The check above reads /proc: an all-interfaces listener is reported as such."""
    with socket.socket() as a, socket.socket(socket.AF_INET6) as b, socket.socket() as c:
        a.bind(("127.0.0.1", 0))
        b.bind(("::", 0))
        c.bind(("0.0.0.0", 0))
        for s in (a, b, c):
            s.listen()
        expected = {("127.0.0.1", a.getsockname()[1]), ("::", b.getsockname()[1]),
                    ("0.0.0.0", c.getsockname()[1])}
        assert expected <= set(listening_sockets())


# ---------------------------------------------------------------------- failures
# Two runs of the module's config, each with the numbers of an uninterrupted run: a learner
# process, then a whole worker node (its raylet) killed in one run that may go on with fewer
# hosts; a worker node killed in a run that must wait for a node to replace it and that
# snapshots rarely (it replays from the start).
def _kill_a_learner(killed: list) -> None:
    """SIGKILL the process of one learner (the newest); its pid goes to `killed`."""
    from ray.util.state import list_actors

    alive = list_actors(filters=[("class_name", "=", "HostLearner"), ("state", "=", "ALIVE")])
    pid = sorted(a.pid for a in alive)[-1]
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)


class _OnLog(logging.Handler):
    """Calls `action` once, when a record contains `text` (in the thread that logs it: Ray's
    Cluster.add_node must run in the main thread)."""

    def __init__(self, text: str, action):
        super().__init__(logging.DEBUG)
        self.text, self.action, self.done = text, action, False

    def emit(self, record):
        if not self.done and self.text in record.getMessage():
            self.done = True
            self.action()


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and int(
                    Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _add_worker_node(cluster):
    with _quiet_fork_warning():
        return cluster.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1",
                                        object_store_memory=100 * 1024 * 1024)


def _kill_raylet(worker, killed: list) -> None:
    """SIGKILL the raylet of the worker node `worker` and wait for its learner to go (Ray
    notices the node's death only after missed health checks). `killed` gets the raylet's
    pid, the time of the kill, and the seconds its learner outlived it."""
    from ray._private import ray_constants

    raylet = worker.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    learners = [pid for pid in _children(raylet) if "HostLearner" in _cmdline(pid)]
    assert len(learners) == 1, learners
    worker.kill_raylet()
    killed.extend([raylet, time.monotonic()])
    # Its learner goes when it notices (within seconds); the chunks are shorter.
    deadline = time.monotonic() + 30
    while Path(f"/proc/{learners[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{learners[0]}").exists(), "the learner outlived its raylet"
    killed.append(time.monotonic() - killed[1])


def _run_losing_a_node(cluster, two_host_run, run_dir: Path, caplog, capfd, min_hosts,
                       learner_killed_at=None, snapshot_every_s=0.0):
    """Train the module's config (6 iterations; its programs and its one-process run are
    shared) on 2 hosts and SIGKILL the worker node's raylet after iteration 4 if a learner's
    process is killed after iteration `learner_killed_at`, else after iteration 2. When the
    driver says it waits for a node, one joins. Gives the module's cluster its second node
    back. Returns (result, the driver's log messages, its stderr lines, the raylet kill's
    iteration)."""
    worker = next(iter(cluster.cluster.worker_nodes))
    raylet_at = 2 if learner_killed_at is None else 4
    learner_killed, killed, added = [], [], []

    def on_rows(rows):
        if rows[-1]["iteration"] == learner_killed_at and not learner_killed:
            _kill_a_learner(learner_killed)
        elif rows[-1]["iteration"] == raylet_at and not killed:
            _kill_raylet(worker, killed)

    on_wait = _OnLog("waiting up to", lambda: added.append(_add_worker_node(cluster)))
    log = logging.getLogger("jaxppo.distributed")
    log.addHandler(on_wait)
    try:
        with caplog.at_level(logging.INFO, logger="jaxppo.distributed"):
            result = train_distributed(two_host_run.cfg, hosts=2, min_hosts=min_hosts,
                                       run_dir=run_dir, progress=False, plot=False,
                                       callback=on_rows, snapshot_every_s=snapshot_every_s,
                                       learner_env=two_host_run.learner_env)
        recovered_s = time.monotonic() - killed[1]
    finally:
        log.removeHandler(on_wait)
        if killed:  # give the module's cluster its second node back
            cluster.cluster.remove_node(worker, allow_graceful=False)
            if not added:
                _add_worker_node(cluster)
            cluster.cluster.wait_for_nodes()
    messages = [r.getMessage() for r in caplog.records]
    stderr = capfd.readouterr().err.splitlines()
    assert learner_killed or learner_killed_at is None
    assert bool(added) == (min_hosts is None)
    print(f"killed raylet pid {killed[0]}; its learner exited {killed[2]:.1f}s later; the run "
          f"finished {recovered_s:.1f}s after the kill; failures: {result.host_failures}; "
          f"driver stderr {len(stderr)} lines, hosts.log "
          f"{len((run_dir / 'hosts.log').read_text().splitlines())}")
    return result, messages, stderr, raylet_at


def _assert_lost_node_reported(run_dir: Path, messages, stderr, restarted_from: int) -> None:
    """The lost node is named, with the snapshot the group restarts from and the hosts' log;
    the driver's terminal gets its own lines only: what Ray forwards (the dead raylet's state
    dump, the node's death, the learners' abort traces) goes to RUN_DIR/hosts.log."""
    hosts_log = run_dir / "hosts.log"
    assert any(m.startswith("lost host") and "node 127.0.0.1" in m and
               f"restarting the group from the state after iteration {restarted_from} " in m and
               str(hosts_log) in m for m in messages), messages
    assert len(stderr) <= 5 and not [line for line in stderr if "raylet" in line
                                     or "pid=" in line], stderr[:50]
    assert "pid=" in hosts_log.read_text()
    assert json.loads((run_dir / "summary.json").read_text())["hosts_log"] == "hosts.log"


@pytest.mark.slow
def test_a_killed_learner_then_a_lost_node_continue_on_fewer_hosts(cluster, two_host_run,
                                                                   tmp_path, caplog, capfd):
    """Two failures in one run with a snapshot after every chunk (the default) and
    min_hosts=1. SIGKILL of one learner's process after iteration 2: the group restarts on 2
    hosts from the snapshot after iteration 2. SIGKILL of the worker node's raylet after
    iteration 4 (its learner dies with it): the run goes on with the host that is left, from
    the snapshot after iteration 4. Every iteration is logged once and the numbers are those
    of an uninterrupted run."""
    run = tmp_path / "run"
    result, messages, stderr, at = _run_losing_a_node(cluster, two_host_run, run, caplog, capfd,
                                                      min_hosts=1, learner_killed_at=2)
    failures = [f["iteration"] for f in result.host_failures]
    assert failures.count(3) == 1 and failures[0] == 3 and failures[1] == 5, failures
    assert any("restarting the group from the state after iteration 2 " in m
               for m in messages), messages
    _assert_lost_node_reported(run, messages, stderr, restarted_from=at)
    assert result.hosts == 1
    assert any("continuing on 1 host(s) instead of 2" in m for m in messages), messages
    assert [row["iteration"] for row in _rows(run)] == [1, 2, 3, 4, 5, 6]
    _assert_same_run(result, two_host_run.single)


@pytest.mark.slow
def test_a_lost_node_is_waited_for_and_rare_snapshots_replay_from_the_start(
        cluster, two_host_run, tmp_path, caplog, capfd):
    """SIGKILL of a worker node's raylet after iteration 2 (its learner dies with it) in a run
    that needs 2 hosts (min_hosts by default) and snapshots rarely (only the initial state):
    it waits for a node to replace the lost one (here one joins once the driver says it
    waits), goes on with 2 hosts from the initial state and replays iterations 1-2; every
    iteration is logged once and the numbers are those of an uninterrupted run. (The restart
    from the snapshot after the last chunk, the default, is
    test_a_killed_learner_then_a_lost_node_continue_on_fewer_hosts'.)"""
    run = tmp_path / "run"
    result, messages, stderr, _ = _run_losing_a_node(cluster, two_host_run, run, caplog, capfd,
                                                     min_hosts=None, snapshot_every_s=1e9)
    assert result.host_failures and result.host_failures[0]["iteration"] == 3
    _assert_lost_node_reported(run, messages, stderr, restarted_from=0)
    assert result.hosts == 2
    assert any("fewer than min_hosts=2: waiting up to 60s for a node to replace the lost "
               "one (--min-hosts 1 would continue without it)" in m for m in messages), messages
    assert any("the group runs again on 2 hosts" in m for m in messages), messages
    assert [row["iteration"] for row in _rows(run)] == [1, 2, 3, 4, 5, 6]
    _assert_same_run(result, two_host_run.single)


# ---------------------------------------------------------------------- bad input
def test_more_hosts_than_nodes_is_a_clear_error(cluster, tmp_path, monkeypatch):
    """The count is of the nodes that can hold a learner, of all alive ones, in the cluster
    joined, before any placement is asked for (which would wait for nodes that are not
    there); the message names the ways to more nodes."""
    from jaxppo.distributed import group

    def no_placement(*args, **kwargs):
        raise AssertionError("a placement group was asked for")

    monkeypatch.setattr(group, "placement_group", no_placement)
    with pytest.raises(NotEnoughNodesError, match=r"hosts=3 .* only 2 alive node") as e:
        train_distributed(tiny(num_envs=6, total_timesteps=6 * 16), hosts=3,
                          run_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()  # nothing written
    msg = str(e.value)
    assert "hosts=3 needs 3 Ray nodes with 1 CPU each" in msg, msg
    assert f"the Ray cluster at {cluster.cluster.address} has only 2 alive node(s) with " \
           "that, of 2 alive: " in msg, msg
    assert msg.count("(CPU 1, GPU 0)") == 2, msg
    for fix in ("make ray-cluster RAY_WORKERS=3", "--address <head>:6379",
                "RAY_ADDRESS=<head>:6379", "--hosts 2"):
        assert fix in msg, (fix, msg)


def test_cpus_another_job_holds_are_a_clear_error_after_the_placement_timeout(cluster, tmp_path):
    """Both nodes can hold a learner, but another job holds one node's CPU: the placement
    waits placement_timeout_s (the count of nodes never drops), then says so; nothing is
    written and the cluster is left as it was."""
    from ray.util.placement_group import placement_group, remove_placement_group

    held = placement_group([{"CPU": 1}])
    ray.get(held.ready(), timeout=30)
    try:
        with pytest.raises(NotEnoughNodesError) as e:
            train_distributed(tiny(num_envs=4, total_timesteps=4 * 16), hosts=2,
                              run_dir=tmp_path / "run", progress=False, placement_timeout_s=2)
    finally:
        remove_placement_group(held)
    assert not (tmp_path / "run").exists()  # nothing written
    msg = str(e.value)
    assert "could not reserve 1 CPU for each of 2 learners (placement STRICT_SPREAD) within " \
           "2s: other jobs hold some of the nodes' resources (`ray status`" in msg, msg
    assert "train on fewer hosts (--hosts)" in msg, msg
    assert msg.count("(CPU 1, GPU 0)") == 2, msg
    deadline = time.monotonic() + 20  # placement groups are removed asynchronously
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2, ray.available_resources()


def test_the_cluster_is_chosen_as_ray_users_expect(tmp_path):
    """--address, else RAY_ADDRESS, else the newest cluster `ray start` recorded that still
    runs, else a new local instance; 'local' and 'auto' as Ray reads them."""
    from jaxppo.distributed.cluster import ClusterUnreachableError, choose_address

    a, b = tmp_path / "a" / "ray_current_cluster", tmp_path / "b" / "ray_current_cluster"
    recorded = [("127.0.0.1:7001", a), ("127.0.0.1:7002", b)]  # newest first
    running = {"127.0.0.1:7001", "127.0.0.1:7002"}
    assert choose_address("10.0.0.1:6379", "10.0.0.2:6379", recorded, running) == \
        ("10.0.0.1:6379", "--address")
    assert choose_address(None, "10.0.0.2:6379", recorded, running) == ("10.0.0.2:6379", "RAY_ADDRESS")
    address, how = choose_address(None, None, recorded, running)
    assert address == "127.0.0.1:7001" and str(a) in how and "also running: 127.0.0.1:7002" in how
    # A recorded cluster that was stopped is passed over.
    address, how = choose_address(None, "", recorded, {"127.0.0.1:7002"})
    assert address == "127.0.0.1:7002" and str(b) in how and "also" not in how
    assert choose_address(None, None, recorded, set())[0] is None
    assert choose_address(None, None, [], running)[0] is None  # not `ray start`'s: not joined
    assert choose_address(None, None, [], running)[1] == \
        "no --address, RAY_ADDRESS or running cluster on this machine"
    assert choose_address("local", None, recorded, running) == (None, "--address local")
    assert choose_address(None, "local", recorded, running) == (None, "RAY_ADDRESS=local")
    assert choose_address("auto", None, recorded, running)[0] == "127.0.0.1:7001"
    assert choose_address("auto", "10.0.0.2:6379", recorded, running)[0] == "10.0.0.2:6379"  # as Ray
    with pytest.raises(ClusterUnreachableError, match="no Ray cluster started by `ray start` is "
                                                      "running on this machine"):
        choose_address(None, "auto", recorded, set())
    # Without a process list, a recorded cluster counts as running when its port answers.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        dead = f"127.0.0.1:{free_port()}"
        assert choose_address(None, None, [(dead, a), (live, b)], None)[0] == live
        assert choose_address(None, None, [(dead, a)], None)[0] is None


def test_a_running_cluster_is_found_from_what_ray_start_records(cluster):
    """The module's cluster, as `ray start --head` does, recorded its address in Ray's
    temp dir; it is found there, its raylets name it, and it would be joined."""
    from jaxppo.distributed import cluster as cl

    address = cluster.cluster.address
    recorded = cl.recorded_clusters()
    running = cl.running_gcs_addresses()
    assert address in [a for a, _ in recorded] and address in running
    mine = [(a, f) for a, f in recorded if a == address]
    chosen, how = cl.choose_address(None, None, mine, running)
    assert chosen == address and "running on this machine, recorded by `ray start`" in how


def test_coordinator_port_in_use_is_a_clear_error(cluster):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # host 0's own check, before any learner joins (not a join's timeout)
        with pytest.raises(DistributedError, match=rf"coordinator port {port} .* not free") as e:
            train_distributed(tiny(), hosts=2, progress=False, coordinator_port=port)
        assert "no answer from the learners" not in str(e.value)


def test_learners_that_cannot_start_their_backend_are_a_clear_error(cluster, tmp_path):
    """Learners asked for a platform their node lacks fail while joining: one clear error
    naming the stage and the cause, the learner's own (not the join's timeout), and no run
    folder."""
    with pytest.raises(DistributedError,
                       match=r"while joining the jax.distributed group .*cuda") as e:
        train_distributed(tiny(), hosts=2, run_dir=tmp_path / "run", progress=False,
                          learner_env={"JAX_PLATFORMS": "cuda"})
    assert "no answer from the learners" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_different_versions_on_the_nodes_is_a_clear_error(cluster, monkeypatch):
    import jaxppo.distributed.group as group

    mine = group.versions()
    monkeypatch.setattr(group, "versions", lambda: {**mine, "jax": "0.0.1"})
    with pytest.raises(DistributedError, match=r"host 0 .* jax 0\.0\.1 here but .* there"):
        train_distributed(tiny(), hosts=2, progress=False)


def test_a_learners_own_error_names_its_host_and_where_it_was_raised():
    """An exception a learner raises (an env's, in an actor thread or the host loop), as the
    driver reports it: the host, the error, jaxppo's note of where (the actor thread), else
    the line that raised from Ray's traceback; config errors pass through as they are."""
    from jaxppo.distributed.group import _task_error

    class Remote(Exception):  # what ray.get raises: Ray's traceback text and the cause
        pass

    e = Remote('ray::HostLearner.train_chunk() (pid=1, ip=127.0.0.1)\n'
               '  File "/x/jaxppo/run/hostloop.py", line 240, in _step\n'
               '  File "/x/my_env.py", line 12, in step\nRuntimeError: the simulator crashed')
    e.cause = RuntimeError("the simulator crashed")
    e.cause.add_note("jaxppo: actor thread 0 of 1 (envs 2-3) raised this while playing "
                     "rollout 6 (iteration 7); the run stopped. Where: my_env.py:12 in step")
    e.cause.add_note("a note of someone else's")
    msg = str(_task_error(e, "running train_chunk", 1))
    assert msg.startswith("the learner of host 1 failed while running train_chunk: RuntimeError: "
                          "the simulator crashed (actor thread 0 of 1 (envs 2-3) raised this "
                          "while playing rollout 6 (iteration 7); the run stopped. Where: "
                          "my_env.py:12 in step). See the learners' logs"), msg
    e.cause = RuntimeError("the simulator crashed")
    msg = str(_task_error(e, "running train_chunk", 0))
    assert ("the learner of host 0 failed while running train_chunk: RuntimeError: the "
            "simulator crashed (raised at my_env.py:12 in step). See") in msg, msg
    e.cause = ConfigError("lr must be > 0")
    assert _task_error(e, "starting") is e.cause


def test_envs_not_divisible_by_hosts_is_a_config_error():
    with pytest.raises(HostsConfigError) as e:
        train_distributed(tiny(num_envs=5), hosts=2, progress=False)
    assert isinstance(e.value, ConfigError)
    msg = str(e.value)
    assert "num_envs=5" in msg and "hosts=2" in msg
    assert "[1, 5]" in msg and "num_envs=4 or 6" in msg
    with pytest.raises(HostsConfigError, match="min_hosts=3 is more than hosts=2"):
        train_distributed(tiny(), hosts=2, min_hosts=3, progress=False)


# `python -m MODULE ARGS` with ray.init made to fail loudly: the entry point must refuse
# before it, as ray.init would wait about a minute for a GCS that is not there.
WITHOUT_RAY_INIT = textwrap.dedent("""\
    import runpy, sys, ray
    def init(*args, **kwargs):
        raise SystemExit("ray.init was called")
    ray.init = init
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
    """)


def test_no_cluster_at_ray_address(tmp_path):
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY_INIT, "jaxppo.distributed", "--hosts", "2", "--env",
         "CartPole-v1", "--defaults", "--runs-dir", str(tmp_path), "--run-name", "unreachable"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no Ray cluster reachable at RAY_ADDRESS=127.0.0.1:1" in proc.stderr
    assert "make ray-cluster" in proc.stderr
    assert not (tmp_path / "unreachable").exists()  # nothing left behind


def test_jaxppo_train_address_names_the_cluster(tmp_path, capsys):
    """`jaxppo train --hosts H --address A` connects to A (before RAY_ADDRESS); --address
    without --hosts is refused before anything starts."""
    from jaxppo import cli

    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:2", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxppo", "train", "--hosts", "2", "--address", "127.0.0.1:1",
         "--env", "CartPole-v1", "--defaults", "--runs-dir", str(tmp_path), "--run-name", "r"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no Ray cluster reachable at --address 127.0.0.1:1" in proc.stderr
    assert "fix --address, or leave it out" in proc.stderr
    assert not (tmp_path / "r").exists()
    assert cli.main(["train", "--address", "127.0.0.1:1", "--env", "CartPole-v1",
                     "--runs-dir", str(tmp_path)]) == 2
    assert "--address 127.0.0.1:1 names a Ray cluster to train on, which only --hosts H does" \
        in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_resume_with_env_is_refused_by_the_job_entry_point(tmp_path, capsys):
    """A resumed run takes its env from its config.yaml: --env with --resume is an error (as
    with `jaxppo train`), before Ray is touched."""
    from jaxppo.distributed.__main__ import main

    assert main(["--hosts", "2", "--resume", str(tmp_path), "--env", "Acrobot-v1"]) == 2
    assert "--env cannot be combined with --resume" in capsys.readouterr().err


def test_dashboard_port_as_address_is_a_clear_error(cluster, tmp_path):
    """The dashboard's HTTP port given as the cluster address: an error before ray.init (which
    would wait a minute for a GCS there)."""
    port = cluster.dashboard.rsplit(":", 1)[1]
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY_INIT, "jaxppo.distributed", "--hosts", "2", "--env",
         "CartPole-v1", "--defaults", "--address", f"127.0.0.1:{port}", "--runs-dir",
         str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "dashboard (job submission) port" in proc.stderr and "ray job submit" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_library_info_logs_are_kept_out_of_a_jobs_output():
    """Even with the root logger at INFO (as a library or site config may set it), the job's
    logging setup keeps orbax's INFO lines (~50 per checkpoint) out; jaxppo's get through."""
    code = textwrap.dedent("""
        import logging, tempfile
        import numpy as np
        logging.basicConfig(level=logging.INFO)
        from jaxppo.distributed.cluster import quiet_library_logs
        quiet_library_logs()
        from jaxppo.run.checkpoints import CheckpointStore
        store = CheckpointStore(tempfile.mkdtemp())
        for step in (1, 2):
            store.save(step, {"a": np.zeros(3)}, {"x": 1})
        store.close()
        logging.getLogger("jaxppo.distributed").warning("kept")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert lines == ["WARNING:jaxppo.distributed:kept"], lines[:20]


def test_single_host_training_never_imports_ray():
    code = textwrap.dedent("""
        import sys
        import jaxppo
        cfg = jaxppo.PPOConfig(num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                               total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                               compilation_cache_dir=None)
        jaxppo.train(cfg, progress=False)
        assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray"))
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


# ---------------------------------------------------------------------- runs
@pytest.mark.slow
def test_a_submitted_job_learns_cartpole_on_two_hosts_and_writes_its_run_folder(
        cluster, compile_cache_dir, tmp_path):
    """`ray job submit ... -- python -m jaxppo.distributed --hosts 2`: the tuned CartPole batch
    (16 envs x 128 steps, 8 epochs x 8 minibatches) for 30 iterations learns, and the driver
    writes the whole run folder and one progress line per iteration to the job's log."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard)
    # 30 iterations of 2048 env steps and a warning about the rest; checkpoints at 10, 20, 30.
    sets = ["num_envs=16", "num_steps=128", "num_minibatches=8", "num_epochs=8", "lr=5e-4",
            f"total_timesteps={16 * 128 * 30 + 100}", "checkpoint_every=10", "log_every=1",
            f"compilation_cache_dir={compile_cache_dir or 'null'}"]
    entry = (f"{sys.executable} -m jaxppo.distributed --hosts 2 --env CartPole-v1 --defaults "
             f"--runs-dir {tmp_path} --run-name job --set "
             + " ".join(sets))
    runtime_env = {"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}}
    # The dashboard accepts jobs only once a node's job agent has registered, which can take
    # a while on a loaded machine ("No available agent to submit job"): wait for it.
    ready_by = time.monotonic() + 120
    while True:
        try:
            job = client.submit_job(entrypoint=entry, runtime_env=runtime_env)
            break
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > ready_by:
                raise
            time.sleep(2.0)
    deadline = time.monotonic() + 240
    status = client.get_job_status(job)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(1.0)
        status = client.get_job_status(job)
    logs = client.get_job_logs(job)
    if not status.is_terminal():
        client.stop_job(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    run = tmp_path / "job"
    for name in ("config.yaml", "metrics.jsonl", "params.msgpack", "summary.json", "curve.png"):
        assert (run / name).exists(), name
    rows = _rows(run)
    assert [r["iteration"] for r in rows] == list(range(1, 31))
    ret = [r["episode_return_mean"] for r in rows]
    # Random play scores ~22 (the first iteration); a learning run is far above it.
    assert ret[0] < 40, ret[:3]
    assert np.nanmean(ret[-5:]) > 120, ret
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hosts"] == 2 and summary["env_steps"] == 16 * 128 * 30
    from jaxppo.run.checkpoints import CheckpointStore

    with CheckpointStore(run, read_only=True) as store:
        assert store.steps() == [10, 20, 30]
    assert "done: final return" in logs and "on 2 hosts" in logs
    # The job's output: jaxppo's progress (plain lines: not a terminal) and warnings, once;
    # no INFO lines of orbax/absl (checkpoints), no config warnings repeated by the learners.
    lines = logs.splitlines()
    assert sum("[CartPole-v1 x2 hosts] iter" in line for line in lines) == 30, logs[-3000:]
    assert not [line for line in lines if "absl" in line or "orbax" in line], logs[-3000:]
    assert not [line for line in lines if "HostLearner" in line and "Warning" in line], logs
    print(f"job output: {len(lines)} lines")


# ---------------------------------------------------------------------- checkpoints and resume
STOP = 3


def _ckpt_cfg(cache_dir):
    # 5 iterations, checkpoints every 2: stopping after 3 is off the grid (saved at 2 and 3),
    # the resumed run saves at 4 and 5; every global statistic is in play. sync="batch": the
    # rollouts are all-gathered across the hosts once per iteration and every host runs the
    # whole update (the module's other 2-host run all-reduces gradients).
    return tiny(cache_dir, total_timesteps=4 * 16 * 5, checkpoint_every=2, keep_checkpoints=2,
                normalize_observations=True, normalize_rewards=True, use_kl_loss=True,
                sync="batch")


def _folder_digest(path: Path) -> dict:
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "<dir>" for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def ray_runs(cluster, compile_cache_dir, tmp_path_factory):
    """A single-process run to the end; a 2-host run stopped after STOP iterations (a copy
    is kept as `stopped`) and then resumed through `jaxppo train --hosts 2 --resume`."""
    import shutil

    from jaxppo import cli

    base = tmp_path_factory.mktemp("ray-ckpt")
    cfg = _ckpt_cfg(compile_cache_dir)
    full = jaxppo.train(cfg, run_dir=base / "full", progress=False, plot=False)
    part = train_distributed(cfg, hosts=2, run_dir=base / "part", progress=False,
                             stop_after_iterations=STOP, plot=False)
    shutil.copytree(base / "part", base / "stopped")
    rows_before = _rows(base / "part")
    rc = cli.main(["train", "--hosts", "2", "--resume", str(base / "part"), "--no-progress",
                   "--no-plot"])
    return SimpleNamespace(base=base, cfg=cfg, full=full, part=part, rc=rc,
                           rows_before=rows_before)


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in ("wall_time", "sps")} for r in rows]


def test_stopped_and_resumed_two_host_run_continues_exactly(ray_runs):
    """A 2-host run with sync="batch", stopped and resumed, gives every iteration once and the
    numbers of one uninterrupted process."""
    from jaxppo.run.checkpoints import CheckpointStore, load_params_dict

    r = ray_runs
    assert not r.part.completed and r.part.iterations_done == STOP
    assert [row["iteration"] for row in r.rows_before] == [1, 2, 3]
    assert r.rc == 0
    full_rows, resumed_rows = _rows(r.base / "full"), _rows(r.base / "part")
    assert [row["iteration"] for row in resumed_rows] == [1, 2, 3, 4, 5]  # each once
    for a, b in zip(resumed_rows, full_rows):
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6, nan_ok=True), (a["iteration"], k)
    saved = load_params_dict(r.base / "part" / "params.msgpack")
    for a, b in zip(jax.tree.leaves(saved["params"]), jax.tree.leaves(r.full.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    # The checkpoint holds the whole run unsharded: every env in global order.
    with CheckpointStore(r.base / "part", read_only=True) as ps:
        assert ps.steps() == [4, 5]
        state, meta = ps.restore(5)
        assert meta["hosts"] == 2 and meta["state_layout"] == "unsharded"
        assert meta["env_steps"] == 5 * r.cfg.batch_size
        np.testing.assert_array_equal(np.asarray(state["env_ids"]), np.arange(4))
    summary = json.loads((r.base / "part" / "summary.json").read_text())
    assert summary["iterations"] == 5 and summary["completed"]


def test_two_host_checkpoint_resumes_on_one_process_and_one_host(ray_runs, tmp_path):
    """A checkpoint does not depend on the layout that wrote it."""
    import shutil

    for name, resume in (("local", lambda run: jaxppo.train(None, resume=run, progress=False,
                                                             plot=False)),
                         ("one-host", lambda run: train_distributed(
                             None, hosts=1, resume=run, progress=False, plot=False))):
        run = tmp_path / name
        shutil.copytree(ray_runs.base / "stopped", run)
        result = resume(run)
        assert result.resumed_from == STOP and result.completed, name
        rows = _rows(run)
        assert [row["iteration"] for row in rows] == [1, 2, 3, 4, 5], name
        for a, b in zip(rows, _rows(ray_runs.base / "full")):
            for k in COMPARED:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6, nan_ok=True), (name, k)


def test_corrupt_checkpoint_is_a_clear_error_and_nothing_changes(ray_runs, tmp_path):
    import shutil

    from jaxppo.run.checkpoints import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(ray_runs.base / "stopped", run)
    step_dir = run / "checkpoints" / str(STOP)
    data = max((p for p in (step_dir / "state" / "d").iterdir()), key=lambda p: p.stat().st_size)
    data.write_bytes(np.random.default_rng(0).bytes(data.stat().st_size))
    before = _folder_digest(run)
    with pytest.raises(CheckpointError) as info:
        train_distributed(None, hosts=2, resume=run, progress=False)
    msg = str(info.value)
    assert str(step_dir) in msg and "corrupt or incomplete" in msg and "iteration 2" in msg
    with pytest.raises(ConfigError, match=r"num_envs=8.*num_envs=4"):
        train_distributed(ray_runs.cfg.replace(num_envs=8), hosts=2, resume=run, progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        train_distributed(None, hosts=2, resume=tmp_path / "nope", progress=False)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train_distributed(ray_runs.cfg, hosts=2, run_dir=run, progress=False)
    assert _folder_digest(run) == before


# ---------------------------------------------------------------------- envs that step in Python
# A gymnasium or envpool env steps in each host's own host loop (or actor threads) on its share
# of the envs, and the learners' update spans every host's devices. Each 2-host run below is
# compared with one process at the same global num_envs, stopped and resumed (or restarted)
# at the same iteration: a resumed host loop restarts its envs, the same way on any layout.
HOST_ENV_STOP = 2


def _host_env_cfg(cache_dir, **kw):
    # 2 seeds (one vector env per seed on each host), every global statistic of the first
    # learner state in play (the first observations of every host's envs), evaluation on host
    # 0, checkpoints every 2 iterations.
    base = dict(env="gymnasium:CartPole-v1", num_seeds=2, total_timesteps=4 * 16 * 4,
                checkpoint_every=2, normalize_observations=True, normalize_rewards=True,
                eval_every=2, eval_episodes=2)
    base.update(kw)
    return tiny(cache_dir, **base)


def _assert_same_rows(multi_dir: Path, single_dir: Path, keys=COMPARED) -> None:
    from jaxppo.run.checkpoints import load_params_dict

    multi, single = _rows(multi_dir), _rows(single_dir)
    assert [(r["iteration"], r.get("seed")) for r in multi] == [(r["iteration"], r.get("seed"))
                                                                for r in single]
    for a, b in zip(multi, single):
        for k in keys:  # None: not logged in that row (no evaluation; before the lag was set)
            expected = None if b.get(k) is None else pytest.approx(b[k], rel=1e-4, abs=1e-6)
            assert a.get(k) == expected, (a["iteration"], k)
    pm = load_params_dict(multi_dir / "params.msgpack")["params"]
    ps = load_params_dict(single_dir / "params.msgpack")["params"]
    for a, b in zip(jax.tree.leaves(pm), jax.tree.leaves(ps)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def host_env_runs(cluster, compile_cache_dir, tmp_path_factory):
    """A gymnasium env on 2 hosts stopped after HOST_ENV_STOP iterations (synchronous host
    loop), then resumed through `jaxppo train --hosts 2 --resume` with max_policy_lag=1 (actor
    threads on each host); and the same in one process."""
    from jaxppo import cli

    base = tmp_path_factory.mktemp("host-env")
    cfg = _host_env_cfg(compile_cache_dir)
    resume = ["--set", "max_policy_lag=1", "--no-progress", "--no-plot"]
    single = jaxppo.train(cfg, run_dir=base / "single", progress=False, plot=False,
                          stop_after_iterations=HOST_ENV_STOP)
    single_rc = cli.main(["train", "--resume", str(base / "single"), *resume])
    part = train_distributed(cfg, hosts=2, run_dir=base / "hosts", progress=False, plot=False,
                             stop_after_iterations=HOST_ENV_STOP)
    rows_before = _rows(base / "hosts")
    rc = cli.main(["train", "--hosts", "2", "--resume", str(base / "hosts"), *resume])
    return SimpleNamespace(base=base, cfg=cfg, single=single, part=part, rc=rc,
                           single_rc=single_rc, rows_before=rows_before)


def test_a_gymnasium_env_on_two_hosts_matches_one_process_and_resumes_with_actor_threads(
        host_env_runs):
    """2 hosts x 2 gymnasium envs (of each of 2 seeds) == 1 process x 4 envs: every metric and
    the final params, through a stop, a resume from the command line and a switch to the
    actor-learner (max_policy_lag 1: after the resume's first update, every rollout is played
    with the params of the update before, on each host)."""
    from jaxppo.run.checkpoints import CheckpointStore

    r = host_env_runs
    assert r.part.hosts == 2 and r.part.num_devices == 2 and r.part.iterations_done == 2
    assert "each host steps its 2 envs in Python" in r.part.layout
    assert [row["iteration"] for row in r.rows_before] == [1, 1, 2, 2]
    assert r.rc == 0 and r.single_rc == 0
    rows = _rows(r.base / "hosts")
    assert [row["iteration"] for row in rows] == [1, 1, 2, 2, 3, 3, 4, 4]  # each once
    assert [row.get("policy_lag") for row in rows[4:]] == [0, 0, 1, 1]
    assert all(np.isfinite(row["eval_return_mean"]) for row in rows if row["iteration"] % 2 == 0)
    _assert_same_rows(r.base / "hosts", r.base / "single",
                      COMPARED + ("eval_return_mean", "policy_lag"))
    with CheckpointStore(r.base / "hosts", read_only=True) as store:
        state, meta = store.restore(4)
    assert meta["hosts"] == 2 and meta["state_layout"] == "unsharded"
    # The learner state unsharded: every seed's envs in global order.
    np.testing.assert_array_equal(np.asarray(state["env_ids"]), np.tile(np.arange(4), (2, 1)))
    summary = json.loads((r.base / "hosts" / "summary.json").read_text())
    assert summary["completed"] and summary["hosts"] == 2 and summary["envs_per_host"] == 2


@pytest.mark.slow
def test_an_envpool_run_on_two_hosts_survives_a_killed_learner(cluster, compile_cache_dir,
                                                               tmp_path, caplog):
    """envpool on 2 hosts, each host's update split over 2 devices; one learner's process is
    SIGKILLed after iteration 2: the group restarts from the snapshot after it, with fresh
    envs as a resumed run has, and goes on to the end with every iteration logged once: the
    numbers of one process (one device) stopped after iteration 2 and resumed."""
    cfg = _host_env_cfg(compile_cache_dir, env="envpool:CartPole-v1", num_seeds=1,
                        eval_every=0, checkpoint_every=0)
    single = tmp_path / "single"
    jaxppo.train(cfg, run_dir=single, progress=False, plot=False, stop_after_iterations=2)
    jaxppo.train(None, resume=single, progress=False, plot=False)
    killed = []

    def on_rows(rows):
        if rows[-1]["iteration"] == 2 and not killed:
            _kill_a_learner(killed)

    run = tmp_path / "hosts"
    with caplog.at_level(logging.INFO, logger="jaxppo.distributed"):
        result = train_distributed(cfg.replace(num_devices=2), hosts=2, run_dir=run,
                                   progress=False, plot=False, callback=on_rows,
                                   learner_env=TWO_DEVICES)
    assert killed and [f["iteration"] for f in result.host_failures] == [3]
    assert result.hosts == 2 and result.num_devices == 4 and result.completed
    assert any("restarting the group from the state after iteration 2 " in r.getMessage()
               for r in caplog.records)
    rows = _rows(run)
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
    _assert_same_rows(run, single)


def test_an_env_stepped_in_python_refuses_what_hosts_cannot_split():
    """Checked before any cluster is reached: a rollout all-gathered over the hosts, and
    actor threads that do not split each host's envs evenly."""
    gym = dict(env="gymnasium:CartPole-v1")
    with pytest.raises(HostsConfigError, match=r"sync='batch' with 2 hosts.*sync='gradients'"):
        train_distributed(tiny(**gym, sync="batch"), hosts=2, progress=False)
    with pytest.raises(HostsConfigError, match=r"actor_threads=2 does not divide the 1 envs of "
                                               r"each of 2 hosts.*actor_threads in \[1\]"):
        train_distributed(tiny(**gym, num_envs=2, num_minibatches=1, max_policy_lag=1,
                               actor_threads=2), hosts=2, progress=False)


# ---------------------------------------------------------------------- make targets
def _make(*args, timeout=60, env=None) -> subprocess.CompletedProcess:
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make")
    # -o: never (re)install the venv from inside a test.
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed-dev",
                           "-o", ".venv/.installed-base", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _submit_command(*make_args) -> str:
    out = _make("-n", "ray-submit", *make_args)
    assert out.returncode == 0, out.stderr
    return out.stdout.replace("\\\n", " ")


def test_make_ray_submit_resume_and_runs_dir():
    """RESUME= resumes (no --env, the run's own env is used); ENV given with it is passed on
    for the entry point to refuse; RUNS_DIR and a --runs-dir in ARGS end up absolute, the one
    in ARGS winning (passed last)."""
    cmd = _submit_command("RESUME=runs/x")
    assert '--resume "$(realpath -m -- runs/x)"' in cmd and "--env" not in cmd
    assert "--env Acrobot-v1" in _submit_command("RESUME=runs/x", "ENV=Acrobot-v1")
    cmd = _submit_command("ARGS=--resume runs/y --set total_timesteps=1000")
    assert "--env" not in cmd and cmd.rstrip().endswith('--resume "$(realpath -m -- runs/y)"')
    cmd = _submit_command("ENV=Acrobot-v1")
    assert "--env Acrobot-v1" in cmd and '--runs-dir "$(realpath -m -- runs)"' in cmd
    assert '--runs-dir "$(realpath -m -- /data/r)"' in _submit_command("RUNS_DIR=/data/r")
    for args in ("--runs-dir mine --set lr=1e-3", "--set lr=1e-3 --runs-dir=mine",
                 "--runs-dir other --runs-dir mine"):
        cmd = _submit_command(f"ARGS={args}", "RUNS_DIR=/data/r")
        last = cmd.rsplit("--runs-dir", 1)[1]
        assert last.strip().startswith('"$(realpath -m -- mine)"'), cmd
    # make train: the same choice of --env; paths stay as given (it runs in this folder).
    for make_args in (["RESUME=runs/x"], ["ARGS=--resume runs/x"]):
        out = _make("-n", "train", *make_args)
        assert out.returncode == 0 and "--resume" in out.stdout and "--env" not in out.stdout
    out = _make("-n", "train", "RUNS_DIR=elsewhere", "ARGS=--runs-dir mine")
    assert out.stdout.replace("\\\n", " ").split()[-2:] == ["--runs-dir", "mine"], out.stdout
    # What the shell makes of it: absolute paths, relative to where make runs.
    assert subprocess.run(["bash", "-c", 'echo "$(realpath -m -- mine)"'], cwd=REPO,
                          capture_output=True, text=True).stdout.strip() == str(REPO / "mine")


def test_make_ray_cluster_with_a_ray_token_and_make_ray_stop_stops_only_its_cluster(tmp_path):
    """Two loopback clusters on two ports, each with its own temp dir. The first is `make
    ray-cluster`'s (head + 1 worker), from a user's shell with a Ray token in the home folder
    (any local `ray.init()` of Ray 2.60 leaves one), which makes `ray start --head` require
    it: every node, `ray status` and job submission run with it and the cluster starts; the
    user's own ~/.ray is not touched. The second is a bare head. `make ray-stop` with the
    first's RAY_PORT stops all of its processes and none of the second's (nor a process that
    only reads the first's logs); Ray's `ray stop` cannot choose. A driver without
    RAY_AUTH_MODE=token is told that the first cluster wants a token."""
    import shutil
    import tempfile

    from jaxppo.distributed.cluster import _refuses_credentials
    from jaxppo.distributed.loopback import _is_gcs, cluster_processes, stop_cluster

    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    real = Path.home() / ".ray"
    before = sorted(p.name for p in real.iterdir()) if real.exists() else None
    # A user's shell: no auth mode, none of the loopback switches the cluster fixture sets.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k not in LOOPBACK_ENV}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    # The bare head: the loopback switches, and a home of its own (no token).
    (tmp_path / "home2").mkdir()
    env2 = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path / "home2"),
                **LOOPBACK_ENV)
    env2.pop("RAY_ADDRESS", None)
    base = Path(tempfile.mkdtemp(prefix="jp-stop-", dir="/tmp"))  # short: Ray's socket paths
    (p1, t1), (p2, t2) = ((free_port(), base / "a"), (free_port(), base / "b"))
    where = [f"RAY_PORT={p1}", f"RAY_TEMP_DIR={t1}"]
    reader = None
    t0 = time.perf_counter()
    try:
        out = _make("ray-cluster", *where, f"RAY_CLIENT_PORT={free_port()}",
                    f"RAY_DASHBOARD={free_port()}", "RAY_WORKERS=1", timeout=300, env=env)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        assert "AuthenticationError" not in out.stdout + out.stderr
        assert out.stdout.count(" node_") == 2, out.stdout[-2000:]  # head + 1 worker, alive
        first = cluster_processes(f"127.0.0.1:{p1}", str(t1))
        gcs = [pid for pid in first if _is_gcs(pid)]
        assert gcs and b"RAY_AUTH_MODE=token" in Path(f"/proc/{gcs[0]}/environ").read_bytes()
        # A driver from that shell without RAY_AUTH_MODE=token is told the cluster wants a
        # token, not that no cluster runs there.
        probe = f"from jaxppo.distributed.cluster import connect\nconnect('127.0.0.1:{p1}', timeout_s=10)\n"
        out = subprocess.run([sys.executable, "-c", probe], env=dict(env, PYTHONPATH=str(REPO)),
                             capture_output=True, text=True, timeout=180)
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert "requires token authentication, which this process does not use" in last, last
        assert "RAY_AUTH_MODE=token" in last and "make ray-cluster" not in last
        # Ray's own retry lines are kept out of the way of the one that says what to do.
        assert "InvalidAuthToken" not in out.stderr
        # Told after one handshake, not after ray.init's 20 s of retries (this process runs
        # without a token too).
        assert _refuses_credentials(f"127.0.0.1:{p1}")
        start_head(p2, t2, env2)
        assert not _refuses_credentials(f"127.0.0.1:{p2}")
        second = cluster_processes(f"127.0.0.1:{p2}", str(t2))
        assert len(first) >= 4 and len(second) >= 4 and not set(first) & set(second)
        # Not a Ray process, though it names the first cluster's logs: left alone.
        reader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                   str(t1 / "session_latest" / "logs" / "raylet.out")])
        stop = _make("ray-stop", *where, env=env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert f"stopped the Ray cluster at 127.0.0.1:{p1}" in stop.stderr
        assert not cluster_processes(f"127.0.0.1:{p1}", str(t1))
        for pid in first:
            assert not Path(f"/proc/{pid}").exists() or \
                Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert cluster_processes(f"127.0.0.1:{p2}", str(t2)) == second  # untouched
        socket.create_connection(("127.0.0.1", p2), timeout=5).close()  # its GCS answers
        assert reader.poll() is None
        again = _make("ray-stop", *where, env=env)
        assert again.returncode == 0 and "nothing to stop" in again.stderr
    finally:
        if reader is not None:
            reader.kill()
            reader.wait()
        for port, temp in ((p1, t1), (p2, t2)):
            stop_cluster(f"127.0.0.1:{port}", str(temp), grace_s=5)
        shutil.rmtree(base, ignore_errors=True)
    print(f"two clusters started and one stopped in {time.perf_counter() - t0:.1f}s")
    assert (sorted(p.name for p in real.iterdir()) if real.exists() else None) == before
    assert sorted(p.name for p in (home / ".ray").iterdir()) == ["auth_token"]


def test_a_sweep_on_hosts_is_recorded_and_resumes_with_its_hyperparameters(
        cluster, compile_cache_dir, tmp_path):
    """A vmapped sweep of 2 lrs on 2 hosts, of a multi-agent env (each host's envs with their
    agents): sweep.json names each member's lr, each member logs its own lr and each agent's
    return, and a resume (without hparams) goes on with the recorded ones."""
    cfg = tiny(compile_cache_dir, env="jaxmarl:MPE_simple_spread_v3", num_seeds=2,
               total_timesteps=4 * 16 * 4, lr_schedule="constant")
    sweep = jaxppo.HyperParams.stack(
        [jaxppo.HyperParams.from_config(cfg.replace(lr=lr)) for lr in (1e-3, 3e-3)])
    run = tmp_path / "run"
    part = train_distributed(cfg, hosts=2, run_dir=run, hparams=sweep, progress=False,
                             plot=False, stop_after_iterations=2)
    assert part.iterations_done == 2
    record = json.loads((run / "sweep.json").read_text())
    assert record["labels"] == ["lr=0.001", "lr=0.003"]
    done = train_distributed(None, hosts=2, resume=run, progress=False, plot=False)
    assert done.completed
    rows = _rows(run)
    lrs = {(r["seed"], r["iteration"]): r["lr"] for r in rows}
    for it in range(1, 5):
        assert lrs[(0, it)] == pytest.approx(1e-3) and lrs[(1, it)] == pytest.approx(3e-3), it
    # MPE's episodes last 25 steps: iterations 2 and 4 end one per env, with every agent's return
    ended = [r for r in rows if r["iteration"] in (2, 4)]
    for r in ended:
        agents = [r[f"episode_return_mean/agent_{i}"] for i in range(3)]
        assert all(math.isfinite(a) for a in agents), r
        assert r["episode_return_mean"] == pytest.approx(sum(agents), rel=1e-5), r
    members = json.loads((run / "summary.json").read_text())["members"]
    assert [m["label"] for m in members] == ["lr=0.001", "lr=0.003"]


def test_a_pbt_population_split_over_hosts_trains_as_one_process(
        cluster, compile_cache_dir, tmp_path):
    """PBT with 4 members on 2 hosts: each host trains 2 whole members (no collective between
    exploit steps) and the hosts exchange fitness and the best members' learner states at
    exploit steps. The same exploit steps, episodes and (up to float rounding) numbers as one
    process; the folder gets the search files; a resume continues the population."""
    cfg = tiny(compile_cache_dir, num_seeds=4, total_timesteps=4 * 16 * 8, log_every=2,
               search={"lr": {"loguniform": [1e-4, 1e-2]}, "clip_param": {"uniform": [0.1, 0.3]}},
               pbt={"interval": 2, "fraction": 0.25})
    run = tmp_path / "run"
    part = train_distributed(cfg, hosts=2, run_dir=run, progress=False, plot=False,
                             stop_after_iterations=4)
    assert part.iterations_done == 4
    multi = train_distributed(None, hosts=2, resume=run, progress=False, plot=False)
    single = jaxppo.train(cfg, progress=False)
    assert multi.hosts == 2 and multi.completed
    m, s = multi.metrics, single.metrics
    np.testing.assert_array_equal(m["pbt_parent"], s["pbt_parent"])
    assert np.isfinite(s["pbt_parent"][0]).sum() == 3  # after iterations 2, 4, 6
    np.testing.assert_array_equal(m["episodes"], s["episodes"])
    for k in ("hp_lr", "hp_clip_param", "value_loss", "grad_norm"):
        np.testing.assert_allclose(m[k], s[k], rtol=1e-3, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(multi.params), jax.tree.leaves(single.params)):
        assert np.shape(a) == np.shape(b) and np.shape(a)[0] == 4  # [members, ...]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
    rec = json.loads((run / "search.json").read_text())
    assert len(rec["members"]) == 4 and "lineage" in rec["pbt"]
    assert (run / "best.yaml").exists()


def test_jaxppo_search_hosts_runs_the_multi_host_driver_on_a_search(tmp_path, capsys,
                                                                    monkeypatch):
    """`jaxppo search --hosts H` is the multi-host driver with its options (and --population),
    on a config that must have a `search` (checked before any cluster is contacted)."""
    import jaxppo.distributed.launch as driver
    from jaxppo.cli import main

    seen = {}
    def fake_train(config, hosts, **kw):
        seen.update(config=config, hosts=hosts, **kw)
        return SimpleNamespace(host_failures=[], run_dir=kw["run_dir"])

    monkeypatch.setattr(driver, "train_distributed", fake_train)
    monkeypatch.setattr(driver.command, "report", lambda result, resume_command: 0)
    code = main(["search", "--hosts", "2", "--env", "CartPole-v1", "--population", "4",
                 "--runs-dir", str(tmp_path), "--stop-after", "3", "--no-progress",
                 "--set", "search={lr: {loguniform: [1.0e-4, 1.0e-2]}}", "pbt={interval: 5}"])
    assert code == 0, capsys.readouterr().err
    assert seen["hosts"] == 2 and seen["stop_after_iterations"] == 3
    assert seen["config"].search["population"] == 4 and seen["config"].num_seeds == 4
    assert seen["config"].pbt == {"interval": 5}
    assert seen["run_dir"].name.startswith("CartPole-v1-search-ray2-"), seen["run_dir"]

    code = main(["search", "--hosts", "2", "--env", "CartPole-v1", "--runs-dir", str(tmp_path)])
    assert code == 2 and "needs a `search`" in capsys.readouterr().err  # before any cluster
    from jaxppo.program.layout import Layout
    from jaxppo.program.resolved import resolve

    cfg = tiny(num_seeds=6, search={"lr": {"uniform": [1e-4, 1e-2]}}, pbt={"interval": 1})
    with pytest.raises(jaxppo.ConfigError, match="members over 4 hosts"):
        resolve(cfg, Layout(1, 4, 0))


# ---------------------------------------------------------------------- Ray Tune
TUNE_BASE = dict(num_epochs=1, total_timesteps=4 * 16 * 20, log_every=5)


def test_a_tune_search_with_optuna_and_asha_drives_jaxppo(cluster, compile_cache_dir, tmp_path):
    """4 trials drawn by Optuna, stopped early by ASHA: every trial reports per chunk, the
    reports carry checkpoints (run folders), and the best trial's config is one of them."""
    pytest.importorskip("optuna")
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    import jaxppo.tune

    base = tiny(compile_cache_dir, **TUNE_BASE)
    tuner = tune.Tuner(
        jaxppo.tune.trainable(base, checkpoint_every=10),
        param_space={"lr": tune.loguniform(1e-4, 1e-2), "clip_param": tune.uniform(0.1, 0.3)},
        tune_config=tune.TuneConfig(
            metric="episode_return_mean", mode="max", num_samples=4, reuse_actors=True,
            search_alg=OptunaSearch(seed=0),
            scheduler=ASHAScheduler(time_attr="iteration", max_t=20, grace_period=10)),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="search", verbose=0))
    results = tuner.fit()
    assert len(results) == 4 and not results.errors
    lrs = set()
    for r in results:
        assert r.metrics["iteration"] in (10, 20)  # ASHA stops some at its rung
        assert math.isfinite(r.metrics["episode_return_mean"])
        assert 1e-4 <= r.config["lr"] <= 1e-2
        lrs.add(r.config["lr"])
        with r.checkpoint.as_directory() as d:  # a jaxppo run folder with its checkpoint
            saved = yaml.safe_load((Path(d) / "config.yaml").read_text())
            assert saved["lr"] == pytest.approx(r.config["lr"])
            assert (Path(d) / "checkpoints").is_dir() and (Path(d) / "metrics.jsonl").exists()
        iterations = list(r.metrics_dataframe["iteration"])
        assert iterations[:2] == [5, 10]  # one report per chunk (log_every=5)
    assert len(lrs) == 4
    best = results.get_best_result()
    assert best.config["lr"] in lrs


def test_tunes_population_based_training_restores_jaxppo_checkpoints(
        cluster, compile_cache_dir, tmp_path):
    """Tune's PBT scheduler clones the better trial's checkpoint into the worse one and
    perturbs its lr: the trial resumes that jaxppo run folder with the new lr.

    Synchronous PBT (`synch=True`): at every 10th iteration the scheduler waits for both
    trials, so an exploit happens however fast either trial runs (asynchronous PBT skips it
    when one trial has already finished, which a race between the trials decided); with 2
    trials and quantile_fraction 0.5 each perturbation clones one into the other. 25
    iterations: perturbations at 10 and 20, and the last report 5 after the last one, so no
    exploit can land on the final report, which would clone a finished run and leave no
    iteration to train with the new lr."""
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    import jaxppo.tune

    base = tiny(compile_cache_dir, **{**TUNE_BASE, "total_timesteps": 4 * 16 * 25},
                lr_schedule="constant")
    pbt = PopulationBasedTraining(time_attr="iteration", perturbation_interval=10,
                                  hyperparam_mutations={"lr": tune.loguniform(1e-5, 1e-2)},
                                  quantile_fraction=0.5, synch=True)
    tuner = tune.Tuner(
        jaxppo.tune.trainable(base, checkpoint_every=10),
        param_space={"lr": tune.grid_search([1e-5, 3e-3])},
        tune_config=tune.TuneConfig(metric="episode_return_mean", mode="max", scheduler=pbt,
                                    reuse_actors=True),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="pbt", verbose=0))
    results = tuner.fit()
    assert len(results) == 2 and not results.errors
    for r in results:
        assert r.metrics["iteration"] == 25
    # at least one exploit step: a trial was cloned and trained on with a perturbed lr
    assert {r.config["lr"] for r in results} != {1e-5, 3e-3}
    for r in results:
        with r.checkpoint.as_directory() as d:
            rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        assert [row["iteration"] for row in rows] == list(range(1, 26))
        assert rows[-1]["lr"] == pytest.approx(r.config["lr"], rel=1e-6)


def test_tune_trainable_rejects_unknown_fields():
    import jaxppo.tune

    with pytest.raises(jaxppo.ConfigError, match="unknown config key 'lrr'"):
        jaxppo.tune.trial_config(tiny(), {"lrr": 1e-3})
    assert jaxppo.tune.trial_config(tiny(), {"network.hidden_sizes": [8]}).network.hidden_sizes == (8,)
