"""Recurrent (GRU) PPO: network shapes, resets, exact replay of the rollout, learning with
memory, and the recurrent policy after training (load_policy, eval)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.collectives import minibatch_indices
from jaxppo.core.hyperparams import HyperParams
from jaxppo.core.losses import ppo_loss_terms
from jaxppo.core.networks import ActorCritic, RecurrentActorCritic, log_prob
from jaxppo.program.layout import Layout

# MemoryChain with memory_length=3: the context bit is shown only at the start and must be
# recalled 3 steps later for +1 (a wrong answer gives -1), so any memoryless policy averages 0.
MEMORY = jaxppo.PPOConfig(
    env="MemoryChain-bsuite", env_kwargs={"memory_length": 3}, num_envs=8, num_steps=16,
    num_minibatches=2, num_epochs=2, total_timesteps=8 * 16 * 2,
    network=jaxppo.NetworkConfig((16,), recurrent_size=8), compilation_cache_dir=None,
)


def _algo(cfg=MEMORY):
    algo = Algorithm.create(jaxppo.resolve(cfg))
    return algo, HyperParams.from_config(algo.config)


def _minibatches(key, env_ids):
    return minibatch_indices(key, env_ids, MEMORY.num_steps, MEMORY.num_minibatches, True)


def test_network_output_shapes():
    net = RecurrentActorCritic(action_dim=3, discrete=True, carry_size=5, hidden_sizes=(7,))
    obs = jnp.ones((4, 6))
    params = net.init(jax.random.PRNGKey(0), obs)
    dist, value, hidden = net.apply(params, obs)
    assert dist.loc.shape == (4, 3) and value.shape == (4,) and hidden.shape == (4, 5)
    # Any leading axes: a [T, B] block in one call.
    dist, value, hidden = net.apply(params, jnp.ones((2, 4, 6)), jnp.zeros((2, 4, 5)),
                                    jnp.zeros((2, 4), bool))
    assert dist.loc.shape == (2, 4, 3) and value.shape == (2, 4) and hidden.shape == (2, 4, 5)
    cont = RecurrentActorCritic(action_dim=2, discrete=False, carry_size=5, hidden_sizes=(7,))
    cp = cont.init(jax.random.PRNGKey(0), obs)
    dist, _, _ = cont.apply(cp, obs)
    assert dist.loc.shape == (4, 2) and dist.log_std.shape == (2,)


def test_reset_zeroes_the_hidden_state():
    net = RecurrentActorCritic(action_dim=2, discrete=True, carry_size=4, hidden_sizes=(8,))
    obs = jax.random.normal(jax.random.PRNGKey(1), (3, 5))
    params = net.init(jax.random.PRNGKey(0), obs)
    hidden = jax.random.normal(jax.random.PRNGKey(2), (3, 4))
    reset = jnp.array([True, False, True])
    out = net.apply(params, obs, hidden, reset)
    fresh = net.apply(params, obs, jnp.zeros((3, 4)))
    kept = net.apply(params, obs, hidden)
    for a, f, k in zip(jax.tree.leaves(out), jax.tree.leaves(fresh), jax.tree.leaves(kept)):
        if a.ndim == 1 and a.shape[0] != 3:  # log_std: not per row
            continue
        np.testing.assert_array_equal(np.asarray(a)[[0, 2]], np.asarray(f)[[0, 2]])
        np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(k)[1])
    assert not np.allclose(np.asarray(out[2])[1], np.asarray(fresh[2])[1])


def test_rollout_stores_initial_carry_and_resets_and_carries_it_across_rollouts():
    algo, hp = _algo()
    state = ppo.init(algo, jax.random.PRNGKey(0), hp)
    state1, traj = jax.jit(ppo.rollout, static_argnums=0)(algo, state, hp)
    done = np.asarray(traj.terminated | traj.truncated)
    assert done.any()  # episodes are 4 steps long
    np.testing.assert_array_equal(np.asarray(traj.reset)[0], np.asarray(state.carry.reset))
    np.testing.assert_array_equal(np.asarray(traj.reset)[1:], done[:-1])
    np.testing.assert_array_equal(np.asarray(state1.carry.reset), done[-1])
    np.testing.assert_array_equal(np.asarray(traj.carry0), np.asarray(state.carry.state))
    # The next rollout starts from the carry the first one ended with.
    _, traj2 = jax.jit(ppo.rollout, static_argnums=0)(algo, state1, hp)
    np.testing.assert_array_equal(np.asarray(traj2.carry0), np.asarray(state1.carry.state))
    assert np.abs(np.asarray(state1.carry.state)).sum() > 0


def test_replaying_the_gru_reproduces_the_rollout_exactly():
    algo, hp = _algo()
    state = ppo.init(algo, jax.random.PRNGKey(3), hp)
    # a non-zero carry at the rollout's start
    state = jax.jit(ppo.iteration, static_argnums=0)(algo, state, hp)[0]
    obs_stats = state.obs_stats
    state, traj = jax.jit(ppo.rollout, static_argnums=0)(algo, state, hp)
    values, next_values = jax.jit(ppo.rollout_values, static_argnums=0)(
        algo, state.params, obs_stats, traj)

    # V(s'_t) from the carry after step t equals V(s_{t+1}) wherever no episode ended.
    done = np.asarray(traj.terminated | traj.truncated)
    np.testing.assert_allclose(np.asarray(next_values)[:-1][~done[:-1]],
                               np.asarray(values)[1:][~done[:-1]], rtol=1e-6, atol=1e-6)

    batch = ppo.make_batch(algo, obs_stats, traj, values, jnp.ones_like(values), values)
    idx = _minibatches(jax.random.PRNGKey(9), state.env_ids)
    cols = np.sort(np.asarray(idx).ravel())
    np.testing.assert_array_equal(cols, np.arange(MEMORY.num_envs))  # a partition of the envs
    for j in range(MEMORY.num_minibatches):
        rb = ppo.gather_minibatch(algo, batch, idx[j])
        assert rb.obs.shape[:2] == (MEMORY.num_steps, MEMORY.num_envs // 2)
        assert rb.carry0.shape == (MEMORY.num_envs // 2, 8)
        dist, v, _ = jax.jit(ppo.unroll, static_argnums=0)(
            algo, state.params, rb.carry0, rb.obs, rb.reset)
        logp = log_prob(True, dist, rb.actions)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(rb.old_log_probs),
                                   rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(v), np.asarray(rb.old_values), atol=1e-6)
        flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]) if x.ndim >= 2 else x,
                            rb._replace(carry0=None))
        terms = ppo_loss_terms(
            True, dist._replace(loc=dist.loc.reshape(-1, 2)), v.reshape(-1), flat,
            clip_param=0.2, vf_clip_param=0.0, vf_coeff=0.5, entropy_coeff=0.0, kl_coeff=0.0,
            use_kl_loss=False, use_vf_clip=False)
        assert float(terms.clip_fraction) == 0.0
        assert abs(float(terms.approx_kl)) < 1e-6 and abs(float(terms.kl)) < 1e-6


def test_minibatches_do_not_depend_on_how_envs_are_split_over_devices():
    key = jax.random.PRNGKey(4)
    whole = _minibatches(key, jnp.arange(8))
    # Two devices of 4 envs each (global ids 0-3 and 4-7), num_minibatches=2 per device.
    assert Algorithm.create(jaxppo.resolve(MEMORY, Layout(2))).local_envs == 4
    parts = [_minibatches(key, jnp.arange(4) + 4 * d) + 4 * d for d in range(2)]
    for j in range(2):
        assert set(np.asarray(whole[j]).tolist()) == set(
            np.concatenate([np.asarray(p[j]) for p in parts]).tolist())


def test_config_fields_and_errors():
    cfg = MEMORY.replace(num_envs=6, num_minibatches=4)
    with pytest.raises(jaxppo.ConfigError, match="num_minibatches=4 does not divide num_envs=6"):
        jaxppo.resolve(cfg)
    # num_steps need not be a multiple of num_minibatches for recurrent minibatches.
    jaxppo.resolve(MEMORY.replace(num_steps=15, total_timesteps=8 * 15))
    with pytest.raises(jaxppo.ConfigError, match="recurrent_size"):
        MEMORY.replace(network=jaxppo.NetworkConfig(recurrent_size=-1)).validate()
    with pytest.raises(jaxppo.ConfigError, match="does not divide the envs on each device"):
        jaxppo.resolve(MEMORY.replace(num_minibatches=8), Layout(2))
    jaxppo.resolve(MEMORY.replace(num_minibatches=8, sync="batch"), Layout(2))
    d = MEMORY.to_dict()
    assert d["network"]["recurrent_size"] == 8
    assert jaxppo.PPOConfig.from_dict(d).network.recurrent_size == 8
    assert jaxppo.PPOConfig().network.recurrent_size == 0
    assert isinstance(jaxppo.resolve(MEMORY).network, RecurrentActorCritic)
    assert isinstance(jaxppo.resolve(jaxppo.PPOConfig()).network, ActorCritic)


def test_train_runs_recurrent_and_its_policy_carries_its_state(tmp_path):
    run_dir = tmp_path / "gru"
    result = jaxppo.train(MEMORY.replace(eval_every=2, eval_episodes=4), run_dir=run_dir,
                          progress=False, plot=False)
    assert result._algorithm.recurrent
    assert np.isfinite(result.metrics["eval_return_mean"][0, -1])
    assert np.all(np.isfinite(result.metrics["policy_loss"]))
    obs = jnp.zeros((3, 3))
    with pytest.raises(TypeError, match="needs its carry"):
        result.policy(obs, jax.random.PRNGKey(0))
    algo = result._algorithm
    carry = algo.initial_carry((3,))
    action, carry = algo.policy_step(result.state.params, result.state.obs_stats, obs, carry,
                                     jax.random.PRNGKey(0))
    assert action.shape == (3,) and carry.shape == (3, 8)

    # The saved policy acts step by step with its carry, and evaluates as the run does.
    policy = jaxppo.load_policy(run_dir)
    assert policy.recurrent and policy.initial_carry((3,)).shape == (3, 8)
    with pytest.raises(TypeError, match="policy.step"):
        policy(obs)
    a1, c1 = policy.step(obs, policy.initial_carry((3,)))
    a2, c2 = algo.policy_step(result.state.params, result.state.obs_stats, obs,
                              algo.initial_carry((3,)), None, deterministic=True)
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))
    np.testing.assert_allclose(np.asarray(c1), np.asarray(c2), atol=1e-6)  # jit vs eager
    _, c3 = policy.step(obs, c1)
    assert not np.allclose(np.asarray(c3), np.asarray(c1))  # the carry moves on
    ev = policy.evaluate(episodes=6, seed=1)
    assert ev == result.evaluate(episodes=6, seed=1)
    assert ev["episodes"] == 6 and set(ev["returns"]) <= {-1.0, 1.0}


@pytest.mark.slow
def test_gru_learns_memory_chain_where_feed_forward_cannot():
    cfg = MEMORY.replace(num_envs=16, num_steps=32, num_minibatches=4, num_epochs=4,
                         total_timesteps=30_000, lr=3e-3, lr_schedule="constant",
                         network=jaxppo.NetworkConfig((32,), recurrent_size=32))
    gru = jaxppo.train(cfg, progress=False).metrics["episode_return_mean"][0]
    ff = jaxppo.train(cfg.replace(network=jaxppo.NetworkConfig((32,))),
                      progress=False).metrics["episode_return_mean"][0]
    gru_final, ff_final = np.nanmean(gru[-10:]), np.nanmean(ff[-10:])
    assert gru_final > 0.8, gru  # chance (and the best memoryless policy) is 0, perfect is 1
    assert abs(ff_final) < 0.3, ff
