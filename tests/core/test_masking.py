"""Invalid-action masking: the masked categorical against a hand computation over the legal
set, sampling and the mode never illegal, the env contract's errors, Jumanji's masks, a
state with no legal action, and PPO with and without the mask on an env where an illegal
action ends the episode (jaxppo.examples.envs.PickLegal)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import networks
from jaxppo.core.networks import DistParams
from jaxppo.envs.make import make_env
from jaxppo.errors import ActionMaskError, ConfigError
from jaxppo.examples.envs import PickLegal

PICK = "jaxppo.examples.envs:PickLegal"
TINY = jaxppo.PPOConfig(env=PICK, num_envs=8, num_steps=16, num_minibatches=2, num_epochs=2,
                        total_timesteps=8 * 16 * 3, network=jaxppo.NetworkConfig((16,)),
                        compilation_cache_dir=None)


# ------------------------------------------------------------------ the distribution by hand
def test_masked_log_prob_entropy_and_kl_are_those_over_the_legal_actions():
    logits = np.array([[0.3, -1.2, 2.0, 0.5], [1.0, 1.0, -0.5, 0.0]], np.float32)
    other = np.array([[-0.4, 0.9, 1.1, 0.2], [0.1, -2.0, 0.7, 0.3]], np.float32)
    mask = np.array([[True, False, True, True], [False, True, False, True]])
    actions = np.array([3, 1])
    p = networks.mask_logits(DistParams(jnp.asarray(logits), jnp.zeros(4)), jnp.asarray(mask))
    q = networks.mask_logits(DistParams(jnp.asarray(other), jnp.zeros(4)), jnp.asarray(mask))
    for i in range(2):
        legal = np.flatnonzero(mask[i])
        # softmax over the legal actions alone, written out
        zp = [math.exp(logits[i, j]) for j in legal]
        zq = [math.exp(other[i, j]) for j in legal]
        P = {j: z / sum(zp) for j, z in zip(legal, zp)}
        Q = {j: z / sum(zq) for j, z in zip(legal, zq)}
        assert float(networks.log_prob(True, p, jnp.asarray(actions))[i]) == pytest.approx(
            math.log(P[actions[i]]), rel=1e-5)
        assert float(networks.entropy(True, p)[i]) == pytest.approx(
            -sum(v * math.log(v) for v in P.values()), rel=1e-5)
        assert float(networks.kl_divergence(True, p, q)[i]) == pytest.approx(
            sum(P[j] * math.log(P[j] / Q[j]) for j in legal), rel=1e-4, abs=1e-6)
    # an illegal action has probability zero (log-prob far below any legal one's)
    assert float(networks.log_prob(True, p, jnp.asarray([1, 0]))[0]) < -1e8
    # no NaN anywhere, gradients included (0 * log 0 is the hazard)
    grads = jax.grad(lambda lg: jnp.sum(networks.entropy(True, networks.mask_logits(
        DistParams(lg, jnp.zeros(4)), jnp.asarray(mask)))))(jnp.asarray(logits))
    assert np.all(np.isfinite(np.asarray(grads)))
    assert np.all(np.asarray(grads)[~mask] == 0.0)


def test_sampling_and_the_mode_never_pick_an_illegal_action():
    key = jax.random.PRNGKey(0)
    k_logits, k_mask, k_sample = jax.random.split(key, 3)
    logits = 3.0 * jax.random.normal(k_logits, (4096, 6))
    mask = jax.random.bernoulli(k_mask, 0.3, (4096, 6)).at[:, 5].set(True)
    dist = networks.mask_logits(DistParams(logits, jnp.zeros(6)), mask)
    sampled = networks.sample(True, dist, k_sample)
    mode = networks.mode(True, dist)
    rows = np.arange(4096)
    assert np.asarray(mask)[rows, np.asarray(sampled)].all()
    assert np.asarray(mask)[rows, np.asarray(mode)].all()
    # the sample follows the renormalised probabilities: one row, many draws
    probs = np.asarray(jax.nn.softmax(dist.loc[0]))
    draws = networks.sample(True, DistParams(jnp.broadcast_to(dist.loc[0], (20000, 6)),
                                             jnp.zeros(6)), k_sample)
    freq = np.bincount(np.asarray(draws), minlength=6) / 20000
    np.testing.assert_allclose(freq, probs, atol=0.015)


# ------------------------------------------------------------------ the env contract
def test_the_mask_is_found_and_its_errors_name_the_fix():
    assert make_env(TINY).masked
    assert not make_env(TINY.replace(mask_actions=False)).masked
    assert not make_env(TINY.replace(env="CartPole-v1")).masked
    with pytest.raises(ConfigError, match=r"mask_actions=true, but CartPole-v1 gives no action "
                                          r"mask.*action_mask\(state, params\)"):
        make_env(TINY.replace(env="CartPole-v1", mask_actions=True))
    with pytest.raises(ConfigError, match=r"continuous actions.*discrete actions only"):
        make_env(TINY.replace(env="Pendulum-v1", mask_actions=True))

    class WrongShape(PickLegal):
        def action_mask(self, state, params=None):
            return state.legal[:3]

    with pytest.raises(ConfigError, match=r"returned bool\[3\]; it must be bool \[8\]"):
        make_env(TINY.replace(env=WrongShape()))

    class FloatMask(PickLegal):
        def action_mask(self, state, params=None):
            return state.legal.astype(jnp.float32)

    with pytest.raises(ConfigError, match=r"returned float32\[8\]; it must be bool \[8\] .*an "
                                          r"integer mask counts nonzero as legal"):
        make_env(TINY.replace(env=FloatMask()))

    class IntMask(PickLegal):  # 0s and 2s: read as bool, nonzero = legal
        def action_mask(self, state, params=None):
            return 2 * state.legal.astype(jnp.int32)

    spec = make_env(TINY.replace(env=IntMask()))
    _, state = spec.env.reset(jax.random.PRNGKey(1), spec.env_params)
    mask = spec.action_mask(state, spec.env_params)
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(state.legal))
    # a frame-stacked env keeps its mask
    spec = make_env(TINY.replace(transforms=({"frame_stack": {"k": 2}},)))
    _, state = spec.env.reset(jax.random.PRNGKey(1), spec.env_params)
    assert spec.masks(jax.tree.map(lambda x: x[None], state)).shape == (1, 8)
    np.testing.assert_array_equal(np.asarray(spec.action_mask(state, spec.env_params)),
                                  np.asarray(state.env_state.legal))


def test_jumanji_masks_are_the_observation_s():
    pytest.importorskip("jumanji")
    spec = make_env(TINY.replace(env="jumanji:Minesweeper-v0"))
    assert spec.masked and spec.action_dim == 100
    env, params = spec.env, spec.env_params
    _, state = env.reset(jax.random.PRNGKey(0), params)
    mask = np.asarray(spec.action_mask(state, params))
    assert mask.shape == (100,) and mask.all()  # nothing revealed yet
    _, state, *_ = env.step(jax.random.PRNGKey(1), state, jnp.int32(37), params)  # [3, 7]
    _, ts = env.jumanji_env.step(env.reset(jax.random.PRNGKey(0), params)[1].jumanji_state,
                                 jnp.asarray([3, 7], jnp.int32))
    if ts.step_type != 2:  # not a mine: the revealed cell is illegal now, as Jumanji says
        np.testing.assert_array_equal(np.asarray(spec.action_mask(state, params)),
                                      np.asarray(ts.observation.action_mask).reshape(-1))
        assert not np.asarray(spec.action_mask(state, params))[37]
    snake = make_env(TINY.replace(env="jumanji:Snake-v1", env_kwargs={"num_rows": 6,
                                                                      "num_cols": 6}))
    assert snake.masked and snake.action_dim == 4


# ------------------------------------------------------------------ training
class DeadEnd(PickLegal):
    """PickLegal whose fourth step of an episode leaves no legal action (an env bug)."""

    def action_mask(self, state, params=None):
        return jnp.logical_and(state.legal, state.time != 3)


def test_a_state_without_a_legal_action_stops_training_naming_the_env(tmp_path):
    cfg = TINY.replace(env=DeadEnd(), total_timesteps=8 * 16 * 2)
    with pytest.raises(ActionMaskError, match=r"DeadEnd's action mask left \d+ state\(s\) with no "
                                              r"legal action in iteration 1's rollout.*Fix the env's"):
        jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False, plot=False)
    assert (tmp_path / "run" / "config.yaml").exists()  # the folder is kept


@pytest.fixture(scope="module")
def masked_vs_unmasked():
    """The same PPO on PickLegal, with and without the mask (2 seeds, 40 iterations each;
    gamma 0.5: a step's reward does not depend on the earlier ones' actions)."""
    cfg = jaxppo.PPOConfig(env=PICK, num_envs=16, num_steps=32, total_timesteps=40 * 512,
                           lr=1e-3, gamma=0.5, num_seeds=2, compilation_cache_dir=None)
    out = {}
    for masked in (True, False):
        r = jaxppo.train(cfg.replace(mask_actions=masked), progress=False, plot=False)
        out[masked] = (np.asarray(r.metrics["episode_return_mean"]),
                       np.asarray(r.metrics["episode_length_mean"]))
    return out


@pytest.mark.slow
def test_masking_never_takes_an_illegal_action_and_learns_faster(masked_vs_unmasked):
    (ret_m, len_m), (ret_u, _) = masked_vs_unmasked[True], masked_vs_unmasked[False]
    # Every masked episode runs its full 16 steps: no illegal action was ever sampled.
    assert np.all(len_m[np.isfinite(len_m)] == 16) and np.isfinite(len_m).sum() > 40, len_m
    # Uniform over the legal actions earns 8 per episode; the unmasked policy starts near 0
    # (an illegal action with probability 5/8 each step ends the episode).
    assert np.nanmean(ret_m[:, :3]) > 7.0 > 2.0 > np.nanmean(ret_u[:, :3])
    assert np.nanmean(ret_m[:, -5:]) > np.nanmean(ret_u[:, -5:]) + 0.5, (ret_m[:, -5:], ret_u[:, -5:])
    # It learns which legal action pays most: the optimum is 12 (measured ~11.4 by now).
    assert np.nanmean(ret_m[:, -5:]) > 10.5 > np.nanmean(ret_m[:, :3]) + 2.0


@pytest.mark.slow
def test_a_recurrent_policy_masks_too():
    cfg = TINY.replace(network=jaxppo.NetworkConfig((16,), recurrent_size=8))
    r = jaxppo.train(cfg, progress=False, plot=False)
    lengths = np.asarray(r.metrics["episode_length_mean"])
    assert np.isfinite(lengths).any() and np.all(lengths[np.isfinite(lengths)] == 16), lengths


PMAP_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jaxppo, numpy as np
base = jaxppo.PPOConfig(env="jaxppo.examples.envs:PickLegal", num_envs=8, num_steps=16,
                        num_minibatches=2, total_timesteps=8 * 16 * 3, compilation_cache_dir=None)
out = {}
for nd, sync in ((1, "gradients"), (2, "gradients"), (2, "batch")):
    r = jaxppo.train(base.replace(num_devices=nd, sync=sync), progress=False, plot=False)
    out[f"{nd}-{sync}"] = {k: np.asarray(r.metrics[k][0]).tolist()
                           for k in ("policy_loss", "entropy", "kl", "episode_length_mean")}
print(json.dumps(out))
"""


def test_masked_training_is_the_same_split_over_devices():
    """Masks travel with the rollout when envs are split over devices (gradients all-reduced)
    or gathered (sync="batch"): the same numbers as one device, no illegal action."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAXPPO_CPU_DEVICES": "2"}
    proc = subprocess.run([sys.executable, "-c", PMAP_SCRIPT], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one = out["1-gradients"]
    for name in ("2-gradients", "2-batch"):
        np.testing.assert_allclose(out[name]["entropy"], one["entropy"], rtol=1e-4, atol=1e-6,
                                   err_msg=f"{name} entropy")
        # Near zero, as means of terms of order one that cancel (normalised advantages): float32
        # sums in another order differ by ~1e-6 (1.3e-6 in the first iteration on one AMD EPYC).
        for k in ("policy_loss", "kl"):
            np.testing.assert_allclose(out[name][k], one[k], rtol=0, atol=1e-5, err_msg=f"{name} {k}")
        assert out[name]["episode_length_mean"] == [16.0] * 3
