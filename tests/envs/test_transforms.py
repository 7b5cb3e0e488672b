"""User transforms: frame stacking, the count-based bonus, composition, and runs with them."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from gymnax.environments import environment, spaces

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.envs.transforms import (CountBonus, DiscreteActionEnv, DiscretizeActions, FrameStack,
                                   FrameStackEnv, resolve_transforms, reward_hooks)
from jaxppo.config import transforms_to_list
from jaxppo.envs.spec import apply_reward_hooks, init_reward_hooks


# ---------------------------------------------------------------------- a clock env
@struct.dataclass
class _State(environment.EnvState):
    time: int


@struct.dataclass
class _Params(environment.EnvParams):
    max_steps_in_episode: int = 100


class Clock(environment.Environment):
    """Observes [time, 10 + time]; terminates after 3 steps (gymnax auto-resets it)."""

    @property
    def default_params(self):
        return _Params()

    def step_env(self, key, state, action, params):
        state = _State(time=state.time + 1)
        return self.get_obs(state), state, jnp.float32(1.0), state.time == 3, {}

    def reset_env(self, key, params):
        state = _State(time=jnp.int32(0))
        return self.get_obs(state), state

    def get_obs(self, state, params=None, key=None):
        t = jnp.float32(state.time)
        return jnp.stack([t, 10.0 + t])

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(0.0, 20.0, (2,), jnp.float32)


def test_frame_stack_shapes_reset_and_final_observation():
    env = FrameStackEnv(Clock(), 3)
    params = env.default_params
    assert env.observation_space(params).shape == (2, 3)
    obs, state = env.reset(jax.random.PRNGKey(0), params)
    assert obs.shape == (2, 3)
    np.testing.assert_array_equal(obs[0], [0, 0, 0])  # every slot holds the first obs
    step = jax.jit(env.step)
    times = []
    for i in range(4):
        obs, state, _, term, trunc, info = step(jax.random.PRNGKey(i), state, 0, params)
        times.append((np.asarray(obs[0]).tolist(), np.asarray(info["final_observation"][0]).tolist(),
                      bool(term)))
    assert times[0] == ([0, 0, 1], [0, 0, 1], False)  # oldest first, newest last
    assert times[1] == ([0, 1, 2], [0, 1, 2], False)
    # The episode ends at t=3: the final observation holds the pre-reset frames, and the
    # next episode starts from a stack of its first observation only.
    assert times[2] == ([0, 0, 0], [1, 2, 3], True)
    assert times[3] == ([0, 0, 1], [0, 0, 1], False)
    np.testing.assert_array_equal(np.asarray(obs[1]), [10, 10, 11])
    # step_env (no auto-reset) stacks too, and keeps the frames when the episode ends.
    obs, state = env.reset(jax.random.PRNGKey(0), params)
    for i in range(3):
        obs, state, _, done, _ = env.step_env(jax.random.PRNGKey(i), state, 0, params)
    np.testing.assert_array_equal(np.asarray(obs[0]), [1, 2, 3])
    assert bool(done)


def test_frame_stack_of_images_concatenates_channels():
    env = FrameStackEnv(Clock(), 4)
    frames = jnp.arange(4 * 2 * 3 * 5).reshape(4, 2, 3, 5)
    out = env._layout(frames)
    assert out.shape == (2, 3, 20)
    np.testing.assert_array_equal(np.asarray(out[..., 5:10]), np.asarray(frames[1]))
    spec = make_env(jaxppo.PPOConfig(env="Breakout-MinAtar", transforms=[{"frame_stack": {"k": 2}}]))
    assert spec.obs_shape == (10, 10, 8)


class _Traj(NamedTuple):
    final_obs: jax.Array
    reward: jax.Array


def test_count_bonus_counts_a_hand_made_sequence():
    a, b, c = [0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.2, 0.9, 0.0]  # c rounds to the cell of a
    d = [0.0, 0.0, 3.0]
    # T=3 steps x E=2 envs of successor observations.
    seq = jnp.asarray([[a, b], [a, d], [c, a]])
    rewards = jnp.asarray([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    hook = CountBonus(scale=0.5, power=0.5)
    counts = hook.init(None)
    assert counts.shape == (2 ** 16,) and int(counts.sum()) == 0
    counts, new_rewards = hook(counts, _Traj(seq, rewards))
    buckets = np.asarray(hook.bucket(jnp.asarray([a, b, d]), 1))
    assert len(set(buckets.tolist())) == 3
    np.testing.assert_array_equal(np.asarray(counts)[buckets], [4, 1, 1])
    assert int(counts.sum()) == 6
    n = np.asarray([[4, 1], [4, 1], [4, 4]], np.float32)
    np.testing.assert_allclose(np.asarray(new_rewards), np.asarray(rewards) + 0.5 / np.sqrt(n),
                               rtol=1e-6)
    # Counts accumulate over batches; power=1 gives scale/N.
    hook1 = CountBonus(scale=0.5, power=1.0)
    counts2, r2 = hook1(counts, _Traj(seq[:1], jnp.zeros((1, 2))))
    np.testing.assert_array_equal(np.asarray(counts2)[buckets[:2]], [5, 2])
    np.testing.assert_allclose(np.asarray(r2), [[0.5 / 5, 0.5 / 2]], rtol=1e-6)


def test_count_bonus_counts_are_global_over_devices():
    hook = CountBonus(scale=1.0)
    obs = jax.random.randint(jax.random.PRNGKey(0), (2, 5, 3, 4), 0, 3).astype(jnp.float32)
    traj = _Traj(obs, jnp.zeros((2, 5, 3)))  # [devices=2, T=5, E=3, obs 4]
    counts, rewards = jax.vmap(lambda t: hook(hook.init(None), t, "device"), axis_name="device")(traj)
    whole = _Traj(jnp.concatenate([obs[0], obs[1]], axis=1), jnp.zeros((5, 6)))
    counts1, rewards1 = hook(hook.init(None), whole)
    np.testing.assert_array_equal(np.asarray(counts[0]), np.asarray(counts1))
    np.testing.assert_array_equal(np.asarray(counts[1]), np.asarray(counts1))
    np.testing.assert_allclose(np.concatenate([rewards[0], rewards[1]], axis=1), rewards1)


def test_transforms_compose_in_order():
    def double(state, traj):  # a plain function hook that counts its calls
        return state + 1, 2.0 * traj.reward

    cfg = jaxppo.PPOConfig(env="CartPole-v1", transforms=(
        {"frame_stack": {"k": 2}}, ("count_bonus", {"scale": 0.25}), double))
    spec = jaxppo.resolve(cfg).spec
    assert spec.obs_shape == (4, 2)
    assert len(init_reward_hooks(reward_hooks(cfg), spec)) == 2  # one state per reward hook
    cfg2 = cfg.replace(transforms=(cfg.transforms[1], jaxppo.envs.transforms.FunctionHook(double, 0)))
    state = init_reward_hooks(reward_hooks(cfg2), spec)
    traj = _Traj(jnp.zeros((2, 1, 4, 2)), jnp.ones((2, 1)))
    rewards, state = apply_reward_hooks(reward_hooks(cfg2), state, traj, traj.reward)
    # bonus first (N = 2 for the one repeated obs), then doubled.
    np.testing.assert_allclose(np.asarray(rewards), 2.0 * (1.0 + 0.25 / np.sqrt(2.0)), rtol=1e-6)
    assert int(state[1]) == 1
    # Reversed order: doubled first, then the bonus.
    cfg3 = cfg2.replace(transforms=cfg2.transforms[::-1])
    hooks3 = reward_hooks(cfg3)
    rewards, _ = apply_reward_hooks(hooks3, init_reward_hooks(hooks3, spec), traj, traj.reward)
    np.testing.assert_allclose(np.asarray(rewards), 2.0 + 0.25 / np.sqrt(2.0), rtol=1e-6)


def test_config_entries_and_errors():
    ts = resolve_transforms(["frame_stack", {"count_bonus": {"scale": 0.1, "power": 1}},
                             ["frame_stack", {"k": 2}]])
    assert [type(t) for t in ts] == [FrameStack, CountBonus, FrameStack] and ts[2].k == 2
    with pytest.raises(jaxppo.ConfigError, match="did you mean 'frame_stack'"):
        jaxppo.resolve(jaxppo.PPOConfig(transforms=["frame_stak"]))
    with pytest.raises(jaxppo.ConfigError, match="does not take"):
        jaxppo.resolve(jaxppo.PPOConfig(transforms=[{"count_bonus": {"sclae": 1}}]))
    with pytest.raises(jaxppo.ConfigError, match="power of two"):
        jaxppo.resolve(jaxppo.PPOConfig(transforms=[{"count_bonus": {"buckets": 1000}}]))
    with pytest.raises(jaxppo.ConfigError, match="k=0"):
        jaxppo.resolve(jaxppo.PPOConfig(transforms=[{"frame_stack": {"k": 0}}]))
    cfg = jaxppo.PPOConfig().with_overrides(['transforms=[{frame_stack: {k: 3}}, count_bonus]'])
    d = cfg.to_dict()
    assert d["transforms"] == [{"frame_stack": {"k": 3}}, "count_bonus"]
    assert jaxppo.PPOConfig.from_dict(d).to_dict()["transforms"] == d["transforms"]
    assert transforms_to_list([CountBonus(scale=0.2)]) == [
        {"count_bonus": {"scale": 0.2, "power": 0.5, "buckets": 65536, "resolution": 1.0}}]
    assert jaxppo.PPOConfig().to_dict()["transforms"] == []


def test_training_with_the_bonus_and_frame_stack_runs():
    cfg = jaxppo.PPOConfig(
        env="DeepSea-bsuite", env_kwargs={"size": 6}, num_envs=4, num_steps=12, num_minibatches=2,
        num_epochs=2, total_timesteps=4 * 12 * 3, network=jaxppo.NetworkConfig((16,)),
        transforms=[{"frame_stack": {"k": 2}}, {"count_bonus": {"scale": 0.1}}],
        compilation_cache_dir=None)
    result = jaxppo.train(cfg, progress=False)
    assert result._algorithm.spec.obs_shape == (6, 6, 2)
    counts = np.asarray(result.state.hook_state[0])
    assert int(counts.sum()) == cfg.num_iterations * cfg.batch_size  # every transition counted
    assert np.all(np.isfinite(result.metrics["policy_loss"]))


# ---------------------------------------------------------------------- discretised actions
class _Box2(Clock):
    """The clock with a 2-D Box action space of unequal bounds."""

    def action_space(self, params=None):
        return spaces.Box(jnp.array([-1.0, 0.0]), jnp.array([1.0, 4.0]), (2,), jnp.float32)


def test_discretize_actions_maps_indices_to_an_even_grid_first_dimension_major():
    env = DiscreteActionEnv(_Box2(), bins=3)
    assert env.action_space(None).n == 9
    got = np.stack([np.asarray(env.continuous_action(jnp.int32(i))) for i in range(9)])
    want = np.array([[a, b] for a in (-1.0, 0.0, 1.0) for b in (0.0, 2.0, 4.0)], np.float32)
    np.testing.assert_array_equal(got, want)
    # Pendulum: a scalar-shaped torque action space [1]; bins=5 -> -2, -1, 0, 1, 2.
    spec = make_env(jaxppo.PPOConfig(env="Pendulum-v1",
                                     transforms=[{"discretize_actions": {"bins": 5}}]))
    assert spec.discrete and spec.action_dim == 5
    torques = [float(spec.env.continuous_action(jnp.int32(i), spec.env_params)[0]) for i in range(5)]
    assert torques == [-2.0, -1.0, 0.0, 1.0, 2.0]


def test_discretize_actions_steps_the_env_with_the_mapped_action():
    spec = make_env(jaxppo.PPOConfig(env="Pendulum-v1",
                                     transforms=[{"discretize_actions": {"bins": 5}}]))
    raw = make_env(jaxppo.PPOConfig(env="Pendulum-v1"))
    key = jax.random.PRNGKey(0)
    _, state = raw.env.reset(key, raw.env_params)
    for i, torque in [(0, -2.0), (3, 1.0)]:
        ours = spec.env.step(key, state, jnp.int32(i), spec.env_params)
        ref = raw.env.step(key, state, jnp.array([torque]), raw.env_params)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        ours = spec.env.step_env(key, state, jnp.int32(i), spec.env_params)
        ref = raw.env.step_env(key, state, jnp.array([torque]), raw.env_params)
        np.testing.assert_array_equal(np.asarray(ours[2]), np.asarray(ref[2]))


def test_discretize_actions_errors_name_the_fix():
    with pytest.raises(jaxppo.ConfigError, match="bins=1 must be an integer >= 2"):
        jaxppo.resolve(jaxppo.PPOConfig(transforms=[{"discretize_actions": {"bins": 1}}]))
    with pytest.raises(jaxppo.ConfigError, match="needs a continuous .Box. action space"):
        make_env(jaxppo.PPOConfig(env="CartPole-v1", transforms=["discretize_actions"]))
    with pytest.raises(jaxppo.ConfigError, match="65\\*\\*2 = 4225 joint actions .at most 4096.; use fewer bins"):
        DiscreteActionEnv(_Box2(), bins=65).action_space(None)
    assert transforms_to_list([DiscretizeActions(bins=7)]) == [{"discretize_actions": {"bins": 7}}]


def test_training_with_discretized_actions_saves_a_policy_of_discrete_actions(tmp_path):
    cfg = jaxppo.PPOConfig(env="Pendulum-v1", num_envs=4, num_steps=16, num_minibatches=2,
                           num_epochs=1, total_timesteps=128, network=jaxppo.NetworkConfig((16,)),
                           transforms=[{"discretize_actions": {"bins": 5}}], compilation_cache_dir=None)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False)
    assert result.state.params["params"]["policy_head"]["kernel"].shape == (16, 5)
    policy = jaxppo.load_policy(tmp_path / "run")
    obs, _ = policy.spec.env.reset(jax.random.PRNGKey(0), policy.spec.env_params)
    action = policy(obs[None])
    assert action.dtype == jnp.int32 and 0 <= int(action[0]) < 5
    stats = policy.evaluate(episodes=2)
    assert -2000 < stats["return_mean"] < 0


def scale(state, traj):  # a reward hook written as a plain function
    return state, 0.5 * traj.reward


def test_a_function_hook_leaves_a_folder_whose_policy_loads_and_that_resumes_from_python(tmp_path):
    """config.yaml records a function hook by name only: training says so; load_policy and
    evaluation leave it out (acting needs none); a resume from the file alone is refused with
    the fix, and one that gives the function again continues the run."""
    cfg = jaxppo.PPOConfig(env="CartPole-v1", num_envs=4, num_steps=8, num_minibatches=2,
                           num_epochs=1, total_timesteps=4 * 8 * 2, transforms=[scale],
                           network=jaxppo.NetworkConfig((8,)), compilation_cache_dir=None)
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match=r"the reward hook\(s\) 'scale' are Python functions, "
                                         r"which .*config.yaml records by name only"):
        jaxppo.train(cfg, run_dir=run, progress=False, plot=False, stop_after_iterations=1)
    recorded = jaxppo.PPOConfig.from_file(run / "config.yaml")
    assert transforms_to_list(recorded.transforms) == [{"reward_hook_function": "scale"}]
    policy = jaxppo.load_policy(run)
    assert len(policy.evaluate(episodes=2, max_steps=20)["returns"]) == 2
    with pytest.raises(jaxppo.ConfigError, match=r"the reward hook 'scale' was a Python function.*"
                                                  r"Acting with the policy needs no reward hook"):
        jaxppo.train(None, resume=run, progress=False, plot=False)
    result = jaxppo.train(cfg, resume=run, progress=False, plot=False)
    assert result.completed and result.iterations_done == 2
