"""Hanabi ("jaxmarl:hanabi"): two training iterations (IPPO) whose rollouts, replayed through
JaxMARL's own step_env and reset with the same keys and actions, have the same observations,
rewards, ends and new games, with JaxMARL's legal moves as the action mask and only legal
moves taken. The compiled iterations are shared by the tests (a module fixture). Skips
without jaxmarl."""

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

    def iterate(state):
        after, traj = ppo.rollout(algo, state, hp)
        new, metrics = ppo.update(algo, after, traj, algo.spec.actor_ids(after.env_ids), hp,
                                  state.env_steps, state.obs_stats)
        return new, traj, metrics

    state = jax.jit(lambda k: ppo.init(algo, k, hp))(jax.random.PRNGKey(0))
    # Compiled once ahead of time, as training compiles its program (a jit call compiles
    # again for the stepped state: Hanabi's reset gives a weakly typed score).
    iterate = jax.jit(iterate).lower(state).compile()
    out = []
    for _ in range(2):
        new, traj, metrics = iterate(state)
        out.append((state, traj, metrics))
        state = new
    return algo, out


def test_the_spec_and_the_training_iterations(iterations):
    """Two agents, JaxMARL's observation size and moves, a masked policy; the update changed
    the params and its losses are finite."""
    algo, out = iterations
    spec, marl = algo.spec, algo.spec.env.marl_env
    assert spec.agents == ("agent_0", "agent_1") and spec.masked
    assert spec.obs_shape == (marl.obs_size,) and spec.action_dim == marl.num_moves == 21
    for _, _, metrics in out:
        for k in ("policy_loss", "value_loss", "entropy", "grad_norm"):
            assert np.isfinite(float(metrics[k])), k
    before, after = out[0][0].params, out[1][0].params
    assert any(np.any(np.asarray(a) != np.asarray(b))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_rollouts_are_jaxmarls_games_with_legal_moves_only(iterations):
    """Both iterations' rollouts: every actor's action is legal in its state (the recorded
    mask), and two envs' rollouts replayed through JaxMARL's step_env with their keys and
    actions have the same observations, masks (JaxMARL's get_legal_moves: the player whose
    turn it is has choices, the other the no-op only), rewards and game ends, a new game
    after an end being JaxMARL's reset with the step key's other half."""
    algo, out = iterations
    marl = algo.spec.env.marl_env
    step, legal_moves = jax.jit(marl.step_env), jax.jit(marl.get_legal_moves)
    T, n, games = CFG.num_steps, algo.spec.num_agents, 0
    for state, traj, _ in out:
        actions = np.asarray(traj.action)
        masks, obs = np.asarray(traj.action_mask), np.asarray(traj.obs)
        assert np.take_along_axis(masks, actions[..., None], axis=-1).all()
        _, env_keys = ppo.rollout_noise(algo, jax.random.split(state.rng)[1], state.env_ids)
        for e in range(2):  # two envs' games
            actors = slice(e * n, (e + 1) * n)  # env e's agents (actors env-major)
            marl_state = jax.tree.map(lambda x: x[e], state.env_state.marl_state)
            for t in range(T):
                legal = _legal(marl, legal_moves, marl_state)
                np.testing.assert_array_equal(masks[t, actors], legal)
                assert sorted(legal.sum(axis=1))[0] == 1  # the other player: the no-op
                k_step, k_reset = jax.random.split(env_keys[t, e])
                acts = {a: jnp.int32(actions[t, e * n + i]) for i, a in enumerate(marl.agents)}
                marl_obs, marl_state, reward, dones, _ = step(k_step, marl_state, acts)
                np.testing.assert_array_equal(np.asarray(traj.reward)[t, actors],
                                              [float(reward[a]) for a in marl.agents])
                assert bool(dones["__all__"]) == bool(np.asarray(traj.terminated)[t, e * n])
                if bool(dones["__all__"]):
                    games += 1
                    marl_obs, marl_state = marl.reset(k_reset)
                if t + 1 < T:
                    np.testing.assert_array_equal(
                        obs[t + 1, actors], np.stack([marl_obs[a] for a in marl.agents]))
    assert games > 0  # the replay went on through new games
