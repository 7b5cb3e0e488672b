"""envpool tasks in host-loop mode (env="envpool:<task>"): jaxppo's SAME_STEP vector env
against envpool's own pools (next-step auto-reset, one env each), Atari's game score and game
end against envpool's own info over games with lives lost, the errors, the tuned Atari
configs and their network, and learning on envpool's CartPole-v1 through the host loop. The
spec, run name, typo and install checks every suite keeps are in tests/envs/test_suites.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import jaxppo
from jaxppo.errors import ConfigError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("envpool") is None,
    reason="envpool is not installed: pip install 'jaxppo[envpool]' (the dev extra installs it)")

SEEDS = [11, 12]


def _actions(n_actions: int, envs: int, steps: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_actions, (envs, steps)).astype(np.int32)


def _envpool_own(task: str, kwargs: dict, seed: int, actions: np.ndarray) -> dict:
    """One env of envpool's own pool (`seed`: envpool seeds env 0 with it), stepped with
    `actions` in turn, one per real transition: envpool resets an ended env on its next step
    and ignores that step's action (its observation starts the next transition). Arrays [T]
    of the T = len(actions) real transitions: obs, reward, terminated, truncated, next_obs
    (the true one at an end), and Atari's info reward, info terminated and lives."""
    import envpool

    pool = envpool.make(task, env_type="gymnasium", num_envs=1, seed=seed, **kwargs)
    obs, _ = pool.reset()
    rows, pending, t = [], False, 0
    while t < len(actions):
        nxt, reward, term, trunc, info = pool.step(np.asarray(actions[t:t + 1]))
        if pending:  # the reset step: no transition, its observation starts the next one
            assert not term[0] and not trunc[0] and reward[0] == 0
            obs, pending = nxt, False
            continue
        rows.append((obs[0], reward[0], term[0], trunc[0], nxt[0], info.get("reward", [0])[0],
                     info.get("terminated", [0])[0], info.get("lives", [0])[0]))
        obs, pending, t = nxt, bool(term[0] or trunc[0]), t + 1
    pool.close()
    keys = ("obs", "reward", "terminated", "truncated", "next_obs", "info_reward",
            "info_terminated", "lives")
    return {k: np.stack([r[i] for r in rows]) for i, k in enumerate(keys)}


def _ours(task: str, kwargs: dict, seeds: list[int], actions: np.ndarray) -> dict:
    """jaxppo's vector env over len(seeds) envs reset with `seeds`, stepped with actions
    [E, T]: arrays [E, T, ...] of obs, reward, terminated, truncated, final_obs and, where
    given, episode_reward and episode_end."""
    from jaxppo.envs.envpool_suite import EnvpoolEnv

    env = EnvpoolEnv(task, kwargs)
    envs = env.make_vec(len(seeds))
    obs, _ = envs.reset(seed=seeds)
    out = {k: [] for k in ("obs", "reward", "terminated", "truncated", "final_obs",
                           "episode_reward", "episode_end")}
    for t in range(actions.shape[1]):
        nxt, reward, term, trunc, info = envs.step(env.env_actions(actions[:, t]))
        for k, v in (("obs", obs), ("reward", reward), ("terminated", term), ("truncated", trunc),
                     ("final_obs", info["final_obs"])):
            out[k].append(v)
        for k in ("episode_reward", "episode_end"):
            out[k].append(info.get(k))
        obs = nxt
    envs.close()
    return {k: np.swapaxes(np.stack(v), 0, 1) for k, v in out.items() if v[0] is not None}


def _frames(obs: np.ndarray) -> np.ndarray:
    """envpool's channel-first frames [..., C, H, W] as jaxppo gives them, [..., H, W, C]."""
    return np.moveaxis(obs, -3, -1)


@pytest.fixture(scope="module")
def breakout():
    """400 steps of 2 Breakout envs with random actions (a whole game or more each), jaxppo's
    and envpool's own."""
    from jaxppo.envs.envpool_suite import ATARI_DEFAULTS

    actions = _actions(4, len(SEEDS), 400, seed=0)
    own = [_envpool_own("Breakout-v5", ATARI_DEFAULTS, s, a) for s, a in zip(SEEDS, actions)]
    return _ours("Breakout-v5", {}, SEEDS, actions), own


def _check_same_step(ours: dict, own: list[dict], frames) -> None:
    for i, ref in enumerate(own):
        np.testing.assert_array_equal(ours["obs"][i], frames(ref["obs"]))
        np.testing.assert_array_equal(ours["final_obs"][i], frames(ref["next_obs"]))
        np.testing.assert_array_equal(ours["reward"][i], ref["reward"])
        np.testing.assert_array_equal(ours["terminated"][i], ref["terminated"])
        np.testing.assert_array_equal(ours["truncated"][i], ref["truncated"])
        # Where no episode ended, the next observation is the step's; where one did, it is
        # the next episode's first, not the last one.
        ended = ref["terminated"] | ref["truncated"]
        same = (ours["obs"][i][1:] == ours["final_obs"][i][:-1]).reshape(len(ended) - 1, -1).all(1)
        np.testing.assert_array_equal(same, ~ended[:-1])


def test_atari_same_step_autoreset_equals_envpools_own(breakout):
    """Every transition, lives lost included (the game goes on), equals envpool's own, with
    the true last observation in final_obs; frames are [84, 84, 4] uint8."""
    ours, own = breakout
    assert ours["obs"].shape == (2, 400, 84, 84, 4) and ours["obs"].dtype == np.uint8
    _check_same_step(ours, own, _frames)
    lives_lost = [(ref["terminated"] & (ref["info_terminated"] == 0)).sum() for ref in own]
    assert min(lives_lost) >= 4, lives_lost  # the conversion is exercised at lives lost


def test_classic_control_same_step_autoreset_with_terminations_and_truncations():
    """envpool's CartPole-v1 with a 12-step time limit (its own max_episode_steps): both kinds
    of end, each as envpool's own, and each truncation at the limit."""
    kwargs = {"max_episode_steps": 12}
    actions = _actions(2, 3, 80, seed=1)
    own = [_envpool_own("CartPole-v1", kwargs, s, a) for s, a in zip([3, 4, 5], actions)]
    ours = _ours("CartPole-v1", kwargs, [3, 4, 5], actions)
    assert ours["obs"].shape == (3, 80, 4) and "episode_end" not in ours
    _check_same_step(ours, own, lambda x: x)
    assert ours["terminated"].any() and ours["truncated"].any()
    for i in range(3):  # the step count since the last end, 12 at every truncation
        ends = np.flatnonzero(ours["terminated"][i] | ours["truncated"][i])
        lengths = np.diff(np.concatenate([[-1], ends]))
        np.testing.assert_array_equal(lengths[ours["truncated"][i][ends]], 12)
        assert (lengths[ours["terminated"][i][ends]] < 12).all()


def _games(reward: np.ndarray, end: np.ndarray) -> list[tuple[float, int]]:
    """(score, length) of each whole game: rewards summed up to and including each end."""
    out, score, length = [], 0.0, 0
    for r, e in zip(reward, end):
        score, length = score + float(r), length + 1
        if e:
            out.append((score, length))
            score, length = 0.0, 0
    return out


def test_atari_reports_the_game_score_of_whole_games(breakout):
    """episode_reward / episode_end make episodes of whole games scored unclipped, by hand
    from envpool's own info (its unclipped reward, its game-over flag), while learning sees
    clipped rewards and an end at every life lost."""
    ours, own = breakout
    for i, ref in enumerate(own):
        expected = _games(ref["info_reward"], ref["info_terminated"] | ref["truncated"])
        assert len(expected) >= 1 and any(s > 0 for s, _ in expected)
        assert _games(ours["episode_reward"][i], ours["episode_end"][i]) == expected
        np.testing.assert_array_equal(ours["reward"][i], np.sign(ref["info_reward"]))
        # A game over is a learning end too; a life lost only ends the learning episode.
        assert (ours["terminated"][i][ours["episode_end"][i]]).all()
        lost = ours["terminated"][i] & ~ours["episode_end"][i]
        np.testing.assert_array_equal(lost, (np.diff(np.concatenate([[5], ref["lives"]])) < 0)
                                      & (ref["lives"] > 0))
    assert max(ours["episode_reward"].max(), 0) >= 1


def test_same_seeds_replay_the_same_envs():
    from jaxppo.envs.envpool_suite import EnvpoolEnv

    envs = EnvpoolEnv("CartPole-v1").make_vec(2)
    first = envs.reset(seed=[7, 8])[0]
    steps = [envs.step(np.array([1, 0], np.int32))[0] for _ in range(5)]
    np.testing.assert_array_equal(envs.reset(seed=[7, 8])[0], first)
    np.testing.assert_array_equal(envs.step(np.array([1, 0], np.int32))[0], steps[0])
    assert not np.array_equal(envs.reset(seed=[8, 9])[0][0], first[0])
    np.testing.assert_array_equal(envs.reset(seed=[8, 9])[0][0], first[1])  # env seeded 8
    # An int seeds env i with seed + i, as a gymnasium vector env; seeds are taken mod 2**31.
    np.testing.assert_array_equal(envs.reset(seed=7)[0], first)
    np.testing.assert_array_equal(envs.reset(seed=[2**31 + 7, 2**32 + 8])[0], first)
    envs.close()


@pytest.mark.parametrize("task", ["MiniGrid-Empty-5x5-v0", "CheetahRun-v1"])
def test_dict_observations_are_gymnasiums_flattening(task):
    """MiniGrid's {direction: Discrete, image, mission} and DeepMind Control's {position,
    velocity}: each env's observation is gymnasium.spaces.flatten of envpool's own, from a
    pool of envpool's with the same seeds, at the reset and after steps; policy_obs flattens
    one observation alike."""
    import envpool
    import gymnasium

    from jaxppo.envs.envpool_suite import EnvpoolEnv

    env = EnvpoolEnv(task)
    space = envpool.make_spec(task).gymnasium_observation_space
    assert env.obs_space.shape == (gymnasium.spaces.flatdim(space),)
    ours = env.make_vec(2)
    own = envpool.make(task, env_type="gymnasium", num_envs=2, batch_size=2, seed=11,
                       env_seed=[11, 12])

    def flattened(obs, info):
        rows = [gymnasium.spaces.flatten(space, {k: v[i] for k, v in obs.items()})
                for i in range(2)]
        return np.stack(rows)[np.argsort(info["env_id"])].astype(np.float32)

    try:
        obs, _ = ours.reset(seed=[11, 12])
        first, info = own.reset()
        np.testing.assert_array_equal(obs, flattened(first, info))
        env0 = int(np.flatnonzero(np.asarray(info["env_id"]) == 0)[0])
        np.testing.assert_array_equal(env.policy_obs({k: v[env0] for k, v in first.items()}),
                                      obs[0])
        rng = np.random.default_rng(0)
        for _ in range(3):
            actions = (rng.integers(0, env.act_space.n, 2) if hasattr(env.act_space, "n")
                       else rng.uniform(-1, 1, (2,) + env.act_space.shape))
            obs, *_ = ours.step(env.env_actions(actions))
            step = own.step(env.env_actions(actions))
            np.testing.assert_array_equal(obs, flattened(step[0], step[4]))
    finally:
        ours.close()
        own.close()


def test_a_deepmind_control_task_trains_and_its_video_is_a_clear_error_without_opengl(
        monkeypatch, tmp_path):
    """envpool:CheetahRun-v1 trains on its flattened observations. A MuJoCo task draws its
    first picture in a process of its own, since its renderer ends the process that cannot
    make an OpenGL context: that process's failure is a VideoError naming what it said."""
    import subprocess

    from jaxppo.errors import VideoError
    from jaxppo.run.video import write_video

    cfg = jaxppo.PPOConfig(env="envpool:CheetahRun-v1", num_envs=2, num_steps=8,
                           num_minibatches=2, total_timesteps=2 * 8 * 2,
                           compilation_cache_dir=None)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    assert result.env.observation_space().shape == (17,)
    assert np.isfinite(result.metrics["policy_loss"]).all()
    said = "ERROR: an OpenGL platform library has not been loaded into this process"
    ran = []

    def crashed(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout=said + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", crashed)
    policy = jaxppo.load_policy(tmp_path / "run")
    with pytest.raises(VideoError, match=r"no video for envpool:CheetahRun-v1: its MuJoCo "
                                         r"renderer could not draw a picture on this machine "
                                         r"\(ERROR: an OpenGL platform library"):
        write_video(policy, tmp_path / "v.gif", max_steps=5)
    assert len(ran) == 1 and ran[0][-2:] == ["CheetahRun-v1", "{}"]
    assert not (tmp_path / "v.gif").exists()


def test_classic_control_makes_and_steps_without_gymnasiums_cast_warning(recwarn):
    """envpool's CartPole declares float64 bounds for its float32 observations: making the
    env and the pool, and stepping it, warn nothing (gymnasium's cast warning is kept out of
    every run's output); another Box warns as before."""
    import gymnasium
    import warnings

    from jaxppo.envs.envpool_suite import EnvpoolEnv

    warnings.simplefilter("always")
    env = EnvpoolEnv("CartPole-v1")
    envs = env.make_vec(2)
    envs.reset(seed=[1, 2])
    envs.step(np.array([1, 0], np.int32))
    envs.close()
    assert env.observation_space().shape == (4,)
    assert [str(w.message) for w in recwarn] == []
    gymnasium.spaces.Box(np.zeros(2), np.ones(2), (2,), np.float32)
    assert any("precision lowered" in str(w.message) for w in recwarn)


def test_atari_options_and_spaces():
    """CleanRL's preprocessing by default, each option overridable; the spaces as jaxppo
    sees them (frames [H, W, C], the time limit envpool's)."""
    from jaxppo.envs.envpool_suite import ATARI_DEFAULTS
    from jaxppo.envs.make import make_env

    spec = make_env(jaxppo.PPOConfig(env="envpool:Pong-v5"))
    assert spec.obs_shape == (84, 84, 4) and spec.discrete and spec.action_dim == 6
    assert spec.env_params.max_steps_in_episode == 27000 and spec.host_loop
    assert spec.env.kwargs == ATARI_DEFAULTS and ATARI_DEFAULTS["episodic_life"]
    spec = make_env(jaxppo.PPOConfig(env="envpool:Pong-v5", env_kwargs={
        "stack_num": 2, "img_height": 64, "episodic_life": False, "max_episode_steps": 500}))
    assert spec.obs_shape == (64, 84, 2) and spec.env_params.max_steps_in_episode == 500
    assert spec.env.kwargs["episodic_life"] is False and spec.env.kwargs["reward_clip"] is True
    spec = make_env(jaxppo.PPOConfig(env="envpool:Pendulum-v1"))
    assert not spec.discrete and spec.action_dim == 1 and spec.obs_shape == (3,)
    assert spec.env.env_actions(np.array([[0.5], [-1.0]])).dtype == np.float32


@pytest.mark.parametrize("kw,match", [
    ({"env": "envpool:Breakuot-v5"},
     r"^env='envpool:Breakuot-v5': 'Breakuot-v5' is not an envpool task; did you mean "
     r"'envpool:Breakout-v5'.*list_all_envs\(\)"),
    ({"env_kwargs": {"stack_nm": 2}}, r"'stack_nm' is not an option of the task; did you mean "
                                      r"'stack_num'\?.*as jaxppo sets them: .*episodic_life=True"),
    ({"env_kwargs": {"stack_num": "2"}}, r"env_kwargs stack_num='2' must be an integer, like its "
                                         r"default 4"),
    ({"env_kwargs": {"max_steps_in_episode": 100, "num_envs": 4}},
     r"env_kwargs \['max_steps_in_episode', 'num_envs'\] cannot be given; instead of "
     r"max_steps_in_episode, set env_kwargs max_episode_steps .*; instead of num_envs, set the "
     r"config's num_envs"),
    ({"env_params": {"max_steps_in_episode": 5}},
     r"^env_params is for gymnax envs; an envpool task takes its options as env_kwargs"),
    ({"num_seeds": 2, "num_devices": 2, "sync": "batch"},
     r"^sync='batch' with num_devices=2: env='envpool:Breakout-v5' steps in Python \(host-loop "
     r"mode\), so its rollout is whole"),
])
def test_errors_name_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        jaxppo.resolve(jaxppo.PPOConfig(**{"env": "envpool:Breakout-v5", **kw}))


def test_a_task_envpool_cannot_make_here_is_a_clear_error(monkeypatch):
    """A task whose own needs are missing (Procgen's Qt 5 runtime, a ViZDoom scenario) is a
    ConfigError with envpool's own words, not envpool's traceback."""
    import envpool

    def missing(task, **kwargs):
        raise ImportError("EnvPool Procgen requires the system Qt 5 runtime on Linux.\nmore")

    monkeypatch.setattr(envpool, "make_spec", missing)
    with pytest.raises(ConfigError, match=r"^env='envpool:BigfishEasy-v0': envpool cannot make "
                                          r"this task on this machine: envpool.make_spec\("
                                          r"'BigfishEasy-v0'\) raised ImportError: EnvPool "
                                          r"Procgen requires the system Qt 5 runtime on Linux\.$"):
        jaxppo.resolve(jaxppo.PPOConfig(env="envpool:BigfishEasy-v0"))


def test_seeds_and_frame_stacking_on_an_envpool_task():
    """Two seeds of envpool's CartPole-v1 with its observations stacked by jaxppo: a stack of
    2 per env [4, 2] whose newest frame is envpool's own observation, one vector env per seed."""
    cfg = jaxppo.PPOConfig(env="envpool:CartPole-v1", num_envs=2, num_steps=8, num_epochs=1,
                           num_minibatches=1, total_timesteps=2 * 8 * 2, num_seeds=2,
                           compilation_cache_dir=None, transforms=[{"frame_stack": {"k": 2}}])
    result = jaxppo.train(cfg, progress=False)
    assert result.metrics["env_steps"].tolist() == [[16, 32]] * 2
    last = np.asarray(result.state.last_obs)  # [seeds, envs, 4, 2]
    assert last.shape == (2, 2, 4, 2) and not np.array_equal(last[0], last[1])


def test_tuned_atari_configs_are_cleanrls_with_its_nature_cnn():
    """`jaxppo train --env envpool:Breakout-v5` starts from the tuned config; its network is
    CleanRL's Nature CNN (parameters counted by hand) and acts on envpool's frames."""
    import jax

    from jaxppo.config import tuned_config_for
    from jaxppo.core.algorithm import Algorithm

    for game, actions in (("Breakout-v5", 4), ("Pong-v5", 6)):
        path, tuned_on = tuned_config_for(f"envpool:{game}")
        assert path.stem == game and tuned_on == f"envpool:{game}"
        cfg = jaxppo.PPOConfig.tuned(f"envpool:{game}")
        assert cfg == jaxppo.PPOConfig.tuned(game) and cfg.env == f"envpool:{game}"
        assert (cfg.num_envs, cfg.num_steps, cfg.num_epochs, cfg.num_minibatches) == (8, 128, 4, 4)
        assert (cfg.clip_param, cfg.vf_clip_param, cfg.lr, cfg.lr_schedule, cfg.entropy_coeff) == (
            0.1, 0.1, 2.5e-4, "linear", 0.01)
        assert cfg.normalize_advantages_over == "minibatch"  # CleanRL's, each minibatch's own
        assert cfg.network.torso == "nature_cnn" and cfg.network.shared_trunk
        run = jaxppo.resolve(cfg)
        trunk = (8 * 8 * 4 * 32 + 32) + (4 * 4 * 32 * 64 + 64) + (3 * 3 * 64 * 64 + 64) + (
            7 * 7 * 64 * 512 + 512)
        shapes = jax.eval_shape(run.network.init, jax.random.PRNGKey(0),
                                np.zeros((1, 84 * 84 * 4), np.float32))
        assert sum(a.size for a in jax.tree.leaves(shapes)) == trunk + 513 * actions + 513
    envs = run.spec.env.make_vec(2)  # Pong: the policy takes a batch of envpool's frames
    obs, _ = envs.reset(seed=[0, 1])
    envs.close()
    action = jax.eval_shape(Algorithm.create(run).act, shapes, None, obs, jax.random.PRNGKey(0))
    assert action.shape == (2,) and obs.shape == (2, 84, 84, 4)
    assert tuned_config_for("envpool:CartPole-v1")[1] == "CartPole-v1"  # gymnax's, same env


def test_every_atari_game_starts_from_the_atari_config_and_vizdoom_is_not_atari():
    """A new run of an Atari game without a config of its own starts from CleanRL's settings
    (`jaxppo train --env envpool:Seaquest-v5`); ViZDoom's tasks share some of Atari's options
    (episodic_life, frame_skip) but are not Atari: they get envpool's own defaults, and no
    Atari config."""
    import argparse

    from jaxppo.envs.catalog import tuned_start
    from jaxppo.envs.envpool_suite import is_atari_task
    from jaxppo.envs.make import make_env
    from jaxppo.run import command

    assert is_atari_task("Seaquest-v5") and is_atari_task("Pong-v5")
    assert not is_atari_task("Basic-v1") and not is_atari_task("CartPole-v1")
    assert not is_atari_task("Ant-v5") and not is_atari_task("NoSuchGame-v5")
    start = tuned_start("envpool:Seaquest-v5")
    assert (start.path.stem, start.env) == ("Breakout-v5", "envpool:Breakout-v5")
    assert tuned_start("envpool:Pong-v5").env == "envpool:Pong-v5"  # its own
    assert tuned_start("envpool:CartPole-v1").env == "CartPole-v1"  # gymnax's, the same env
    assert tuned_start("envpool:Basic-v1") is None and tuned_start("envpool:Ant-v5") is None

    parser = argparse.ArgumentParser()
    command.add_config_flags(parser)
    config, source = command.new_config(parser.parse_args(["--env", "envpool:Seaquest-v5"]))
    atari = jaxppo.PPOConfig.tuned("envpool:Breakout-v5")
    assert config == atari.replace(env="envpool:Seaquest-v5")
    assert source == ("defaults < tuned envpool:Breakout-v5 (CleanRL's Atari settings, the same "
                      "for every game)")
    with pytest.raises(ConfigError, match=r"for an Atari game, CleanRL's settings for every game: "
                       r"PPOConfig.tuned\('envpool:Breakout-v5'\)"
                       r".replace\(env='envpool:Seaquest-v5'\)"):
        jaxppo.PPOConfig.tuned("envpool:Seaquest-v5")

    spec = make_env(jaxppo.PPOConfig(env="envpool:Basic-v1"))  # built, without Atari's options
    assert spec.env.kwargs == {} and not spec.env.atari


def test_cartpole_learns_through_the_host_loop():
    """envpool's CartPole-v1 through today's host loop: 14k env steps (a few seconds) take the
    training return from about 20 past 150, and the run folder's evaluation plays the
    policy in envpool's envs."""
    cfg = jaxppo.PPOConfig(env="envpool:CartPole-v1", num_envs=8, num_steps=128, num_epochs=8,
                           num_minibatches=8, total_timesteps=8 * 128 * 14, lr=1e-3,
                           vf_clip_param=None, compilation_cache_dir=None, seed=1)
    result = jaxppo.train(cfg, progress=False)
    curve = result.metrics["episode_return_mean"][0]
    assert np.nanmean(curve[:2]) < 40, curve
    assert np.nanmean(curve[-3:]) > 150, curve
    assert result.evaluate(episodes=4)["return_mean"] > 200
