"""Recurrent policies on envs that step in Python (network.recurrent_size > 0): the actor
carries each env's hidden state across steps and rollouts and zeroes it where an episode
ended, as the compiled rollout does; the update replays the network from the recorded carries
and resets and reproduces the actor's log-probs; actor threads join their carries; a short run
on a gymnasium memory task learns what a feed-forward one cannot."""

from __future__ import annotations

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.core.networks import log_prob
from jaxppo.run.train import Start, _local_runner

GRU = jaxppo.PPOConfig(env="gymnasium:CartPole-v1", num_envs=4, num_steps=32, num_epochs=2,
                       num_minibatches=2, total_timesteps=4 * 32 * 3, compilation_cache_dir=None,
                       normalize_observations=True,
                       network=jaxppo.NetworkConfig((16,), recurrent_size=8))


def _runner(cfg):
    run = jaxppo.resolve(cfg)
    return _local_runner(Start(run, HyperParams.from_config(run.config)))


def _replay(algo, params, obs_stats, traj):
    """The compiled update's replay of the network over a rollout [T, E] (ppo.unroll from the
    rollout's carry and resets): (log-probs of its actions [T, E], carries [T, E, ...])."""
    obs_in = algo.obs_in(obs_stats, jnp.asarray(traj.obs))
    dist, _, carries = jax.jit(ppo.unroll, static_argnums=0)(
        algo, params, jax.tree.map(jnp.asarray, traj.carry0), obs_in, jnp.asarray(traj.reset))
    return np.asarray(log_prob(True, dist, jnp.asarray(traj.action))), jax.device_get(carries)


@pytest.mark.parametrize("lag", [0, 1])
def test_the_carry_crosses_steps_and_rollouts_and_resets_at_episode_ends(lag):
    cfg = GRU.replace(max_policy_lag=lag, **({"actor_threads": 2} if lag else {}))
    runner = _runner(cfg)
    try:
        algo = runner.algorithm
        assert algo.recurrent
        trajs, acting = [], []
        for _ in range(2):
            st = jax.device_get(runner.state)
            acting.append((st.params, st.obs_stats))
            trajs.append(runner.iterate()[1])
    finally:
        runner.close()
    first, second = trajs
    assert first.carry0.shape == (4, 8) and first.reset.shape == (32, 4)
    np.testing.assert_array_equal(first.carry0, 0.0)  # every env starts a new episode
    for traj in trajs:
        done = traj.terminated | traj.truncated
        assert done.any()
        np.testing.assert_array_equal(traj.reset[1:], done[:-1])  # zeroed after an end
    np.testing.assert_array_equal(first.reset[0], True)
    done = first.terminated | first.truncated
    np.testing.assert_array_equal(second.reset[0], done[-1])  # across the rollouts
    # Replaying as the update does reproduces the actor's log-probs, and the carry the
    # second rollout started from is the first's last one (lag 1: the second rollout was
    # played with the first params too, so the same replay covers both).
    logp, carries = _replay(algo, *acting[0], first)
    np.testing.assert_allclose(logp, first.log_prob, rtol=0, atol=1e-5)
    np.testing.assert_allclose(second.carry0, carries[-1], rtol=0, atol=1e-5)
    logp, _ = _replay(algo, *acting[0 if lag else 1], second)
    np.testing.assert_allclose(logp, second.log_prob, rtol=0, atol=1e-5)


def test_a_users_lstm_with_seeds_and_actor_threads():
    """A user's module with a tuple carry (the LSTM example), 2 seeds, 2 actor threads at lag
    1: each seed's rollout starts from its carry after the last one (joined over the threads'
    envs), and the update's replay reproduces its log-probs."""
    cfg = GRU.replace(num_seeds=2, max_policy_lag=1, actor_threads=2, network=jaxppo.NetworkConfig(
        module="jaxppo.examples.networks:LSTMActorCritic"))
    runner = _runner(cfg)
    try:
        acting = jax.device_get(runner.state)
        first, second = (runner.iterate()[1] for _ in range(2))
    finally:
        runner.close()
    for k in range(2):  # lag 1: both rollouts played with the initial params
        seed = lambda t: jax.tree.map(lambda x: x[k], t)  # noqa: E731
        params, stats = seed(acting.params), seed(acting.obs_stats)
        logp, carries = _replay(runner.algorithm, params, stats, seed(first))
        np.testing.assert_allclose(logp, first.log_prob[k], rtol=0, atol=1e-5)
        for c0, c in zip(jax.tree.leaves(seed(second.carry0)), jax.tree.leaves(carries)):
            assert c0.shape == (4, 32)
            np.testing.assert_allclose(c0, c[-1], rtol=0, atol=1e-5)


def test_the_update_sees_its_behaviour_policy_exactly():
    """One epoch of one minibatch: the first gradient step's policy is the acting one, so the
    update's KL and clip fraction are those of identical distributions (zero)."""
    cfg = GRU.replace(num_epochs=1, num_minibatches=1)
    runner = _runner(cfg)
    try:
        metrics = runner.iterate()[0]
    finally:
        runner.close()
    assert abs(float(metrics["approx_kl"])) < 1e-6 and abs(float(metrics["kl"])) < 1e-6
    assert float(metrics["clip_fraction"]) == 0.0


def test_the_host_update_is_the_compiled_recurrent_update_on_the_same_rollout():
    """A compiled recurrent rollout of gymnax's CartPole-v1 (gymnasium's spaces), from a
    non-zero carry, through the host runner's update: the params, statistics and metrics of
    the compiled iteration on it."""
    cfg = GRU.replace(normalize_rewards=True)
    run = jaxppo.resolve(cfg.replace(env="CartPole-v1"))
    algo, hp = Algorithm.create(run), HyperParams.from_config(run.config)
    iteration = jax.jit(ppo.iteration, static_argnums=0)
    state = iteration(algo, ppo.init(algo, jax.random.PRNGKey(5), hp), hp)[0]
    expected, expected_m = iteration(algo, state, hp)
    rolled, traj = jax.jit(ppo.rollout, static_argnums=0)(algo, state, hp)
    traj = jax.device_get(traj._replace(episode_end=traj.terminated | traj.truncated))
    assert np.abs(traj.carry0).max() > 0 and traj.reset.any()
    runner = _runner(cfg)
    try:
        host_in = runner.state.replace(
            params=state.params, opt_state=state.opt_state, kl_coeff=state.kl_coeff,
            obs_stats=state.obs_stats, return_stats=state.return_stats, rng=rolled.rng,
            env_steps=state.env_steps, iteration=state.iteration)
        got, got_m = runner.learner.update(host_in, traj)
    finally:
        runner.close()
    for a, b in zip(jax.tree.leaves((got.params, got.opt_state, got.obs_stats, got.return_stats)),
                    jax.tree.leaves((expected.params, expected.opt_state, expected.obs_stats,
                                     expected.return_stats))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    for k, v in expected_m.items():
        np.testing.assert_allclose(got_m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_recurrent_seeds_and_evaluation(tmp_path):
    """Two seeds with a recurrent policy through the run folder; the saved policy carries its
    state through an evaluation of the gymnasium env."""
    cfg = GRU.replace(num_seeds=2, eval_every=3, eval_episodes=2)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False)
    assert result.metrics["eval_return_mean"].shape == (2, 3)
    assert np.isfinite(result.metrics["eval_return_mean"][:, -1]).all()
    policy = jaxppo.load_policy(tmp_path / "run", seed_index=1)
    assert policy.recurrent and policy.evaluate(episodes=2, seed=0)["episodes"] == 2


class Recall(gymnasium.Env):
    """A cue of -1 or +1 is shown at the first step only; three steps later the action must
    name it (reward +1 if it does, -1 if not). Chance, and the best a policy without memory
    can do, is 0; remembering the cue gives 1."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cue, self.t = int(self.np_random.integers(2)), 0
        return np.array([2 * self.cue - 1, 0], np.float32), {}

    def step(self, action):
        self.t += 1
        end = self.t == 3
        reward = (1.0 if int(action) == self.cue else -1.0) if end else 0.0
        return np.array([0, self.t / 3], np.float32), reward, end, False, {}


if "JaxppoRecall-v0" not in gymnasium.envs.registry:
    gymnasium.register(id="JaxppoRecall-v0", entry_point=Recall)


@pytest.mark.slow
def test_a_recurrent_policy_learns_to_remember_where_feed_forward_cannot():
    """A GRU policy on a gymnasium memory task through the host loop: 5k env steps (about
    10 s on 2 cores) take it from chance to remembering the cue; a feed-forward one stays at
    chance."""
    cfg = jaxppo.PPOConfig(env="gymnasium:JaxppoRecall-v0", num_envs=16, num_steps=32,
                           num_minibatches=4, num_epochs=4, total_timesteps=16 * 32 * 10, lr=3e-3,
                           lr_schedule="constant", compilation_cache_dir=None,
                           network=jaxppo.NetworkConfig((32,), recurrent_size=32))
    gru = jaxppo.train(cfg, progress=False).metrics["episode_return_mean"][0]
    ff = jaxppo.train(cfg.replace(network=jaxppo.NetworkConfig((32,))),
                      progress=False).metrics["episode_return_mean"][0]
    assert abs(gru[0]) < 0.3 and np.mean(gru[-3:]) > 0.9, gru
    assert abs(np.mean(ff[-3:])) < 0.3, ff
