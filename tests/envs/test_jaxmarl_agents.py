"""Multi-agent runs beyond the feed-forward IPPO step (tests/envs/test_jaxmarl.py): a recurrent
(GRU) policy with one carry per actor, replayed by hand actor by actor on JaxMARL's own
observations, the update's replay of the rollout, and resume; per-agent returns and SMAX's
win rate against sums by hand and JaxMARL's win; the joint policy of a run folder, each
agent's own policy, `jaxppo eval` and export. The trained run and the rollout are shared by
the tests (module fixtures). Skips without jaxmarl."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.core.running_stats import RunningStats
from jaxppo.envs.make import make_env

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


@pytest.fixture(scope="module")
def gru_run(tmp_path_factory, compile_cache_dir):
    """A 3-iteration recurrent run with a checkpoint after each: (config, its folder, result)."""
    cfg = GRU.replace(checkpoint_every=1, log_every=1, compilation_cache_dir=compile_cache_dir)
    folder = tmp_path_factory.mktemp("gru") / "full"
    return cfg, folder, jaxppo.train(cfg, run_dir=folder, progress=False)


def test_recurrent_run_resumes_exactly(gru_run, tmp_path):
    cfg, _, full = gru_run
    jaxppo.train(cfg, run_dir=tmp_path / "part", progress=False, stop_after_iterations=2)
    resumed = jaxppo.train(None, resume=tmp_path / "part", progress=False)
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for key in ("episode_return_mean", "episode_return_mean/agent_1", "policy_loss"):
        np.testing.assert_array_equal(full.metrics[key], resumed.metrics[key])


def test_recurrent_minibatches_must_divide_the_actors():
    for critic_input in ("local", "world_state"):  # MAPPO's GRU critic: the same sequences
        with pytest.raises(jaxppo.ConfigError, match=r"num_envs=2 x 3 agents = 6: .* choose "
                                                     r"num_minibatches from \[1, 2, 3, 6\]"):
            jaxppo.resolve(GRU.replace(num_minibatches=4, critic_input=critic_input))
    jaxppo.resolve(GRU.replace(num_minibatches=6))  # one actor's sequence per minibatch


def test_each_agents_return_beside_the_team_return(gru_rollout):
    """episode_return_mean/<agent> is that agent's rewards summed over its env's first
    episode, averaged over envs; their sum is the team return."""
    algo, _, _, _, traj = gru_rollout
    metrics = ppo.agent_metrics(algo, ppo.gather_rollout_stats(algo, traj))
    assert set(metrics) == {f"episode_return_mean/agent_{i}" for i in range(N_AGENTS)}
    rewards = np.asarray(traj.reward, np.float64)[:LIMIT].reshape(LIMIT, GRU.num_envs, N_AGENTS)
    want = rewards.sum(axis=0).mean(axis=0)
    got = [float(metrics[f"episode_return_mean/agent_{i}"]) for i in range(N_AGENTS)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_win_rate_counts_the_won_episodes_among_the_ended():
    """local_agent_stats on a hand-made rollout of 2 envs x 2 agents: returns summed per
    agent where the env's episode ended, wins counted once per env."""
    done = np.array([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]], bool)  # [T=3, E*N=4]
    won = np.array([[1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], bool)
    ret = np.arange(12, dtype=np.float32).reshape(3, 4)
    traj = jaxppo.core.algorithm.Transition(
        *([None] * 7), terminated=jnp.asarray(done), truncated=jnp.zeros_like(done),
        episode_return=jnp.asarray(ret), episode_length=None, won=jnp.asarray(won))
    got = np.asarray(jaxppo.core.collectives.local_agent_stats(traj, 2))
    want_returns = [sum(ret[t, i] for t in range(3) for i in (a, a + 2) if done[t, i])
                    for a in range(2)]
    np.testing.assert_allclose(got, want_returns + [3.0])  # 4 episodes ended, 3 won


def test_smax_reports_a_win_where_every_enemy_died_as_jaxmarl_counts_it():
    """A state with every enemy dead: the next step ends the episode, JaxMARL's reward holds
    its won_battle_bonus (its baselines' win: a last reward >= 1) and info["won"] is set;
    with every ally dead instead, no win."""
    env = make_env(GRU.replace(env="jaxmarl:smax:3m")).env
    assert env.reports_wins
    _, state = env.reset(jax.random.PRNGKey(3))
    inner = state.marl_state.state
    allies = env.marl_env.num_allies
    for dead, win in ((slice(allies, None), True), (slice(0, allies), False)):
        killed = inner.replace(unit_alive=inner.unit_alive.at[dead].set(False),
                               unit_health=inner.unit_health.at[dead].set(0.0))
        s = state.replace(marl_state=state.marl_state.replace(state=killed))
        _, _, reward, term, trunc, info = env.step(jax.random.PRNGKey(4), s,
                                                   jnp.zeros((allies,), jnp.int32))
        assert bool(term) and not bool(trunc)
        assert bool(info["won"]) is win
        assert bool(np.all(np.asarray(reward) >= 1.0)) is win


def test_evaluation_gives_each_agents_return_of_jaxmarls_own_episodes(gru_rollout):
    """The deterministic GRU policy played by hand through JaxMARL's reset and step_env (the
    same keys), each agent's carry its own: evaluate's per-agent and team returns."""
    algo, _, state, _, _ = gru_rollout
    n, key = 2, jax.random.PRNGKey(7)
    got = algo.evaluate(state.params, state.obs_stats, key, num_episodes=n, deterministic=True)
    marl = algo.spec.env.marl_env
    k_reset, k = jax.random.split(key)
    returns = np.zeros((n, N_AGENTS))
    mstates = [marl.reset(kr)[1] for kr in jax.random.split(k_reset, n)]
    obs = [marl.get_obs(s) for s in mstates]
    carries = [jnp.zeros((N_AGENTS, GRU.network.recurrent_size)) for _ in range(n)]
    step_env = jax.jit(marl.step_env)  # JaxMARL's own step, compiled once
    for _ in range(LIMIT):
        k, _, k_step = jax.random.split(k, 3)
        for i, ks in enumerate(jax.random.split(k_step, n)):
            agent_obs = jnp.stack([obs[i][a] for a in marl.agents])
            dist, _, carries[i] = _one_step(algo, state.params, state.obs_stats, agent_obs,
                                            carries[i])
            acts = {a: jnp.argmax(dist.loc[j]) for j, a in enumerate(marl.agents)}
            obs[i], mstates[i], rew, _, _ = step_env(jax.random.split(ks)[0], mstates[i], acts)
            returns[i] += [float(rew[a]) for a in marl.agents]
    np.testing.assert_allclose(float(got["eval_return_mean"]), returns.sum(1).mean(), rtol=1e-4)
    for j, a in enumerate(marl.agents):
        np.testing.assert_allclose(float(got[f"eval_return_mean/{a}"]), returns[:, j].mean(),
                                   rtol=1e-4)


def test_joint_policy_acts_for_every_agent_as_each_agents_own_policy(gru_run):
    """load_policy of a multi-agent run: a dict of JaxMARL observations in, a dict of actions
    out, each agent's action and carry those of the network run by hand on that agent's
    observation alone, and of policy.agent(name)."""
    _, folder, _ = gru_run
    policy = jaxppo.load_policy(folder)
    assert policy.agents == ("agent_0", "agent_1", "agent_2") and policy.recurrent
    marl = policy.env.marl_env
    obs, _ = marl.reset(jax.random.PRNGKey(5))
    carry = policy.initial_carry((N_AGENTS,))
    actions, carry1 = policy.joint(obs, carry)
    assert set(actions) == set(marl.agents) and carry1.shape == (N_AGENTS, 8)
    for i, a in enumerate(marl.agents):
        dist, _, c = _one_step(policy.algorithm, policy.params, policy.obs_stats,
                               obs[a][None], carry[i][None])
        assert int(actions[a]) == int(jnp.argmax(dist.loc[0]))
        np.testing.assert_allclose(np.asarray(carry1[i]), np.asarray(c[0]), rtol=1e-5, atol=1e-6)
        own, own_carry = policy.agent(a).step(obs[a], carry[i])
        assert int(own) == int(actions[a])
        np.testing.assert_allclose(np.asarray(own_carry), np.asarray(carry1[i]), rtol=1e-5,
                                   atol=1e-6)
    # A batch of 2 joint observations: actions [2] per agent.
    batch = {a: jnp.stack([obs[a], obs[a]]) for a in marl.agents}
    acts, _ = policy.joint(batch, policy.initial_carry((2, N_AGENTS)),
                           key=jax.random.PRNGKey(0))
    assert all(acts[a].shape == (2,) for a in marl.agents)
    with pytest.raises(ValueError, match=r"obs must map every agent"):
        policy.joint({"agent_0": obs["agent_0"]}, carry)
    with pytest.raises(ValueError, match="not one of"):
        policy.agent("agent_9")


def test_eval_command_and_export_of_a_multi_agent_run(gru_run, tmp_path, capsys):
    """`jaxppo eval` on the run folder reports the team and each agent's return; the exported
    function is every agent's policy on its padded observation."""
    from jaxppo import cli

    _, folder, _ = gru_run
    assert cli.main(["eval", str(folder), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "team return" in out and "agent_0" in out and "agent_2" in out
    policy = jaxppo.load_policy(folder)
    ex = jaxppo.export_policy(policy, path=tmp_path / "marl.jaxexport")
    assert ex.metadata["agents"]["names"] == list(policy.agents)
    assert ex.metadata["agents"]["obs_size"]["agent_1"] == 18
    fn = jax.export.deserialize(ex.path.read_bytes())
    obs, _ = policy.env.marl_env.reset(jax.random.PRNGKey(6))
    rows = jnp.stack([obs[a] for a in policy.agents])
    action, carry = fn.call(rows, policy.initial_carry((N_AGENTS,)))
    want, want_carry = policy.joint(obs, policy.initial_carry((N_AGENTS,)))
    assert [int(x) for x in action] == [int(want[a]) for a in policy.agents]
    np.testing.assert_allclose(np.asarray(carry), np.asarray(want_carry), rtol=1e-5, atol=1e-6)


def test_progress_line_shows_the_team_return_and_win_rate(capsys):
    from jaxppo.run.progress import Reporter

    cfg = GRU.replace(env="jaxmarl:smax:3m")
    reporter = Reporter(cfg, 4, progress=None, team=True, wins=True)
    rows = [{"episode_return_mean": 1.5, "win_rate": 0.25, "iteration": 1},
            {"episode_return_mean": 2.5, "win_rate": 0.75, "iteration": 2}]
    reporter.update(2, rows, 100.0)
    line = capsys.readouterr().err
    assert "team return 2.0  win rate 0.50" in line


def test_feed_forward_joint_policy_pads_each_agents_observation():
    """Speaker-listener (observations of 3 and 11 numbers, 3 and 5 actions): the joint policy
    on JaxMARL's own dict pads the speaker's observation and masks its extra actions, as the
    network run by hand on the padded rows does."""
    from jaxppo.run.policy import Policy

    cfg = GRU.replace(env="jaxmarl:MPE_simple_speaker_listener_v4", num_minibatches=2,
                      network=jaxppo.NetworkConfig((16,)))
    algo = Algorithm.create(jaxppo.resolve(cfg))
    params = algo.init_params(jax.random.PRNGKey(1))
    policy = Policy(algo, params, RunningStats.create((algo.spec.obs_dim,)))
    env = policy.env
    obs, env_state = env.marl_env.reset(jax.random.PRNGKey(2))
    mask = policy.action_mask(env.reset(jax.random.PRNGKey(2))[1])  # the same reset
    actions = policy(obs, action_mask=mask)
    logits = algo.network.apply(params, env.stack(obs))[0].loc  # [2, 5]
    want = np.argmax(np.where(np.asarray(mask), np.asarray(logits), -np.inf), axis=-1)
    assert [int(actions[a]) for a in env.agents] == want.tolist()
    assert int(actions["speaker_0"]) < 3
    assert int(policy.agent("speaker_0")(obs["speaker_0"], action_mask=mask[0])) == want[0]
    with pytest.raises(ValueError, match=r"shape \(11,\), but its observations have 3 numbers"):
        policy.agent("speaker_0")(obs["listener_0"], action_mask=mask[0])


def test_joint_policy_with_agent_ids_acts_for_the_env_and_refuses_one_agent():
    from jaxppo.run.policy import Policy

    cfg = GRU.replace(agent_id=True, num_minibatches=2, network=jaxppo.NetworkConfig((16,)))
    algo = Algorithm.create(jaxppo.resolve(cfg))
    params = algo.init_params(jax.random.PRNGKey(1))
    policy = Policy(algo, params, RunningStats.create((algo.spec.obs_dim,)))
    obs, _ = policy.env.marl_env.reset(jax.random.PRNGKey(2))
    actions = policy.joint(obs)
    rows = jnp.concatenate([policy.env.stack(obs), jnp.eye(N_AGENTS)], axis=-1)
    want = np.argmax(np.asarray(algo.network.apply(params, rows)[0].loc), axis=-1)
    assert [int(actions[a]) for a in policy.agents] == want.tolist()
    with pytest.raises(TypeError, match="agent_id=true"):
        policy.agent("agent_0")
