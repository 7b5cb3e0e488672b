"""Brax envs by name ("brax:<name>", jaxppo.envs.brax_suite): the gymnax contract checked against
Brax's own reset and step, the time limit as a truncation, a real end as a termination, the
errors, and a short learning run. The tests that need brax skip without it (CI installs it
with the dev extra)."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.check import check_env
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
pytestmark = [  # brax's and jaxopt's own deprecation notices, not this package's
    pytest.mark.filterwarnings("ignore:Accessing `ncon` directly:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:JAXopt is no longer maintained:DeprecationWarning"),
]
needs_brax = pytest.mark.skipif(
    importlib.util.find_spec("brax") is None,
    reason="brax is not installed: pip install 'jaxppo[brax]' (the dev extra installs it)")

ENV = "brax:inverted_pendulum"
T = 48  # steps of every compared rollout (one compiled program per env and params shape)
TINY = jaxppo.PPOConfig(env=ENV, num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                        total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                        compilation_cache_dir=None)


@pytest.fixture(scope="module")
def pendulum():
    """(spec, adapter rollout, Brax rollout, Brax reset), jitted, for brax:inverted_pendulum."""
    spec = make_env(TINY)
    env = spec.env

    @jax.jit
    def adapter_rollout(params, key, keys, actions):
        """Reset with `key`, then step with keys[t] and actions[t] ([T], [T, 1])."""
        obs0, state = env.reset(key, params)

        def body(state, x):
            k, a = x
            obs, state, reward, term, trunc, info = env.step(k, state, a, params)
            return state, (obs, reward, term, trunc, info["final_observation"], state.time)

        _, out = jax.lax.scan(body, state, (keys, actions))
        return obs0, out

    @jax.jit
    def brax_rollout(key, actions):
        """Brax's own env: reset with `key`, step (no wrappers, no reset) with actions."""
        state = env.brax_env.reset(key)

        def body(state, a):
            state = env.brax_env.step(state, a)
            return state, (state.obs, jnp.asarray(state.reward, jnp.float32), state.done)

        _, out = jax.lax.scan(body, state, actions)
        return state.obs, out

    return spec, adapter_rollout, brax_rollout, jax.jit(env.brax_env.reset)


def _keys(seed: int):
    key, *keys = jax.random.split(jax.random.PRNGKey(seed), T + 1)
    return key, jnp.stack(keys)


@needs_brax
def test_spec_and_run_name(pendulum):
    spec, *_ = pendulum
    assert spec.obs_shape == (4,) and not spec.discrete and spec.action_dim == 1
    np.testing.assert_array_equal(spec.action_low, [-1.0])
    np.testing.assert_array_equal(spec.action_high, [1.0])
    assert spec.env_params.max_steps_in_episode == 1000  # Brax's episode_length
    assert TINY.env_name == "brax-inverted_pendulum"  # run folders: no ':' in the name
    assert TINY.to_dict()["env"] == ENV  # config.yaml rebuilds it by name


@needs_brax
def test_reset_and_steps_equal_brax_own(pendulum):
    spec, adapter_rollout, brax_rollout, brax_reset = pendulum
    key, keys = _keys(0)
    actions = 0.1 * jnp.where(jnp.arange(T) % 2, 1.0, -1.0)[:, None]
    obs0, (obs, reward, term, trunc, final_obs, _) = adapter_rollout(
        spec.env_params, key, keys, actions)
    brax_obs0, (brax_obs, brax_reward, brax_done) = brax_rollout(key, actions)
    n = 10  # the unbalanced pole falls after about 15 steps: compare the steps before
    assert not np.asarray(brax_done[:n]).any()
    np.testing.assert_array_equal(obs0, brax_obs0)
    np.testing.assert_allclose(obs[:n], brax_obs[:n], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(final_obs[:n], brax_obs[:n], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(reward[:n], brax_reward[:n])
    assert not np.asarray(term[:n]).any() and not np.asarray(trunc[:n]).any()


@needs_brax
def test_time_limit_is_a_truncation_with_the_final_observation(pendulum):
    spec, adapter_rollout, brax_rollout, brax_reset = pendulum
    limit = make_env(TINY.replace(env_kwargs={"max_steps_in_episode": 5})).env_params
    assert limit.max_steps_in_episode == 5
    key, keys = _keys(1)
    actions = jnp.zeros((T, 1))
    _, (obs, reward, term, trunc, final_obs, time) = adapter_rollout(limit, key, keys, actions)
    _, (brax_obs, _, brax_done) = brax_rollout(key, actions)
    assert not np.asarray(brax_done[:5]).any()
    ends = np.flatnonzero(np.asarray(trunc))
    np.testing.assert_array_equal(ends, np.arange(4, T, 5))  # every 5th step
    assert not np.asarray(term).any()
    np.testing.assert_array_equal(time[:6], [1, 2, 3, 4, 0, 1])
    # The step at the limit: the final observation is the 5th step's, the returned one the
    # reset's, drawn with that step's key.
    np.testing.assert_allclose(final_obs[4], brax_obs[4], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(obs[4], brax_reset(keys[4]).obs)
    assert not np.allclose(final_obs[4], obs[4])


@needs_brax
def test_a_fallen_pole_is_a_termination(pendulum):
    spec, adapter_rollout, brax_rollout, brax_reset = pendulum
    key, keys = _keys(2)
    actions = jnp.ones((T, 1))  # push the cart one way until the pole falls
    _, (obs, reward, term, trunc, final_obs, time) = adapter_rollout(
        spec.env_params, key, keys, actions)
    _, (brax_obs, _, brax_done) = brax_rollout(key, actions)
    first = int(np.argmax(np.asarray(brax_done) > 0))
    assert 0 < first < T - 1 and brax_done[first] == 1.0
    assert np.flatnonzero(np.asarray(term))[0] == first and not np.asarray(trunc).any()
    assert abs(float(final_obs[first, 1])) > 0.2  # the pole's angle past Brax's limit
    np.testing.assert_allclose(final_obs[: first + 1], brax_obs[: first + 1], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(obs[first], brax_reset(keys[first]).obs)
    assert int(time[first]) == 0 and int(time[first + 1]) == 1


@needs_brax
def test_the_adapter_passes_the_env_contract_check(pendulum):
    spec, *_ = pendulum
    check_env(spec.env, spec.env_params, ENV)  # what make_env skips for the trusted adapter


@needs_brax
def test_errors_name_the_fix(monkeypatch):
    import brax.envs
    from brax.envs.inverted_pendulum import InvertedPendulum

    class Broken(InvertedPendulum):  # as brax 0.14.2's swimmer under jax 0.10 (jnp.clip(a_min=))
        def step(self, state, action):
            raise TypeError("clip() got an unexpected keyword argument 'a_min'")

    monkeypatch.setitem(brax.envs._envs, "broken_pendulum", Broken)
    with pytest.raises(ConfigError, match=r"Brax's own reset or step fails with brax .*a_min"):
        make_env(TINY.replace(env="brax:broken_pendulum"))
    with pytest.raises(ConfigError, match=r"did you mean 'brax:inverted_pendulum'.*Registered: "
                                          r".*brax:halfcheetah"):
        make_env(TINY.replace(env="brax:inverted_pendulm"))
    with pytest.raises(ConfigError, match=r"get_environment\('reacher', backend='nope'\) raised"):
        make_env(TINY.replace(env="brax:reacher", env_kwargs={"backend": "nope"}))
    with pytest.raises(ConfigError, match=r"max_steps_in_episode, Brax's episode_length"):
        make_env(TINY.replace(env_kwargs={"episode_length": 100}))
    with pytest.raises(ConfigError, match=r"did you mean 'brax:inverted_pendulum'"):
        make_env(TINY.replace(env="inverted_pendulum"))


def test_without_brax_a_brax_env_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "brax", None)  # import brax -> ImportError
    monkeypatch.setitem(sys.modules, "brax.envs", None)
    with pytest.raises(ConfigError, match=r"pip install 'jaxppo\[brax\]'"):
        make_env(TINY)


def test_gymnax_training_never_imports_brax():
    code = textwrap.dedent("""
        import sys
        import jaxppo
        from jaxppo.program.resolved import resolve
        assert "brax" not in sys.modules
        cfg = jaxppo.PPOConfig(num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1,
                               total_timesteps=16, network=jaxppo.NetworkConfig((8,)),
                               compilation_cache_dir=None)
        resolve(cfg)
        jaxppo.train(cfg, progress=False)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("brax", "mujoco"))
        assert not loaded, loaded
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


@needs_brax
@pytest.mark.slow
def test_ppo_learns_to_balance_the_brax_pendulum(tmp_path):
    cfg = jaxppo.PPOConfig(
        env=ENV, num_envs=16, num_steps=32, num_minibatches=4, num_epochs=4,
        total_timesteps=16 * 32 * 40, lr=3e-4, lr_schedule="constant", gamma=0.97,
        entropy_coeff=0.0, normalize_observations=True, network=jaxppo.NetworkConfig((32, 32)),
        compilation_cache_dir=None)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    returns = np.asarray(result.metrics["episode_return_mean"]).reshape(-1)
    first, last = np.nanmean(returns[:5]), np.nanmean(returns[-5:])
    assert first < 15 and last > 3 * first, returns  # random: ~5 steps upright
    assert "env: brax:inverted_pendulum" in (tmp_path / "run" / "config.yaml").read_text()
