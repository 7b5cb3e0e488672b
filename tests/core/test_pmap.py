"""pmap over local devices: shard invariance and learning, on 4 forced CPU devices."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("pmap_worker.py")


EQUIVALENCE_CHECKS = ["equivalence", "equivalence-state-std", "equivalence-batch",
                      "equivalence-batch-gru", "equivalence-kl-stop"]


def _run(*which: str) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), *which], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


# The worker's checks each test reads.
CHECKS_OF = {"test_one_iteration_on_four_devices_equals_one_device": EQUIVALENCE_CHECKS,
             "test_cartpole_learns_on_two_devices_and_params_stay_replicated": ["learn"],
             "test_stop_at_return_and_best_params_on_two_devices": ["stop"]}


@pytest.fixture(scope="module")
def worker_results(request) -> dict:
    """Every check the selected tests of this module read, in one worker process (one jax
    start, not one per check or per fixture)."""
    selected = [item for item in request.session.items if item.path == request.path]
    return _run(*dict.fromkeys(c for item in selected for c in CHECKS_OF[item.originalname]))


@pytest.mark.parametrize("which", EQUIVALENCE_CHECKS)
def test_one_iteration_on_four_devices_equals_one_device(worker_results, which):
    r = worker_results[which]
    assert r["replicated_after_iteration"]
    assert r["max_param_diff"] < 1e-5, r["max_param_diff"]
    assert r["max_obs_mean_diff"] < 1e-5 and r["max_obs_var_diff"] < 1e-5
    m1, m4 = r["metrics_1"], r["metrics_4"]
    for key in ("episode_return_mean", "episodes", "value_loss", "policy_loss", "entropy", "kl",
                "explained_variance", "grad_norm", "env_steps"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-4, abs=1e-6), key
    if which == "equivalence-kl-stop":  # stopped mid-iteration, at the same minibatch
        assert 1 < m1["gradient_steps"] == m4["gradient_steps"] < 16, (m1, m4)


@pytest.mark.slow
def test_cartpole_learns_on_two_devices_and_params_stay_replicated(worker_results):
    r = worker_results["learn"]
    assert r["devices"] == 2
    assert r["replicated_after_training"]
    # Random play scores ~20; a learning run is far above that after 300k steps.
    assert r["first_return"] < 60
    assert r["final_return"] > 300, r


@pytest.mark.slow
def test_stop_at_return_and_best_params_on_two_devices(worker_results):
    r = worker_results["stop"]
    assert r["devices"] == 2
    assert not r["completed"] and r["iterations"] < r["num_iterations"], r
    assert "stop_at_return" in r["stopped"], r
    assert r["last_eval"] >= 150.0 and r["best_eval"] >= 150.0, r
    assert r["best_iteration"] == r["policy_iteration"] <= r["iterations"], r
    assert r["best_return_of_policy"] > 100, r  # the best params, loaded, play well
