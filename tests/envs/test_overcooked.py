"""Overcooked by layout ("jaxmarl:overcooked:<layout>"): the spec, the rewards of a whole
episode against JaxMARL's own step_env replayed by hand (the sparse reward, plus the shaped
reward annealed over each env's steps, the count going on through the auto-reset), the
tuned config's name and the errors. No training: the env is stepped under one jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.config import tuned_config_for
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError

pytest.importorskip("jaxmarl")

ENV = "jaxmarl:overcooked:cramped_room"
HORIZON, STEPS = 300, 401  # shaped_reward_steps; one whole 400-step episode, then a step


def test_the_spec_is_two_agents_on_the_flattened_grid():
    spec = make_env(jaxppo.PPOConfig(env=ENV))
    marl = spec.env.marl_env
    h, w, c = marl.observation_space("agent_0").shape
    assert spec.agents == ("agent_0", "agent_1") and spec.discrete and spec.action_dim == 6
    assert spec.obs_shape == (h * w * c,) and (h, w) == (5, 4)  # cramped_room, 26 planes
    assert spec.env_params.max_steps_in_episode == 401 and not spec.masked


def test_rewards_are_jaxmarls_sparse_plus_the_annealed_shaped_reward():
    spec = make_env(jaxppo.PPOConfig(env=ENV, env_kwargs={"shaped_reward_steps": HORIZON}))
    env, params, marl = spec.env, spec.env_params, spec.env.marl_env
    keys = jax.random.split(jax.random.PRNGKey(0), STEPS + 1)
    actions = jax.random.randint(jax.random.PRNGKey(1), (STEPS, 2), 0, 6)

    @jax.jit
    def both():
        obs, state = env.reset(keys[0], params)

        def step(carry, xs):
            state, mstate = carry
            key, action = xs
            _, state, reward, _, truncated, _ = env.step(key, state, action, params)
            acts = {a: action[i] for i, a in enumerate(marl.agents)}
            _, mstate, sparse, _, info = marl.step_env(jax.random.split(key)[0], mstate, acts)
            per_agent = lambda d: jnp.stack([d[a] for a in marl.agents])  # noqa: E731
            return (state, mstate), (reward, per_agent(sparse),
                                     per_agent(info["shaped_reward"]), truncated)

        (state, _), out = jax.lax.scan(step, (state, state.marl_state), (keys[1:], actions))
        return state, out

    state, (reward, sparse, shaped, truncated) = both()
    coef = np.clip(1.0 - np.arange(STEPS) / HORIZON, 0.0, 1.0)[:, None]
    want = np.asarray(sparse, np.float64) + coef * np.asarray(shaped, np.float64)
    np.testing.assert_allclose(np.asarray(reward)[:400], want[:400], rtol=1e-6)  # episode 1
    assert np.asarray(shaped)[:HORIZON].any()  # random agents put onions in the pot
    assert np.flatnonzero(np.asarray(truncated)).tolist() == [399]
    # The count goes on through the reset; the new episode's time starts again.
    assert int(state.env_steps) == STEPS and int(state.time) == 1
    np.testing.assert_array_equal(np.asarray(reward)[HORIZON:400], np.asarray(sparse)[HORIZON:400])


def test_the_tuned_config_and_the_errors():
    path, env = tuned_config_for(ENV)
    assert path.name == "overcooked_cramped_room.yaml" and env == ENV
    assert jaxppo.PPOConfig(env=ENV).env_name == "overcooked_cramped_room"
    with pytest.raises(ConfigError, match="did you mean 'jaxmarl:overcooked:cramped_room'"):
        make_env(jaxppo.PPOConfig(env="jaxmarl:overcooked:cramped_rom"))
    with pytest.raises(ConfigError, match="shaped_reward_steps=-1 must be an int >= 0"):
        make_env(jaxppo.PPOConfig(env=ENV, env_kwargs={"shaped_reward_steps": -1}))
