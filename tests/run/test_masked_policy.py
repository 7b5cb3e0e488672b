"""A policy trained with the env's action mask, outside training: a loaded policy, the
TrainResult, evaluation, export and recorded episodes all take the legal actions and never
act outside them; a missing or malformed mask is a clear error."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import jaxppo
from jaxppo import cli
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.running_stats import RunningStats
from jaxppo.examples.envs import PickLegal
from jaxppo.run.policy import Policy
from jaxppo.run.video import record_episodes

ENV = "jaxppo.examples.envs:PickLegal"
A, OBS = 8, 16  # PickLegal's actions and observation size


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    """One tiny masked run (its TrainResult and its run folder's loaded policy)."""
    run = tmp_path_factory.mktemp("masked") / "picklegal"
    result = jaxppo.train(jaxppo.PPOConfig(env=ENV, num_envs=4, num_steps=16, total_timesteps=1024,
                                           compilation_cache_dir=None),
                          run_dir=run, progress=False, plot=False)
    return {"run": run, "result": result, "policy": jaxppo.load_policy(run)}


def _obs_and_masks(n, seed=0, legal=None):
    """Random observations [n, 16] and masks [n, 8] with at least one legal action per row
    (exactly one when legal=1)."""
    rng = np.random.default_rng(seed)
    obs = rng.uniform(size=(n, OBS)).astype(np.float32)
    masks = rng.uniform(size=(n, A)) < 0.4 if legal is None else np.zeros((n, A), bool)
    masks[np.arange(n), rng.integers(0, A, n)] = True
    return obs, masks


def _legal(actions, masks) -> bool:
    actions = np.asarray(actions)
    return bool(masks[np.arange(len(actions)), actions].all())


def _unmasked_policy():
    """An untrained policy of the same env trained without its mask (mask_actions=false)."""
    algo = Algorithm.create(jaxppo.resolve(jaxppo.PPOConfig(env=ENV, mask_actions=False)))
    params = algo.network.init(jax.random.PRNGKey(0), np.zeros((1, OBS), np.float32))
    return Policy(algo, params, RunningStats.create((OBS,)))


def test_a_loaded_masked_policy_acts_legally_sampled_and_deterministic(masked):
    policy, result = masked["policy"], masked["result"]
    assert policy.masked and "masked" in repr(policy)
    obs, masks = _obs_and_masks(512)
    det = policy(obs, action_mask=masks)
    assert _legal(det, masks)
    np.testing.assert_array_equal(det, result.policy(obs, deterministic=True, action_mask=masks))
    for seed in range(4):
        key = jax.random.PRNGKey(seed)
        sampled = policy(obs, key, action_mask=masks)
        assert _legal(sampled, masks)
        np.testing.assert_array_equal(sampled, result.policy(obs, key, action_mask=masks))
    # One legal action per row: it is the action, whatever the network prefers; 0/1 ints work.
    obs, one = _obs_and_masks(512, seed=1, legal=1)
    np.testing.assert_array_equal(policy(obs, action_mask=one.astype(np.int32)), one.argmax(-1))
    np.testing.assert_array_equal(policy(obs, jax.random.PRNGKey(9), action_mask=one),
                                  one.argmax(-1))
    # One observation and its [A] mask; step with a carry as well.
    assert one[0, int(policy(obs[0], action_mask=one[0]))]
    action, carry = policy.step(obs[:3], (), None, one[:3])
    np.testing.assert_array_equal(action, one[:3].argmax(-1))
    assert carry == ()


def test_action_mask_of_one_state_and_of_a_batch(masked):
    policy = masked["policy"]
    env, params = PickLegal(), policy.env_params
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    obs, states = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
    batch = policy.action_mask(states)
    assert batch.shape == (3, A) and batch.dtype == bool
    np.testing.assert_array_equal(batch, states.legal)
    one = jax.tree.map(lambda x: x[2], states)
    np.testing.assert_array_equal(policy.action_mask(one), states.legal[2])
    assert _legal(policy(obs, action_mask=batch), np.asarray(batch))
    with pytest.raises(TypeError, match="not a state"):
        policy.action_mask({"legal": states.legal})
    with pytest.raises(TypeError, match="trained without an action mask"):
        _unmasked_policy().action_mask(one)


def test_missing_wrong_and_empty_masks_are_clear_errors(masked):
    policy, result = masked["policy"], masked["result"]
    obs, masks = _obs_and_masks(4)
    with pytest.raises(TypeError, match=r"trained with .*mask.*policy\.action_mask\(state\)"):
        policy(obs)
    with pytest.raises(TypeError, match="trained with"):
        policy.step(obs, ())
    with pytest.raises(TypeError, match="trained with"):
        result.policy(obs, deterministic=True)
    with pytest.raises(ValueError, match=r"shape \(4, 7\).*\(4, 8\)"):
        policy(obs, action_mask=masks[:, :7])
    with pytest.raises(ValueError, match=r"shape \(8,\).*\(4, 8\)"):
        policy(obs, action_mask=masks[0])
    empty = masks.copy()
    empty[2] = False
    with pytest.raises(ValueError, match=r"no legal action \(the first at index \(2,\)\)"):
        policy(obs, action_mask=empty)
    with pytest.raises(TypeError, match="other than 0 and 1"):
        policy(obs, action_mask=masks * 2.5)
    with pytest.raises(TypeError, match="not an array of bools"):
        policy(obs, action_mask=[["yes"] * A] * 4)
    # An unmasked policy refuses a mask rather than ignoring it.
    with pytest.raises(TypeError, match=r"trained without an action mask \(mask_actions=false\)"):
        _unmasked_policy()(obs, action_mask=masks)


def test_evaluation_and_recorded_episodes_stay_legal(masked, capsys):
    # An illegal action pays -1 and ends PickLegal's 16-step episode: a masked policy never does.
    assert cli.main(["eval", str(masked["run"]), "--episodes", "8", "--stochastic", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lengths"] == [16] * 8 and min(out["returns"]) > 0
    (episode,) = record_episodes(masked["policy"], deterministic=False)
    assert episode.length == 16 and episode.rewards.min() >= 0


def test_jax_export_takes_the_mask_after_the_observations(masked, tmp_path):
    policy = masked["policy"]
    out = jaxppo.export_policy(masked["run"], "jax", tmp_path / "p.jaxexport", stochastic=True)
    meta = out.metadata
    assert meta["variants"]["deterministic"]["inputs"] == ["obs", "action_mask"]
    assert meta["variants"]["sample"]["inputs"] == ["obs", "action_mask", "seed"]
    assert meta["action_mask"]["shape"] == ["b", A] and meta["action_mask"]["dtype"] == "bool"
    det = jax.export.deserialize(out.path.read_bytes())
    sample = jax.export.deserialize(out.sample_path.read_bytes())
    obs, masks = _obs_and_masks(512, seed=2)
    action = det.call(obs, masks)
    assert _legal(action, masks)
    np.testing.assert_array_equal(action, policy(obs, action_mask=masks))
    for seed in (0, 5):
        action = sample.call(obs, masks, np.uint32(seed))
        assert _legal(action, masks)
        np.testing.assert_array_equal(action, policy(obs, jax.random.PRNGKey(seed), masks))
    # A row with no legal action gets -1 from every variant, the others their legal action.
    masks[::3] = False
    for action in (det.call(obs, masks), sample.call(obs, masks, np.uint32(0))):
        action = np.asarray(action)
        assert (action[::3] == -1).all()
        assert _legal(np.delete(action, np.s_[::3]), np.delete(masks, np.s_[::3], axis=0))


def test_onnx_export_takes_the_mask_after_the_observations(masked, tmp_path):
    pytest.importorskip("jax2onnx")
    ort = pytest.importorskip("onnxruntime")
    policy = masked["policy"]
    out = jaxppo.export_policy(policy, "onnx", tmp_path / "p.onnx", stochastic=True)
    det = ort.InferenceSession(str(out.path), providers=["CPUExecutionProvider"])
    sample = ort.InferenceSession(str(out.sample_path), providers=["CPUExecutionProvider"])
    assert [i.name for i in det.get_inputs()] == ["obs", "action_mask"]
    assert [i.name for i in sample.get_inputs()] == ["obs", "action_mask", "noise"]
    obs, masks = _obs_and_masks(512, seed=3)
    action = det.run(["action"], {"obs": obs, "action_mask": masks})[0]
    assert _legal(action, masks)
    np.testing.assert_array_equal(action, policy(obs, action_mask=masks))
    key = jax.random.PRNGKey(4)
    noise = np.asarray(jax.random.gumbel(key, (512, A)))  # what policy(obs, key) draws
    action = sample.run(["action"], {"obs": obs, "action_mask": masks, "noise": noise})[0]
    assert _legal(action, masks)
    np.testing.assert_array_equal(action, policy(obs, key, action_mask=masks))
    masks[1::4] = False
    for sess, extra in ((det, {}), (sample, {"noise": noise})):
        action = sess.run(["action"], {"obs": obs, "action_mask": masks, **extra})[0]
        assert (action[1::4] == -1).all()
        assert _legal(np.delete(action, np.s_[1::4]), np.delete(masks, np.s_[1::4], axis=0))
