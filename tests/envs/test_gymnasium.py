"""Gymnasium envs in host-loop mode (env="gymnasium:<id>"): the transition contract
(terminated vs truncated, the true final observation, bootstrapping a truncation from it)
checked against a numpy replay of a tiny registered env, the errors, the run folder with
resume and the CLI, and learning on gymnasium's CartPole-v1."""

from __future__ import annotations

import json

import gymnasium
import jax
import numpy as np
import pytest

import jaxppo
from jaxppo import cli
from jaxppo.core import ppo
from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.transforms import EnvWrapper
from jaxppo.errors import ConfigError
from jaxppo.core.gae import compute_gae
from jaxppo.run.hostloop import HostLoopRunner
from jaxppo.run.logs import read_metrics

LIMIT = 5  # the registered time limit of Walk
GOAL = 3  # Walk terminates when x reaches it


class Walk(gymnasium.Env):
    """x starts at 0; action 1 steps right, action 0 stays. Observation [x, t]; reward
    1 + 0.1 * x after the step; terminated when x reaches GOAL. The registered TimeLimit
    truncates at LIMIT steps."""

    observation_space = gymnasium.spaces.Box(0.0, 10.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x, self.t = 0, 0
        return self._obs(), {}

    def step(self, action):
        self.x += int(action)
        self.t += 1
        return self._obs(), 1.0 + 0.1 * self.x, self.x >= GOAL, False, {}

    def _obs(self):
        return np.array([self.x, self.t], np.float32)


if "JaxppoWalk-v0" not in gymnasium.envs.registry:
    gymnasium.register(id="JaxppoWalk-v0", entry_point=Walk, max_episode_steps=LIMIT)

WALK = jaxppo.PPOConfig(env="gymnasium:JaxppoWalk-v0", num_envs=3, num_steps=24, num_epochs=1,
                        num_minibatches=2, total_timesteps=3 * 24 * 4, compilation_cache_dir=None,
                        gamma=0.9, gae_lambda=0.8, entropy_coeff=0.0,
                        network=jaxppo.NetworkConfig(hidden_sizes=(16,)))


def replay(actions: np.ndarray):
    """Walk's transitions for recorded actions [T, E], in plain numpy: obs, final obs,
    rewards, terminated and truncated, every env starting from a reset."""
    T, E = actions.shape
    obs, final = np.zeros((T, E, 2), np.float32), np.zeros((T, E, 2), np.float32)
    rew, term, trunc = np.zeros((T, E)), np.zeros((T, E), bool), np.zeros((T, E), bool)
    for e in range(E):
        x = t = 0
        for s in range(T):
            obs[s, e] = (x, t)
            x, t = x + int(actions[s, e]), t + 1
            final[s, e] = (x, t)
            rew[s, e] = 1.0 + 0.1 * x
            term[s, e] = x >= GOAL
            trunc[s, e] = t >= LIMIT and not term[s, e]
            if term[s, e] or trunc[s, e]:
                x = t = 0
    return obs, final, rew, term, trunc


def numpy_value_targets(v_obs, v_final, rew, term, trunc, gamma, lam):
    """GAE by hand: bootstrap with V(true final obs) unless terminated; cut at every end."""
    T, E = rew.shape
    targets = np.zeros((T, E))
    for e in range(E):
        adv = 0.0
        for s in reversed(range(T)):
            done = term[s, e] or trunc[s, e]
            boot = 0.0 if term[s, e] else v_final[s, e]
            delta = rew[s, e] + gamma * boot - v_obs[s, e]
            adv = delta + (0.0 if done else gamma * lam * adv)
            targets[s, e] = adv + v_obs[s, e]
    return targets


@pytest.fixture(scope="module")
def walk_runner():
    run = jaxppo.resolve(WALK)
    runner = HostLoopRunner(run, HyperParams.from_config(run.config))
    yield runner
    runner.close()


def test_transitions_follow_the_gymnasium_contract(walk_runner):
    runner = walk_runner
    params, stats = jax.device_get((runner.state.params, runner.state.obs_stats))  # acting ones
    metrics, traj = runner.iterate()
    obs, final, rew, term, trunc = replay(traj.action)
    assert term.any() and trunc.any()  # both kinds of episode end happen in 24 steps
    np.testing.assert_array_equal(traj.obs, obs)
    np.testing.assert_array_equal(traj.final_obs, final)  # the true final obs, not the reset one
    np.testing.assert_allclose(traj.reward, rew, rtol=1e-6)
    np.testing.assert_array_equal(traj.terminated, term)
    np.testing.assert_array_equal(traj.truncated, trunc)
    assert (traj.final_obs[trunc][:, 1] == LIMIT).all()
    # Episode stats: every ended episode, with its length.
    ends = term | trunc
    assert metrics["episodes"] == ends.sum()
    assert metrics["episode_length_mean"] == pytest.approx(traj.episode_length[ends].mean())
    assert int(runner.state.env_steps) == 3 * 24

    # Value targets: jaxppo's pieces against GAE by hand with V of the recorded observations.
    algo = runner.algorithm
    values, next_values = ppo.rollout_values(algo, params, stats, traj)
    _, targets = compute_gae(traj.reward, values, next_values, traj.terminated, traj.truncated,
                             WALK.gamma, WALK.gae_lambda)
    value = jax.jit(algo.value)
    v_obs = np.asarray(value(params, stats, obs))
    v_final = np.asarray(value(params, stats, final))
    expected = numpy_value_targets(v_obs, v_final, rew, term, trunc, WALK.gamma, WALK.gae_lambda)
    np.testing.assert_allclose(np.asarray(targets), expected, rtol=1e-5, atol=1e-5)
    # Bootstrapping from the reset observation instead would give other targets.
    v_reset = np.asarray(value(params, stats, np.zeros((1, 2), np.float32)))[0]
    wrong = numpy_value_targets(v_obs, np.where(ends, v_reset, v_final), rew, term, trunc,
                                WALK.gamma, WALK.gae_lambda)
    assert not np.allclose(wrong[trunc], expected[trunc], atol=1e-4)


def test_rollouts_continue_across_iterations(walk_runner):
    """An iteration starts where the last one stopped: an episode in progress goes on."""
    before = walk_runner.rollout.obs.copy()
    _, traj = walk_runner.iterate()
    np.testing.assert_array_equal(traj.obs[0], before)


class ShiftedWalk(Walk):
    """Walk with actions 5 (stay) and 6 (step): a Discrete space with start=5."""

    action_space = gymnasium.spaces.Discrete(2, start=5)

    def step(self, action):
        assert action in (5, 6), action
        return super().step(action - 5)


if "JaxppoShiftedWalk-v0" not in gymnasium.envs.registry:
    gymnasium.register(id="JaxppoShiftedWalk-v0", entry_point=ShiftedWalk, max_episode_steps=LIMIT)


def test_action_spaces():
    """Discrete actions shifted by the space's start; Box actions as vectors [E, D]."""
    from jaxppo.envs.gymnasium_env import GymnasiumEnv

    shifted = GymnasiumEnv("JaxppoShiftedWalk-v0")
    np.testing.assert_array_equal(shifted.env_actions(np.array([0, 1, 1])), [5, 6, 6])
    run = jaxppo.resolve(WALK.replace(env="gymnasium:Pendulum-v1", num_envs=2, num_steps=8,
                                      total_timesteps=32))
    assert not run.spec.discrete and run.spec.action_dim == 1 and run.eval_max_steps == 200
    np.testing.assert_array_equal(run.spec.action_low, [-2.0])
    runner = HostLoopRunner(run, HyperParams.from_config(run.config))
    try:
        metrics, traj = runner.iterate()
        assert traj.action.shape == (8, 2, 1) and np.isfinite(metrics["policy_loss"])
        assert runner.rollout.env.env_actions(np.array([[3.0], [-1.0]])).shape == (2, 1)
    finally:
        runner.close()


def test_a_namespaced_id_names_one_run_folder():
    """gymnasium's "namespace/name" ids (ALE/Pong-v5) give a run folder name without '/',
    as envpool's do; the config keeps the id as given."""
    for env, name in [("gymnasium:ALE/Pong-v5", "ALE-Pong-v5"),
                      ("gymnasium:phys2d/CartPole-v1", "phys2d-CartPole-v1"),
                      ("gymnasium:CartPole-v1", "CartPole-v1"),
                      ("gymnasium:gymnasium_robotics:FetchReach-v2", "FetchReach-v2")]:
        config = jaxppo.PPOConfig(env=env)
        assert config.env_name == name and config.to_dict()["env"] == env


class GymnaxOnly(EnvWrapper):
    """An env wrapper of a user's with no host form."""

    def wrap(self, env):
        return env


def test_errors_name_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match=r"'gymnasium:Cartpole-v1' is not a registered gymnasium "
                                          r"env; registered ids like it: CartPole-v1"):
        jaxppo.resolve(WALK.replace(env="gymnasium:Cartpole-v1"))
    with pytest.raises(ConfigError, match=r"sync='batch' with num_devices=2: env='gymnasium:"
                                          r"JaxppoWalk-v0' steps in Python .*use sync='gradients'"):
        jaxppo.resolve(WALK.replace(num_seeds=2, num_devices=2, sync="batch"))
    with pytest.raises(ConfigError, match=r"transform GymnaxOnly wraps a gymnax env and has no "
                                          r"form for env='gymnasium:JaxppoWalk-v0'.*wrap_host"):
        jaxppo.resolve(WALK.replace(transforms=[GymnaxOnly()]))
    with pytest.raises(ConfigError, match=r"no pure train function .* jaxppo.train\(config\)"):
        jaxppo.make_train(WALK)
    with pytest.raises(ConfigError, match=r"gymnasium.make\('CartPole-v1', bogus=1\) raised "
                                          r"TypeError"):
        jaxppo.resolve(WALK.replace(env="gymnasium:CartPole-v1", env_kwargs={"bogus": 1}))
    monkeypatch.setitem(__import__("sys").modules, "ale_py", None)  # ale-py not installed
    with pytest.raises(ConfigError, match=r"'gymnasium:ALE/Pong-v5': the ALE/ ids come from the "
                                          r"ale-py package, which is not installed: pip install "
                                          r"ale-py \(or train envpool's Atari, "
                                          r"env='envpool:Pong-v5'"):
        jaxppo.resolve(WALK.replace(env="gymnasium:ALE/Pong-v5"))
    monkeypatch.setitem(__import__("sys").modules, "gymnasium", None)
    with pytest.raises(ConfigError, match=r"needs the gymnasium package: pip install "
                                          r"'jaxppo\[gymnasium\]'"):
        jaxppo.resolve(WALK)


def test_a_critic_lr_of_its_own_is_reported_as_in_the_compiled_path():
    """critic_lr on an env stepped in Python: its own annealed value each iteration beside
    lr's, in the metrics (the update is the compiled path's, where its step is tested)."""
    r = jaxppo.train(WALK.replace(critic_lr=2e-3), progress=False)
    done = np.arange(4) * 3 * 24 / WALK.total_timesteps  # the share of the run before each
    np.testing.assert_allclose(r.metrics["critic_lr"][0], 2e-3 * (1 - done), rtol=1e-6)
    np.testing.assert_allclose(r.metrics["lr"][0], WALK.lr * (1 - done), rtol=1e-6)


def test_run_folder_resume_and_cli(tmp_path, capsys):
    """`jaxppo train --env gymnasium:...`: the run folder as for gymnax envs; a resume
    continues from the learner checkpoint with fresh envs; `jaxppo eval` plays the policy."""
    argv = ["train", "--env", "gymnasium:CartPole-v1", "--runs-dir", str(tmp_path),
            "--run-name", "gym", "--no-progress", "--no-plot", "--set", "num_envs=4",
            "num_steps=32", "num_minibatches=2", "num_epochs=2", "total_timesteps=640",
            "compilation_cache_dir=null", "eval_every=3", "eval_episodes=2", "log_every=2"]
    assert cli.main(argv + ["--stop-after", "2"]) == 0
    run_dir = tmp_path / "gym"
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2]
    assert cli.main(["train", "--resume", str(run_dir), "--no-progress", "--no-plot"]) == 0
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["env_steps"] for r in rows] == [128 * i for i in range(1, 6)]
    assert rows[2]["eval_return_mean"] is not None and rows[3]["eval_return_mean"] is None
    assert rows[4]["eval_return_mean"] is not None  # the last iteration evaluates too
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["iterations"] == 5
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--episodes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["episodes"] == 2 and out["env"] == "CartPole-v1" and out["iteration"] == 5
    policy = jaxppo.load_policy(run_dir)
    assert policy.evaluate(episodes=2, seed=0) == policy.evaluate(episodes=2, seed=0)


@pytest.mark.slow
def test_learns_gymnasium_cartpole():
    """60k env steps of gymnasium's CartPole-v1 (about 15 s on 2 cores): from ~20 to near 500."""
    cfg = jaxppo.PPOConfig(env="gymnasium:CartPole-v1", num_envs=8, num_steps=128, num_epochs=8,
                           num_minibatches=8, total_timesteps=8 * 128 * 58, lr=1e-3,
                           vf_clip_param=None, compilation_cache_dir=None, seed=1)
    result = jaxppo.train(cfg, progress=False)
    curve = result.metrics["episode_return_mean"][0]
    assert np.nanmean(curve[:3]) < 60
    assert np.nanmean(curve[-5:]) > 400, curve[-10:]
    assert result.evaluate(episodes=4)["return_mean"] > 400


class Lives(gymnasium.Env):
    """A game of 2 lives of 3 steps each, as an episodic-life wrapper shows it: losing a life
    terminates (reset then goes on with the same game); reward 1 a step (clipped), the game's
    own score 10 a step in info["episode_reward"], and info["episode_end"] at the game's end.
    Observations are uint8 [lives, step of the life, 200]."""

    observation_space = gymnasium.spaces.Box(0, 255, (3,), np.uint8)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if getattr(self, "lives", 0) == 0:  # a new game; otherwise the next life
            self.lives = 2
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        lost = self.t == 3
        self.lives -= lost
        info = {"episode_reward": 10.0, "episode_end": lost and self.lives == 0}
        return self._obs(), 1.0, lost, False, info

    def _obs(self):
        return np.array([self.lives, self.t, 200], np.uint8)


if "JaxppoLives-v0" not in gymnasium.envs.registry:
    gymnasium.register(id="JaxppoLives-v0", entry_point=Lives)


def test_reported_episodes_and_uint8_observations():
    """Learning sees a life lost as an end and the clipped reward; the episode metrics add up
    the env's episode_reward until its episode_end (the game over). uint8 observations stay
    uint8 in the rollout and the checkpointed state, and become floats at the network input."""
    cfg = WALK.replace(env="gymnasium:JaxppoLives-v0", num_envs=2, num_steps=12,
                       total_timesteps=2 * 12 * 2, normalize_observations=True)
    run = jaxppo.resolve(cfg)
    runner = HostLoopRunner(run, HyperParams.from_config(run.config))
    try:
        metrics, traj = runner.iterate()
    finally:
        runner.close()
    assert traj.obs.dtype == traj.final_obs.dtype == np.uint8
    np.testing.assert_array_equal(traj.terminated[:, 0], np.arange(1, 13) % 3 == 0)
    np.testing.assert_array_equal(traj.reward, 1.0)
    np.testing.assert_array_equal(traj.episode_end[:, 0], np.arange(1, 13) % 6 == 0)
    assert metrics["episodes"] == 4  # two games over in each env, not eight lives
    assert metrics["episode_return_mean"] == metrics["episode_return_min"] == 60.0
    assert metrics["episode_length_mean"] == 6.0
    from jaxppo.run.hostloop import abstract_state
    assert abstract_state(run, HyperParams.from_config(run.config)).last_obs.dtype == np.uint8
    algo, st = runner.algorithm, runner.state
    np.testing.assert_array_equal(algo.value(st.params, st.obs_stats, traj.obs[0]),
                                  algo.value(st.params, st.obs_stats, traj.obs[0].astype(np.float32)))
    # Evaluation counts the same episodes: whole games of the env's own score.
    from jaxppo.run.hostloop import evaluate_host
    returns, lengths = evaluate_host(algo, st.params, st.obs_stats, episodes=3, seed=0,
                                     deterministic=True, max_steps=50)
    np.testing.assert_array_equal(returns, 60.0)
    np.testing.assert_array_equal(lengths, 6)


def test_an_env_that_steps_in_python_reports_after_every_iteration():
    """Its default chunk is one iteration (progress, checkpoint_minutes and signals after
    each), where a gymnax env's run of the same length gets ~40 chunks; log_every still sets
    it, and checkpoint_every still bounds it."""
    from jaxppo.run.loop import chunk_length

    for env in ("gymnasium:CartPole-v1", "envpool:Breakout-v5"):
        cfg = jaxppo.PPOConfig(env=env, num_envs=8, num_steps=128, total_timesteps=8 * 128 * 400)
        assert chunk_length(cfg) == 1
        assert chunk_length(cfg.replace(log_every=20)) == 20
        assert chunk_length(cfg.replace(log_every=20, checkpoint_every=5)) == 5
    gymnax = jaxppo.PPOConfig(env="CartPole-v1", num_envs=8, num_steps=128,
                              total_timesteps=8 * 128 * 400)
    assert chunk_length(gymnax) == 10
