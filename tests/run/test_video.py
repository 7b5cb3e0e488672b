"""Episode videos: one frame per observation, episodes back to back, capped by --max-steps;
every drawable env draws; clear errors for an env or a format that cannot be written."""

from __future__ import annotations

import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import jaxppo
from jaxppo import cli
from jaxppo.core.algorithm import Algorithm
from jaxppo.run.policy import Policy
from jaxppo.core.running_stats import RunningStats
from jaxppo.run.video import record_episodes, write_video

TINY = dict(num_envs=4, num_steps=16, num_minibatches=2, num_epochs=1, total_timesteps=64,
            compilation_cache_dir=None)


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("video") / "cartpole"
    jaxppo.train(jaxppo.PPOConfig(env="CartPole-v1", network=jaxppo.NetworkConfig((16,)), **TINY),
                 run_dir=run, progress=False, plot=False)
    return run


def _handmade(config):
    algo = Algorithm.create(jaxppo.resolve(config))
    params = algo.network.init(jax.random.PRNGKey(0), jnp.zeros((1, algo.spec.obs_dim)))
    return Policy(algo, params, RunningStats.create((algo.spec.obs_dim,)))


def test_cli_gif_has_one_frame_per_observation(cartpole_run, tmp_path, capsys):
    out = tmp_path / "cartpole.gif"
    assert cli.main(["eval", str(cartpole_run), "--video", str(out), "--max-steps", "20",
                     "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    (length,) = record["lengths"]
    assert 1 <= length <= 20
    # the reset observation, then one per step (the last one the episode ended in)
    assert Image.open(out).n_frames == record["frames"] == length + 1
    # the same episode as record_episodes plays (deterministic policy, seed 0)
    (episode,) = record_episodes(jaxppo.load_policy(cartpole_run), max_steps=20)
    assert episode.length == length and record["returns"] == [float(episode.rewards.sum())]


def test_episodes_play_back_to_back(cartpole_run, tmp_path, capsys):
    out = tmp_path / "three.gif"
    assert cli.main(["eval", str(cartpole_run), "--video", str(out), "--episodes", "3",
                     "--max-steps", "8", "--stochastic", "--seed", "2"]) == 0
    assert "3 episode(s)" in capsys.readouterr().out
    played = record_episodes(jaxppo.load_policy(cartpole_run), episodes=3, seed=2,
                             deterministic=False, max_steps=8)
    assert Image.open(out).n_frames == sum(e.length + 1 for e in played)


@pytest.mark.parametrize("env, transforms", [
    ("Pendulum-v1", ()), ("Acrobot-v1", ()), ("MountainCar-v0", ()),
    ("MountainCarContinuous-v0", ()), ("Breakout-MinAtar", ({"frame_stack": {"k": 2}},)),
])
def test_every_drawable_env_draws(env, transforms, tmp_path):
    policy = _handmade(jaxppo.PPOConfig(env=env, transforms=transforms,
                                        network=jaxppo.NetworkConfig((8,), torso="mlp"), **TINY))
    out = write_video(policy, tmp_path / "v.gif", max_steps=3)
    image = Image.open(tmp_path / "v.gif")
    assert image.n_frames == out["frames"] == 4
    pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 2  # something was drawn


def test_mp4(cartpole_run, tmp_path):
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    out = write_video(jaxppo.load_policy(cartpole_run), tmp_path / "c.mp4", max_steps=5)
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(tmp_path / "c.mp4"))
    assert frames == out["frames"]


def test_mp4_without_ffmpeg_names_the_install(cartpole_run, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *_a, **_k: None)
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(jaxppo.VideoError, match=r"pip install 'jaxppo\[video\]'.*\.gif"):
        write_video(jaxppo.load_policy(cartpole_run), tmp_path / "c.mp4", max_steps=5)
    assert not (tmp_path / "c.mp4").exists()


def test_an_env_without_drawing_is_a_clear_error(tmp_path):
    policy = _handmade(jaxppo.PPOConfig(env="Catch-bsuite", **TINY))
    with pytest.raises(jaxppo.VideoError, match="no video for Catch-bsuite.*CartPole-v1.*MinAtar"):
        write_video(policy, tmp_path / "catch.gif")
    assert not (tmp_path / "catch.gif").exists()


def test_cli_errors(cartpole_run, tmp_path, capsys):
    assert cli.main(["eval", str(cartpole_run), "--video", str(tmp_path / "x.avi")]) == 2
    assert "use a .gif" in capsys.readouterr().err
    assert cli.main(["eval", str(cartpole_run), "--video", str(tmp_path / "x.gif"),
                     "--episodes", "0"]) == 2
    assert "episodes=0" in capsys.readouterr().err
