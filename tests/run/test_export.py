"""Policy export: the serialized jax.export function and the ONNX model give the actions of
`load_policy` (observation normalisation included) for discrete, continuous, discretised,
CNN and recurrent policies; the JSON description; the errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo import cli
from jaxppo.core.algorithm import Algorithm
from jaxppo.run.policy import Policy
from jaxppo.core.running_stats import RunningStats

TINY = dict(num_envs=4, num_steps=16, num_minibatches=2, num_epochs=1, compilation_cache_dir=None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-seed CartPole run (Python API) and a Pendulum run with the defaults (CLI, a
    Gaussian policy: Pendulum's tuned config discretises its actions), both normalising
    observations, 2 iterations each."""
    base = tmp_path_factory.mktemp("export")
    cartpole = base / "cartpole"
    jaxppo.train(jaxppo.PPOConfig(env="CartPole-v1", total_timesteps=128, num_seeds=2,
                                  normalize_observations=True, network=jaxppo.NetworkConfig((16, 16)),
                                  **TINY), run_dir=cartpole, progress=False, plot=False)
    assert cli.main(["train", "--env", "Pendulum-v1", "--defaults", "--set", "num_envs=4",
                     "num_steps=16", "num_minibatches=2", "num_epochs=1", "total_timesteps=128",
                     "normalize_observations=true", "network.hidden_sizes=[16,16]",
                     "compilation_cache_dir=null", "--runs-dir", str(base), "--run-name",
                     "pendulum", "--no-progress", "--no-plot"]) == 0
    return dict(base=base, cartpole=cartpole, pendulum=base / "pendulum")


def _random_obs(n, dim, scale=2.0, seed=0):
    return (np.random.default_rng(seed).normal(size=(n, dim)) * scale).astype(np.float32)


def _handmade(config, seed=1):
    """A policy with random params (not PPO's tiny policy-head init, so actions differ from
    state to state) and observation statistics far from the identity."""
    algo = Algorithm.create(jaxppo.resolve(config))
    params = algo.network.init(jax.random.PRNGKey(seed), jnp.zeros((1, algo.spec.obs_dim)))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.5 * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys)])
    d = algo.spec.obs_dim
    stats = RunningStats(jnp.linspace(-0.5, 0.5, d), jnp.linspace(0.5, 2.0, d), jnp.asarray(10.0))
    return Policy(algo, params, stats)


def _onnx_session(path):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------- jax format
def test_jax_export_gives_load_policys_actions_for_any_batch(runs, tmp_path):
    out = jaxppo.export_policy(runs["cartpole"], format="jax", path=tmp_path / "p.jaxexport",
                               stochastic=True, seed_index=1)
    policy = jaxppo.load_policy(runs["cartpole"], seed_index=1)
    det = jax.export.deserialize(out.path.read_bytes())
    sample = jax.export.deserialize(out.sample_path.read_bytes())
    assert out.sample_path.name == "p.sample.jaxexport"
    for n in (1, 7, 64):  # the batch dimension is symbolic
        obs = _random_obs(n, 4, seed=n)
        np.testing.assert_array_equal(det.call(obs), policy(obs))
        for seed in (0, 3):
            np.testing.assert_array_equal(sample.call(obs, np.uint32(seed)),
                                          policy(obs, jax.random.PRNGKey(seed)))
    # The other seed of the run is another policy.
    other = jaxppo.load_policy(runs["cartpole"], seed_index=0)
    obs = _random_obs(256, 4)
    assert not np.array_equal(np.asarray(other(obs)), np.asarray(policy(obs))) or \
        not np.array_equal(np.asarray(other.obs_stats.mean), np.asarray(policy.obs_stats.mean))


def test_jax_export_runs_without_jaxppo(runs, tmp_path):
    path = tmp_path / "cartpole.jaxexport"
    jaxppo.export_policy(runs["cartpole"], "jax", path)
    obs = _random_obs(5, 4)
    np.save(tmp_path / "obs.npy", obs)
    code = ("import sys, jax, numpy as np\n"
            f"exp = jax.export.deserialize(open({str(path)!r}, 'rb').read())\n"
            f"print(np.asarray(exp.call(np.load({str(tmp_path / 'obs.npy')!r}))).tolist())\n"
            "assert not any(m.startswith('jaxppo') for m in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == np.asarray(jaxppo.load_policy(runs["cartpole"])(obs)).tolist()


def test_sidecar_describes_inputs_outputs_and_variants(runs, tmp_path):
    out = jaxppo.export_policy(runs["cartpole"], "jax", tmp_path / "p.jaxexport", stochastic=True)
    meta = json.loads((tmp_path / "p.jaxexport.json").read_text())
    assert meta == out.metadata
    assert meta["env"] == "CartPole-v1" and meta["format"] == "jax"
    assert meta["obs"] == {"shape": ["b", 4], "dtype": "float32"}
    assert meta["action"] == {"shape": ["b"], "dtype": "int32", "kind": "discrete", "num_actions": 2}
    assert meta["observation_normalization"] == "included"
    assert meta["variants"] == {
        "deterministic": {"file": "p.jaxexport", "inputs": ["obs"], "outputs": ["action"]},
        "sample": {"file": "p.sample.jaxexport", "inputs": ["obs", "seed"], "outputs": ["action"]}}
    assert "cpu" in meta["platforms"] and "carry" not in meta


def test_a_fixed_batch_size(runs, tmp_path):
    out = jaxppo.export_policy(runs["cartpole"], "jax", tmp_path / "p.jaxexport", batch_size=3)
    exp = jax.export.deserialize(out.path.read_bytes())
    assert exp.in_avals[0].shape == (3, 4) and out.metadata["obs"]["shape"] == [3, 4]


def test_default_path_is_named_after_the_run_folder_inside_it(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = runs["cartpole"]
    out = run / "cartpole-seed1.jaxexport"
    try:
        assert cli.main(["export", str(run), "--format", "jax", "--seed-index", "1"]) == 0
        assert out.is_file() and out.with_name(out.name + ".json").is_file()
        assert capsys.readouterr().out == f"wrote {out}, {out}.json\n"
        assert not list(tmp_path.iterdir())  # nothing in the working directory
    finally:
        out.unlink(missing_ok=True)
        out.with_name(out.name + ".json").unlink(missing_ok=True)


def test_discretised_actions_record_the_original_envs_actions(tmp_path):
    policy = _handmade(jaxppo.PPOConfig.tuned("Pendulum-v1", total_timesteps=64, **TINY))
    out = jaxppo.export_policy(policy, "jax", tmp_path / "pendulum.jaxexport")
    assert out.metadata["action"]["kind"] == "discrete" and out.metadata["action"]["num_actions"] == 5
    assert out.metadata["env_action_table"] == [[-2.0], [-1.0], [0.0], [1.0], [2.0]]
    assert out.metadata["transforms"] == [{"discretize_actions": {"bins": 5}}]
    obs = _random_obs(32, 3)
    np.testing.assert_array_equal(jax.export.deserialize(out.path.read_bytes()).call(obs), policy(obs))


CNN = jaxppo.PPOConfig(env="Breakout-MinAtar", network=jaxppo.NetworkConfig((16,), torso="cnn",
                                                                           conv_channels=(4,)),
                       total_timesteps=64, normalize_observations=True, **TINY)
GRU = jaxppo.PPOConfig(env="MemoryChain-bsuite", total_timesteps=64, normalize_observations=True,
                       network=jaxppo.NetworkConfig((16,), recurrent_size=8), **TINY)


def _minatar_obs(n, seed=0):
    return (np.random.default_rng(seed).random((n, 10, 10, 4)) < 0.2).astype(np.float32)


def test_jax_export_of_a_cnn_policy(tmp_path):
    policy = _handmade(CNN)
    out = jaxppo.export_policy(policy, "jax", tmp_path / "breakout.jaxexport", stochastic=True)
    assert out.metadata["obs"] == {"shape": ["b", 10, 10, 4], "dtype": "float32"}
    obs = _minatar_obs(16)
    det = jax.export.deserialize(out.path.read_bytes())
    sample = jax.export.deserialize(out.sample_path.read_bytes())
    np.testing.assert_array_equal(det.call(obs), policy(obs))
    np.testing.assert_array_equal(sample.call(obs, np.uint32(5)), policy(obs, jax.random.PRNGKey(5)))


def test_jax_export_of_a_recurrent_policy_carries_its_state(tmp_path):
    policy = _handmade(GRU)
    out = jaxppo.export_policy(policy, "jax", tmp_path / "gru.jaxexport", stochastic=True)
    assert out.metadata["carry"] == {"shape": ["b", 8], "dtype": "float32", "initial": "zeros"}
    assert out.metadata["variants"]["sample"]["inputs"] == ["obs", "carry", "seed"]
    det = jax.export.deserialize(out.path.read_bytes())
    sample = jax.export.deserialize(out.sample_path.read_bytes())
    carry = ours = np.zeros((6, 8), np.float32)
    s_carry = s_ours = carry
    for t in range(4):  # a few steps: the carry must travel the same way
        obs = _random_obs(6, 3, seed=t)
        action, carry = det.call(obs, carry)
        expected, ours = policy.step(obs, ours)
        np.testing.assert_array_equal(action, expected)
        np.testing.assert_allclose(carry, ours, atol=1e-6)
        s_action, s_carry = sample.call(obs, s_carry, np.uint32(t))
        s_expected, s_ours = policy.step(obs, s_ours, jax.random.PRNGKey(t))
        np.testing.assert_array_equal(s_action, s_expected)


# ---------------------------------------------------------------------- onnx format
def test_onnx_discrete_matches_load_policy(runs, tmp_path, capsys):
    pytest.importorskip("jax2onnx")
    path = tmp_path / "cartpole.onnx"
    assert cli.main(["export", str(runs["cartpole"]), "--format", "onnx", "-o", str(path),
                     "--stochastic"]) == 0
    assert "cartpole.sample.onnx" in capsys.readouterr().out
    policy = jaxppo.load_policy(runs["cartpole"])
    obs = _random_obs(256, 4)
    det = _onnx_session(path)
    assert [i.name for i in det.get_inputs()] == ["obs"]
    assert det.get_inputs()[0].shape == ["b", 4]
    np.testing.assert_array_equal(det.run(["action"], {"obs": obs})[0], policy(obs))
    # The sampling variant with the Gumbel noise jax.random draws gives the same sample.
    key = jax.random.PRNGKey(7)
    noise = np.asarray(jax.random.gumbel(key, (256, 2)))
    sample = _onnx_session(tmp_path / "cartpole.sample.onnx")
    np.testing.assert_array_equal(sample.run(["action"], {"obs": obs, "noise": noise})[0],
                                  policy(obs, key))
    meta = json.loads((tmp_path / "cartpole.onnx.json").read_text())
    assert meta["noise"] == {"shape": ["b", 2], "dtype": "float32", "distribution": "gumbel(0, 1)"}


def test_onnx_continuous_matches_load_policy(runs, tmp_path):
    pytest.importorskip("jax2onnx")
    out = jaxppo.export_policy(runs["pendulum"], "onnx", tmp_path / "pendulum.onnx", stochastic=True)
    policy = jaxppo.load_policy(runs["pendulum"])
    assert not policy.spec.discrete and out.metadata["action"]["kind"] == "continuous"
    assert out.metadata["action"]["low"] == [-2.0] and out.metadata["action"]["high"] == [2.0]
    obs = _random_obs(256, 3, scale=3.0)
    det = _onnx_session(out.path)
    np.testing.assert_allclose(det.run(None, {"obs": obs})[0], policy(obs), atol=1e-5)
    sample = _onnx_session(out.sample_path)
    key = jax.random.PRNGKey(3)
    noise = np.asarray(jax.random.normal(key, (256, 1)))  # what policy(obs, key) draws
    np.testing.assert_allclose(sample.run(None, {"obs": obs, "noise": noise})[0], policy(obs, key),
                               atol=1e-5)
    sampled = sample.run(None, {"obs": obs, "noise": 10 * noise})[0]  # some beyond the bounds
    np.testing.assert_allclose(sampled, _jax_sample(policy, obs, 10 * noise), atol=1e-5)
    assert sampled.min() == -2.0 and sampled.max() == 2.0


def _jax_sample(policy, obs, noise):
    """jaxppo's sample for given Gaussian noise (what `policy(obs, key)` does with its own)."""
    from jaxppo.core import networks
    from jaxppo.envs.spec import env_action

    algo = policy.algorithm
    obs_in = algo.obs_in(policy.obs_stats, jnp.asarray(obs))
    dist, _, _ = algo.network.apply(policy.params, obs_in, ())
    return env_action(algo.spec, networks.sample_with_noise(False, dist, jnp.asarray(noise)))


@pytest.mark.parametrize("which", ["cnn", "recurrent"])
def test_onnx_cnn_and_recurrent_policies(which, tmp_path):
    pytest.importorskip("jax2onnx")
    policy = _handmade(CNN if which == "cnn" else GRU)
    out = jaxppo.export_policy(policy, "onnx", tmp_path / f"{which}.onnx")
    session = _onnx_session(out.path)
    if which == "cnn":
        obs = _minatar_obs(16)
        np.testing.assert_array_equal(session.run(None, {"obs": obs})[0], policy(obs))
        return
    assert [i.name for i in session.get_inputs()] == ["obs", "carry"]
    assert [o.name for o in session.get_outputs()] == ["action", "next_carry"]
    carry = ours = np.zeros((6, 8), np.float32)
    for t in range(4):
        obs = _random_obs(6, 3, seed=t)
        action, carry = session.run(None, {"obs": obs, "carry": carry})
        expected, ours = policy.step(obs, ours)
        np.testing.assert_array_equal(action, expected)
        np.testing.assert_allclose(carry, ours, atol=1e-5)


# ---------------------------------------------------------------------- errors
def test_missing_onnx_extra_names_the_install(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax2onnx", None)  # what an uninstalled package looks like
    with pytest.raises(jaxppo.ExportError, match=r"pip install 'jaxppo\[export\]'"):
        jaxppo.export_policy(runs["cartpole"], "onnx", tmp_path / "p.onnx")
    assert not (tmp_path / "p.onnx").exists()


def test_export_never_overwrites_the_run_folders_files(runs, tmp_path, capsys):
    """An output that is (after links and "..") one of the run folder's own files, or whose
    .json description would be, is refused before anything is written; a new name next to
    them is fine."""
    run = runs["cartpole"]
    own = {name: (run / name).read_bytes() for name in ("params.msgpack", "summary.json",
                                                        "config.yaml")}
    for output, named in ((run / "params.msgpack", "own params.msgpack"),
                          (run / "summary", "summary.json (written with"),  # + ".json"
                          (run / "checkpoints" / ".." / "config.yaml", "own config.yaml"),
                          (run / "checkpoints" / "p.jaxexport", "own checkpoints"),
                          (run / "best" / "params.msgpack", "own best/")):
        assert cli.main(["export", str(run), "--format", "jax", "-o", str(output)]) == 2, output
        err = capsys.readouterr().err
        assert "would overwrite" in err and named in err and "outside the run folder" in err, err
    from jaxppo.distributed.cluster import HOSTS_LOG
    from jaxppo.run.folder import RUN_FILES

    assert HOSTS_LOG in RUN_FILES  # named there by value: that module imports Ray
    link = tmp_path / "link.jaxexport"
    link.symlink_to(run / "params.msgpack")
    with pytest.raises(jaxppo.ExportError, match="own params.msgpack"):
        jaxppo.export_policy(run, "jax", link)
    assert {name: (run / name).read_bytes() for name in own} == own
    assert not (run / "checkpoints" / "p.jaxexport").exists() and not (run / "summary").exists()
    out = run / "policy.jaxexport"  # a new name in the folder; a gymnax env imports nothing
    try:
        assert cli.main(["export", str(run), "--format", "jax", "-o", str(out), "--no-imports"]) == 0
        assert out.exists()
    finally:
        out.unlink(missing_ok=True)
        out.with_name(out.name + ".json").unlink(missing_ok=True)


def test_export_writes_nothing_through_a_link_or_into_best(runs, tmp_path, capsys):
    """Links planted at the default outputs (RUN/RUN.jaxexport and its .json) are refused,
    named, and left as they are, as is what they point to; best/'s files are the folder's
    own."""
    run = shutil.copytree(runs["cartpole"], tmp_path / "cartpole")
    target = tmp_path / "outside.txt"
    target.write_text("not jaxppo's\n")
    for name in ("cartpole.jaxexport", "cartpole.jaxexport.json"):
        link = run / name
        link.symlink_to(target)
        assert cli.main(["export", str(run), "--format", "jax"]) == 2
        err = capsys.readouterr().err
        assert f"{link}" in err and "is a symbolic link" in err and "Remove the link" in err, err
        assert link.is_symlink() and target.read_text() == "not jaxppo's\n"
        link.unlink()
    assert not (run / "cartpole.jaxexport").exists()
    (run / "best").mkdir()  # as a run with eval_every keeps it
    shutil.copy(run / "params.msgpack", run / "best" / "params.msgpack")
    (run / "best" / "best.json").write_text('{"iteration": 2}')
    best = {p: p.read_bytes() for p in (run / "best").iterdir()}
    for output in ("params.msgpack", "best.json", "best"):  # "best": its .json is best.json
        assert cli.main(["export", str(run), "--format", "jax", "-o",
                         str(run / "best" / output)]) == 2
        assert f"{run}'s own best/" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (run / "best").iterdir()} == best


def test_export_replaces_a_link_outside_the_run_folder(runs, tmp_path):
    """-o may name any path outside the run folder; a link there is replaced by the export,
    not written through."""
    target = tmp_path / "outside.txt"
    target.write_text("not jaxppo's\n")
    out = tmp_path / "p.jaxexport"
    out.symlink_to(target)
    jaxppo.export_policy(runs["cartpole"], "jax", out, batch_size=2)
    assert not out.is_symlink() and target.read_text() == "not jaxppo's\n"
    assert jax.export.deserialize(out.read_bytes()).in_avals[0].shape == (2, 4)


def test_bad_inputs_are_clear_errors(runs, tmp_path, capsys):
    with pytest.raises(jaxppo.ExportError, match="format='tflite' is not an export format"):
        jaxppo.export_policy(runs["cartpole"], "tflite", tmp_path / "p")
    with pytest.raises(jaxppo.ExportError, match="batch_size=0"):
        jaxppo.export_policy(runs["cartpole"], "jax", tmp_path / "p", batch_size=0)
    assert cli.main(["export", str(tmp_path / "missing"), "--format", "jax"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["export", str(runs["cartpole"]), "--format", "jax", "--seed-index", "5"]) == 2
    assert "holds 2 seed(s)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["export", str(runs["cartpole"]), "--format", "tflite"])
