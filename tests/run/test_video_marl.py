"""Videos of multi-agent runs: `jaxppo eval RUN_DIR --video` on an MPE run folder, one frame
per JaxMARL state (the reset's, then each step's before any reset), every agent acting with
the joint policy, checked against JaxMARL's own step_env replayed with the same keys and
actions; write_video on an Overcooked run folder and a SMAX battle; a clear error for Hanabi.
The run folders hold a config and untrained params (what load_policy reads), so nothing
trains. Skips without jaxmarl."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import jaxppo
from jaxppo import cli
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.running_stats import RunningStats
from jaxppo.run.checkpoints import write_params
from jaxppo.run.folder import write_config
from jaxppo.run.policy import Policy
from jaxppo.run.video import record_episodes, write_video

pytest.importorskip("jaxmarl")

TINY = dict(num_envs=2, num_steps=8, num_minibatches=2, num_epochs=1, total_timesteps=16,
            network=jaxppo.NetworkConfig((8,)), compilation_cache_dir=None)
MPE_STEPS = 26  # simple_spread's whole episode: the last frame is its end, before the reset
TITLE_ROWS = 16  # a frame's title (episode, step, return), left out where drawings compare


def _run_folder(path, config):
    """A run folder as load_policy reads it: config.yaml and params.msgpack (untrained)."""
    algo = Algorithm.create(jaxppo.resolve(config))
    path.mkdir(parents=True)
    write_config(path, config, overwrite=False)
    write_params(path / "params.msgpack", jax.jit(algo.init_params)(jax.random.PRNGKey(0)),
                 RunningStats.create((algo.spec.obs_dim,)))
    return path


def _frames(path) -> np.ndarray:
    """Every frame of a gif below its title, RGB [F, H, W, 3]."""
    image = Image.open(path)
    frames = []
    for i in range(image.n_frames):
        image.seek(i)
        frames.append(np.asarray(image.convert("RGB"))[TITLE_ROWS:])
    return np.stack(frames)


def test_cli_video_of_an_mpe_run_draws_jaxmarls_states(tmp_path, capsys):
    """A whole simple_spread episode: one frame per state, consecutive frames differ (the
    agents move), and the recorded states and team return are JaxMARL's own step_env's with
    the episode's keys and the joint policy's actions (the last state the episode's end, not
    the reset after it)."""
    run = _run_folder(tmp_path / "mpe", jaxppo.PPOConfig(env="jaxmarl:MPE_simple_spread_v3",
                                                          **TINY))
    out = tmp_path / "mpe.gif"
    assert cli.main(["eval", str(run), "--video", str(out), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["lengths"] == [MPE_STEPS] and record["frames"] == MPE_STEPS + 1
    frames = _frames(out)
    assert len(frames) == MPE_STEPS + 1
    assert all(np.any(frames[t] != frames[t + 1]) for t in range(MPE_STEPS))

    policy = jaxppo.load_policy(run)
    (episode,) = record_episodes(policy)
    assert record["returns"] == [float(episode.rewards.sum())]
    marl = policy.env.marl_env
    key, k_reset = jax.random.split(jax.random.PRNGKey(0))  # record_episodes' keys, seed 0
    obs, state = marl.reset(k_reset)
    step = jax.jit(marl.step_env)
    team = 0.0
    np.testing.assert_allclose(episode.states[0].p_pos, state.p_pos)
    for t in range(MPE_STEPS):
        key, _, k_step = jax.random.split(key, 3)
        actions = policy.joint(obs)  # the deterministic joint policy on JaxMARL's obs
        obs, state, reward, _, _ = step(jax.random.split(k_step)[0], state, actions)
        team += sum(float(reward[a]) for a in marl.agents)
        np.testing.assert_allclose(episode.states[t + 1].p_pos, state.p_pos, rtol=1e-5,
                                   atol=1e-6)
    np.testing.assert_allclose(float(episode.rewards.sum()), team, rtol=1e-5)


def test_write_video_of_an_overcooked_run(tmp_path):
    """Overcooked through JaxMARL's renderer: one frame per state, a frame changes exactly
    where JaxMARL's state (grid, agents' directions, what they hold) changes, and it does."""
    run = _run_folder(tmp_path / "overcooked", jaxppo.PPOConfig(
        env="jaxmarl:overcooked:cramped_room", **TINY))
    steps = 6
    frames, states = _sampled_video(jaxppo.load_policy(run), tmp_path / "kitchen.gif", steps, 1)
    drawn = lambda s: (s.maze_map, s.agent_dir_idx, s.agent_inv)  # noqa: E731
    changed = [any(np.any(np.asarray(a) != np.asarray(b))
                   for a, b in zip(drawn(states[t]), drawn(states[t + 1])))
               for t in range(steps)]
    assert any(changed)
    assert [bool(np.any(frames[t] != frames[t + 1])) for t in range(steps)] == changed


def _sampled_video(policy, path, steps: int, seed: int):
    """(the frames, the recorded states) of one sampled episode of `steps` steps, written to
    `path`: one frame per state."""
    out = write_video(policy, path, max_steps=steps, deterministic=False, seed=seed)
    frames = _frames(path)
    assert out["frames"] == len(frames) == steps + 1 and out["lengths"] == [steps]
    states = record_episodes(policy, max_steps=steps, deterministic=False, seed=seed)[0].states
    return frames, states


def _untrained(env: str) -> Policy:
    algo = Algorithm.create(jaxppo.resolve(jaxppo.PPOConfig(env=env, **TINY)))
    return Policy(algo, algo.init_params(jax.random.PRNGKey(0)),
                  RunningStats.create((algo.spec.obs_dim,)))


def test_write_video_of_a_smax_battle(tmp_path):
    """SMAX 3m against JaxMARL's heuristic enemy: one frame per env step's state; a frame
    changes where the units' positions, health or attacks change, and the battle moves."""
    steps = 5
    frames, states = _sampled_video(_untrained("jaxmarl:smax:3m"), tmp_path / "smax.gif", steps, 2)
    assert all(hasattr(s, "unit_positions") or hasattr(s.state, "unit_positions") for s in states)
    assert sum(bool(np.any(frames[t] != frames[t + 1])) for t in range(steps)) >= steps - 1
    blue = (frames[0][..., 2] > 150) & (frames[0][..., 0] < 100) & (frames[0][..., 1] < 100)
    assert blue.any()  # the allies, drawn in JaxMARL's blue


def test_a_multi_agent_env_without_drawing_is_a_clear_error(tmp_path):
    policy = _untrained("jaxmarl:hanabi")
    with pytest.raises(jaxppo.VideoError,
                       match=r"no video for jaxmarl:hanabi.*MPE.*SMAX.*Overcooked"):
        write_video(policy, tmp_path / "hanabi.gif")
    assert not (tmp_path / "hanabi.gif").exists()
