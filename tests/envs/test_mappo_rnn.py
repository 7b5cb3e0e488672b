"""MAPPO with GRUs (`critic_input` world_state | joint_obs with `network.recurrent_size > 0`):
the critic a torso and GRU of its own over the world state, the actor's GRU over each agent's
observation (with `agent_id`, its one-hot after it). The critic's values against a plain flax
Dense+GRU+Dense stack run by hand over the world-state sequence with its resets, the actor
independent of the critic's input, the update replaying both carries from the rollout's, a
resumed run, and the trained actor loaded, evaluated and exported with its carry alone. One
short run (and its resumed twin) on MPE simple_spread, compiled once for the module."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from resumed_runs import check_resume_continues_exactly  # tests/ is on sys.path

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams

pytest.importorskip("jaxmarl")

N, D, H, F = 3, 18, 8, 16  # MPE simple_spread: agents, observation size; GRU and torso sizes
E, T = 2, 32  # envs, steps: MPE's 25-step episodes end inside every rollout
CFG = jaxppo.PPOConfig(env="jaxmarl:MPE_simple_spread_v3", num_envs=E, num_steps=T,
                       num_minibatches=2, num_epochs=2, total_timesteps=2 * E * T,
                       network=jaxppo.NetworkConfig((F,), recurrent_size=H),
                       critic_input="world_state", agent_id=True, checkpoint_every=1,
                       log_every=1)
TIMINGS = ("wall_time", "sps")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run folder, trained result, algo, rollout Transition [T, E*N] from the trained state,
    the state after it): a run checked to resume exactly, then one rollout on from it."""
    tmp = tmp_path_factory.mktemp("mappo_rnn")
    cfg = CFG.replace(compilation_cache_dir=str(tmp / "xla"))
    full = check_resume_continues_exactly(cfg, tmp)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    hp = HyperParams.from_config(algo.config)
    after, traj = jax.jit(lambda s: ppo.rollout(algo, s, hp))(full.state)
    return tmp / "full", full, algo, traj, after


class CriticByHand(nn.Module):
    """One step of the critic as the docs describe it: Dense + tanh, GRU, Dense to a value."""

    @nn.compact
    def __call__(self, carry, x):
        carry, y = nn.GRUCell(H)(carry, jnp.tanh(nn.Dense(F)(x)))
        return carry, nn.Dense(1)(y)[..., 0]


def _critic_by_hand(params, carry0, world_state, reset, final_world_state):
    """Values [T, K] and successor values [T, K] of the world-state sequence [T, K, C] from
    carry0 [K, H], the carry zeroed where `reset` [T, K]; and the carry after the last step."""
    p = params["params"]
    mine = {"params": {"Dense_0": p["critic_encoder"]["Dense_0"], "GRUCell_0": p["critic_core"],
                       "Dense_1": p["value_head"]}}
    critic = CriticByHand()
    carry, values, next_values = np.asarray(carry0), [], []
    for t in range(world_state.shape[0]):
        carry = np.where(np.asarray(reset[t])[:, None], 0.0, carry)
        carry, v = critic.apply(mine, carry, world_state[t])
        values.append(v)
        next_values.append(critic.apply(mine, carry, final_world_state[t])[1])
    return np.stack(values), np.stack(next_values), np.asarray(carry)


def test_the_resumed_run_equals_the_uninterrupted_one_metrics_too(run):
    """The fixture's check compares the final states (params, both carries, ...); every
    iteration's metrics of the resumed run equal the uninterrupted run's, timings aside."""
    folder = run[0]

    def metrics(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]

    whole, resumed = metrics(folder), metrics(folder.parent / "part")
    assert len(whole) == 2 and resumed == whole


def test_the_critic_is_a_gru_of_its_own_on_the_world_state(run):
    """Values and successor values of a rollout from the trained state, and the critic carry
    it leaves in the state, against the critic by hand from the rollout's recorded carry."""
    _, full, algo, traj, after = run
    params = full.state.params
    actor_carry0, critic_carry0 = traj.carry0
    assert actor_carry0.shape == critic_carry0.shape == (E * N, H)
    assert np.abs(np.asarray(critic_carry0)).max() > 0  # carried over from the last iteration
    assert np.asarray(traj.reset).any() and not np.asarray(traj.reset).all()
    values, next_values = ppo.rollout_values(algo, params, full.state.obs_stats, traj)
    want, want_next, carry = _critic_by_hand(params, critic_carry0, traj.world_state,
                                             traj.reset, traj.final_world_state)
    np.testing.assert_allclose(np.asarray(values), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(next_values), want_next, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(after.carry.state[1]), carry, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(after.carry.state[1]), np.asarray(
        ppo.unroll(algo, params, traj.carry0, algo.obs_in(full.state.obs_stats, traj.obs),
                   traj.reset, traj.world_state)[2][1][-1]))


def test_the_update_replays_both_carries_and_the_actor_ignores_the_world_state(run):
    """A minibatch of whole sequences replays the acting policy and the rollout's values
    exactly; noise for the world state changes the values, not the policy."""
    _, full, algo, traj, _ = run
    params, stats = full.state.params, full.state.obs_stats
    values, _ = ppo.rollout_values(algo, params, stats, traj)
    batch = ppo.make_batch(algo, stats, traj, values, values, values)
    cols = jnp.asarray([1, 4])  # actors of both envs, agents 1 of each
    mb = ppo.gather_minibatch(algo, batch, cols)
    dist, v, _ = ppo.forward(algo, params, mb)
    np.testing.assert_allclose(np.asarray(dist.loc).reshape(T, 2, -1),
                               np.asarray(traj.dist.loc)[:, cols], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v).reshape(T, 2), np.asarray(values)[:, cols],
                               rtol=1e-5, atol=1e-6)
    noise = jax.random.normal(jax.random.PRNGKey(3), mb.critic_obs.shape)
    dist2, v2, _ = ppo.forward(algo, params, mb._replace(critic_obs=noise))
    np.testing.assert_array_equal(np.asarray(dist.loc), np.asarray(dist2.loc))
    assert not np.allclose(np.asarray(v), np.asarray(v2))


def test_the_actor_sees_its_observation_and_agent_id_before_its_gru(run):
    _, full, algo, _, _ = run
    p = full.state.params["params"]
    assert p["encoder"]["Dense_0"]["kernel"].shape == (D + N, F)  # observation + one-hot
    assert p["critic_encoder"]["Dense_0"]["kernel"].shape == (N * D, F)  # the world state


def test_load_policy_acts_with_the_actor_carry_alone(run, tmp_path):
    """The loaded joint policy, stepped with the actor's carry (zeroed at episode starts by
    hand), takes the rollout's most likely actions; evaluation and export run the same."""
    folder, _, _, traj, _ = run
    policy = jaxppo.load_policy(folder)
    assert policy.recurrent
    assert np.shape(policy.initial_carry((E, N))) == (E, N, H)  # the actor's only
    carry = np.asarray(traj.carry0[0]).reshape(E, N, H)
    exported = jaxppo.export_policy(policy, "jax", tmp_path / "actor.jaxexport")
    assert exported.metadata["carry"]["shape"] == ["b", N, H]
    fn = jax.export.deserialize(bytearray(exported.path.read_bytes()))
    ex_carry = carry
    for t in range(T):
        keep = ~np.asarray(traj.reset[t]).reshape(E, N, 1)
        carry, ex_carry = carry * keep, ex_carry * keep
        obs = np.asarray(traj.obs[t]).reshape(E, N, D)
        joint, carry = policy.joint({a: obs[:, i] for i, a in enumerate(policy.agents)}, carry)
        want = np.argmax(np.asarray(traj.dist.loc[t]), -1).reshape(E, N)
        np.testing.assert_array_equal(np.stack([joint[a] for a in policy.agents], 1), want)
        action, ex_carry = fn.call(obs, ex_carry)
        np.testing.assert_array_equal(np.asarray(action), want)
        np.testing.assert_allclose(np.asarray(ex_carry), np.asarray(carry), atol=1e-6)
    metrics = policy.evaluate(episodes=2)  # the actor alone, with its carry
    done = np.asarray(traj.terminated) | np.asarray(traj.truncated)
    episode = int(np.asarray(traj.episode_length)[done][0])  # MPE's fixed length
    assert metrics["lengths"] == [episode] * 2 and np.isfinite(metrics["returns"]).all()


def test_onnx_export_of_the_actor(run, tmp_path):
    pytest.importorskip("jax2onnx")
    ort = pytest.importorskip("onnxruntime")
    folder, _, _, traj, _ = run
    policy = jaxppo.load_policy(folder)
    out = jaxppo.export_policy(policy, "onnx", tmp_path / "actor.onnx")
    session = ort.InferenceSession(str(out.path))
    assert [i.name for i in session.get_inputs()] == ["obs", "carry"]
    carry = ours = np.zeros((E, N, H), np.float32)
    for t in range(4):
        obs = np.asarray(traj.obs[t]).reshape(E, N, D)
        action, carry = session.run(None, {"obs": obs, "carry": carry})
        expected, ours = policy.step(obs, ours)
        np.testing.assert_array_equal(action, expected)
        np.testing.assert_allclose(carry, ours, atol=1e-5)


def test_joint_obs_critic_with_a_gru_and_a_local_critic_with_agent_ids():
    """joint_obs feeds the critic's GRU every agent's observation; a local critic with
    agent_id shares the actor's GRU, whose input ends with the one-hot."""
    joint = Algorithm.create(jaxppo.resolve(CFG.replace(critic_input="joint_obs")))
    p = joint.init_params(jax.random.PRNGKey(0))["params"]
    assert p["critic_encoder"]["Dense_0"]["kernel"].shape == (N * D, F)
    assert joint.train_carry((5,))[1].shape == (5, H)
    local = Algorithm.create(jaxppo.resolve(CFG.replace(critic_input="local")))
    p = local.init_params(jax.random.PRNGKey(0))["params"]
    assert "critic_core" not in p and p["encoder"]["Dense_0"]["kernel"].shape == (D + N, F)
    assert local.train_carry((5,)).shape == (5, H)


# ---------------------------------------------------------------- a GRU per agent
PER_AGENT = CFG.replace(agent_params="per_agent", agent_id=False, checkpoint_every=0,
                        compilation_cache_dir=None)


def test_a_gru_per_agent_replays_each_actor_through_its_own_network():
    """agent_params per_agent with GRUs: each actor's rollout policy and values are its own
    agent's network (run alone on that agent's actors, carries and resets), and a minibatch
    of whole envs (each env's agents together) replays them exactly."""
    algo = Algorithm.create(jaxppo.resolve(PER_AGENT))
    hp = HyperParams.from_config(algo.config)

    @jax.jit
    def run(s):
        s, traj = ppo.rollout(algo, s, hp)  # a second rollout: carries not all zero
        s, traj = ppo.rollout(algo, s, hp)
        values, _ = ppo.rollout_values(algo, s.params, s.obs_stats, traj)
        return s, traj, values

    state, traj, values = run(ppo.init(algo, jax.random.PRNGKey(0), hp))
    assert np.abs(np.asarray(traj.carry0[1])).max() > 0
    obs_in = algo.obs_in(state.obs_stats, traj.obs)
    inner = algo.network.inner
    for i in range(N):
        own = algo.agent_params(state.params, i)
        mine = jax.tree.map(lambda c: c[i::N], traj.carry0)

        def step(carry, xs, own=own):
            dist, value, carry = inner.apply(own, xs[0], carry, xs[1], critic_obs=xs[2])
            return carry, (dist.loc, value)

        _, (loc, v) = jax.lax.scan(step, mine, (obs_in[:, i::N], traj.reset[:, i::N],
                                                traj.world_state[:, i::N]))
        np.testing.assert_allclose(np.asarray(traj.dist.loc[:, i::N]), np.asarray(loc),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(values[:, i::N]), np.asarray(v), rtol=1e-5,
                                   atol=1e-5)
    env_ids = algo.spec.actor_ids(state.env_ids)
    idx = ppo.collectives.minibatch_indices(jax.random.PRNGKey(4), env_ids, T, 2, True, N)
    assert sorted(np.asarray(idx).reshape(-1).tolist()) == list(range(E * N))
    for cols in np.asarray(idx):  # whole envs, each env's agents in order
        assert (cols.reshape(-1, N) == cols.reshape(-1, N)[:, :1] + np.arange(N)).all()
    batch = ppo.make_batch(algo, state.obs_stats, traj, values, values, values)
    for cols in idx:
        dist, v, _ = ppo.forward(algo, state.params, ppo.gather_minibatch(algo, batch, cols))
        np.testing.assert_allclose(np.asarray(dist.loc).reshape(T, N, -1),
                                   np.asarray(traj.dist.loc)[:, np.asarray(cols)], rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(v).reshape(T, N),
                                   np.asarray(values)[:, np.asarray(cols)], rtol=1e-5, atol=1e-6)


def test_a_gru_per_agent_policy_acts_and_exports_with_each_agents_carry(tmp_path):
    """The joint policy steps each agent's own GRU on its carry [*batch, N, H]; one agent's
    policy is its own network on its own carry [*batch, H]; the export equals the policy."""
    from jaxppo.run.policy import Policy

    algo = Algorithm.create(jaxppo.resolve(PER_AGENT))
    params = jax.jit(algo.init_params)(jax.random.PRNGKey(0))
    hp = HyperParams.from_config(algo.config)
    policy = Policy(algo, params, ppo.init(algo, jax.random.PRNGKey(0), hp).obs_stats)
    exported = jaxppo.export_policy(policy, "jax", tmp_path / "per_agent.jaxexport")
    fn = jax.export.deserialize(bytearray(exported.path.read_bytes()))
    rng = np.random.default_rng(0)
    carry = ex_carry = policy.initial_carry((E, N))
    agent_carries = [policy.agent(a).initial_carry((E,)) for a in policy.agents]
    for t in range(3):
        obs = rng.normal(size=(E, N, D)).astype(np.float32)
        actions, carry = policy.step(obs, carry)
        ex_actions, ex_carry = fn.call(obs, ex_carry)
        np.testing.assert_array_equal(np.asarray(ex_actions), np.asarray(actions))
        np.testing.assert_allclose(np.asarray(ex_carry), np.asarray(carry), atol=1e-6)
        for i, a in enumerate(policy.agents):
            own, agent_carries[i] = policy.agent(a).step(obs[:, i], agent_carries[i])
            np.testing.assert_array_equal(np.asarray(own), np.asarray(actions)[:, i])
            np.testing.assert_allclose(np.asarray(agent_carries[i]), np.asarray(carry)[:, i],
                                       atol=1e-6)
