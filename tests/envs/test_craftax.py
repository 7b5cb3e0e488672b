"""Craftax envs by name ("craftax:<name>", jaxppo.envs.craftax_suite): the gymnax 1.x contract
checked against Craftax-Classic's own reset and step without auto-reset (observations,
rewards, the time limit as a truncation where Craftax says only `done`, lava as a
termination, the final observation and the reset with the step's key), the errors, and a
short training run with its run folder. Craftax compiles slowly on a CPU (~10 s for a
rollout), so one jitted rollout per side serves every comparison. The tests that need
craftax skip without it (CI installs it with the dev extra)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError
from readme_commands import readme_train_config

ENV = "craftax:Craftax-Classic-Symbolic-v1"
T = 12  # steps of every compared rollout
TINY = jaxppo.PPOConfig(env=ENV, num_envs=4, num_steps=16, num_minibatches=2, num_epochs=1,
                        total_timesteps=4 * 16 * 2, network=jaxppo.NetworkConfig((16,)),
                        compilation_cache_dir=None)
NOOP = 0


@pytest.fixture(scope="module")
def classic():
    """(spec, reset, adapter rollout, Craftax rollout), jitted, for Craftax-Classic-Symbolic.
    Both rollouts start from a given state, so a test may edit it (no recompile)."""
    pytest.importorskip("craftax")
    spec = make_env(TINY)
    env = spec.env
    cenv = env.craftax_env

    @jax.jit
    def adapter_rollout(params, state, keys, actions):
        """Step from `state` with keys[t] and actions[t] ([T], [T])."""
        def body(state, x):
            k, a = x
            obs, state, reward, term, trunc, info = env.step(k, state, a, params)
            return state, (obs, reward, term, trunc, info["final_observation"], state.timestep)

        return jax.lax.scan(body, state, (keys, actions))[1]

    @jax.jit
    def craftax_rollout(craftax_params, state, keys, actions):
        """Craftax's own env without auto-reset: step (no reset) with the step key jaxppo's
        adapter derives, split(keys[t])[0], as gymnax does."""
        def body(state, x):
            k, a = x
            obs, state, reward, done, info = cenv.step(jax.random.split(k)[0], state, a,
                                                       craftax_params)
            return state, (obs, reward, done, info["discount"])

        return jax.lax.scan(body, state, (keys, actions))[1]

    reset = jax.jit(lambda k, p: env.reset(k, p))
    return spec, reset, adapter_rollout, craftax_rollout


def _keys(seed: int):
    key, *keys = jax.random.split(jax.random.PRNGKey(seed), T + 1)
    return key, jnp.stack(keys)


def test_spec_and_run_name(classic):
    spec, *_ = classic
    assert spec.obs_shape == (1345,) and spec.discrete and spec.action_dim == 17
    assert spec.env_params.max_steps_in_episode == 10000  # Craftax-Classic's max_timesteps
    assert TINY.env_name == "Craftax-Classic-Symbolic-v1" and TINY.to_dict()["env"] == ENV
    space = spec.env.observation_space(spec.env_params)
    assert (float(space.low), float(space.high), space.dtype) == (0.0, 1.0, jnp.float32)


def test_reset_and_steps_equal_craftax_own(classic):
    spec, reset, adapter_rollout, craftax_rollout = classic
    key, keys = _keys(0)
    params = spec.env_params
    obs0, state = reset(key, params)
    c_obs0, _ = spec.env.craftax_env.reset(key, params.craftax)
    np.testing.assert_array_equal(obs0, c_obs0)
    actions = jax.random.randint(jax.random.PRNGKey(1), (T,), 0, 17)
    obs, reward, term, trunc, final_obs, time = adapter_rollout(params, state, keys, actions)
    c_obs, c_reward, c_done, _ = craftax_rollout(params.craftax, state, keys, actions)
    assert not np.asarray(c_done).any()  # 12 random steps do not end a Craftax episode
    np.testing.assert_array_equal(obs, c_obs)
    np.testing.assert_array_equal(final_obs, c_obs)
    np.testing.assert_array_equal(reward, c_reward)
    assert not np.asarray(term).any() and not np.asarray(trunc).any()
    np.testing.assert_array_equal(time, np.arange(1, T + 1))


def test_time_limit_is_a_truncation_where_craftax_says_done(classic):
    _, reset, adapter_rollout, craftax_rollout = classic
    limit = make_env(TINY.replace(env_kwargs={"max_steps_in_episode": 5})).env_params
    assert limit.max_steps_in_episode == 5 and limit.craftax.max_timesteps == 10000
    key, keys = _keys(2)
    _, state = reset(key, limit)
    actions = jnp.full((T,), NOOP, jnp.int32)
    obs, reward, term, trunc, final_obs, time = adapter_rollout(limit, state, keys, actions)
    c_obs, c_reward, c_done, c_discount = craftax_rollout(
        limit.craftax.replace(max_timesteps=5), state, keys, actions)
    assert bool(c_done[4]) and float(c_discount[4]) == 0.0  # Craftax: done, discount 0
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(trunc)), [4, 9])
    assert not np.asarray(term).any()
    np.testing.assert_array_equal(final_obs[:5], c_obs[:5])
    np.testing.assert_array_equal(reward[:5], c_reward[:5])
    # The step at the limit returns the reset's observation, drawn with that step's key.
    reset_obs, _ = reset(jax.random.split(keys[4])[1], limit)
    np.testing.assert_array_equal(obs[4], reset_obs)
    np.testing.assert_array_equal(time[:6], [1, 2, 3, 4, 0, 1])


def test_lava_is_a_termination(classic):
    from craftax.craftax_classic.constants import BlockType

    spec, reset, adapter_rollout, craftax_rollout = classic
    params = spec.env_params
    key, keys = _keys(3)
    _, state = reset(key, params)
    x, y = (int(v) for v in state.player_position)
    state = state.replace(map=state.map.at[x, y].set(BlockType.LAVA.value))
    actions = jnp.full((T,), NOOP, jnp.int32)
    _, _, term, trunc, final_obs, time = adapter_rollout(params, state, keys, actions)
    c_obs, _, c_done, _ = craftax_rollout(params.craftax, state, keys, actions)
    assert bool(c_done[0]) and bool(term[0]) and not bool(trunc[0])
    np.testing.assert_array_equal(final_obs[0], c_obs[0])
    assert int(time[0]) == 0 and not np.asarray(term[1:]).any()  # a new world, no lava


def test_reset_and_step_keep_the_state_structure(classic):
    """What jaxppo's check_env traces first (check_env itself would compile ~13 s more)."""
    spec, *_ = classic
    env, params = spec.env, spec.env_params
    key = jax.random.PRNGKey(0)
    obs, state = jax.eval_shape(lambda k: env.reset(k, params), key)
    out = jax.eval_shape(lambda k, s: env.step(k, s, jnp.int32(0), params), key, state)
    assert jax.tree.structure(out[1]) == jax.tree.structure(state)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(state)))
    assert out[0].shape == out[5]["final_observation"].shape == obs.shape == (1345,)
    assert [x.dtype for x in out[2:5]] == [jnp.float32, jnp.bool_, jnp.bool_]


def test_env_kwargs_set_craftax_params_and_errors_name_the_fix():
    pytest.importorskip("craftax")
    spec = make_env(TINY.replace(env_kwargs={"day_length": 100}))
    assert spec.env_params.craftax.day_length == 100
    with pytest.raises(ConfigError, match=r"did you mean 'craftax:Craftax-Classic-Symbolic-v1'"
                                          r".*Available: .*craftax:Craftax-Symbolic-v1"):
        make_env(TINY.replace(env="craftax:Craftax-Clasic-Symbolic-v1"))
    with pytest.raises(ConfigError, match=r"time limit is env_kwargs max_steps_in_episode"):
        make_env(TINY.replace(env_kwargs={"max_timesteps": 100}))
    with pytest.raises(ConfigError, match=r"\['day_lenght'\] are neither Craftax's EnvParams.*"
                                          r"'day_length'"):
        make_env(TINY.replace(env_kwargs={"day_lenght": 100}))
    with pytest.raises(ConfigError, match=r"did you mean 'craftax:Craftax-Classic-Symbolic-v1'"):
        make_env(TINY.replace(env="Craftax-Classic-Symbolic-v1"))


def test_without_craftax_a_craftax_env_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "craftax", None)  # import craftax -> ImportError
    monkeypatch.setitem(sys.modules, "craftax.craftax_env", None)
    with pytest.raises(ConfigError, match=r"pip install 'jaxppo\[craftax\]'"):
        make_env(TINY)


@pytest.mark.slow
def test_training_runs_end_to_end_with_a_run_folder(tmp_path):
    """Two tiny iterations (~30 s, nearly all compiling): Craftax learns over millions of
    steps, so this checks the whole program and the run folder, not a learning curve."""
    pytest.importorskip("craftax")
    cfg = readme_train_config(ENV).replace(compilation_cache_dir=None)  # README's command
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    assert np.asarray(result.metrics["policy_loss"]).shape == (2,)
    assert np.isfinite(np.asarray(result.metrics["policy_loss"])).all()
    assert f"env: {ENV}" in (tmp_path / "run" / "config.yaml").read_text()
