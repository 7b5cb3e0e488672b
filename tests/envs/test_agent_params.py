"""A network per agent (`agent_params: per_agent`) on a JaxMARL env: each actor's
distribution and value against a plain-numpy MLP with its own agent's params, the loss and
each agent's gradient against the shared network's on that agent's samples alone, agents that
start equal and part on different data, the errors, and a resumed, loaded and exported
per-agent MAPPO run. Tiny configs, one compile of each program."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from resumed_runs import check_resume_continues_exactly  # tests/ is on sys.path

import jaxppo
from jaxppo.core import networks, ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.errors import ConfigError

pytest.importorskip("jaxmarl")

N, D, A = 3, 18, 5  # MPE_simple_spread_v3: agents, observation size, actions
TINY = jaxppo.PPOConfig(env="jaxmarl:MPE_simple_spread_v3", num_envs=2, num_steps=16,
                        num_minibatches=2, num_epochs=1, total_timesteps=3 * 32,
                        network=jaxppo.NetworkConfig((16,)), compilation_cache_dir=None,
                        agent_params="per_agent")


@pytest.fixture(scope="module")
def per_agent():
    """(algo, hp, state, traj, batch) of one rollout with a network per agent."""
    return _one_rollout(TINY)


def _one_rollout(config):
    """(algo, hp, state, traj, batch) of one rollout, with random advantages."""
    algo = Algorithm.create(jaxppo.resolve(config))
    hp = HyperParams.from_config(algo.config)
    state = ppo.init(algo, jax.random.PRNGKey(0), hp)

    @jax.jit
    def run(s):
        s, traj = ppo.rollout(algo, s, hp)
        values, _ = ppo.rollout_values(algo, s.params, s.obs_stats, traj)
        adv = jax.random.normal(jax.random.PRNGKey(1), values.shape)
        return traj, ppo.make_batch(algo, s.obs_stats, traj, values, adv, values + adv)

    traj, batch = run(state)
    return algo, hp, state, traj, batch


def _numpy_mlp(p, x, torso, head):
    """A tanh MLP torso, then a head, in float64 (the built-in network by hand)."""
    h = np.asarray(x, np.float64)
    for i in range(len(p[torso])):
        h = np.tanh(h @ p[torso][f"Dense_{i}"]["kernel"] + p[torso][f"Dense_{i}"]["bias"])
    return h @ p[head]["kernel"] + p[head]["bias"]


def test_each_actor_acts_with_its_own_agents_params_against_numpy(per_agent):
    algo, _, state, traj, _ = per_agent
    assert jax.tree.leaves(state.params)[0].shape[0] == N
    obs = np.asarray(traj.obs)  # [T, E*N, D], actor k is agent k % N
    dist, values, _ = algo.network.apply(state.params, algo.obs_in(state.obs_stats, obs))
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), state.params["params"])
    for i in range(N):
        p = jax.tree.map(lambda a: a[i], p64)
        np.testing.assert_allclose(np.asarray(dist.loc)[:, i::N],
                                   _numpy_mlp(p, obs[:, i::N], "actor_torso", "policy_head"),
                                   rtol=1e-4, atol=1e-5)
        value = _numpy_mlp(p, obs[:, i::N], "critic_torso", "value_head")[..., 0]
        np.testing.assert_allclose(np.asarray(values)[:, i::N], value, rtol=1e-4, atol=1e-5)
    # The agents' params differ (one key each), so their logits do.
    assert not np.allclose(np.asarray(dist.loc)[:, 0::N], np.asarray(dist.loc)[:, 1::N])
    # One env's agents [N, D], as a policy gets them, and agent_params' slice of the params.
    one_env = np.asarray(algo.network.apply(state.params, obs[0, :N])[0].loc)
    for i in range(N):
        own = algo.network.inner.apply(algo.agent_params(state.params, i), obs[0, i])[0].loc
        np.testing.assert_allclose(one_env[i], np.asarray(own), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"agent_params=per_agent.*\[\.\.\., 3, D\]"):
        algo.network.apply(state.params, obs[0, :2])


def test_the_joint_policy_and_each_agents_own_act_with_its_own_params(per_agent):
    from jaxppo.run.policy import Policy

    algo, _, state, traj, _ = per_agent
    policy = Policy(algo, state.params, state.obs_stats)
    obs = np.asarray(traj.obs)[3, :N]  # env 0's agents at step 3
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), state.params["params"])
    want = [int(np.argmax(_numpy_mlp(jax.tree.map(lambda a: a[i], p64), obs[i], "actor_torso",
                                     "policy_head"))) for i in range(N)]
    joint = policy.joint({a: obs[i] for i, a in enumerate(policy.agents)})
    assert [int(joint[a]) for a in policy.agents] == want
    assert [int(policy.agent(a)(obs[i])) for i, a in enumerate(policy.agents)] == want


def test_the_loss_is_the_mean_of_the_agents_losses_and_each_gradient_its_own(per_agent):
    """The per-agent loss on a minibatch is the mean over agents of the shared network's loss
    with params[i] on agent i's samples only, and the gradient of params[i] is that agent's
    gradient / N: no agent's samples reach another agent's params."""
    algo, hp, state, _, batch = per_agent
    mb = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)  # [T*E*N] samples
    shared = Algorithm.create(jaxppo.resolve(TINY.replace(agent_params="shared")))
    grads_of = {a: jax.jit(lambda p, b, a=a: ppo.loss_and_grads(a, p, b, hp, 0.01, 0.2))
                for a in (algo, shared)}
    grads, terms = grads_of[algo](state.params, mb)
    totals = []
    for i in range(N):
        g_i, t_i = grads_of[shared](algo.agent_params(state.params, i),
                                    jax.tree.map(lambda x: x[i::N], mb))
        totals.append(float(t_i.total))
        for got, want in zip(jax.tree.leaves(algo.agent_params(grads, i)), jax.tree.leaves(g_i)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want) / N, rtol=1e-4,
                                       atol=1e-7)
    np.testing.assert_allclose(float(terms.total), np.mean(totals), rtol=1e-5)
    # A change to agent 0's samples leaves the other agents' gradients as they were.
    changed = mb._replace(advantages=mb.advantages.at[0::N].multiply(-3.0),
                          value_targets=mb.value_targets.at[0::N].add(1.0))
    grads2, _ = grads_of[algo](state.params, changed)
    for got, was in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
        np.testing.assert_array_equal(np.asarray(got)[1:], np.asarray(was)[1:])
        assert not np.allclose(np.asarray(got)[0], np.asarray(was)[0])


def _step(algo, hp, params, opt_state, grads):
    return ppo.apply_grads(algo, params, opt_state, jax.flatten_util.ravel_pytree(grads)[0], hp,
                           1e-3)[:2]


def test_agents_that_start_equal_part_on_different_data(per_agent):
    """Every agent's params set to agent 0's: their gradients differ (each agent's own
    samples), and so do their params after one step of the one optimizer over them all."""
    algo, hp, state, _, batch = per_agent
    mb = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    equal = jax.tree.map(lambda p: jnp.broadcast_to(p[:1], p.shape), state.params)
    grads, _ = jax.jit(lambda p, b: ppo.loss_and_grads(algo, p, b, hp, 0.01, 0.2))(equal, mb)
    params, opt_state = jax.jit(lambda p, o, g: _step(algo, hp, p, o, g))(
        equal, state.opt_state, grads)
    # One optimizer over every agent's params: Adam's moments are one flat vector of them all.
    size = sum(p.size for p in jax.tree.leaves(state.params))
    assert {np.shape(x) for x in jax.tree.leaves(opt_state) if np.ndim(x)} == {(size,)}
    for p in jax.tree.leaves(params):
        p = np.asarray(p)
        assert not np.allclose(p[0], p[1]) and not np.allclose(p[1], p[2])


def test_a_gaussian_log_std_per_agent_comes_back_per_actor():
    """Continuous actions (a custom env's): each agent's own shared log_std vector, for each
    of its actors."""
    inner = networks.ActorCritic(action_dim=2, discrete=False, hidden_sizes=(8,))
    net = networks.PerAgentNetwork(inner, 3, False)
    params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4)))
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: (p + jnp.arange(3.0)[:, None]) if "log_std" in str(path) else p, params)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 6, 4))  # [T, E*N, obs]
    dist, values, _ = jax.jit(net.apply)(params, x)
    assert dist.loc.shape == dist.log_std.shape == (5, 6, 2) and values.shape == (5, 6)
    np.testing.assert_array_equal(np.asarray(dist.log_std[:, :, 0]),
                                  np.tile(np.arange(3.0), (5, 2)))
    for i in range(3):
        want = jax.jit(inner.apply)(net.agent_params(params, i), x[:, i::3])[0].loc
        np.testing.assert_allclose(np.asarray(dist.loc[:, i::3]), np.asarray(want), rtol=1e-6)


def test_errors_name_the_field_and_the_fix():
    with pytest.raises(ConfigError, match="agent_params='per_agent' only applies to multi-agent"
                                          r".*agent_params: shared"):
        jaxppo.resolve(jaxppo.PPOConfig(agent_params="per_agent"))
    with pytest.raises(ConfigError, match="agent_params='per-agent'.*did you mean 'per_agent'"):
        jaxppo.PPOConfig(agent_params="per-agent").validate()
    # With a GRU a minibatch holds whole envs (each env's agents together): M divides envs.
    with pytest.raises(ConfigError, match=r"num_envs=2: .* each env's agents together\); "
                                          r"choose num_minibatches from \[1, 2\]"):
        jaxppo.resolve(TINY.replace(network=jaxppo.NetworkConfig((16,), recurrent_size=8),
                                    num_minibatches=3))


def test_a_users_module_gets_one_copy_per_agent():
    from jaxppo.examples.networks import LayerNormActorCritic

    module = LayerNormActorCritic(hidden_sizes=(8,), value_hidden_sizes=(8,))
    algo = Algorithm.create(jaxppo.resolve(TINY.replace(network=module)))
    params = jax.jit(algo.init_params)(jax.random.PRNGKey(0))
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (2 * N, D)))
    dist, values, _ = jax.jit(algo.network.apply)(params, x)
    inner = jax.jit(algo.network.inner.apply)
    for i in range(N):
        d, v, _ = inner(algo.agent_params(params, i), x[i::N])
        np.testing.assert_allclose(np.asarray(dist.loc[i::N]), np.asarray(d.loc), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(values[i::N]), np.asarray(v), rtol=1e-5)


def test_a_resumed_per_agent_mappo_run_continues_exactly_and_loads_and_exports(tmp_path):
    from jaxppo.run.export import export_policy

    cfg = TINY.replace(critic_input="joint_obs", agent_id=True, checkpoint_every=1, log_every=1,
                       total_timesteps=2 * 32, compilation_cache_dir=str(tmp_path / "xla"))
    full = check_resume_continues_exactly(cfg, tmp_path)
    policy = jaxppo.load_policy(tmp_path / "full")
    obs = np.asarray(full.state.last_obs)[:N]  # env 0's agents
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), full.state.params["params"])
    x = np.concatenate([obs, np.eye(N)], axis=-1)  # agent_id: the one-hot after the obs
    want = [int(np.argmax(_numpy_mlp(jax.tree.map(lambda a: a[i], p64), x[i], "actor_torso",
                                     "policy_head"))) for i in range(N)]
    np.testing.assert_array_equal(np.asarray(policy(obs)), want)
    joint = policy.joint({a: obs[i] for i, a in enumerate(policy.agents)})
    assert [int(joint[a]) for a in policy.agents] == want
    exported = export_policy(policy, "jax", path=tmp_path / "actor")
    assert exported.metadata["obs"]["shape"] == ["b", N, D]
    fn = jax.export.deserialize(bytearray(exported.path.read_bytes()))
    np.testing.assert_array_equal(np.asarray(fn.call(obs[None]))[0], want)


# ---------------------------------------------------------------------- a network per group
TAG = TINY.replace(env="jaxmarl:MPE_simple_tag_v3", agent_params="per_group")
TAG_AGENTS = ("adversary_0", "adversary_1", "adversary_2", "agent_0")


def test_agents_named_alike_form_a_group():
    assert networks.agent_groups(TAG_AGENTS) == (0, 0, 0, 1)
    assert networks.agent_groups(["ally_0", "ally_1", "ally_2"]) == (0, 0, 0)
    assert networks.agent_groups(["alice_0", "bob_0", "eve_0"]) == (0, 1, 2)
    assert networks.agent_groups(["agent_1", "leadadversary_0", "adversary_0", "agent_0"]) == (
        0, 1, 2, 0)
    assert networks.agent_groups(["red", "blue", "red_2"]) == (0, 1, 0)


def test_each_group_acts_with_its_own_params_and_learns_from_all_its_agents():
    """simple_tag's three adversaries share one network and its good agent has another: each
    actor's logits against numpy with its group's params, and a group's gradient the sum of
    what a network per agent gives its agents when each starts from its group's params."""
    from jaxppo.run.policy import Policy

    algo, hp, state, traj, batch = _one_rollout(TAG)
    n, groups = len(TAG_AGENTS), (0, 0, 0, 1)
    assert algo.spec.agents == TAG_AGENTS and algo.network.groups == groups
    assert {p.shape[0] for p in jax.tree.leaves(state.params)} == {2}
    obs = np.asarray(traj.obs)  # [T, E*N, D], actor k is agent k % N
    dist, _, _ = algo.network.apply(state.params, algo.obs_in(state.obs_stats, obs))
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), state.params["params"])
    for i, g in enumerate(groups):
        p = jax.tree.map(lambda a: a[g], p64)
        np.testing.assert_allclose(np.asarray(dist.loc)[:, i::n],
                                   _numpy_mlp(p, obs[:, i::n], "actor_torso", "policy_head"),
                                   rtol=1e-4, atol=1e-5)
    # The gradient against a network per agent started from each agent's group's params.
    per_agent = Algorithm.create(jaxppo.resolve(TAG.replace(agent_params="per_agent")))
    tiled = jax.tree.map(lambda p: p[np.asarray(groups)], state.params)
    mb = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    grads, terms = jax.jit(lambda p: ppo.loss_and_grads(algo, p, mb, hp, 0.01, 0.2))(
        state.params)
    own, own_terms = jax.jit(lambda p: ppo.loss_and_grads(per_agent, p, mb, hp, 0.01, 0.2))(
        tiled)
    np.testing.assert_allclose(float(terms.total), float(own_terms.total), rtol=1e-6)
    for got, each in zip(jax.tree.leaves(grads), jax.tree.leaves(own)):
        each = np.asarray(each)
        np.testing.assert_allclose(np.asarray(got), np.stack([each[:3].sum(0), each[3]]),
                                   rtol=1e-4, atol=1e-7)
    # A policy: each agent's own is its group's network.
    policy = Policy(algo, state.params, state.obs_stats)
    x = np.asarray(traj.obs)[2, :n]
    for i, name in enumerate(TAG_AGENTS):
        want = np.argmax(_numpy_mlp(jax.tree.map(lambda a: a[groups[i]], p64), x[i],
                                    "actor_torso", "policy_head"))
        own = x[i][:policy.env.agent_obs_size(name)]  # agent_0's 14 numbers, padded to 16
        assert int(policy.agent(name)(own)) == int(want)


def test_groups_named_in_the_config():
    """agent_params {group: [agent, ...]} (RLlib's policy_mapping_fn by name): the groups in
    the mapping's order, each actor acting with its group's params; every agent in one group,
    names checked against the env's with the close ones."""
    named = {"lone": ["adversary_2"], "pack": ["adversary_0", "adversary_1"],
             "prey": ["agent_0"]}
    assert networks.agent_groups(TAG_AGENTS, named) == (1, 1, 0, 2)
    cfg = TAG.replace(agent_params=named)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    assert algo.network.groups == (1, 1, 0, 2)
    params = jax.jit(algo.init_params)(jax.random.PRNGKey(0))
    assert {p.shape[0] for p in jax.tree.leaves(params)} == {3}
    n = len(TAG_AGENTS)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (2 * n, 16)))  # 2 envs, padded
    dist, _, _ = jax.jit(algo.network.apply)(params, x)
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    for i, g in enumerate((1, 1, 0, 2)):
        np.testing.assert_allclose(
            np.asarray(dist.loc)[i::n], _numpy_mlp(jax.tree.map(lambda a: a[g], p64), x[i::n],
                                                   "actor_torso", "policy_head"),
            rtol=1e-4, atol=1e-5)
    # The config file's form and back.
    assert jaxppo.PPOConfig.from_dict(cfg.to_dict()).agent_params == named
    errors = [({"pack": ["adversary_0", "adversary_1", "adversary_3"], "prey": ["agent_0"]},
               r"group 'pack' names 'adversary_3', which is not one of .*did you mean "
               r"'adversary_2'"),
              ({"pack": ["adversary_0", "adversary_1", "adversary_2"],
                "prey": ["agent_0", "adversary_0"]}, r"'adversary_0' is in two groups, 'pack' "
                                                     r"and 'prey'"),
              ({"pack": ["adversary_0", "adversary_1", "adversary_2"]},
               r"'agent_0' in no group; .* \{agent_0: \[agent_0\]\}")]
    for groups, message in errors:
        with pytest.raises(ConfigError, match=message):
            jaxppo.resolve(TAG.replace(agent_params=groups))
    for bad in ({}, {"pack": []}, {"pack": "adversary_0"}, {"pack": [0]}):
        with pytest.raises(ConfigError, match="a mapping of group names to non-empty lists"):
            TAG.replace(agent_params=bad).validate()
