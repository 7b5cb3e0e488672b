"""Env transforms and normalisation for envs that step in Python: frame stacking and
discretised actions applied to the host vector env, observation and return statistics of the
host loop, each against a plain-numpy reference; the statistics through a checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.host_transforms import stack_layout
from jaxppo.envs.transforms import DiscreteActionEnv, FrameStackEnv
from jaxppo.run.hostloop import HostLoopRunner
from jaxppo.run.train import Start, _local_runner
from test_gymnasium import GOAL, LIMIT, WALK  # tests/envs is on sys.path under pytest

# Walk: observation [x, t], x += action; terminated at x = GOAL, truncated after LIMIT steps.
COUNT = WALK.replace(num_envs=3, num_steps=20, total_timesteps=3 * 20 * 4,
                     network=jaxppo.NetworkConfig(hidden_sizes=(8,)))


def _runner(cfg, restored=None) -> HostLoopRunner:
    run = jaxppo.resolve(cfg)
    return _local_runner(Start(run, HyperParams.from_config(run.config), restored))


def numpy_frame_stacks(actions: np.ndarray, k: int):
    """Walk's stacked observations and final observations [T, E, 2, k] for recorded actions
    [T, E], by hand: every slot starts as the episode's first observation; the final stack
    ends in the pre-reset observation."""
    T, E = actions.shape
    obs, final = np.zeros((T, E, 2, k), np.float32), np.zeros((T, E, 2, k), np.float32)
    for e in range(E):
        x = t = 0
        frames = [np.array([0, 0], np.float32)] * k
        for s in range(T):
            obs[s, e] = np.stack(frames, axis=-1)
            x, t = x + int(actions[s, e]), t + 1
            frames = frames[1:] + [np.array([x, t], np.float32)]
            final[s, e] = np.stack(frames, axis=-1)
            if x >= GOAL or t >= LIMIT:
                x = t = 0
                frames = [np.array([0, 0], np.float32)] * k
    return obs, final


@pytest.mark.parametrize("seeds", [1, 2])
def test_frame_stack_on_the_host_vector_env(seeds):
    cfg = COUNT.replace(transforms=[{"frame_stack": {"k": 3}}], num_seeds=seeds)
    runner = _runner(cfg)
    try:
        assert runner.algorithm.spec.obs_shape == (2, 3)
        # Two rollouts: the stacks carry over from one to the next.
        trajs = [runner.iterate()[1] for _ in range(2)]
    finally:
        runner.close()
    traj = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1 if seeds > 1 else 0), *trajs)
    assert traj.terminated.any() and traj.truncated.any()
    for s in range(seeds):
        part = jax.tree.map(lambda x: x[s], traj) if seeds > 1 else traj
        obs, final = numpy_frame_stacks(np.asarray(part.action), 3)
        np.testing.assert_array_equal(part.obs, obs)
        np.testing.assert_array_equal(part.final_obs, final)


def test_stack_layout_is_the_compiled_wrappers():
    """The numpy layout of the stacks is FrameStackEnv's, for vectors and images."""
    rng = np.random.default_rng(0)
    for shape in ((4,), (3, 5), (6, 5, 2)):
        frames = rng.integers(0, 255, (3, 4) + shape).astype(np.uint8)  # [n, k, *shape]
        compiled = jax.vmap(FrameStackEnv(None, 4)._layout)(jnp.asarray(frames))
        np.testing.assert_array_equal(stack_layout(frames), np.asarray(compiled))


def test_discretized_actions_on_a_host_env(tmp_path):
    """Pendulum's torque in [-2, 2] through 5 bins: index j is -2 + j, as the compiled
    wrapper maps it; a short run trains on it, and its exported policy lists the table."""
    cfg = jaxppo.PPOConfig(env="gymnasium:Pendulum-v1", num_envs=2, num_steps=8, num_epochs=1,
                           num_minibatches=1, total_timesteps=2 * 8 * 2,
                           compilation_cache_dir=None, transforms=[{"discretize_actions": {"bins": 5}}])
    run = jaxppo.resolve(cfg)
    env = run.spec.env
    assert run.spec.discrete and run.spec.action_dim == 5
    index = np.arange(5)
    np.testing.assert_array_equal(env.env_actions(index), (-2.0 + index)[:, None])
    compiled = DiscreteActionEnv(env._env, 5)
    np.testing.assert_array_equal(env.env_actions(index), np.stack(
        [np.asarray(compiled.continuous_action(jnp.asarray(i))) for i in index]))
    result = jaxppo.train(cfg, progress=False, run_dir=tmp_path / "run")
    assert result.metrics["env_steps"].tolist() == [[16, 32]]
    exported = jaxppo.export_policy(tmp_path / "run", format="jax", path=tmp_path / "policy")
    assert exported.metadata["env_action_table"] == [[-2.0], [-1.0], [0.0], [1.0], [2.0]]


def numpy_running_stats(samples: np.ndarray, prior: float = 1e-4):
    """(mean, var) of samples [N, ...] together with RunningStats' prior (mean 0, variance 1,
    weight `prior`), by the plain weighted formula."""
    x = np.asarray(samples, np.float64)
    total = prior + len(x)
    mean = x.sum(0) / total
    var = (prior * (1.0 + mean ** 2) + ((x - mean) ** 2).sum(0)) / total
    return mean, var


def test_normalisation_statistics_of_the_host_loop():
    """normalize_observations and normalize_rewards on the host path: the observation
    statistics cover the first reset and every rollout's observations, the return statistics
    every rollout's discounted returns, as a numpy reference computes them."""
    cfg = COUNT.replace(normalize_observations=True, normalize_rewards=True, num_seeds=1)
    runner = _runner(cfg)
    try:
        seen, returns, trajs = [runner.rollout.obs.copy()], [], []
        for _ in range(3):
            _, traj = runner.iterate()
            seen.append(np.asarray(traj.obs).reshape(-1, 2))
            returns.append(np.asarray(traj.discounted_return).reshape(-1))
            trajs.append(traj)
        st = jax.device_get(runner.state)
    finally:
        runner.close()
    mean, var = numpy_running_stats(np.concatenate(seen))
    np.testing.assert_allclose(st.obs_stats.mean, mean, rtol=1e-5)
    np.testing.assert_allclose(st.obs_stats.var, var, rtol=1e-4)
    r_mean, r_var = numpy_running_stats(np.concatenate(returns))
    np.testing.assert_allclose(st.return_stats.mean, r_mean, rtol=1e-5)
    np.testing.assert_allclose(st.return_stats.var, r_var, rtol=1e-4)
    # The discounted-return tracker, by hand: G_t = gamma * G_{t-1} + r_t, zeroed at ends.
    traj = jax.tree.map(lambda *xs: np.concatenate(xs), *trajs)
    d = np.zeros(3)
    for t in range(3 * cfg.num_steps):
        d = d * cfg.gamma + traj.reward[t]
        np.testing.assert_allclose(traj.discounted_return[t], d, rtol=1e-5)
        d[traj.terminated[t] | traj.truncated[t]] = 0.0


def test_statistics_and_stacks_through_a_checkpoint(tmp_path):
    """A resumed run restores the statistics (observation, return) exactly, and restarts its
    envs with fresh stacks."""
    cfg = COUNT.replace(normalize_observations=True, normalize_rewards=True,
                        transforms=[{"frame_stack": {"k": 2}}], num_seeds=2)
    first = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, stop_after_iterations=2)
    saved = jax.device_get(first.state)
    runner = _runner(cfg, restored=saved)
    try:
        for a, b in zip(jax.tree.leaves((runner.state.obs_stats, runner.state.return_stats)),
                        jax.tree.leaves((saved.obs_stats, saved.return_stats))):
            np.testing.assert_array_equal(np.asarray(a), b)
        obs = runner.rollout.obs  # [seeds, E, 2, k]: fresh episodes, every slot the first obs
        np.testing.assert_array_equal(obs[..., 0], obs[..., 1])
    finally:
        runner.close()
    done = jaxppo.train(None, resume=tmp_path / "run", progress=False)
    assert done.completed and done.metrics["env_steps"].shape == (2, 4)
