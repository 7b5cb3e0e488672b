"""JaxMARL envs by name ("jaxmarl:<name>", jaxppo.envs.jaxmarl_suite) trained with IPPO (one
network shared by every agent, agents folded into the batch as actors): the agents' batch
against one built by hand from JaxMARL's own dicts, the rewards and dones the rollout records
against JaxMARL's step, per-agent GAE against a plain-numpy GAE, the team return against the
rewards summed by hand, SMAX's available actions as masks, errors, and seeds and resume of a
short run. The tests that need jaxmarl skip without it (CI installs it with the dev extra)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.collectives import episode_metrics
from jaxppo.core.hyperparams import HyperParams
from jaxppo.envs.make import make_env
from jaxppo.errors import ConfigError

pytest.importorskip("jaxmarl")

ENV = "jaxmarl:MPE_simple_spread_v3"
# MPE's max_steps is 25, and its episodes end on the step after: 26 steps. A rollout of 32
# steps holds every env's first episode.
N_AGENTS, OBS_DIM, N_ACTIONS, LIMIT = 3, 18, 5, 26
TINY = jaxppo.PPOConfig(env=ENV, num_envs=2, num_steps=32, num_minibatches=2, num_epochs=1,
                        total_timesteps=4 * 64, network=jaxppo.NetworkConfig((16,)),
                        normalize_advantages=False, compilation_cache_dir=None)


def _rollout(config=TINY, key=0):
    algo = Algorithm.create(jaxppo.resolve(config))
    hp = HyperParams.from_config(algo.config)
    state = ppo.init(algo, jax.random.PRNGKey(key), hp)
    after, traj = ppo.rollout(algo, state, hp)
    return algo, hp, state, after, traj


def _numpy_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Plain GAE over [T, B]: a terminated step bootstraps 0, a truncated one V(final obs),
    and both cut the trace."""
    T = rewards.shape[0]
    adv = np.zeros_like(rewards, dtype=np.float64)
    last = np.zeros(rewards.shape[1])
    for t in reversed(range(T)):
        nonterminal = 1.0 - terminated[t]
        delta = rewards[t] + gamma * next_values[t] * nonterminal - values[t]
        cut = 1.0 - np.maximum(terminated[t], truncated[t])
        last = delta + gamma * lam * cut * last
        adv[t] = last
    return adv, adv + values


def test_spec_has_the_agents_and_one_agents_spaces():
    spec = make_env(TINY)
    assert spec.agents == ("agent_0", "agent_1", "agent_2") and spec.num_agents == N_AGENTS
    assert spec.obs_shape == (OBS_DIM,) and spec.discrete and spec.action_dim == N_ACTIONS
    assert not spec.masked  # MPE gives no available actions
    assert spec.env_params.max_steps_in_episode == LIMIT


def test_observations_are_batched_env_major_as_built_by_hand():
    """Actor e * N + i holds agent i of env e, each observation JaxMARL's own dict entry."""
    algo, _, state, _, _ = _rollout()
    marl = algo.spec.env.marl_env
    k_env = jax.random.split(jax.random.PRNGKey(0), 3)[2]
    by_hand = []
    for e in range(TINY.num_envs):
        obs, _ = marl.reset(jax.random.fold_in(k_env, e))
        by_hand += [np.asarray(obs[a]) for a in marl.agents]
    np.testing.assert_array_equal(np.asarray(state.last_obs), np.stack(by_hand))
    assert state.last_obs.shape == (TINY.num_envs * N_AGENTS, OBS_DIM)
    assert state.episode_return.shape == (TINY.num_envs * N_AGENTS,)


def test_rollout_records_jaxmarls_rewards_and_shared_done_per_agent():
    """Replaying each env's actions through JaxMARL's own step_env (no jaxppo code) gives
    the rewards and dones the rollout recorded for that env's actors."""
    algo, _, state, _, traj = _rollout()
    marl, N = algo.spec.env.marl_env, N_AGENTS
    env_keys = ppo.rollout_noise(algo, jax.random.split(state.rng)[1], state.env_ids)[1]
    for e in range(TINY.num_envs):
        mstate = jax.tree.map(lambda x: x[e], state.env_state.marl_state)
        for t in range(LIMIT):  # the first episode, before any reset
            acts = {a: traj.action[t, e * N + i] for i, a in enumerate(marl.agents)}
            k_step = jax.random.split(env_keys[t, e])[0]
            _, mstate, rew, dones, _ = marl.step_env(k_step, mstate, acts)
            got = np.asarray(traj.reward[t, e * N:(e + 1) * N])
            np.testing.assert_allclose(got, [float(rew[a]) for a in marl.agents], rtol=1e-6)
            ended = bool(dones["__all__"])
            assert ended == (t == LIMIT - 1)
            # MPE's end is its time limit: truncated (bootstrapped), shared by the agents.
            assert list(np.asarray(traj.truncated[t, e * N:(e + 1) * N])) == [ended] * N
            assert not np.any(np.asarray(traj.terminated[t, e * N:(e + 1) * N]))


def test_gae_is_per_agent_with_the_shared_done_against_numpy():
    algo, hp, state, after, traj = _rollout()
    values, next_values = ppo.rollout_values(algo, state.params, state.obs_stats, traj)
    stats = ppo.gather_rollout_stats(algo, traj)
    _, adv, targets, _ = ppo.gae(algo, after, traj, values, next_values, stats, hp)
    want_adv, want_targets = _numpy_gae(
        np.asarray(traj.reward, np.float64), np.asarray(values, np.float64),
        np.asarray(next_values, np.float64), np.asarray(traj.terminated, np.float64),
        np.asarray(traj.truncated, np.float64), TINY.gamma, TINY.gae_lambda)
    assert adv.shape == (TINY.num_steps, TINY.num_envs * N_AGENTS)
    np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(targets), want_targets, rtol=1e-4, atol=1e-5)
    # Each agent's column has its own rewards: the agents' advantages differ.
    assert not np.allclose(np.asarray(adv[:, 0]), np.asarray(adv[:, 1]))


def test_team_return_is_the_sum_over_agents_of_their_returns():
    algo, _, _, _, traj = _rollout()
    metrics = episode_metrics(ppo.gather_rollout_stats(algo, traj)["episodes"])
    rewards = np.asarray(traj.reward, np.float64)[:LIMIT]  # each env's first episode
    team = rewards.reshape(LIMIT, TINY.num_envs, N_AGENTS).sum(axis=(0, 2))
    assert int(metrics["episodes"]) == TINY.num_envs
    np.testing.assert_allclose(float(metrics["episode_return_mean"]), team.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["episode_return_min"]), team.min(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["episode_length_mean"]), LIMIT)


def test_smax_masks_the_unavailable_actions():
    cfg = TINY.replace(env="jaxmarl:smax:3m", num_steps=8, total_timesteps=2 * 16)
    algo, _, state, _, traj = _rollout(cfg)
    spec = algo.spec
    assert spec.masked and spec.num_agents == 3
    marl = spec.env.marl_env
    avail = marl.get_avail_actions(jax.tree.map(lambda x: x[1], state.env_state.marl_state))
    np.testing.assert_array_equal(np.asarray(spec.masks(state.env_state))[3:6],
                                  np.stack([np.asarray(avail[a], bool) for a in marl.agents]))
    legal = np.take_along_axis(np.asarray(traj.action_mask),
                               np.asarray(traj.action)[..., None], axis=-1)
    assert legal.all()


def test_errors_name_the_fix():
    with pytest.raises(ConfigError, match="did you mean 'jaxmarl:MPE_simple_spread_v3'"):
        jaxppo.resolve(TINY.replace(env="jaxmarl:MPE_simple_sprad_v3"))
    with pytest.raises(ConfigError, match="did you mean 'jaxmarl:MPE_simple_spread_v3'"):
        make_env(TINY.replace(env="MPE_simple_spread_v3"))  # the bare name: the suite's
    with pytest.raises(ConfigError, match="did you mean 'jaxmarl:smax:3m'"):
        make_env(TINY.replace(env="jaxmarl:smax:3mm"))
    # Box actions and transforms: tests/envs/test_jaxmarl_box.py


def test_missing_package_gives_the_install_line(monkeypatch):
    from jaxppo.envs import adapter

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(adapter, "import_package", missing)
    with pytest.raises(ConfigError, match=r"pip install 'jaxppo\[jaxmarl\]'"):
        make_env(TINY)


def test_jaxmarls_import_prints_nothing():
    code = ("import jaxppo; jaxppo.resolve(jaxppo.PPOConfig(env='jaxmarl:MPE_simple_spread_v3',"
            " num_envs=2, num_steps=8, num_minibatches=1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert "submoduled" not in out.stdout + out.stderr


def test_seeds_train_and_a_resumed_run_continues_exactly(tmp_path):
    cfg = TINY.replace(num_seeds=2, total_timesteps=4 * 64, checkpoint_every=1, log_every=1)
    full = jaxppo.train(cfg, run_dir=tmp_path / "full", progress=False)
    assert full.metrics["episode_return_mean"].shape == (2, 4)
    assert np.all(np.isfinite(full.metrics["episode_return_mean"]))
    jaxppo.train(cfg, run_dir=tmp_path / "part", progress=False, stop_after_iterations=2)
    resumed = jaxppo.train(None, resume=tmp_path / "part", progress=False)
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(full.metrics["episode_return_mean"],
                                  resumed.metrics["episode_return_mean"])


def test_the_docs_command_trains_the_tuned_config(tmp_path):
    from readme_commands import readme_train_config

    config = readme_train_config(ENV, env_kwargs={})  # the discrete MPE's (docs: Box too)
    assert (config.num_envs, config.num_steps, config.num_minibatches) == (16, 128, 4)
    result = jaxppo.train(config.replace(compilation_cache_dir=None, total_timesteps=2 * 2048),
                          run_dir=tmp_path / "run", progress=False)
    assert result.metrics["episode_return_mean"].shape == (2, 2)
    assert (tmp_path / "run" / "params.msgpack").is_file()


def test_every_smax_map_starts_from_the_ippo_smax_config():
    """A new run of a SMAX map without a config of its own starts from 3m's (JaxMARL's
    ippo_rnn_smax settings, the same for every map); an unknown map or another JaxMARL env
    from none; from Python the error says how."""
    import argparse

    from jaxppo.envs.catalog import tuned_start
    from jaxppo.run import command

    start = tuned_start("jaxmarl:smax:5m_vs_6m")
    assert (start.path.stem, start.env) == ("smax_3m", "jaxmarl:smax:3m")
    assert tuned_start("jaxmarl:smax:2s3z").env == "jaxmarl:smax:2s3z"  # its own
    assert tuned_start("jaxmarl:smax:5m_vs_6n") is None and tuned_start("jaxmarl:MPE_simple_tag_v3") is None
    parser = argparse.ArgumentParser()
    command.add_config_flags(parser)
    config, source = command.new_config(parser.parse_args(["--env", "jaxmarl:smax:5m_vs_6m"]))
    assert config == jaxppo.PPOConfig.tuned("jaxmarl:smax:3m").replace(env="jaxmarl:smax:5m_vs_6m")
    assert source == ("defaults < tuned jaxmarl:smax:3m (JaxMARL's IPPO settings for SMAX, the "
                      "same for every map)")
    with pytest.raises(ConfigError, match=r"for a SMAX map, JaxMARL's IPPO settings for every "
                                          r"map: PPOConfig.tuned\('jaxmarl:smax:3m'\)"):
        jaxppo.PPOConfig.tuned("jaxmarl:smax:5m_vs_6m")


def test_evaluation_returns_the_team_return_of_jaxmarls_own_episodes():
    """The deterministic policy played through JaxMARL's own reset and step_env (the same
    keys), its rewards summed over agents and steps by hand, gives evaluate's returns."""
    algo, _, state, _, _ = _rollout()
    n, key = 2, jax.random.PRNGKey(7)
    got = algo.evaluate(state.params, state.obs_stats, key, num_episodes=n, deterministic=True)
    marl = algo.spec.env.marl_env
    k_reset, k = jax.random.split(key)
    returns = np.zeros(n)
    mstates = [marl.reset(kr)[1] for kr in jax.random.split(k_reset, n)]
    obs = [marl.get_obs(s) for s in mstates]
    for _ in range(LIMIT):
        k, _, k_step = jax.random.split(k, 3)
        for i, ks in enumerate(jax.random.split(k_step, n)):
            agent_obs = jnp.stack([obs[i][a] for a in marl.agents])
            logits = algo.network.apply(state.params, algo.obs_in(state.obs_stats, agent_obs))[0]
            acts = {a: jnp.argmax(logits.loc[j]) for j, a in enumerate(marl.agents)}
            obs[i], mstates[i], rew, _, _ = marl.step_env(jax.random.split(ks)[0], mstates[i],
                                                          acts)
            returns[i] += sum(float(rew[a]) for a in marl.agents)
    np.testing.assert_allclose(float(got["eval_return_mean"]), returns.mean(), rtol=1e-4)
    assert float(got["eval_length_mean"]) == LIMIT


def test_one_iteration_on_four_devices_equals_one_device():
    """Envs split over 4 devices keep each env's agents together: the same update."""
    worker = Path(__file__).parent.parent / "core" / "pmap_worker.py"
    proc = subprocess.run([sys.executable, str(worker), "equivalence-marl"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])["equivalence-marl"]
    assert r["replicated_after_iteration"] and r["max_param_diff"] < 1e-5
    m1, m4 = r["metrics_1"], r["metrics_4"]
    assert m1["episodes"] == m4["episodes"] == 8
    for key in ("episode_return_mean", "value_loss", "env_steps"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-4, abs=1e-6), key
    # Near zero, as means of terms that cancel: float32 sums in another order differ by ~1e-6.
    for key in ("policy_loss", "kl"):
        assert m1[key] == pytest.approx(m4[key], abs=1e-5), key


def test_agents_of_other_sizes_are_padded_and_their_extra_actions_masked():
    """Speaker-listener: the speaker sees 3 numbers and has 3 actions, the listener 11 and 5.
    The speaker's observation is zero-padded at the end (as JaxMARL's baselines pad) and its
    2 extra actions are masked out, so it never takes one."""
    cfg = TINY.replace(env="jaxmarl:MPE_simple_speaker_listener_v4", num_steps=8,
                       total_timesteps=2 * 16)
    algo, _, state, _, traj = _rollout(cfg)
    spec, marl = algo.spec, algo.spec.env.marl_env
    assert spec.agents == ("speaker_0", "listener_0")
    assert spec.obs_shape == (11,) and spec.action_dim == 5 and spec.masked
    k_env = jax.random.split(jax.random.PRNGKey(0), 3)[2]
    obs, _ = marl.reset(jax.random.fold_in(k_env, 0))
    speaker = np.concatenate([np.asarray(obs["speaker_0"]), np.zeros(8, np.float32)])
    np.testing.assert_array_equal(np.asarray(state.last_obs[0]), speaker)
    np.testing.assert_array_equal(np.asarray(state.last_obs[1]), np.asarray(obs["listener_0"]))
    masks = np.asarray(traj.action_mask)  # [T, E*2, 5]
    assert masks[:, 0::2, :3].all() and not masks[:, 0::2, 3:].any() and masks[:, 1::2].all()
    assert np.asarray(traj.action)[:, 0::2].max() < 3
