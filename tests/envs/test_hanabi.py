"""Hanabi ("jaxmarl:hanabi"): the adapter's reset and step against JaxMARL's own env with the
same keys and legal actions, its legal moves as the policy's action mask, and two training
iterations (IPPO) whose rollouts take legal actions only, replayed through JaxMARL's step_env.
The compiled iteration is shared by the tests (a module fixture). Skips without jaxmarl."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams

pytest.importorskip("jaxmarl")

ENV = "jaxmarl:hanabi"
CFG = jaxppo.PPOConfig(env=ENV, num_envs=4, num_steps=16, num_minibatches=2, num_epochs=1,
                       total_timesteps=4 * 16 * 2, network=jaxppo.NetworkConfig((16,)),
                       compilation_cache_dir=None)


def _legal(marl, legal_moves, marl_state) -> np.ndarray:
    """JaxMARL's legal moves of a state (`legal_moves`: its get_legal_moves, jitted), bool
    [agents, moves]."""
    moves = legal_moves(marl_state)
    return np.stack([np.asarray(moves[a], bool) for a in marl.agents])


@pytest.fixture(scope="module")
def iterations():
    """Two training iterations from init: each the rollout, then the update on it (what
    ppo.iteration runs), compiled once; (algo, [(state before, rollout, metrics)] * 2)."""
    algo = Algorithm.create(jaxppo.resolve(CFG))
    hp = HyperParams.from_config(CFG)

    @jax.jit
    def iterate(state):
        after, traj = ppo.rollout(algo, state, hp)
        new, metrics = ppo.update(algo, after, traj, algo.spec.actor_ids(after.env_ids), hp,
                                  state.env_steps, state.obs_stats)
        return new, traj, metrics

    state = jax.jit(lambda k: ppo.init(algo, k, hp))(jax.random.PRNGKey(0))
    out = []
    for _ in range(2):
        new, traj, metrics = iterate(state)
        out.append((state, traj, metrics))
        state = new
    return algo, out


@pytest.fixture(scope="module")
def jaxmarl_fns(iterations):
    """JaxMARL's own Hanabi (the run's), its step_env and get_legal_moves, compiled once."""
    marl = iterations[0].spec.env.marl_env
    return marl, jax.jit(marl.step_env), jax.jit(marl.get_legal_moves)


def test_reset_and_step_are_jaxmarls_with_legal_moves_as_the_mask(iterations, jaxmarl_fns):
    """Six turns with a random legal move of each agent: observations, rewards, ends and the
    action mask equal JaxMARL's own reset, step_env and get_legal_moves with the same keys."""
    spec, (marl, marl_step, legal_moves) = iterations[0].spec, jaxmarl_fns
    env, params = spec.env, spec.env_params
    assert spec.agents == ("agent_0", "agent_1") and spec.masked
    assert spec.obs_shape == (marl.obs_size,) and spec.action_dim == marl.num_moves
    reset, step = jax.jit(env.reset), jax.jit(env.step)
    mask_of = jax.jit(spec.action_mask)
    key = jax.random.PRNGKey(4)
    obs, state = reset(key, params)
    want_obs, marl_state = marl.reset(key)
    for t in range(6):
        np.testing.assert_array_equal(np.asarray(obs),
                                      np.stack([want_obs[a] for a in marl.agents]))
        legal = _legal(marl, legal_moves, marl_state)
        np.testing.assert_array_equal(np.asarray(mask_of(state, params)), legal)
        assert legal.sum(axis=1).tolist().count(1) == 1  # the other player: the no-op only
        logits = jax.random.normal(jax.random.fold_in(key, t), legal.shape)
        action = jnp.argmax(jnp.where(legal, logits, -jnp.inf), axis=-1)
        k = jax.random.fold_in(key, 100 + t)
        obs, state, reward, term, trunc, _ = step(k, state, action, params)
        want_obs, marl_state, want_reward, dones, _ = marl_step(
            jax.random.split(k)[0], marl_state, {a: action[i] for i, a in enumerate(marl.agents)})
        np.testing.assert_array_equal(np.asarray(reward),
                                      [float(want_reward[a]) for a in marl.agents])
        assert bool(term) == bool(dones["__all__"]) and not bool(trunc)
        if bool(term):  # the adapter reset with the key's other half
            want_obs, marl_state = marl.reset(jax.random.split(k)[1])


def test_training_takes_legal_moves_only(iterations, jaxmarl_fns):
    """Both iterations' rollouts: every actor's action is legal in its state (the recorded
    mask), and env 0's rollout replayed through JaxMARL's step_env with its keys and actions
    gives the same rewards and game ends with every action legal by JaxMARL's
    get_legal_moves (a new game after an end from JaxMARL's reset with the step key's other
    half, as the adapter resets); the update changed the params and its losses are finite."""
    algo, out = iterations
    marl, marl_step, legal_moves = jaxmarl_fns
    T, n, games = CFG.num_steps, algo.spec.num_agents, 0
    for state, traj, metrics in out:
        actions = np.asarray(traj.action)
        taken = np.take_along_axis(np.asarray(traj.action_mask), actions[..., None], axis=-1)
        assert taken.all()
        assert np.any(np.asarray(traj.action_mask).sum(-1) > 1)  # real choices were masked
        _, env_keys = ppo.rollout_noise(algo, jax.random.split(state.rng)[1], state.env_ids)
        marl_state = jax.tree.map(lambda x: x[0], state.env_state.marl_state)
        for t in range(T):
            acts = actions[t, :n]  # env 0's agents (actors env-major)
            assert _legal(marl, legal_moves, marl_state)[np.arange(n), acts].all()
            k_step, k_reset = jax.random.split(env_keys[t, 0])
            _, marl_state, reward, dones, _ = marl_step(
                k_step, marl_state, {a: jnp.int32(acts[i]) for i, a in enumerate(marl.agents)})
            np.testing.assert_array_equal(np.asarray(traj.reward)[t, :n],
                                          [float(reward[a]) for a in marl.agents])
            assert bool(dones["__all__"]) == bool(np.asarray(traj.terminated)[t, 0])
            games += bool(dones["__all__"])
            if bool(dones["__all__"]):
                marl_state = marl.reset(k_reset)[1]
        for k in ("policy_loss", "value_loss", "entropy", "grad_norm"):
            assert np.isfinite(float(metrics[k])), k
    assert games > 0  # the replay went on through new games
    before, after = out[0][0].params, out[1][0].params
    assert any(np.any(np.asarray(a) != np.asarray(b))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
