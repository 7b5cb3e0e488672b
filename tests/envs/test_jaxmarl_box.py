"""Continuous (Box) actions on a JaxMARL env (MPE with `action_type: Continuous`) and the
observation transforms on a multi-agent env. The adapter's step against JaxMARL's own with
dict actions; frame stacks against a plain-numpy stacking of the env's own observations;
each agent's count bonus against counts by hand; discretised actions against the bins by
hand; the errors. One short run (a GRU per agent, a world-state critic, frame stacking and a
count bonus, compiled once for the module) resumed exactly, then loaded as the joint policy,
evaluated and exported (jax, and ONNX with each agent's network in turn); and a learning check on continuous simple_spread (marked slow)."""

import json
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from resumed_runs import check_resume_continues_exactly  # tests/ is on sys.path

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.envs.transforms import CountBonus, EnvWrapper
from jaxppo.errors import ConfigError

pytest.importorskip("jaxmarl")

ENV, BOX = "jaxmarl:MPE_simple_spread_v3", {"action_type": "Continuous"}
N, D, A, H, K = 3, 18, 5, 8, 2  # agents, observation size, action size, GRU size, frames
E, T = 2, 32
RUN = jaxppo.PPOConfig(env=ENV, env_kwargs=BOX, num_envs=E, num_steps=T, num_minibatches=2,
                       num_epochs=1, total_timesteps=2 * E * T,
                       network=jaxppo.NetworkConfig((16,), recurrent_size=H),
                       agent_params="per_agent", critic_input="world_state",
                       transforms=[{"frame_stack": {"k": K}}, {"count_bonus": {"scale": 0.1}}],
                       checkpoint_every=1, log_every=1)
TIMINGS = ("wall_time", "sps")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run folder of RUN, checked to resume exactly."""
    tmp = tmp_path_factory.mktemp("marl_box")
    check_resume_continues_exactly(RUN.replace(compilation_cache_dir=str(tmp / "xla")), tmp)
    return tmp / "full"


def test_every_agent_has_the_box_and_the_env_steps_as_jaxmarls():
    spec = make_env(RUN.replace(transforms=[]))
    assert spec.agents == ("agent_0", "agent_1", "agent_2") and not spec.discrete
    assert spec.action_dim == A and not spec.masked and spec.world_state is not None
    np.testing.assert_array_equal(spec.action_low, np.zeros(A))  # JaxMARL's Box(0, 1, (5,))
    np.testing.assert_array_equal(spec.action_high, np.ones(A))
    env, marl = spec.env, spec.env.marl_env
    action = jax.random.uniform(jax.random.PRNGKey(1), (N, A))
    key = jax.random.PRNGKey(2)

    @jax.jit
    def both(k):
        obs, state = env.reset(k)
        ours = env.step(key, state, action)
        theirs = marl.step_env(jax.random.split(key)[0], state.marl_state,
                               {a: action[i] for i, a in enumerate(env.agents)})
        return obs, ours, theirs

    obs, (obs1, _, reward, term, trunc, _), (want_obs, _, want_reward, _, _) = both(key)
    assert obs.shape == (N, D) and not bool(term) and not bool(trunc)
    np.testing.assert_array_equal(obs1, np.stack([want_obs[a] for a in env.agents]))
    np.testing.assert_array_equal(reward, np.stack([want_reward[a] for a in env.agents]))


def test_errors_name_the_agents_spaces_and_the_fix():
    from jaxmarl.environments.mpe.simple import SimpleMPE
    from jaxmarl.environments.spaces import Box, Discrete
    from jaxppo.envs.jaxmarl_suite import JaxMarlEnv

    with pytest.raises(ConfigError, match=r"speaker_0: \[3\].*listener_0: \[5\].*padded "
                                          r"dimensions.*action_type: Discrete"):
        make_env(jaxppo.PPOConfig(env="jaxmarl:MPE_simple_speaker_listener_v4",
                                  env_kwargs=BOX).validate())
    mixed = SimpleMPE(num_agents=2, action_spaces={"agent_0": Discrete(5),
                                                   "agent_1": Box(0.0, 1.0, (5,))})
    with pytest.raises(ConfigError, match="mixes Discrete and Box.*agent_0: Discrete, "
                                          "agent_1: Box"):
        JaxMarlEnv(mixed)

    class Flip(EnvWrapper):  # a user's wrapper that does not say it takes the agent axis
        name = "flip"

    with pytest.raises(ConfigError, match=r"transform 'flip' .* multi-agent env.*"
                                          r"takes_agents = True"):
        make_env(RUN.replace(transforms=[Flip()]).validate())
    with pytest.raises(ConfigError, match=r"reward hook function 'bonus'.*\[T, E\*N\].*"
                                          r"RewardHook subclass with takes_agents = True"):
        def bonus(state, traj):
            return state, traj.reward
        jaxppo.resolve(RUN.replace(transforms=[bonus]))
    with pytest.raises(ConfigError, match="mask_actions=true.*continuous actions"):
        make_env(RUN.replace(transforms=[], mask_actions=True).validate())


@pytest.mark.full_optimization  # two programs compared to the last bit (tests/conftest.py)
def test_frames_stack_each_agents_own_observations_as_numpy_stacks_them():
    """The frame-stacked env against the env itself, stepped with the same keys and actions
    through an episode's end (MPE's 26 steps): each agent's stack [D, K] is its last K
    observations, oldest first, all K the first one after a reset; the pre-reset stack ends
    in the pre-reset observation; the world state is the env's own."""
    stacked = make_env(RUN.replace(transforms=[{"frame_stack": {"k": K}}]))
    plain, steps = stacked.env._env, 30
    assert stacked.obs_shape == (D, K) and stacked.world_state is not None
    actions = jax.random.uniform(jax.random.PRNGKey(3), (steps, N, A))
    keys = jax.random.split(jax.random.PRNGKey(4), steps)

    def play(env):
        def step(state, xs):
            obs, state, _, term, trunc, info = env.step(xs[0], state, xs[1])
            ws = env.world_state(state) if env is plain else stacked.world_state(state)
            return state, (obs, info["final_observation"], term | trunc, ws)
        obs0, state = env.reset(jax.random.PRNGKey(5))
        return obs0, jax.lax.scan(step, state, (keys, actions))[1]

    (obs0, (obs, final, done, ws)), (s0, (s_obs, s_final, s_done, s_ws)) = jax.jit(
        lambda: (play(plain), play(stacked.env)))()
    obs0, obs, final, done = map(np.asarray, (obs0, obs, final, done))
    assert done.sum() == 1  # one episode end inside the 30 steps
    frames = [obs0] * K
    np.testing.assert_array_equal(s0, np.stack(frames, axis=-1))
    for t in range(steps):
        want_final = np.stack(frames[1:] + [final[t]], axis=-1)
        frames = [obs[t]] * K if done[t] else frames[1:] + [obs[t]]
        np.testing.assert_array_equal(s_obs[t], np.stack(frames, axis=-1))
        np.testing.assert_array_equal(s_final[t], want_final)
    np.testing.assert_array_equal(s_done, done)
    np.testing.assert_array_equal(s_ws, ws)


class Batch(NamedTuple):
    """What count_bonus reads of a rollout: observations [T, E*N, ...], rewards [T, E*N]."""

    final_obs: jax.Array
    reward: jax.Array


def test_each_agent_counts_its_own_observations():
    """count_bonus on a multi-agent batch [T, E*N]: a table per agent, so two agents seeing
    the same observation count it apart; the bonus is scale / sqrt(visits) by hand."""
    hook = CountBonus(scale=0.5)
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 2, size=(4, E * N, 3)).astype(np.float32)  # few distinct rows
    reward = rng.normal(size=(4, E * N)).astype(np.float32)
    traj = Batch(jnp.asarray(obs), jnp.asarray(reward))
    state = hook.init(SimpleNamespace(agents=("a", "b", "c")))
    assert state.shape == (N, hook.buckets)
    state, out = jax.jit(hook)(state, traj)
    state, out = jax.jit(hook)(state, traj)  # a second batch: the counts go on
    counts = {}
    for t in range(4):
        for k in range(E * N):
            key = (k % N, tuple(obs[t, k]))
            counts[key] = counts.get(key, 0) + 2
    want = reward + 0.5 / np.sqrt([[counts[(k % N, tuple(obs[t, k]))] for k in range(E * N)]
                                   for t in range(4)])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    assert int(state.sum()) == 2 * obs.shape[0] * obs.shape[1]
    assert hook.init(SimpleNamespace(agents=())).shape == (hook.buckets,)  # one agent's


def test_discretized_box_actions_of_every_agent():
    spec = make_env(RUN.replace(transforms=[{"discretize_actions": {"bins": 3}}]))
    assert spec.discrete and spec.action_dim == 3 ** A and spec.agents
    index = np.array([0, 3 ** A - 1, 1 * 81 + 2 * 27 + 0 * 9 + 1 * 3 + 2])  # base-3 digits
    got = np.asarray(spec.env.continuous_action(jnp.asarray(index)))
    want = np.array([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0.5, 1, 0, 0.5, 1]], np.float32)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ConfigError, match="needs a continuous .*Box.* action space"):
        make_env(RUN.replace(env_kwargs={}, transforms=["discretize_actions"]))


def test_the_resumed_per_agent_gru_run_equals_the_uninterrupted_one_metrics_too(run):
    """The fixture compares the final states (each agent's params, carries, counts, ...);
    every iteration's metrics of the resumed run equal the uninterrupted run's."""
    def metrics(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]

    whole = metrics(run)
    assert len(whole) == 2 and metrics(run.parent / "part") == whole


def test_the_joint_policy_acts_evaluates_and_exports(run, tmp_path):
    """The loaded joint policy ({agent: stacked obs} -> {agent: action [A]}) acts as each
    agent's own GRU does (its mean, clipped to the Box), and its jax export as the policy on
    the stacked array; evaluation plays whole 26-step episodes."""
    policy = jaxppo.load_policy(run)
    algo = policy.algorithm
    obs = np.random.default_rng(1).normal(size=(E, N, D, K)).astype(np.float32)
    carry = policy.initial_carry((E, N))
    joint, carry1 = policy.joint({a: obs[:, i] for i, a in enumerate(policy.agents)}, carry)
    actions, _ = policy.step(obs, carry)
    x = algo.obs_in(policy.obs_stats, obs)
    for i, a in enumerate(policy.agents):
        dist, _, own = algo.network.inner.apply(algo.agent_params(policy.params, i), x[:, i],
                                                carry[:, i])
        want = np.clip(np.asarray(dist.loc), 0.0, 1.0)
        assert joint[a].shape == (E, A)
        np.testing.assert_allclose(np.asarray(joint[a]), want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(carry1)[:, i], np.asarray(own), atol=1e-6)
    exported = jaxppo.export_policy(policy, "jax", tmp_path / "joint.jaxexport")
    assert exported.metadata["obs"]["shape"] == ["b", N, D, K]
    assert exported.metadata["action"]["kind"] == "continuous"
    fn = jax.export.deserialize(bytearray(exported.path.read_bytes()))
    np.testing.assert_array_equal(np.asarray(fn.call(obs, carry)[0]), np.asarray(actions))
    metrics = policy.evaluate(episodes=2)
    assert metrics["lengths"] == [26, 26] and np.isfinite(metrics["returns"]).all()


def test_onnx_export_of_a_gru_per_agent(run, tmp_path):
    """The run's policy (a GRU per agent on stacked frames) exported to ONNX: an env's agents
    together in, each agent's Box action and carry out, as the policy gives them step after
    step (jax2onnx converts each agent's network applied in turn, not the vmap over agents
    that training uses)."""
    pytest.importorskip("jax2onnx")
    ort = pytest.importorskip("onnxruntime")
    policy = jaxppo.load_policy(run)
    out = jaxppo.export_policy(policy, "onnx", tmp_path / "agents.onnx")
    assert out.metadata["action"]["low"] == [0.0] * A
    session = ort.InferenceSession(str(out.path))
    assert [i.name for i in session.get_inputs()] == ["obs", "carry"]
    rng = np.random.default_rng(2)
    carry = ours = np.asarray(policy.initial_carry((E, N)))
    for _ in range(3):
        obs = rng.normal(size=(E, N, D, K)).astype(np.float32)
        action, carry = session.run(None, {"obs": obs, "carry": carry})
        want, ours = policy.step(obs, ours)
        assert action.shape == (E, N, A)
        np.testing.assert_allclose(action, np.asarray(want), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(carry, np.asarray(ours), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ppo_learns_continuous_simple_spread():
    """The docs' command for continuous MPE (IPPO with a Gaussian shared by the three agents,
    the tuned config with its --set): the team return of the last ten iterations' episodes
    beats the first iteration's (the initial policy's) clearly, over 41k env steps."""
    from readme_commands import readme_train_config

    cfg = readme_train_config(ENV, env_kwargs=BOX).replace(compilation_cache_dir=None)
    assert (cfg.num_envs, cfg.num_steps, cfg.total_timesteps) == (16, 32, 16 * 32 * 80)
    result = jaxppo.train(cfg, progress=False, plot=False)
    returns = np.asarray(result.metrics["episode_return_mean"][0])
    initial, trained = returns[0], returns[-10:].mean()
    assert trained > initial + 0.1 * abs(initial), (initial, trained)
