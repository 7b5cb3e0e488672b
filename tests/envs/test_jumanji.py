"""Jumanji envs by name ("jumanji:<Id>", jaxppo.envs.jumanji_suite): the gymnax contract checked
against Jumanji's own reset and step on a 6x6 Snake (flattened observations, rewards, a real
end as a termination, jaxppo's time limit as a truncation, the final observation and the
reset with the step's key), a MultiDiscrete action spec as one Discrete action, the errors,
and a short training run with its run folder. The tests that need jumanji skip without it
(CI installs it with the dev extra)."""

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

ENV = "jumanji:Snake-v1"
ROWS = COLS = 6
T = 24  # steps of every compared rollout
TINY = jaxppo.PPOConfig(env=ENV, env_kwargs={"num_rows": ROWS, "num_cols": COLS},
                        num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                        total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                        compilation_cache_dir=None)
UP, RIGHT, DOWN, LEFT = 0, 1, 2, 3


@pytest.fixture(scope="module")
def snake():
    """(spec, adapter rollout, Jumanji rollout, Jumanji reset), jitted, for a 6x6 Snake."""
    pytest.importorskip("jumanji")
    spec = make_env(TINY)
    env = spec.env
    jenv = env.jumanji_env

    @jax.jit
    def adapter_rollout(params, key, keys, actions):
        """Reset with `key`, then step with keys[t] and actions[t] ([T], [T])."""
        obs0, state = env.reset(key, params)

        def body(state, x):
            k, a = x
            obs, state, reward, term, trunc, info = env.step(k, state, a, params)
            return state, (obs, reward, term, trunc, info["final_observation"], state.time)

        _, out = jax.lax.scan(body, state, (keys, actions))
        return obs0, out

    @jax.jit
    def jumanji_rollout(key, actions):
        """Jumanji's own env: reset with `key`, step (no reset) with actions; observations
        flattened by hand (grid, step_count, action_mask: Snake's field order)."""
        state, ts = jenv.reset(key)

        def flat(o):
            return jnp.concatenate([o.grid.reshape(-1), o.step_count[None].astype(jnp.float32),
                                    o.action_mask.astype(jnp.float32)])

        def body(state, a):
            state, ts = jenv.step(state, a)
            return state, (flat(ts.observation), ts.reward, ts.step_type, ts.discount)

        _, out = jax.lax.scan(body, state, actions)
        return flat(ts.observation), state.head_position, out

    return spec, adapter_rollout, jumanji_rollout, jax.jit(lambda k: env.reset(k)[0])


def _keys(seed: int):
    key, *keys = jax.random.split(jax.random.PRNGKey(seed), T + 1)
    return key, jnp.stack(keys)


def _square(head, n: int = T):
    """Actions that walk a 2x2 square inside the grid from `head` (never an edge)."""
    row, col = int(head[0]), int(head[1])
    h, v = (RIGHT, LEFT) if col < COLS - 1 else (LEFT, RIGHT)
    d, u = (DOWN, UP) if row < ROWS - 1 else (UP, DOWN)
    return jnp.asarray([h, d, v, u] * (n // 4 + 1), jnp.int32)[:n]


def test_spec_and_run_name(snake):
    spec, *_ = snake
    assert spec.obs_shape == (ROWS * COLS * 5 + 1 + 4,) and spec.discrete and spec.action_dim == 4
    assert spec.env.obs_parts == (("grid", (ROWS, COLS, 5)), ("step_count", ()),
                                  ("action_mask", (4,)))
    assert spec.env_params.max_steps_in_episode == 4000  # Snake's own time_limit
    assert TINY.env_name == "Snake-v1" and TINY.to_dict()["env"] == ENV


def test_reset_and_steps_equal_jumanji_own(snake):
    spec, adapter_rollout, jumanji_rollout, _ = snake
    key, keys = _keys(0)
    _, head, _ = jumanji_rollout(key, jnp.zeros((T,), jnp.int32))
    actions = _square(head)
    obs0, (obs, reward, term, trunc, final_obs, time) = adapter_rollout(
        spec.env_params, key, keys, actions)
    j_obs0, _, (j_obs, j_reward, j_type, _) = jumanji_rollout(key, actions)
    assert not (np.asarray(j_type) == 2).any()  # the square never ends an episode
    np.testing.assert_array_equal(obs0, j_obs0)
    np.testing.assert_array_equal(obs, j_obs)
    np.testing.assert_array_equal(final_obs, j_obs)
    np.testing.assert_array_equal(reward, j_reward)
    assert not np.asarray(term).any() and not np.asarray(trunc).any()
    np.testing.assert_array_equal(time, np.arange(1, T + 1))


def test_leaving_the_grid_is_a_termination(snake):
    spec, adapter_rollout, jumanji_rollout, reset_obs = snake
    key, keys = _keys(1)
    actions = jnp.full((T,), UP, jnp.int32)  # up until the head leaves the grid
    _, head, (j_obs, _, j_type, j_discount) = jumanji_rollout(key, actions)
    first = int(head[0])  # row r: r steps up to row 0, the next one leaves the grid
    assert j_type[first] == 2 and j_discount[first] == 0.0 and not (j_type[:first] == 2).any()
    _, (obs, _, term, trunc, final_obs, time) = adapter_rollout(
        spec.env_params, key, keys, actions)
    assert np.flatnonzero(np.asarray(term))[0] == first and not np.asarray(trunc).any()
    np.testing.assert_array_equal(final_obs[: first + 1], j_obs[: first + 1])
    np.testing.assert_array_equal(obs[first], reset_obs(keys[first]))
    assert int(time[first]) == 0


def test_time_limit_is_a_truncation_with_the_final_observation(snake):
    _, adapter_rollout, jumanji_rollout, reset_obs = snake
    limit = make_env(TINY.replace(env_kwargs={**TINY.env_kwargs, "max_steps_in_episode": 5}))
    assert limit.env_params.max_steps_in_episode == 5
    key, keys = _keys(0)
    _, head, _ = jumanji_rollout(key, jnp.zeros((T,), jnp.int32))
    # The reset after step 5 starts elsewhere, so the square of the first episode may hit a
    # wall later: compare the first episode, and its end.
    actions = _square(head)
    _, (obs, reward, term, trunc, final_obs, time) = adapter_rollout(
        limit.env_params, key, keys, actions)
    _, _, (j_obs, j_reward, j_type, _) = jumanji_rollout(key, actions)
    assert not (np.asarray(j_type[:5]) == 2).any()
    assert np.flatnonzero(np.asarray(trunc))[0] == 4 and not np.asarray(term[:5]).any()
    np.testing.assert_array_equal(final_obs[:5], j_obs[:5])
    np.testing.assert_array_equal(reward[:5], j_reward[:5])
    np.testing.assert_array_equal(obs[4], reset_obs(keys[4]))
    np.testing.assert_array_equal(time[:6], [1, 2, 3, 4, 0, 1])


def test_jumanji_time_limit_is_its_termination(snake):
    """Snake ends its own time limit with discount 0: a termination, as Jumanji says."""
    short = make_env(TINY.replace(env_kwargs={**TINY.env_kwargs, "time_limit": 3}))
    assert short.env_params.max_steps_in_episode == 3  # jaxppo's limit follows time_limit
    env, params = short.env, short.env_params
    _, state = env.reset(jax.random.PRNGKey(3), params)
    head = state.jumanji_state.head_position
    ends = []
    for a in _square((head.row, head.col), 3):
        _, state, _, term, trunc, _ = env.step(jax.random.PRNGKey(4), state, a, params)
        ends.append((bool(term), bool(trunc)))
    assert ends == [(False, False), (False, False), (True, False)]


def test_a_multidiscrete_action_is_one_discrete_action():
    pytest.importorskip("jumanji")
    spec = make_env(TINY.replace(env="jumanji:Minesweeper-v0", env_kwargs={}))
    assert spec.discrete and spec.action_dim == 100  # [row, col] on a 10x10 board
    env, params = spec.env, spec.env_params
    _, state = env.reset(jax.random.PRNGKey(0), params)
    _, _, reward, *_ = env.step(jax.random.PRNGKey(1), state, jnp.int32(37), params)
    _, ts = env.jumanji_env.step(state.jumanji_state, jnp.asarray([3, 7], jnp.int32))
    assert float(reward) == float(ts.reward)


def test_the_adapter_passes_the_env_contract_check(snake):
    spec, *_ = snake
    check_env(spec.env, spec.env_params, ENV, steps=128)  # what make_env skips


def test_errors_name_the_fix():
    pytest.importorskip("jumanji")
    with pytest.raises(ConfigError, match=r"did you mean 'jumanji:Snake-v1'.*Available: .*"
                                          r"jumanji:Game2048-v1"):
        make_env(TINY.replace(env="jumanji:Snak-v1"))
    with pytest.raises(ConfigError, match=r"jumanji.make\('Snake-v1', num_rowz=6\) raised"):
        make_env(TINY.replace(env_kwargs={"num_rowz": 6}))
    with pytest.raises(ConfigError, match=r"MultiDiscreteArray .* combinations.*up to 4096"):
        make_env(TINY.replace(env="jumanji:JobShop-v0", env_kwargs={}))
    with pytest.raises(ConfigError, match=r"action spec is BoundedArray\(shape=\(2,\)"):
        make_env(TINY.replace(env="jumanji:MultiCVRP-v0", env_kwargs={}))
    with pytest.raises(ConfigError, match=r"reward is an array of shape \(2,\) \(one per agent"):
        make_env(TINY.replace(env="jumanji:LevelBasedForaging-v0", env_kwargs={}))
    with pytest.raises(ConfigError, match=r"did you mean 'jumanji:Snake-v1'"):
        make_env(TINY.replace(env="Snake-v1", env_kwargs={}))


def test_without_jumanji_a_jumanji_env_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jumanji", None)  # import jumanji -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'jaxppo\[jumanji\]'"):
        make_env(TINY)


@pytest.mark.slow
def test_ppo_learns_to_stay_on_the_grid_and_eat(tmp_path):
    pytest.importorskip("jumanji")
    # README's command without Snake's action mask: the mask keeps even a random snake on the
    # grid (every episode already lasts the 64-step limit), so learning to stay on it is
    # measured unmasked.
    cfg = readme_train_config(ENV).replace(compilation_cache_dir=None, mask_actions=False)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    returns = np.asarray(result.metrics["episode_return_mean"]).reshape(-1)
    lengths = np.asarray(result.metrics["episode_length_mean"]).reshape(-1)
    # A random snake leaves the 5x5 grid after ~6 steps, eating ~0.15 fruit; after 20
    # iterations (~8 s) it stays ~30 steps and eats ~0.9.
    assert np.nanmean(lengths[-5:]) > 2 * np.nanmean(lengths[:3]), lengths
    assert np.nanmean(returns[-5:]) > 2 * np.nanmean(returns[:3]), returns
    assert f"env: {ENV}" in (tmp_path / "run" / "config.yaml").read_text()
    policy = jaxppo.load_policy(tmp_path / "run")  # the env rebuilt from config.yaml by name
    assert policy.evaluate(episodes=2)["episodes"] == 2
