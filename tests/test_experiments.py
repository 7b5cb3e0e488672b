"""The experiments folder: tuned configs are valid, the results table is built from the result
files, and the Pendulum optimum script models gymnax's Pendulum exactly."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.errors import ConfigError

from jaxppo.config import TUNED_DIR, PPOConfig, tuned_env_names
from jaxppo.envs.make import make_env
from jaxppo.program.resolved import resolve

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(TUNED_DIR.glob("*.yaml"))


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_tuned_config_is_valid_and_named_after_its_env(path):
    cfg = PPOConfig.tuned(path.stem)
    assert cfg == PPOConfig.from_file(path) and cfg.env_name == path.stem
    if cfg.env.startswith("envpool:") and importlib.util.find_spec("envpool") is None:
        pytest.skip("envpool is not installed: pip install 'jaxppo[envpool]' (the dev extra "
                    "installs it)")
    resolve(cfg)  # an env that builds with the config's env_kwargs


def test_tuned_configs_ship_with_the_package_and_take_overrides():
    assert len(CONFIGS) >= 10 and tuned_env_names() == [p.stem for p in CONFIGS]
    cfg = PPOConfig.tuned("CartPole-v1", num_seeds=3, network={"activation": "relu"})
    base = PPOConfig.tuned("CartPole-v1")
    assert cfg.num_seeds == 3 and cfg.network.activation == "relu"
    assert cfg.network.hidden_sizes == base.network.hidden_sizes  # other network fields kept
    with pytest.raises(ConfigError, match="no tuned config for env='CartPole-v2'; did you mean 'CartPole-v1'"):
        PPOConfig.tuned("CartPole-v2")
    with pytest.raises(ConfigError, match="unknown config key 'lrr'"):
        PPOConfig.tuned("CartPole-v1", lrr=1e-3)


def test_results_table_rows(tmp_path, monkeypatch):
    rx = _load_script("run_experiments")
    base = {"seeds": 4, "env_steps_per_seed": 150016, "wall_seconds": 6.2, "sps_all_seeds": 1e5,
            "final_return_mean": 498.25, "final_return_std": 1.5, "budget_capped": False}
    (tmp_path / "CartPole-v1.json").write_text(json.dumps(
        {**base, "env": "CartPole-v1", "eval_return_mean": 500.0, "eval_return_std": 0.0}))
    (tmp_path / "Catch-bsuite.json").write_text(json.dumps({**base, "env": "Catch-bsuite"}))
    (tmp_path / "bench.json").write_text(json.dumps({"sps": 1}))  # not a results file
    monkeypatch.setattr(rx, "RESULTS", tmp_path)
    rows = rx.build_table().splitlines()
    assert len(rows) == 4
    assert rows[2].startswith("| CartPole-v1 | 500.0 ± 0.0 (4) | 498.2 ± 1.5 | 1.5e5 |")
    assert "| 500 (1.5e5) |" in rows[2]
    assert rows[3].startswith("| Catch-bsuite | — (4) | 498.2 ± 1.5 |")


def test_pendulum_optimum_transition_matches_gymnax():
    po = _load_script("pendulum_optimum")
    spec = make_env(PPOConfig(env="Pendulum-v1"))
    env, params = spec.env, spec.env_params
    keys = jax.random.split(jax.random.key(0), 64)
    _, states = jax.vmap(lambda k: env.reset(k, params))(keys)
    states = states.replace(theta_dot=states.theta_dot * 6.0)  # reach the speed clip too
    u = jnp.linspace(-3.0, 3.0, 64)  # beyond the torque bounds too
    _, nxt, reward, _, _ = jax.vmap(lambda k, s, a: env.step_env(k, s, a[None], params))(keys, states, u)
    r, theta, theta_dot = po.transition(params, states.theta, states.theta_dot, u)
    np.testing.assert_allclose(r, reward, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(theta, nxt.theta, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(theta_dot, nxt.theta_dot, rtol=1e-6, atol=1e-6)


def test_pendulum_interpolation_is_exact_on_nodes_and_periodic():
    po = _load_script("pendulum_optimum")
    n = 9
    interp = po.make_interp(n, n, 8.0)
    thetas = -np.pi + 2 * np.pi * np.arange(n) / n
    dots = np.linspace(-8.0, 8.0, n)
    v = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    th, dot = np.meshgrid(thetas, dots, indexing="ij")
    np.testing.assert_allclose(interp(v, jnp.asarray(th), jnp.asarray(dot)), v, atol=1e-5)
    # theta wraps: theta + 2*pi lands on the same node
    np.testing.assert_allclose(interp(v, jnp.asarray(th + 2 * np.pi), jnp.asarray(dot)), v, atol=1e-4)
    # half-way between two theta nodes is the average
    mid = interp(v, jnp.float32(thetas[2] + np.pi / n), jnp.float32(dots[3]))
    assert float(mid) == pytest.approx(float(v[2, 3] + v[3, 3]) / 2, abs=1e-5)


def test_pendulum_fell_back_marks_a_swing_up_given_up_near_the_top():
    """An episode falls back when it comes within 0.7 rad of upright and later hangs more
    than 2 rad from it; starting low, or swinging up and staying, does not."""
    po = _load_script("pendulum_optimum")

    def run(thetas):
        near, fell = jnp.bool_(False), jnp.bool_(False)
        for th in thetas:
            near, now = po.fell_back(near, jnp.float32(th))
            fell = fell | now
        return bool(fell)

    assert run([3.0, 2.5, 1.0, 0.6, 1.5, 2.5, 3.1])          # near the top, then down again
    assert run([3.0, -0.5, -2.0 * math.pi + 2.1])            # wraps: 2.1 rad from upright
    assert not run([3.0, 2.5, 2.9, 2.2, 2.6])               # never near the top
    assert not run([3.0, 1.5, 0.6, 0.3, 0.0, -0.1, 0.05])    # swings up and stays
    assert not run([0.2, 1.0, 1.9, 0.1])                     # falls to 1.9 only: not low


def test_pendulum_policy_comparison_plays_the_run_on_the_greedy_resets(tmp_path):
    """--policy: each seed's deterministic policy on the same resets as the greedy one; the
    script's return equals a plain Python loop over gymnax, and the angle bins partition it."""
    import jaxppo

    po = _load_script("pendulum_optimum")
    cfg = PPOConfig(env="Pendulum-v1", num_envs=4, num_steps=16, num_minibatches=2,
                    num_epochs=1, total_timesteps=128, num_seeds=2, compilation_cache_dir=None)
    jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False)
    spec = make_env(cfg)
    env, p = spec.env, spec.env_params
    values, interp, torques = po.solve(p, 21, 5)
    assert values.shape == (po.HORIZON + 1, 21, 21)

    def greedy(obs, state, t):
        r, nth, ndot = po.transition(p, state.theta, state.theta_dot, torques)
        return jnp.array([torques[jnp.argmax(r + interp(values[po.HORIZON - t - 1], nth, ndot))]])

    keys = jax.random.split(jax.random.key(3), 6)
    out = po.compare_policy(str(tmp_path / "run"), env, p, po.make_player(env, p, greedy), keys)
    assert len(out["seeds"]) == 2 and out["episodes"] == 6

    policy = jaxppo.load_policy(tmp_path / "run", seed_index=1)
    returns, fells, ups = [], [], []
    for key in keys[:2]:
        k_reset, k_step = jax.random.split(key)
        obs, state = env.reset(k_reset, p)
        total, near, fell, up = 0.0, False, False, po.HORIZON
        for t in range(po.HORIZON):
            obs, state, r, _, _ = env.step_env(k_step, state, policy(obs[None])[0], p)
            total += float(r)
            angle = abs((float(state.theta) + math.pi) % (2 * math.pi) - math.pi)
            fell = fell or (near and angle > 2.0)
            near = near or angle < 0.7
            up = t if up == po.HORIZON and angle < 0.3 else up
        returns.append(total)
        fells.append(fell)
        ups.append(up)
    seed = out["seeds"][1]
    ours, _, fell, up = po.make_player(env, p, lambda o, s, t: policy(o[None])[0])(keys)
    np.testing.assert_allclose(np.asarray(ours)[:2], returns, rtol=1e-4)
    assert list(np.asarray(fell)[:2]) == fells and list(np.asarray(up)[:2]) == ups
    assert seed["episodes_fell_back"] == int(np.sum(fell))
    assert seed["steps_to_up_mean"] == pytest.approx(float(np.mean(up)))
    assert seed["return_mean"] == pytest.approx(float(np.mean(ours)), rel=1e-5)
    bins = seed["gap_by_start_angle"]
    assert sum(b["episodes"] for b in bins) == 6
    assert sum(b["gap"] * b["episodes"] for b in bins) / 6 == pytest.approx(seed["gap_mean"], abs=1e-3)
    assert seed["gap_mean"] == pytest.approx(out["greedy_return_mean"] - seed["return_mean"], abs=1e-3)


def test_actor_learner_benchmark_trains_the_same_config_at_both_lags(monkeypatch):
    """experiments/actor_learner.py: each case's two sides differ in max_policy_lag only."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))  # its `from bench import ...`
    al = _load_script("actor_learner")
    for case, spec in al.CASES.items():
        sync, lag1 = al.case_config(case, 0), al.case_config(case, 1)
        assert sync.replace(max_policy_lag=1) == lag1 and lag1.env == spec["env"]
        assert sync.num_iterations == spec["iterations"] and sync.log_every == 1
        if al._available(case) is None:
            assert resolve(lag1).host_loop
