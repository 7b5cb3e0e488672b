"""Multi-agent runs beyond the feed-forward IPPO step (tests/envs/test_jaxmarl.py): a recurrent
(GRU) policy with one carry per actor, replayed by hand actor by actor from JaxMARL's own
observations, the update's replay of the rollout, and resume. Skips without jaxmarl."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams

pytest.importorskip("jaxmarl")

# 3 agents x 2 envs = 6 actors; MPE's episodes last 26 steps, so every actor's carry is reset
# once inside the 32 steps.
N_AGENTS, LIMIT = 3, 26
GRU = jaxppo.PPOConfig(env="jaxmarl:MPE_simple_spread_v3", num_envs=2, num_steps=32,
                       num_minibatches=3, num_epochs=1, total_timesteps=3 * 64,
                       network=jaxppo.NetworkConfig((16,), recurrent_size=8),
                       compilation_cache_dir=None)


@pytest.fixture(scope="module")
def gru_rollout():
    algo = Algorithm.create(jaxppo.resolve(GRU))
    hp = HyperParams.from_config(algo.config)
    state = ppo.init(algo, jax.random.PRNGKey(0), hp)
    after, traj = jax.jit(lambda s: ppo.rollout(algo, s, hp))(state)
    return algo, hp, state, after, traj


@functools.partial(jax.jit, static_argnums=0)
def _one_step(algo, params, obs_stats, obs, carry):
    """The network on one observation [1, D] and the carry before it [1, H]."""
    return algo.network.apply(params, algo.obs_in(obs_stats, obs), carry)


def _by_hand(algo, params, obs_stats, obs, resets):
    """One actor's GRU run step by step from a zero carry on its own observations [T, D]:
    (logits [T, A], values [T], the carry after the last step [H])."""
    carry = jnp.zeros((1, GRU.network.recurrent_size))
    logits, values = [], []
    for t in range(obs.shape[0]):
        if resets[t]:
            carry = jnp.zeros_like(carry)
        dist, value, carry = _one_step(algo, params, obs_stats, obs[t][None], carry)
        logits.append(np.asarray(dist.loc[0]))
        values.append(float(value[0]))
    return np.stack(logits), np.asarray(values), np.asarray(carry[0])


def test_each_actor_carries_its_own_state_reset_at_its_envs_end(gru_rollout):
    """Each actor's logits in the rollout equal its GRU run by hand on its own observations
    (JaxMARL's, actor e*N+i = agent i of env e), its carry zeroed where its env's episode
    ended; the carries after the rollout are each actor's own."""
    algo, _, state, after, traj = gru_rollout
    assert state.carry.state.shape == (GRU.num_envs * N_AGENTS, 8)
    done = np.asarray(traj.terminated) | np.asarray(traj.truncated)  # [T, E*N]
    # The episode ends are the env's, shared by its agents.
    assert done[LIMIT - 1].all() and done.sum() == GRU.num_envs * N_AGENTS
    resets = np.concatenate([np.ones((1, done.shape[1]), bool), done[:-1]])
    np.testing.assert_array_equal(np.asarray(traj.reset), resets)
    for actor in range(GRU.num_envs * N_AGENTS):
        logits, _, carry = _by_hand(algo, state.params, state.obs_stats, traj.obs[:, actor],
                                    resets[:, actor])
        np.testing.assert_allclose(np.asarray(traj.dist.loc[:, actor]), logits, rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(np.asarray(after.carry.state[actor]), carry, rtol=1e-5,
                                   atol=1e-6)
    # The agents of one env see different observations, so their carries differ.
    assert not np.allclose(np.asarray(after.carry.state[0]), np.asarray(after.carry.state[1]))


def test_the_update_replays_each_actors_sequence(gru_rollout):
    """The values GAE uses are each actor's by-hand values, and every minibatch of whole actor
    sequences replays the policy the rollout acted with (ratio 1 before any step)."""
    algo, _, state, _, traj = gru_rollout
    values, _ = ppo.rollout_values(algo, state.params, state.obs_stats, traj)
    resets = np.asarray(traj.reset)
    for actor in (0, 4):
        want = _by_hand(algo, state.params, state.obs_stats, traj.obs[:, actor],
                        resets[:, actor])[1]
        np.testing.assert_allclose(np.asarray(values[:, actor]), want, rtol=1e-5, atol=1e-6)
    zeros = jnp.zeros_like(values)
    batch = ppo.make_batch(algo, state.obs_stats, traj, values, zeros, zeros)
    env_ids = algo.spec.actor_ids(state.env_ids)
    cols = jaxppo.core.collectives.minibatch_indices(jax.random.PRNGKey(1), env_ids,
                                                     GRU.num_steps, GRU.num_minibatches, True)
    assert sorted(np.asarray(cols).ravel().tolist()) == list(range(GRU.num_envs * N_AGENTS))
    for m in range(GRU.num_minibatches):
        mb = ppo.gather_minibatch(algo, batch, cols[m])
        assert mb.obs.shape[:2] == (GRU.num_steps, 2)  # 6 actors / 3 minibatches
        dist, _, samples = ppo.forward(algo, state.params, mb)
        logp = jaxppo.core.networks.log_prob(True, dist, samples.actions)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(samples.old_log_probs),
                                   rtol=1e-5, atol=1e-5)


def test_recurrent_run_resumes_exactly(tmp_path, compile_cache_dir):
    cfg = GRU.replace(checkpoint_every=1, log_every=1, compilation_cache_dir=compile_cache_dir)
    full = jaxppo.train(cfg, run_dir=tmp_path / "full", progress=False)
    jaxppo.train(cfg, run_dir=tmp_path / "part", progress=False, stop_after_iterations=2)
    resumed = jaxppo.train(None, resume=tmp_path / "part", progress=False)
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for key in ("episode_return_mean", "policy_loss"):
        np.testing.assert_array_equal(full.metrics[key], resumed.metrics[key])


def test_recurrent_minibatches_must_divide_the_actors():
    with pytest.raises(jaxppo.ConfigError, match=r"num_envs=2 x 3 agents = 6: .* choose "
                                                 r"num_minibatches from \[1, 2, 3, 6\]"):
        jaxppo.resolve(GRU.replace(num_minibatches=4))
    jaxppo.resolve(GRU.replace(num_minibatches=6))  # one actor's sequence per minibatch
