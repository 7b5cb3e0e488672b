"""Multi-host training over Ray, on a 2-node local cluster (1 CPU each) on loopback.

One cluster (head with the dashboard + one worker node) serves the whole module. Everything
binds 127.0.0.1: the nodes get node_ip_address=127.0.0.1 and every Ray process inherits
jaxppo.distributed.loopback.LOOPBACK_ENV, so no Ray process swaps in the outward IP.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from jaxppo import NetworkConfig, PPOConfig  # noqa: E402
from jaxppo.algorithm import Algorithm, HyperParams  # noqa: E402
from jaxppo.config import ConfigError  # noqa: E402
from jaxppo.distributed import (HostsConfigError, NotEnoughNodesError, RayTrainer,  # noqa: E402
                                train_distributed)
from jaxppo.distributed.loopback import LOOPBACK_ENV  # noqa: E402
from jaxppo.distributed.ray_trainer import _quiet_fork_warning, connect  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def tiny(cache_dir=None, **kw) -> PPOConfig:
    base = dict(env="CartPole-v1", num_envs=4, num_steps=16, num_minibatches=2, num_epochs=2,
                total_timesteps=4 * 16 * 2, network=NetworkConfig((16, 16)),
                compilation_cache_dir=cache_dir)
    base.update(kw)
    return PPOConfig(**base)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        for k, v in LOOPBACK_ENV.items():
            mp.setenv(k, v)
        port = _free_port()
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


def _assert_tree_close(a, b, atol, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), what
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   atol=atol, rtol=0, err_msg=what)


# ---------------------------------------------------------------------- exactness
def test_two_hosts_match_one_host_iteration(cluster, compile_cache_dir):
    """2 hosts x 2 envs == 1 host x 4 envs: params, optimiser, statistics and metrics,
    with every global statistic in play (obs/reward normalisation, KL penalty)."""
    cfg = tiny(compile_cache_dir, normalize_observations=True, normalize_rewards=True,
               use_kl_loss=True, vf_clip_param=10.0)
    trainer = RayTrainer(cfg, 2).start()
    try:
        info = trainer.host_info
        assert len({h["node_id"] for h in info}) == 2  # STRICT_SPREAD: one learner per node
        assert [h["env_offset"] for h in info] == [0, 2]
        rows = [trainer.run_iteration() for _ in range(2)]
        trainer.broadcast_params()
        host_params = trainer.host_params()
        driver_flat = trainer.flat_params
        dist = trainer.state
        compiled = ray.get([h.compile_counts.remote() for h in trainer.hosts])
    finally:
        trainer.shutdown()

    algo = Algorithm(cfg)
    hp = HyperParams.from_config(cfg)
    state = jax.jit(algo.init)(jax.random.PRNGKey(cfg.seed), hp)
    step = jax.jit(algo.iteration)
    single_rows = []
    for _ in range(2):
        state, m = step(state, hp)
        single_rows.append(jax.device_get(m))

    _assert_tree_close(state.params, dist.params, 1e-5, "params")
    _assert_tree_close(state.opt_state, dist.opt_state, 1e-5, "opt_state")
    _assert_tree_close(state.obs_stats, dist.obs_stats, 1e-5, "obs_stats")
    _assert_tree_close(state.return_stats, dist.return_stats, 1e-4, "return_stats")
    np.testing.assert_array_equal(np.asarray(state.rng), np.asarray(dist.rng))
    assert float(state.kl_coeff) == pytest.approx(float(dist.kl_coeff))
    assert int(state.env_steps) == int(dist.env_steps) == 2 * cfg.batch_size
    for r1, r2 in zip(single_rows, rows):
        for k in ("episode_return_mean", "episodes", "episode_length_mean", "policy_loss",
                  "value_loss", "entropy", "kl", "clip_fraction", "explained_variance",
                  "grad_norm", "kl_coeff", "lr", "env_steps"):
            assert float(r1[k]) == pytest.approx(r2[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    # Each host compiled each of its programs once (iteration 2 reused iteration 1's).
    assert all(set(c.values()) == {1} for c in compiled), compiled
    # Every host holds exactly the driver's params.
    assert all(np.array_equal(p, driver_flat) for p in host_params)
    flat_single = np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.params)])
    np.testing.assert_allclose(host_params[0], flat_single, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- bad input
def test_more_hosts_than_nodes_is_a_clear_error(cluster):
    with pytest.raises(NotEnoughNodesError, match=r"hosts=3 .* only 2 alive node"):
        train_distributed(tiny(num_envs=6), hosts=3, progress=False)


def test_envs_not_divisible_by_hosts_is_a_config_error():
    with pytest.raises(HostsConfigError) as e:
        train_distributed(tiny(num_envs=5), hosts=2, progress=False)
    assert isinstance(e.value, ConfigError)
    msg = str(e.value)
    assert "num_envs=5" in msg and "hosts=2" in msg
    assert "[1, 5]" in msg and "num_envs=4 or 6" in msg


def test_recurrent_and_reward_hooks_are_rejected_up_front():
    with pytest.raises(HostsConfigError, match="recurrent_size"):
        train_distributed(tiny(network=NetworkConfig(hidden_sizes=(16,), recurrent_size=8),
                               num_minibatches=2), hosts=2, progress=False)
    with pytest.raises(HostsConfigError, match="reward hooks"):
        train_distributed(tiny(transforms=[{"count_bonus": {"scale": 0.1}}]), hosts=2,
                          progress=False)


def test_no_cluster_at_ray_address(tmp_path):
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:1", RAY_USAGE_STATS_ENABLED="0")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxppo.distributed", "--hosts", "2", "--env", "CartPole-v1",
         "--defaults", "--runs-dir", str(tmp_path), "--run-name", "unreachable"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no Ray cluster reachable at RAY_ADDRESS=127.0.0.1:1" in proc.stderr
    assert "make ray-cluster" in proc.stderr
    assert time.perf_counter() - t0 < 60
    assert not (tmp_path / "unreachable").exists()  # nothing left behind


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
def test_cartpole_learns_on_two_hosts(cluster, compile_cache_dir, tmp_path):
    # The tuned CartPole batch (16 envs x 128 steps, 8 epochs x 8 minibatches), 30 iterations.
    cfg = PPOConfig(env="CartPole-v1", num_envs=16, num_steps=128, num_epochs=8,
                    num_minibatches=8, lr=5e-4, total_timesteps=16 * 128 * 30,
                    compilation_cache_dir=compile_cache_dir)
    result = train_distributed(cfg, hosts=2, run_dir=tmp_path, progress=False)
    ret = result.metrics["episode_return_mean"]
    # Random play scores ~22 (the first iteration); a learning run is far above it.
    assert ret[0] < 40, ret[:3]
    assert np.nanmean(ret[-5:]) > 120, ret
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 31))
    assert rows[-1]["env_steps"] == 16 * 128 * 30
    # The trained policy works through the usual TrainResult API.
    obs = jnp.zeros((3, 4))
    assert result.policy(obs, deterministic=True).shape == (3,)


@pytest.mark.slow
def test_host_killed_mid_iteration_is_replaced_and_iteration_retried(cluster, compile_cache_dir,
                                                                      tmp_path, caplog):
    fired = []

    def kill_host_1(trainer, iteration, phase, step):
        # Kill host 1 in the middle of iteration 2's gradient steps (once).
        if iteration == 2 and phase == "grad" and step == 1 and not fired:
            fired.append(trainer.hosts[1])
            ray.kill(trainer.hosts[1], no_restart=True)

    cfg = tiny(compile_cache_dir, total_timesteps=4 * 16 * 4)
    with caplog.at_level(logging.WARNING, logger="jaxppo.distributed"):
        result = train_distributed(cfg, hosts=2, run_dir=tmp_path, progress=False,
                                   fault_hook=kill_host_1)
    assert fired
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("host 1 died (") and
               m.endswith("replacing it and retrying iteration 2") for m in messages), messages
    assert [f["host"] for f in result.host_failures] == [1]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]  # every iteration exactly once
    assert [r["env_steps"] for r in rows] == [64, 128, 192, 256]
    assert all(np.isfinite(r["policy_loss"]) for r in rows)


@pytest.mark.slow
def test_job_submission_succeeds_and_writes_run_folder(cluster, compile_cache_dir, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard)
    sets = ["num_envs=4", "num_steps=16", "num_minibatches=2", "num_epochs=2",
            "total_timesteps=320", "network.hidden_sizes=[16,16]",
            f"compilation_cache_dir={compile_cache_dir or 'null'}"]
    entry = (f"{sys.executable} -m jaxppo.distributed --hosts 2 --env CartPole-v1 --defaults "
             f"--runs-dir {tmp_path} --run-name job --no-plot --no-progress --set "
             + " ".join(sets))
    # No working_dir upload: every node of this local cluster runs this venv's python, where
    # jaxppo is installed (editable). Uploading the repo made the workers' download of the
    # package flaky on a loaded 2-core machine ("Failed to download runtime_env file
    # package"), and it is not what this test is about.
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
    for name in ("config.yaml", "metrics.jsonl", "params.msgpack", "summary.json"):
        assert (run / name).exists(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hosts"] == 2 and summary["env_steps"] == 320
    assert "done: final return" in logs


# ---------------------------------------------------------------------- checkpoints and resume
STOP = 3


def _ckpt_cfg(cache_dir):
    # 5 iterations, checkpoints every 2: stopping after 3 is off the grid (saved at 2 and 3),
    # the resumed run saves at 4 and 5; every global statistic is in play.
    return tiny(cache_dir, total_timesteps=4 * 16 * 5, checkpoint_every=2, keep_checkpoints=2,
                normalize_observations=True, normalize_rewards=True, use_kl_loss=True)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _folder_digest(path: Path) -> dict:
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "<dir>" for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def ray_runs(cluster, compile_cache_dir, tmp_path_factory):
    """A 2-host run to the end; one stopped after STOP iterations (a copy is kept as
    `stopped`) and then resumed through `jaxppo train --hosts 2 --resume`."""
    import shutil

    from jaxppo import cli

    base = tmp_path_factory.mktemp("ray-ckpt")
    cfg = _ckpt_cfg(compile_cache_dir)
    t0 = time.perf_counter()
    full = train_distributed(cfg, hosts=2, run_dir=base / "full", progress=False)
    part = train_distributed(cfg, hosts=2, run_dir=base / "part", progress=False,
                             stop_after_iterations=STOP)
    shutil.copytree(base / "part", base / "stopped")
    rows_before = _rows(base / "part")
    rc = cli.main(["train", "--hosts", "2", "--resume", str(base / "part"), "--no-progress",
                   "--no-plot"])
    seconds = time.perf_counter() - t0
    return SimpleNamespace(base=base, cfg=cfg, full=full, part=part, rc=rc,
                           rows_before=rows_before, seconds=seconds)


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in ("wall_time", "sps")} for r in rows]


def test_stopped_and_resumed_two_host_run_is_bit_identical(ray_runs):
    from jaxppo.checkpoint import CheckpointStore, load_params_dict

    r = ray_runs
    assert not r.part.completed and r.part.iterations_done == STOP
    assert [row["iteration"] for row in r.rows_before] == [1, 2, 3]
    assert r.rc == 0
    full_rows, resumed_rows = _rows(r.base / "full"), _rows(r.base / "part")
    assert [row["iteration"] for row in resumed_rows] == [1, 2, 3, 4, 5]  # each once
    assert _strip(resumed_rows) == _strip(full_rows)
    # Final params (params.msgpack of the resumed CLI run) equal the uninterrupted run's.
    saved = load_params_dict(r.base / "part" / "params.msgpack")
    for a, b in zip(jax.tree.leaves(saved["params"]), jax.tree.leaves(r.full.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Whole saved states (driver state and every host's envs) are identical at each step.
    with CheckpointStore(r.base / "full", read_only=True) as fs, \
            CheckpointStore(r.base / "part", read_only=True) as ps:
        assert fs.steps() == ps.steps() == [4, 5]
        for step in (4, 5):
            assert fs.read_meta(step)["state_digest"] == ps.read_meta(step)["state_digest"]
        state, meta = ps.restore(5)
        assert meta["hosts"] == 2 and meta["env_steps"] == 5 * r.cfg.batch_size
        np.testing.assert_array_equal(np.asarray(state["env_ids"]), np.arange(4))
    summary = json.loads((r.base / "part" / "summary.json").read_text())
    assert summary["iterations"] == 5 and summary["completed"]


def test_corrupt_checkpoint_is_a_clear_error_and_resume_drops_later_rows(ray_runs, tmp_path):
    import shutil

    from jaxppo.checkpoint import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(ray_runs.base / "stopped", run)
    # A corrupt newest checkpoint: a clear error naming it, nothing in the folder changed.
    step_dir = run / "checkpoints" / str(STOP)
    data = max((p for p in (step_dir / "state" / "d").iterdir()), key=lambda p: p.stat().st_size)
    data.write_bytes(np.random.default_rng(0).bytes(data.stat().st_size))
    before = _folder_digest(run)
    with pytest.raises(CheckpointError) as info:
        train_distributed(None, hosts=2, resume=run, progress=False)
    msg = str(info.value)
    assert str(step_dir) in msg and "corrupt or incomplete" in msg and "iteration 2" in msg
    with pytest.raises(ConfigError, match=r"num_envs=8.*num_envs=4"):
        train_distributed(ray_runs.cfg.replace(num_envs=8), hosts=2, resume=run,
                          progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        train_distributed(None, hosts=2, resume=tmp_path / "nope", progress=False)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train_distributed(ray_runs.cfg, hosts=2, run_dir=run, progress=False)
    assert _folder_digest(run) == before

    # As the message says: move the corrupt one out and resume from iteration 2, here on
    # one host (the checkpoint holds all envs in global order, so any hosts dividing num_envs
    # will do). The row of iteration 3 written before is dropped and written again.
    shutil.move(step_dir, tmp_path / "bad")
    result = train_distributed(None, hosts=1, resume=run, progress=False,
                               stop_after_iterations=1, strategy="PACK")
    assert result.resumed_from == 2 and result.iterations_done == 3 and not result.completed
    rows = _rows(run)
    assert [row["iteration"] for row in rows] == [1, 2, 3]
    assert list(result.metrics["iteration"]) == [1, 2, 3]
    full = _rows(ray_runs.base / "full")
    assert _strip(rows[:2]) == _strip(full[:2])
    for k in ("policy_loss", "value_loss", "entropy", "kl", "grad_norm", "kl_coeff", "env_steps"):
        assert rows[2][k] == pytest.approx(full[2][k], rel=1e-4, abs=1e-6), k
