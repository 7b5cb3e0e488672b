"""XLand-MiniGrid envs by name ("xminigrid:<name>", jaxppo.envs.xminigrid_suite): what only
xminigrid has (byte observations, a random start drawn with the step's key, env_kwargs and
their errors) and a short learning run with its run folder. The contract every suite keeps
(checked against xminigrid's own reset and step on MiniGrid-Empty-5x5: reaching the goal as a
termination, the time limit as a truncation) is in tests/envs/test_suites.py. The tests that
need xminigrid skip without it (CI installs it with the dev extra)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError
from readme_commands import readme_train_config

ENV = "xminigrid:MiniGrid-Empty-5x5"
TINY = jaxppo.PPOConfig(env=ENV, num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                        total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                        compilation_cache_dir=None)
RIGHT = 1


def test_observations_are_bytes():
    pytest.importorskip("xminigrid")
    spec = make_env(TINY)
    assert spec.env.observation_space(spec.env_params).dtype == jnp.uint8


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


def test_env_kwargs_and_errors_name_the_fix():
    pytest.importorskip("xminigrid")
    assert make_env(TINY.replace(env_kwargs={"view_size": 3})).obs_shape == (3, 3, 2)
    with pytest.raises(ConfigError, match=r"xminigrid.make\('MiniGrid-Empty-5x5', view=3\) "
                                          r"raised"):
        make_env(TINY.replace(env_kwargs={"view": 3}))


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
