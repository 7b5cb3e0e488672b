"""Videos of envs that step in Python (gymnasium, envpool): the env's own pictures, one per
step from the reset to the step before the last, of the episode evaluation plays; an env that
cannot render is a clear error."""

from __future__ import annotations

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import jaxppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.running_stats import RunningStats
from jaxppo.run.policy import Policy
from jaxppo.run.video import record_episodes, write_video

TINY = dict(num_envs=2, num_steps=8, num_minibatches=1, num_epochs=1, total_timesteps=16,
            compilation_cache_dir=None, network=jaxppo.NetworkConfig((8,)))


def _handmade(config):
    algo = Algorithm.create(jaxppo.resolve(config))
    params = algo.network.init(jax.random.PRNGKey(0), jnp.zeros((1, algo.spec.obs_dim)))
    return Policy(algo, params, RunningStats.create((algo.spec.obs_dim,)))


def test_a_gymnasium_episode_is_the_evaluated_one_in_the_envs_own_pictures(tmp_path):
    """Frame-stacked CartPole: each recorded episode is the one evaluation plays (same return
    and length) with its seed, drawn in CartPole's own 400x600 pictures (not the stack): the reset's
    and one after each step but the last."""
    policy = _handmade(jaxppo.PPOConfig(env="gymnasium:CartPole-v1",
                                        transforms=[{"frame_stack": {"k": 2}}], **TINY))
    played = record_episodes(policy, episodes=2, seed=3)
    for i, episode in enumerate(played):  # episode i: evaluation's one episode of seed 3 + i
        evaluated = policy.evaluate(episodes=1, seed=3 + i)
        assert [episode.length] == evaluated["lengths"] and episode.length < 500
        assert float(episode.rewards.sum()) == evaluated["returns"][0]
        assert episode.observations.shape == (episode.length, 400, 600, 3)
    assert played[0].length != played[1].length or not np.array_equal(
        played[0].observations, played[1].observations)
    out = write_video(policy, tmp_path / "cartpole.gif", episodes=2, seed=1, max_steps=6)
    assert out["lengths"] == [6, 6] and Image.open(tmp_path / "cartpole.gif").n_frames == 12


def test_an_atari_video_shows_the_colour_screen(tmp_path):
    policy = _handmade(jaxppo.PPOConfig(env="envpool:Pong-v5", **TINY))
    out = write_video(policy, tmp_path / "pong.gif", max_steps=4)
    image = Image.open(tmp_path / "pong.gif")
    assert out["frames"] == image.n_frames == 4 and out["lengths"] == [4]
    (episode,) = record_episodes(policy, max_steps=3)
    assert episode.observations.shape == (3, 210, 160, 3) and episode.observations.dtype == np.uint8
    colours = np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)
    assert len(colours) > 3  # Pong's court, paddles and the title, not a grey frame


class NoPicture(gymnasium.Env):
    """An env of one's own whose render() draws nothing."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 1.0, False, False, {}

    def render(self):
        return None


def test_an_env_that_renders_no_picture_is_a_clear_error(tmp_path):
    gymnasium.register(id="jaxppo_tests/NoPicture-v0", entry_point=NoPicture, max_episode_steps=5)
    policy = _handmade(jaxppo.PPOConfig(env="gymnasium:jaxppo_tests/NoPicture-v0", **TINY))
    with pytest.raises(jaxppo.VideoError, match=r"^no video for gymnasium:jaxppo_tests/NoPicture-v0"
                                                r": with render_mode='rgb_array' its render\(\) "
                                                r"gave None, not a picture \[H, W, 3\]$"):
        write_video(policy, tmp_path / "none.gif")
    assert not (tmp_path / "none.gif").exists()


class NoOpenGL(NoPicture):
    """An env whose renderer fails as MuJoCo's does on a machine without a display."""

    def render(self):
        raise RuntimeError("an OpenGL platform library has not been loaded into this process")


def test_a_renderer_without_opengl_is_a_clear_error_that_names_egl(tmp_path, monkeypatch):
    """MuJoCo's renderer on a machine without a display: a VideoError with the renderer's
    words and, while MUJOCO_GL is unset, the setting that draws through EGL instead."""
    gymnasium.register(id="jaxppo_tests/NoOpenGL-v0", entry_point=NoOpenGL, max_episode_steps=5)
    policy = _handmade(jaxppo.PPOConfig(env="gymnasium:jaxppo_tests/NoOpenGL-v0", **TINY))
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    with pytest.raises(jaxppo.VideoError, match=r"RuntimeError: an OpenGL platform library has "
                                                r"not been loaded into this process\); MuJoCo "
                                                r"draws without a display through EGL: run with "
                                                r"MUJOCO_GL=egl set$"):
        write_video(policy, tmp_path / "gl.gif")
    monkeypatch.setenv("MUJOCO_GL", "osmesa")  # already chosen: no advice
    with pytest.raises(jaxppo.VideoError, match=r"loaded into this process\)$"):
        write_video(policy, tmp_path / "gl.gif")
