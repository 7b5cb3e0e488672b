"""MAPPO's centralised critic (`critic_input`: "world_state" | "joint_obs") and agent ids in
the input (`agent_id`) on JaxMARL envs: the world state the rollout records against JaxMARL's
own (SMAX's get_world_state, MPE's observations concatenated as JaxMARL's MAPPO wrapper
builds it), the critic's values against a plain-numpy MLP on those inputs, the actor's
log-probs independent of the critic's input, the one-hot ids by hand, the errors, and a
resumed, loaded and exported MAPPO run. Tiny configs, one compile of each program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from resumed_runs import check_resume_continues_exactly  # tests/ is on sys.path

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.core.running_stats import RunningStats
from jaxppo.envs import jaxmarl_suite
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError

pytest.importorskip("jaxmarl")

N, D = 3, 18  # MPE_simple_spread_v3: agents, observation size
TINY = jaxppo.PPOConfig(env="jaxmarl:MPE_simple_spread_v3", num_envs=2, num_steps=32,
                        num_minibatches=2, num_epochs=1, total_timesteps=3 * 64,
                        network=jaxppo.NetworkConfig((16,)), normalize_advantages=False,
                        compilation_cache_dir=None, critic_input="world_state")


@pytest.fixture(scope="module")
def mappo():
    """(algo, state, traj) of one rollout of MAPPO with a world-state critic."""
    algo = Algorithm.create(jaxppo.resolve(TINY))
    hp = HyperParams.from_config(algo.config)
    state = ppo.init(algo, jax.random.PRNGKey(0), hp)
    _, traj = jax.jit(lambda s: ppo.rollout(algo, s, hp))(state)
    return algo, state, traj


def _numpy_value(params, x):
    """The critic by hand: tanh MLP torso, then the value head, in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    h = np.asarray(x, np.float64)
    torso = p["critic_torso"]
    for i in range(len(torso)):
        h = np.tanh(h @ torso[f"Dense_{i}"]["kernel"] + torso[f"Dense_{i}"]["bias"])
    return (h @ p["value_head"]["kernel"] + p["value_head"]["bias"])[..., 0]


def test_mpe_world_state_is_every_agents_observation_concatenated(mappo):
    """JaxMARL's MPEWorldStateWrapper: the agents' observations flattened in agent order, the
    same for every agent of the env; the successor's from the pre-reset observations."""
    algo, _, traj = mappo
    T, A = traj.reward.shape
    per_env = lambda o: np.asarray(o).reshape(T, A // N, N * D)  # noqa: E731
    want = np.repeat(per_env(traj.obs)[:, :, None], N, axis=2).reshape(T, A, N * D)
    np.testing.assert_allclose(np.asarray(traj.world_state), want, rtol=1e-6, atol=1e-6)
    want = np.repeat(per_env(traj.final_obs)[:, :, None], N, axis=2).reshape(T, A, N * D)
    np.testing.assert_allclose(np.asarray(traj.final_world_state), want, rtol=1e-6, atol=1e-6)


def test_smax_world_state_is_jaxmarls_get_world_state():
    spec = make_env(TINY.replace(env="jaxmarl:smax:3m"))
    smax = spec.env.marl_env._env  # SMAX itself, under the heuristic enemy

    @jax.jit
    def both(keys):
        _, env_state = jax.vmap(spec.env.reset, in_axes=(0, None))(keys, spec.env_params)
        want = jax.vmap(smax.get_world_state)(env_state.marl_state.state)
        return spec.world_states(env_state), want

    got, want = both(jax.random.split(jax.random.PRNGKey(1), 2))  # [2 * 3, C], [2, C]
    np.testing.assert_array_equal(np.asarray(got), np.repeat(np.asarray(want), 3, axis=0))


def test_values_are_the_critic_on_the_world_state_against_numpy(mappo):
    algo, state, traj = mappo
    values, next_values = ppo.rollout_values(algo, state.params, state.obs_stats, traj)
    np.testing.assert_allclose(np.asarray(values), _numpy_value(state.params, traj.world_state),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(next_values),
                               _numpy_value(state.params, traj.final_world_state),
                               rtol=1e-4, atol=1e-5)
    # A world state built by hand, through the public value().
    ws = np.linspace(-1.0, 1.0, N * D, dtype=np.float32)[None].repeat(N, 0)
    obs = np.zeros((N, D), np.float32)
    got = algo.value(state.params, state.obs_stats, obs, world_state=ws)
    np.testing.assert_allclose(np.asarray(got), _numpy_value(state.params, ws), rtol=1e-5)


def test_the_actors_log_probs_do_not_depend_on_the_critic_input(mappo):
    """The same loss's policy from the batch with its critic input replaced by noise, and
    from IPPO's network (a local critic) holding the same actor params."""
    algo, state, traj = mappo
    values, _ = ppo.rollout_values(algo, state.params, state.obs_stats, traj)
    batch = ppo.make_batch(algo, state.obs_stats, traj, values, values, values)
    mb = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    dist, v, _ = ppo.forward(algo, state.params, mb)
    noise = jax.random.normal(jax.random.PRNGKey(3), mb.critic_obs.shape)
    dist2, v2, _ = ppo.forward(algo, state.params, mb._replace(critic_obs=noise))
    np.testing.assert_array_equal(np.asarray(dist.loc), np.asarray(dist2.loc))
    assert not np.allclose(np.asarray(v), np.asarray(v2))
    ippo = Algorithm.create(jaxppo.resolve(TINY.replace(critic_input="local")))
    local = ippo.init_params(jax.random.PRNGKey(0))
    params = {"params": {**state.params["params"],
                         "critic_torso": local["params"]["critic_torso"]}}
    dist3, _, _ = ippo.network.apply(params, mb.obs)
    np.testing.assert_array_equal(np.asarray(dist.loc), np.asarray(dist3.loc))


def test_joint_obs_and_agent_ids_by_hand():
    """joint_obs: each agent's normalised observations of its env, concatenated; agent_id: a
    one-hot of the agent's index after the (normalised) observation, env-major."""
    cfg = TINY.replace(critic_input="joint_obs", agent_id=True, normalize_observations=True)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(4, 2 * N, D)).astype(np.float32)  # [T, E*N, D]
    stats = RunningStats(jnp.asarray(rng.normal(size=D), jnp.float32),
                             jnp.asarray(rng.uniform(0.5, 2, size=D), jnp.float32),
                             jnp.float32(10.0))
    norm = np.clip((obs - np.asarray(stats.mean)) / np.sqrt(np.asarray(stats.var) + 1e-8),
                   -10, 10)
    joint = algo.critic_in(stats, obs)
    for e in range(2):
        for i in range(N):
            np.testing.assert_allclose(np.asarray(joint[:, e * N + i]),
                                       norm[:, e * N:(e + 1) * N].reshape(4, N * D), rtol=1e-5,
                                       atol=1e-5)
    x = np.asarray(algo.obs_in(stats, obs))
    np.testing.assert_allclose(x[..., :D], norm, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x[..., D:], np.tile(np.eye(N), (2, 1))[None].repeat(4, 0))
    one_env = np.asarray(algo.obs_in(stats, obs[0, :N]))  # a policy's [N, D]: the same ids
    np.testing.assert_array_equal(one_env[:, D:], np.eye(N))
    assert algo.input_dims() == (D + N, N * D)
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, \*obs_shape\]"):
        algo.obs_in(stats, obs[0, 0])


def test_critic_agent_ids_by_hand_and_through_the_critic():
    """critic_agent_id: the centralised critic's input (world state or joint observations)
    followed by the agent's one-hot index, env-major, the actor's input unchanged (JaxMARL's
    MAPPO world state with obs_with_agent_id); the values are the critic on it."""
    cfg = TINY.replace(critic_agent_id=True)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    assert algo.input_dims() == (D, N * D + N)
    hp = HyperParams.from_config(algo.config)
    state = ppo.init(algo, jax.random.PRNGKey(0), hp)
    _, traj = jax.jit(lambda s: ppo.rollout(algo, s, hp))(state)
    T, A = traj.reward.shape
    ids = np.tile(np.eye(N, dtype=np.float32), (A // N, 1))[None].repeat(T, 0)
    want = np.concatenate([np.asarray(traj.world_state), ids], axis=-1)
    np.testing.assert_array_equal(
        np.asarray(algo.critic_in(state.obs_stats, traj.obs, traj.world_state)), want)
    values, next_values = ppo.rollout_values(algo, state.params, state.obs_stats, traj)
    np.testing.assert_allclose(np.asarray(values), _numpy_value(state.params, want),
                               rtol=1e-4, atol=1e-5)
    final = np.concatenate([np.asarray(traj.final_world_state), ids], axis=-1)
    np.testing.assert_allclose(np.asarray(next_values), _numpy_value(state.params, final),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(algo.obs_in(state.obs_stats, traj.obs)),
                                  np.asarray(traj.obs))  # the actor sees no id
    ws = np.linspace(-1.0, 1.0, N * D, dtype=np.float32)[None].repeat(N, 0)  # one env, public
    got = algo.value(state.params, state.obs_stats, np.zeros((N, D), np.float32), world_state=ws)
    np.testing.assert_allclose(np.asarray(got), _numpy_value(
        state.params, np.concatenate([ws, np.eye(N, dtype=np.float32)], -1)), rtol=1e-5)

    joint = Algorithm.create(jaxppo.resolve(cfg.replace(critic_input="joint_obs")))
    assert joint.input_dims() == (D, N * D + N)
    x = np.asarray(joint.critic_in(state.obs_stats, traj.obs))
    np.testing.assert_array_equal(x[..., N * D:], ids)
    np.testing.assert_array_equal(x[..., :N * D], np.asarray(traj.world_state))  # MPE's


def test_errors_name_the_field_and_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match="only apply to multi-agent envs.*critic_input: local"):
        jaxppo.resolve(jaxppo.PPOConfig(critic_input="joint_obs", agent_id=True))
    with pytest.raises(ConfigError, match="critic_input.*'local'"):
        jaxppo.PPOConfig(critic_input="global").validate()
    with pytest.raises(ConfigError, match="critic_agent_id=True only applies to multi-agent"):
        jaxppo.resolve(jaxppo.PPOConfig(critic_agent_id=True))
    with pytest.raises(ConfigError, match="critic_input='local' gives the critic the policy's "
                                          "input: use agent_id: true"):
        jaxppo.resolve(TINY.replace(critic_input="local", critic_agent_id=True))
    with pytest.raises(ConfigError, match="shared_trunk: false"):
        jaxppo.resolve(TINY.replace(network=jaxppo.NetworkConfig((16,), shared_trunk=True)))
    with pytest.raises(ConfigError, match="normalize_observations: false"):
        jaxppo.resolve(TINY.replace(normalize_observations=True))
    monkeypatch.setattr(jaxmarl_suite, "_world_state_fn", lambda env: None)
    with pytest.raises(ConfigError, match="gives no world state.*critic_input: joint_obs"):
        jaxppo.resolve(TINY)


def test_a_resumed_mappo_run_continues_exactly_and_its_actor_loads_and_exports(tmp_path):
    from jaxppo.run.export import export_policy

    # One compile for the three runs: a compilation cache of the test's own.
    cfg = TINY.replace(agent_id=True, checkpoint_every=1, log_every=1, total_timesteps=2 * 64,
                       compilation_cache_dir=str(tmp_path / "xla"))
    full = check_resume_continues_exactly(cfg, tmp_path)
    policy = jaxppo.load_policy(tmp_path / "full")
    obs = np.asarray(full.state.last_obs)[:N]  # env 0's agents
    want = policy.algorithm.act(full.state.params, full.state.obs_stats, obs, None, deterministic=True)
    np.testing.assert_array_equal(np.asarray(policy(obs)), np.asarray(want))
    exported = export_policy(policy, "jax", path=tmp_path / "actor")
    assert exported.metadata["obs"]["shape"] == ["b", N, D]
    fn = jax.export.deserialize(bytearray(exported.path.read_bytes()))
    np.testing.assert_array_equal(np.asarray(fn.call(obs[None]))[0], np.asarray(want))
