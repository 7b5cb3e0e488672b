"""The single-host trainer: seeds, sweeps, determinism, NaN handling, envs, TrainResult.

Compiling dominates the cost here, so every config is tiny and compiled results are shared
through module-scoped fixtures.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from gymnax.environments import environment, spaces

import jaxppo
from jaxppo import ConfigError, HyperParams, NetworkConfig, PPOConfig, TrainingDivergedError
from jaxppo.core.algorithm import METRIC_KEYS

N_ITER = 6
SMALL = PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=16, num_minibatches=2, num_epochs=2,
    total_timesteps=4 * 16 * N_ITER, network=NetworkConfig(hidden_sizes=(16, 16)),
    log_every=4,  # chunks of 4 and 2 iterations: the last chunk skips its tail
    num_devices=1, compilation_cache_dir=None,
)
HEALTH = ("policy_loss", "value_loss", "entropy", "kl", "approx_kl", "grad_norm",
          "explained_variance", "clip_fraction")


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_metrics_close(got: dict, want: dict, rtol=1e-4, atol=1e-5):
    for k in METRIC_KEYS:
        np.testing.assert_allclose(np.asarray(got[k], np.float64), np.asarray(want[k], np.float64),
                                   rtol=rtol, atol=atol, err_msg=k)


def seed_slice(tree, s):
    return jax.tree.map(lambda x: x[s], tree)


# ------------------------------------------------------------------ shared compiled runs
@pytest.fixture(scope="module")
def hp():
    return HyperParams.from_config(SMALL)


@pytest.fixture(scope="module")
def train_fn():
    """make_train(SMALL), jitted once; called with explicit (key, hparams)."""
    return jax.jit(jaxppo.make_train(SMALL))


@pytest.fixture(scope="module")
def seed_keys():
    return jax.random.split(jax.random.PRNGKey(SMALL.seed), 2)


@pytest.fixture(scope="module")
def separate_runs(train_fn, hp, seed_keys):
    return [jax.device_get(train_fn(k, hp)) for k in seed_keys]


@pytest.fixture(scope="module")
def two_seeds():
    return jaxppo.train(SMALL.replace(num_seeds=2), progress=False)


@pytest.fixture(scope="module")
def one_seed():
    return jaxppo.train(SMALL, progress=False)


# ------------------------------------------------------------------ seeds
def test_metrics_layout(one_seed, two_seeds):
    for res, shape in ((one_seed, (1, N_ITER)), (two_seeds, (2, N_ITER))):
        for k in METRIC_KEYS + ("iteration", "wall_time", "sps"):
            assert np.shape(res.metrics[k]) == shape, k
    np.testing.assert_array_equal(one_seed.metrics["iteration"][0], np.arange(1, N_ITER + 1))
    np.testing.assert_array_equal(one_seed.metrics["env_steps"][0], 64 * np.arange(1, N_ITER + 1))
    np.testing.assert_array_equal(two_seeds.metrics["env_steps"][1], 64 * np.arange(1, N_ITER + 1))
    assert int(one_seed.state.iteration) == N_ITER
    assert int(one_seed.state.env_steps) == N_ITER * 64
    np.testing.assert_array_equal(np.asarray(two_seeds.state.iteration), [N_ITER, N_ITER])
    # the two seeds are really different runs
    assert not np.allclose(two_seeds.metrics["policy_loss"][0], two_seeds.metrics["policy_loss"][1])


def test_train_equals_make_train(one_seed, train_fn, hp):
    """train() in chunks (with a skipped tail) = make_train's single scan, same key."""
    state, metrics = train_fn(jax.random.PRNGKey(SMALL.seed), hp)
    assert_metrics_close(seed_slice(one_seed.metrics, 0), metrics)
    assert_trees_close(one_seed.params, state.params)


@pytest.mark.parametrize("s", [0, 1])
def test_vmapped_seeds_equal_separate_runs(two_seeds, separate_runs, s):
    """Seed s of train(num_seeds=2) = make_train run alone with split(PRNGKey(seed), 2)[s]."""
    state, metrics = separate_runs[s]
    got = {k: v[s] for k, v in two_seeds.metrics.items()}
    assert_metrics_close(got, metrics)
    assert_trees_close(seed_slice(two_seeds.params, s), state.params)
    assert_trees_close(seed_slice(two_seeds.state.obs_stats, s), state.obs_stats)


def test_same_seed_twice_is_identical(one_seed):
    again = jaxppo.train(SMALL, progress=False)
    for k in METRIC_KEYS:
        np.testing.assert_array_equal(one_seed.metrics[k], again.metrics[k], err_msg=k)
    assert_trees_equal(one_seed.params, again.params)
    assert_trees_equal(one_seed.state.rng, again.state.rng)


def test_make_train_same_key_twice_is_identical(train_fn, hp, separate_runs, seed_keys):
    state, metrics = jax.device_get(train_fn(seed_keys[0], hp))
    assert_trees_equal(metrics, separate_runs[0][1])
    assert_trees_equal(state.params, separate_runs[0][0].params)


def test_different_seed_differs(train_fn, hp):
    _, m0 = train_fn(jax.random.PRNGKey(0), hp)
    _, m1 = train_fn(jax.random.PRNGKey(1), hp)
    assert not np.allclose(np.asarray(m0["value_loss"]), np.asarray(m1["value_loss"]))


# ------------------------------------------------------------------ sweeps over HyperParams
LRS = (1e-3, 2e-2)


@pytest.fixture(scope="module")
def lr_hps():
    return [HyperParams.from_config(SMALL.replace(lr=lr, lr_schedule="constant")) for lr in LRS]


def stack(hps):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *hps)


def test_vmap_over_lr_equals_separate_runs(train_fn, lr_hps):
    key = jax.random.PRNGKey(3)
    swept_state, swept = jax.jit(jax.vmap(jaxppo.make_train(SMALL), in_axes=(None, 0)))(key, stack(lr_hps))
    for i, hp_i in enumerate(lr_hps):
        state, metrics = train_fn(key, hp_i)
        assert_metrics_close(seed_slice(swept, i), metrics)
        assert_trees_close(seed_slice(swept_state.params, i), state.params, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(swept["lr"][i]), LRS[i], rtol=1e-6)
    # the sweep is not vacuous: the two learning rates give different runs
    assert not np.allclose(np.asarray(swept["policy_loss"][0]), np.asarray(swept["policy_loss"][1]))


def test_train_with_batched_hparams_per_seed(train_fn, lr_hps, seed_keys):
    """train(num_seeds=2, hparams=batched): seed s uses key s and hyperparameters s."""
    res = jaxppo.train(SMALL.replace(num_seeds=2), hparams=stack(lr_hps), progress=False)
    for s in range(2):
        state, metrics = train_fn(seed_keys[s], lr_hps[s])
        assert_metrics_close({k: v[s] for k, v in res.metrics.items()}, metrics)
        assert_trees_close(seed_slice(res.params, s), state.params, rtol=1e-4, atol=1e-5)


def test_batched_hparams_with_wrong_leading_axis(lr_hps):
    with pytest.raises(ConfigError, match=r"num_seeds=3"):
        jaxppo.train(SMALL.replace(num_seeds=3), hparams=stack(lr_hps), progress=False)


def test_lr_schedule_metric(one_seed):
    """Default linear anneal from lr to 0 over total_timesteps, read at each iteration's start."""
    steps = 64 * np.arange(N_ITER)
    expected = SMALL.lr * (1 - steps / SMALL.total_timesteps)
    np.testing.assert_allclose(one_seed.metrics["lr"][0], expected, rtol=1e-5)


# ------------------------------------------------------------------ a user's own env
@struct.dataclass
class SignState(environment.EnvState):
    sign: jax.Array


@struct.dataclass
class SignParams(environment.EnvParams):
    max_steps_in_episode: int = 10
    nan_from_step: int = -1  # the reward is NaN from this in-episode step on (-1: never)


class SignEnv(environment.Environment):
    """Observe a random sign; reward 1 for the action that matches it (0 for -, 1 for +)."""

    @property
    def default_params(self):
        return SignParams()

    def _obs(self, state):
        return jnp.stack([state.sign, jnp.float32(0.5)])

    def step_env(self, key, state, action, params):
        reward = (action == (state.sign > 0)).astype(jnp.float32)
        time = state.time + 1
        reward = jnp.where((params.nan_from_step >= 0) & (time >= params.nan_from_step), jnp.nan, reward)
        sign = jnp.where(jax.random.bernoulli(key), 1.0, -1.0).astype(jnp.float32)
        state = SignState(time=time, sign=sign)
        return self._obs(state), state, reward, jnp.array(False), {}

    def reset_env(self, key, params):
        sign = jnp.where(jax.random.bernoulli(key), 1.0, -1.0).astype(jnp.float32)
        state = SignState(time=0, sign=sign)
        return self._obs(state), state

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params=None):
        return spaces.Box(-1.0, 1.0, (2,), jnp.float32)


def test_user_env_trains():
    cfg = SMALL.replace(env=SignEnv(), lr=1e-2, lr_schedule="constant", total_timesteps=64 * 12,
                        log_every=0)
    res = jaxppo.train(cfg, progress=False)
    assert res.config.env_name == "SignEnv"
    for k in HEALTH:
        assert np.all(np.isfinite(res.metrics[k])), k
    ret = res.metrics["episode_return_mean"][0]
    # 10-step episodes end 4 times per env per 16 steps (truncation): stats are never empty
    assert np.all(np.isfinite(ret)) and np.all(res.metrics["episode_length_mean"] == 10)
    # random play gets 5 of 10; the policy learns to follow the sign
    assert ret[:2].mean() < 7.5 and ret[-3:].mean() > 8.0, ret
    obs = jnp.array([[1.0, 0.5], [-1.0, 0.5]])
    np.testing.assert_array_equal(np.asarray(res.policy(obs, deterministic=True)), [1, 0])


def test_diverging_run_raises_and_keeps_earlier_rows(tmp_path):
    """Rewards turn NaN at env step 49 of the (never-ending) episodes: iteration 4 of 16 steps."""
    cfg = SMALL.replace(env=SignEnv(), env_kwargs={"max_steps_in_episode": 1000, "nan_from_step": 49},
                        log_every=2)
    with pytest.raises(TrainingDivergedError, match=r"diverged at iteration 4\b") as info:
        jaxppo.train(cfg, run_dir=tmp_path, progress=False)
    err = info.value
    assert err.iteration == 4
    assert err.last_finite is not None and err.last_finite["iteration"] == 3
    assert "metrics.jsonl" in str(err)
    assert "Try a lower lr" in str(err) and "first iteration" not in str(err)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # row 3 comes from the failing chunk
    for r in rows:
        for k in HEALTH:
            assert r[k] is not None and math.isfinite(r[k]), (r["iteration"], k)


def test_a_run_that_fails_in_its_first_iteration_points_at_the_network_and_env_first():
    cfg = SMALL.replace(env=SignEnv(), env_kwargs={"max_steps_in_episode": 1000, "nan_from_step": 3})
    with pytest.raises(TrainingDivergedError, match=r"diverged at iteration 1\b") as info:
        jaxppo.train(cfg, progress=False)
    message = str(info.value)
    assert "It failed in the first iteration, where the usual cause is not the step size" in message
    assert "network gives finite outputs" in message and "observations and rewards" in message


# ------------------------------------------------------------------ TrainResult functions
def test_policy_and_value_shapes(one_seed, two_seeds):
    obs = jax.random.normal(jax.random.PRNGKey(0), (7, 4))
    key = jax.random.PRNGKey(1)
    for res, seed in ((one_seed, 0), (two_seeds, 0), (two_seeds, 1)):
        a = res.policy(obs, key, seed=seed)
        assert a.shape == (7,) and jnp.issubdtype(a.dtype, jnp.integer)
        assert np.all((np.asarray(a) >= 0) & (np.asarray(a) < 2))
        assert res.value(obs, seed=seed).shape == (7,)
        assert res.policy(obs, deterministic=True, seed=seed).shape == (7,)
    # leading batch dims are kept; a single observation works
    assert one_seed.policy(jnp.zeros((3, 5, 4)), key).shape == (3, 5)
    assert one_seed.value(jnp.zeros((3, 5, 4))).shape == (3, 5)
    assert one_seed.value(jnp.zeros(4)).shape == ()
    with pytest.raises(ValueError, match="PRNG key"):
        one_seed.policy(obs)


def test_policy_and_value_use_the_trained_params(one_seed, two_seeds):
    obs = jax.random.normal(jax.random.PRNGKey(2), (9, 4))
    net = one_seed._algorithm.network
    dist, v, _ = net.apply(one_seed.params, obs)
    np.testing.assert_array_equal(np.asarray(one_seed.policy(obs, deterministic=True)),
                                  np.asarray(jnp.argmax(dist.loc, -1)))
    np.testing.assert_allclose(np.asarray(one_seed.value(obs)), np.asarray(v), rtol=1e-5, atol=1e-6)
    _, v1, _ = net.apply(seed_slice(two_seeds.params, 1), obs)
    np.testing.assert_allclose(np.asarray(two_seeds.value(obs, seed=1)), np.asarray(v1), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ continuous control
@pytest.fixture(scope="module")
def pendulum():
    cfg = SMALL.replace(env="Pendulum-v1", env_kwargs={"max_steps_in_episode": 10, "max_torque": 1.5},
                        total_timesteps=64 * 4, log_every=0)
    return jaxppo.train(cfg, progress=False)


def test_pendulum_runs_with_finite_metrics(pendulum):
    m = pendulum.metrics
    assert m["policy_loss"].shape == (1, 4)
    for k in HEALTH:
        assert np.all(np.isfinite(m[k])), k
    # 10-step episodes (truncated by the time limit) end in every iteration
    assert np.all(np.isfinite(m["episode_return_mean"])) and np.all(m["episode_length_mean"] == 10)
    assert np.all(m["episode_return_mean"] < 0)  # Pendulum rewards are costs
    assert np.all(m["episodes"] > 0)
    log_std = np.asarray(pendulum.params["params"]["log_std"])
    assert log_std.shape == (1,) and np.all(np.isfinite(log_std))


def test_pendulum_actions_within_bounds(pendulum):
    obs = jax.random.normal(jax.random.PRNGKey(0), (2000, 3)) * 3.0
    a = np.asarray(pendulum.policy(obs, jax.random.PRNGKey(1)))
    assert a.shape == (2000, 1) and np.all(np.isfinite(a))
    assert a.min() >= -1.5 and a.max() <= 1.5  # the env's (overridden) max_torque
    # std ~1 samples around ~0: some fall outside the bounds and are clipped onto them
    assert np.any(a == 1.5) and np.any(a == -1.5)
    d = np.asarray(pendulum.policy(obs, deterministic=True))
    assert d.shape == (2000, 1) and d.min() >= -1.5 and d.max() <= 1.5
    assert pendulum.value(obs).shape == (2000,)


def test_env_only_sees_actions_within_bounds():
    """A user's continuous env that turns its reward into NaN for an out-of-bounds action:
    training stays finite, so the rollout clips the Gaussian samples before `env.step`."""
    from gymnax.environments.classic_control.pendulum import Pendulum

    class StrictPendulum(Pendulum):
        def step_env(self, key, state, action, params):
            obs, state, reward, term, info = super().step_env(key, state, action, params)
            outside = jnp.any(jnp.abs(action) > params.max_torque)
            return obs, state, jnp.where(outside, jnp.nan, reward), term, info

    cfg = SMALL.replace(env=StrictPendulum(), env_kwargs={"max_torque": 0.5}, total_timesteps=64 * 3,
                        log_every=0)
    res = jaxppo.train(cfg, progress=False)  # raises TrainingDivergedError if an action escaped
    for k in HEALTH:
        assert np.all(np.isfinite(res.metrics[k])), k
