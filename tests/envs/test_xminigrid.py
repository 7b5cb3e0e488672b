"""XLand-MiniGrid envs by name ("xminigrid:<name>", jaxppo.envs.xminigrid_suite): the gymnax 1.x
contract checked against xminigrid's own reset and step on MiniGrid-Empty-5x5 (observations,
rewards, reaching the goal as a termination, the time limit as a truncation, the final
observation and the reset with the step's key), the errors, and a short learning run with
its run folder. The tests that need xminigrid skip without it (CI installs it with the dev
extra)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.check import check_env
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError
from readme_commands import readme_train_config

ENV = "xminigrid:MiniGrid-Empty-5x5"
T = 16  # steps of every compared rollout
TINY = jaxppo.PPOConfig(env=ENV, num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                        total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                        compilation_cache_dir=None)
FORWARD, RIGHT, LEFT = 0, 1, 2
# From (1, 1) facing right: two steps right, turn to face down, two steps down: the goal (3, 3).
TO_GOAL = [FORWARD, FORWARD, RIGHT, FORWARD, FORWARD]


@pytest.fixture(scope="module")
def empty():
    """(spec, adapter rollout, xminigrid rollout), for MiniGrid-Empty-5x5."""
    pytest.importorskip("xminigrid")
    spec = make_env(TINY)
    env = spec.env

    def adapter_rollout(params, key, keys, actions):
        """Reset with `key`, then step with keys[t] and actions[t] ([T], [T])."""
        @jax.jit
        def run(key, keys, actions):
            obs0, state = env.reset(key, params)

            def body(state, x):
                k, a = x
                obs, state, reward, term, trunc, info = env.step(k, state, a, params)
                return state, (obs, reward, term, trunc, info["final_observation"],
                               state.state.step_num)

            return obs0, jax.lax.scan(body, state, (keys, actions))[1]

        return run(key, keys, actions)

    def xminigrid_rollout(key, actions, max_steps=None):
        """xminigrid's own env: reset with `key`, step (no reset) with actions."""
        xenv, xparams = env.xminigrid_env, spec.env_params.xminigrid
        if max_steps is not None:
            xparams = xparams.replace(max_steps=max_steps)

        @jax.jit
        def run(key, actions):
            ts = xenv.reset(xparams, key)

            def body(ts, a):
                ts = xenv.step(xparams, ts, a)
                return ts, (ts.observation, ts.reward, ts.step_type, ts.discount)

            return ts.observation, jax.lax.scan(body, ts, actions)[1]

        return run(key, actions)

    return spec, adapter_rollout, xminigrid_rollout


def _keys(seed: int):
    key, *keys = jax.random.split(jax.random.PRNGKey(seed), T + 1)
    return key, jnp.stack(keys)


def test_spec_and_run_name(empty):
    spec, *_ = empty
    assert spec.obs_shape == (7, 7, 2) and spec.discrete and spec.action_dim == 6
    assert spec.env.observation_space(spec.env_params).dtype == jnp.uint8
    assert spec.env_params.max_steps_in_episode == 100  # xminigrid's max_steps: 4 * 5 * 5
    assert TINY.env_name == "MiniGrid-Empty-5x5" and TINY.to_dict()["env"] == ENV


def test_reset_and_steps_equal_xminigrid_own(empty):
    spec, adapter_rollout, xminigrid_rollout = empty
    key, keys = _keys(0)
    actions = jnp.asarray([RIGHT, LEFT, FORWARD, LEFT, RIGHT, FORWARD, LEFT, LEFT] * 2, jnp.int32)
    obs0, (obs, reward, term, trunc, final_obs, time) = adapter_rollout(
        spec.env_params, key, keys, actions)
    x_obs0, (x_obs, x_reward, x_type, _) = xminigrid_rollout(key, actions)
    assert not (np.asarray(x_type) == 2).any()  # these actions never reach the goal
    np.testing.assert_array_equal(obs0, x_obs0)
    np.testing.assert_array_equal(obs, x_obs)
    np.testing.assert_array_equal(final_obs, x_obs)
    np.testing.assert_array_equal(reward, x_reward)
    assert not np.asarray(term).any() and not np.asarray(trunc).any()
    np.testing.assert_array_equal(time, np.arange(1, T + 1))


def test_the_goal_is_a_termination(empty):
    spec, adapter_rollout, xminigrid_rollout = empty
    key, keys = _keys(1)
    actions = jnp.asarray(TO_GOAL + [RIGHT] * (T - 5), jnp.int32)
    obs0, (obs, reward, term, trunc, final_obs, time) = adapter_rollout(
        spec.env_params, key, keys, actions)
    _, (x_obs, x_reward, x_type, x_discount) = xminigrid_rollout(key, actions)
    assert x_type[4] == 2 and x_discount[4] == 0.0 and not (x_type[:4] == 2).any()
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(term)), [4])
    assert not np.asarray(trunc).any()
    assert float(reward[4]) == pytest.approx(1 - 0.9 * 5 / 100) == float(x_reward[4])
    np.testing.assert_array_equal(final_obs[:5], x_obs[:5])
    np.testing.assert_array_equal(obs[4], obs0)  # Empty-5x5 always starts in the same place
    np.testing.assert_array_equal(time[3:6], [4, 0, 1])


def test_time_limit_is_a_truncation_with_the_final_observation(empty):
    _, adapter_rollout, xminigrid_rollout = empty
    limit = make_env(TINY.replace(env_kwargs={"max_steps_in_episode": 4})).env_params
    assert limit.max_steps_in_episode == 4
    key, keys = _keys(2)
    actions = jnp.full((T,), RIGHT, jnp.int32)  # turning on the spot
    obs0, (obs, _, term, trunc, final_obs, time) = adapter_rollout(limit, key, keys, actions)
    _, (x_obs, _, x_type, x_discount) = xminigrid_rollout(key, actions, max_steps=4)
    assert x_type[3] == 2 and x_discount[3] == 1.0  # xminigrid: LAST with discount 1
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(trunc)), [3, 7, 11, 15])
    assert not np.asarray(term).any()
    np.testing.assert_array_equal(final_obs[:4], x_obs[:4])
    np.testing.assert_array_equal(obs[3], obs0)
    np.testing.assert_array_equal(time[:6], [1, 2, 3, 0, 1, 2])


def test_a_random_start_is_drawn_with_the_step_key():
    pytest.importorskip("xminigrid")
    spec = make_env(TINY.replace(env="xminigrid:MiniGrid-EmptyRandom-5x5",
                                 env_kwargs={"max_steps_in_episode": 1}))
    env, params = spec.env, spec.env_params
    reset = jax.jit(lambda k: env.reset(k, params))
    step = jax.jit(lambda k, s: env.step(k, s, jnp.int32(RIGHT), params))
    _, state = reset(jax.random.PRNGKey(0))
    starts = set()
    for i in range(6):
        obs, state, _, term, trunc, _ = step(jax.random.PRNGKey(i), state)
        assert bool(trunc) and not bool(term)
        np.testing.assert_array_equal(obs, reset(jax.random.PRNGKey(i))[0])
        starts.add(tuple(np.asarray(state.state.agent.position)))
    assert len(starts) > 1


def test_the_adapter_passes_the_env_contract_check(empty):
    spec, *_ = empty
    check_env(spec.env, spec.env_params, ENV, steps=256)  # what make_env skips


def test_env_kwargs_and_errors_name_the_fix():
    pytest.importorskip("xminigrid")
    assert make_env(TINY.replace(env_kwargs={"view_size": 3})).obs_shape == (3, 3, 2)
    with pytest.raises(ConfigError, match=r"did you mean 'xminigrid:MiniGrid-Empty-5x5'.*"
                                          r"Available: .*xminigrid:MiniGrid-FourRooms"):
        make_env(TINY.replace(env="xminigrid:MiniGrid-Emtpy-5x5"))
    with pytest.raises(ConfigError, match=r"time limit is env_kwargs max_steps_in_episode"):
        make_env(TINY.replace(env_kwargs={"max_steps": 10}))
    with pytest.raises(ConfigError, match=r"xminigrid.make\('MiniGrid-Empty-5x5', view=3\) "
                                          r"raised"):
        make_env(TINY.replace(env_kwargs={"view": 3}))
    with pytest.raises(ConfigError, match=r"did you mean 'xminigrid:MiniGrid-Empty-5x5'"):
        make_env(TINY.replace(env="MiniGrid-Empty-5x5"))


def test_without_xminigrid_an_xminigrid_env_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "xminigrid", None)  # import xminigrid -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'jaxppo\[xminigrid\]'"):
        make_env(TINY)


@pytest.mark.slow
def test_ppo_learns_to_reach_the_goal(tmp_path):
    pytest.importorskip("xminigrid")
    cfg = readme_train_config(ENV).replace(compilation_cache_dir=None)  # README's command
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    returns = np.asarray(result.metrics["episode_return_mean"]).reshape(-1)
    lengths = np.asarray(result.metrics["episode_length_mean"]).reshape(-1)
    # The return is 1 - 0.9 * steps / 100 at the goal: 0.955 for the shortest path (5 steps).
    # Random walks reach it in ~20 steps (the episodes that end within an iteration are the
    # short ones); after 16 iterations (~8 s) PPO walks the shortest path.
    assert np.nanmean(returns[:4]) < 0.8 and np.nanmean(returns[-3:]) > 0.94, returns
    assert np.nanmean(lengths[-3:]) < 7 < np.nanmean(lengths[:4]), lengths
    assert f"env: {ENV}" in (tmp_path / "run" / "config.yaml").read_text()
    policy = jaxppo.load_policy(tmp_path / "run")  # the env rebuilt from config.yaml by name
    assert policy.evaluate(episodes=4)["return_mean"] == pytest.approx(0.955, abs=1e-6)
