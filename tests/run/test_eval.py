"""Evaluation: hand-computed returns on a tiny env, in-training evaluation that leaves the
training randomness alone, and the load_policy round trip."""

from __future__ import annotations

import json
import shutil
import struct as pystruct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import struct
from gymnax.environments import environment, spaces

import jaxppo
from checkpoint_records import edit_records  # tests/ is on sys.path
from jaxppo import cli
from jaxppo.core.algorithm import Algorithm
from jaxppo.run.checkpoints import CheckpointError, save_params
from jaxppo.config import NetworkConfig, PPOConfig
from jaxppo.core.evaluation import EVAL_KEY_TAG, run_episodes
from jaxppo.core.running_stats import RunningStats


# ---------------------------------------------------------------------- a tiny env
@struct.dataclass
class CountdownState(environment.EnvState):
    length: int


@struct.dataclass
class CountdownParams(environment.EnvParams):
    max_steps_in_episode: int = 100
    min_len: int = 1
    max_len: int = 7


class Countdown(environment.Environment):
    """An episode lasts L steps, L drawn uniformly from [min_len, max_len] at reset.
    Reward 1 + action (actions 0/1); observation [t, L]; terminated when t reaches L."""

    @property
    def default_params(self):
        return CountdownParams()

    def step_env(self, key, state, action, params):
        t = state.time + 1
        new = CountdownState(time=t, length=state.length)
        reward = 1.0 + jnp.asarray(action, jnp.float32)
        return self._obs(new), new, reward, t >= state.length, {}

    def reset_env(self, key, params):
        length = jax.random.randint(key, (), params.min_len, params.max_len + 1)
        state = CountdownState(time=0, length=length)
        return self._obs(state), state

    def _obs(self, state):
        return jnp.stack([state.time, state.length]).astype(jnp.float32)

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(0.0, 1000.0, (2,), jnp.float32)


ENV = Countdown()


def always(action):
    return lambda obs, key: jnp.full(obs.shape[:1], action, jnp.int32)


def alternate(obs, key):  # 1 on even steps, 0 on odd ones
    return (obs[:, 0].astype(jnp.int32) % 2 == 0).astype(jnp.int32)


def _episodes(act, params, n=16, max_steps=1000, seed=0):
    def step(obs, key, carry):
        return act(obs, key), carry

    stats = jax.jit(lambda k: run_episodes(step, ENV, params, k, n, max_steps))(jax.random.PRNGKey(seed))
    return np.asarray(stats.returns), np.asarray(stats.lengths)


def test_each_env_plays_exactly_one_episode():
    returns, lengths = _episodes(always(1), ENV.default_params, n=64)
    # Random lengths 1..7: an env that finished early must not collect anything afterwards.
    assert set(lengths.tolist()) == set(range(1, 8))
    np.testing.assert_array_equal(returns, 2.0 * lengths)
    returns0, lengths0 = _episodes(always(0), ENV.default_params, n=64)
    np.testing.assert_array_equal(lengths0, lengths)  # same reset keys, same episodes
    np.testing.assert_array_equal(returns0, 1.0 * lengths)


def test_hand_computed_return_of_an_alternating_policy():
    params = CountdownParams(min_len=5, max_len=5)
    returns, lengths = _episodes(alternate, params, n=4)
    np.testing.assert_array_equal(returns, [8.0] * 4)  # 2 + 1 + 2 + 1 + 2
    np.testing.assert_array_equal(lengths, [5] * 4)


def test_episodes_are_cut_at_max_steps_and_at_the_env_time_limit():
    returns, lengths = _episodes(always(1), CountdownParams(min_len=50, max_len=50), max_steps=7)
    np.testing.assert_array_equal(lengths, [7] * 16)
    np.testing.assert_array_equal(returns, [14.0] * 16)
    returns, lengths = _episodes(always(1), CountdownParams(max_steps_in_episode=3, min_len=5, max_len=5))
    np.testing.assert_array_equal(lengths, [3] * 16)
    np.testing.assert_array_equal(returns, [6.0] * 16)


@pytest.mark.parametrize("bias, deterministic, expected", [
    ([0.0, 5.0], True, 10.0), ([5.0, 0.0], True, 5.0), ([0.0, 60.0], False, 10.0)])
def test_algorithm_evaluate_with_a_hand_made_policy(bias, deterministic, expected):
    cfg = PPOConfig(env=ENV, env_kwargs={"min_len": 5, "max_len": 5}, num_envs=4, num_steps=16,
                    network=NetworkConfig((8,)), eval_episodes=6,
                    eval_deterministic=deterministic, compilation_cache_dir=None).validate()
    algo = Algorithm.create(jaxppo.resolve(cfg))
    params = algo.network.init(jax.random.PRNGKey(0), jnp.zeros((1, 2)))
    head = params["params"]["policy_head"]
    params["params"]["policy_head"] = {"kernel": jnp.zeros_like(head["kernel"]),
                                       "bias": jnp.asarray(bias, jnp.float32)}
    stats = RunningStats.create((2,))
    m = jax.jit(algo.evaluate)(params, stats, jax.random.PRNGKey(1))
    assert float(m["eval_return_mean"]) == expected
    assert float(m["eval_return_std"]) == 0.0
    assert float(m["eval_length_mean"]) == 5.0


# ---------------------------------------------------------------------- evaluation in training
# Two seeds (vmapped), 4 iterations, evaluation after iterations 3 (a multiple) and 4 (the end).
CFG = PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=16, total_timesteps=4 * 64, num_minibatches=2,
    network=NetworkConfig((16, 16)), log_every=2, num_seeds=2, normalize_observations=True,
    eval_episodes=5, compilation_cache_dir=None,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, fully_optimised):
    """Training with and without evaluation: two programs, compared to the last bit, so
    compiled as users' runs are (tests/conftest.py)."""
    base = tmp_path_factory.mktemp("eval")
    with fully_optimised():
        plain = jaxppo.train(CFG, progress=False)
        evaluated = jaxppo.train(CFG.replace(eval_every=3, tensorboard=True),
                                 run_dir=base / "run", progress=False)
    return dict(base=base, run=base / "run", plain=plain, evaluated=evaluated)


def test_evaluation_does_not_change_training(trained):
    plain, ev = trained["plain"], trained["evaluated"]
    for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(ev.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for k, v in plain.metrics.items():
        if k not in ("wall_time", "sps"):
            np.testing.assert_array_equal(v, ev.metrics[k], err_msg=k)
    assert "eval_return_mean" not in plain.metrics


def test_eval_metrics_on_eval_iterations_only(trained):
    m = trained["evaluated"].metrics
    for k in ("eval_return_mean", "eval_return_std", "eval_length_mean"):
        assert m[k].shape == (2, 4)
        assert np.isnan(m[k][:, :2]).all() and np.isfinite(m[k][:, 2:]).all(), k
    assert (m["eval_length_mean"][:, 2:] >= 1).all()
    rows = [json.loads(line) for line in (trained["run"] / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8  # 4 iterations x 2 seeds
    assert [r["eval_return_mean"] is None for r in rows] == [True] * 4 + [False] * 4


def test_summary_reports_the_last_evaluation_per_seed(trained):
    from jaxppo.run.folder import summary as _summary

    ev = trained["evaluated"]
    s = _summary(ev)
    last = [float(v) for v in ev.metrics["eval_return_mean"][:, -1]]
    assert s["final_eval_return_per_seed"] == last
    assert s["final_eval_return_mean"] == pytest.approx(np.mean(last))
    assert s["final_eval_return_std"] == pytest.approx(np.std(last))
    assert s["final_eval_iteration"] == 4
    assert "final_eval_return_mean" not in _summary(trained["plain"])


def test_a_run_folders_summary_json_is_strict_json(trained):
    """summary.json parses with a parser that knows no NaN, and states the steps per seed and
    over both seeds."""
    def refuse(name):
        raise ValueError(f"{name} in summary.json")

    s = json.loads((trained["run"] / "summary.json").read_text(), parse_constant=refuse)
    assert s["env_steps"] == CFG.total_timesteps and s["num_seeds"] == 2
    assert s["env_steps_all_seeds"] == s["env_steps_this_call"] == 2 * CFG.total_timesteps
    assert s["resumed_from"] is None


def test_final_in_training_eval_matches_the_loaded_policy(trained):
    """The program's last evaluation, replayed outside it with the loaded policy and the same
    key, gives the same returns."""
    ev = trained["evaluated"]
    for seed in range(2):
        policy = jaxppo.load_policy(trained["run"], seed_index=seed)
        key = jax.random.fold_in(jnp.asarray(ev.state.rng)[seed], EVAL_KEY_TAG)
        stats = jax.jit(lambda k: run_episodes(lambda o, _, c: (policy(o), c), policy.spec.env,
                                               policy.spec.env_params, k, 5, 500))(key)
        assert float(jnp.mean(stats.returns)) == pytest.approx(float(ev.metrics["eval_return_mean"][seed, -1]))


# ---------------------------------------------------------------------- load_policy
def _some_obs(n=64):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(scale=[1.0, 1.0, 0.1, 1.0], size=(n, 4)), jnp.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_loaded_policy_acts_like_the_trained_one(trained, seed):
    ev = trained["evaluated"]
    policy = jaxppo.load_policy(trained["run"], seed_index=seed)
    assert policy.iteration == 4
    obs = _some_obs()
    np.testing.assert_array_equal(policy(obs), ev.policy(obs, deterministic=True, seed=seed))
    key = jax.random.PRNGKey(7)
    np.testing.assert_array_equal(policy(obs, key), ev.policy(obs, key, seed=seed))
    np.testing.assert_array_equal(policy(obs[0]), ev.policy(obs[0], deterministic=True, seed=seed))
    # The same evaluation numbers from the loaded policy and from the TrainResult.
    assert policy.evaluate(episodes=6, seed=3) == ev.evaluate(episodes=6, seed=3, policy_seed=seed)


def test_load_policy_from_params_msgpack_and_errors(trained, tmp_path):
    ev = trained["evaluated"]
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    shutil.rmtree(run / "checkpoints")
    save_params(run / "params.msgpack", ev)
    policy = jaxppo.load_policy(run, seed_index=1)
    obs = _some_obs()
    np.testing.assert_array_equal(policy(obs), ev.policy(obs, deterministic=True, seed=1))
    with pytest.raises(CheckpointError, match="does not exist"):
        jaxppo.load_policy(tmp_path / "missing")
    (run / "params.msgpack").unlink()
    with pytest.raises(CheckpointError, match="no trained policy"):
        jaxppo.load_policy(run)


def test_cli_eval_prints_mean_and_std(trained, capsys):
    policy = jaxppo.load_policy(trained["run"])
    want = policy.evaluate(episodes=3, seed=2)
    assert cli.main(["eval", str(trained["run"]), "--episodes", "3", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert f"return {want['return_mean']:.2f} ± {want['return_std']:.2f}" in out
    assert f"length {want['length_mean']:.1f}" in out and "3 episodes" in out
    assert cli.main(["eval", str(trained["run"]), "--episodes", "3", "--stochastic", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["episodes"] == 3 and got["deterministic"] is False
    assert cli.main(["eval", str(trained["base"] / "nope")]) == 2


def test_cli_eval_evaluates_every_seed_with_one_compile(trained, capsys, monkeypatch):
    """Without --seed-index every seed is evaluated: each seed's figures are those of
    load_policy(seed_index=i).evaluate, the aggregate is mean ± std of the seeds' means, in
    the text and in --json; the evaluation program is compiled once for all seeds."""
    import jaxppo.run.policy as policy_module

    seeds = CFG.num_seeds
    want = [jaxppo.load_policy(trained["run"], seed_index=i).evaluate(episodes=3, seed=2)
            for i in range(seeds)]
    assert want[0]["returns"] != want[1]["returns"]  # the seeds differ: the check can fail
    compiles = []
    real = policy_module._evaluator
    monkeypatch.setattr(policy_module, "_evaluator",
                        lambda *a, **kw: compiles.append(1) or real(*a, **kw))
    assert cli.main(["eval", str(trained["run"]), "--episodes", "3", "--seed", "2", "--json"]) == 0
    assert len(compiles) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["seeds"] == seeds and got["episodes"] == 3 and got["deterministic"] is True
    assert [s["seed_index"] for s in got["per_seed"]] == list(range(seeds))
    for mine, ref in zip(got["per_seed"], want):
        assert mine["returns"] == ref["returns"] and mine["lengths"] == ref["lengths"]
        assert mine["return_mean"] == pytest.approx(ref["return_mean"])
    means = np.array([w["return_mean"] for w in want])
    assert got["aggregate"]["return_mean"] == pytest.approx(means.mean())
    assert got["aggregate"]["return_std"] == pytest.approx(means.std())
    assert got["aggregate"]["length_mean"] == pytest.approx(np.mean([w["length_mean"] for w in want]))

    assert cli.main(["eval", str(trained["run"]), "--episodes", "3", "--seed", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"{seeds} seeds, 3 episodes each" in lines[0]
    for i, ref in enumerate(want):
        assert lines[1 + i].strip().startswith(
            f"seed {i}: return {ref['return_mean']:.2f} ± {ref['return_std']:.2f}, length "
            f"{ref['length_mean']:.1f} ± {ref['length_std']:.1f}")
    assert f"return {means.mean():.2f} ± {means.std():.2f}" in lines[-1] and "over the 2 seeds" in lines[-1]

    # --seed-index keeps evaluating one seed, in the one-seed shape.
    assert cli.main(["eval", str(trained["run"]), "--episodes", "3", "--seed", "2",
                     "--seed-index", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["seed_index"] == 1 and "per_seed" not in one
    assert one["returns"] == want[1]["returns"]


def test_a_shared_folder_naming_a_function_runs_nothing(trained, tmp_path, capsys):
    """config.yaml naming `os:system` with env_kwargs {command: ...}: a ConfigError (exit 2)
    before anything is called; a gymnax env's folder loads with --no-imports."""
    pwned = tmp_path / "pwned"
    run = tmp_path / "shared"
    shutil.copytree(trained["run"], run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config.update(env="os:system", env_kwargs={"command": f"touch {pwned}"})
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    # config.yaml alone disagrees with the checkpoint's record of the config: refused as such
    with pytest.raises(jaxppo.ConfigError, match=r"env is 'os:system' in config.yaml but "
                                                 r"'CartPole-v1' in the checkpoint") as refused:
        jaxppo.load_policy(run)
    assert "--set" not in str(refused.value)  # loading a policy takes no other value
    edit_records(run, lambda r: r["config"].update(  # the record edited as well
        env="os:system", env_kwargs={"command": f"touch {pwned}"}))
    with pytest.raises(jaxppo.ConfigError, match=r"'os:system' is a function, not an env class"):
        jaxppo.load_policy(run)
    assert cli.main(["eval", str(run)]) == 2
    assert "'os:system' is a function, not an env class" in capsys.readouterr().err
    assert not pwned.exists()
    assert jaxppo.load_policy(trained["run"], trust_config=False).config.env == "CartPole-v1"
    assert cli.main(["eval", str(trained["run"]), "--episodes", "2", "--no-imports"]) == 0


# ---------------------------------------------------------------------- TensorBoard
def _read_events(path: Path) -> list:
    """Scalar (tag, step, value) of a TFRecord event file, parsed with tensorboardX's protos."""
    from tensorboardX.proto import event_pb2

    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = pystruct.unpack("<Q", data[i:i + 8])
        event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for v in event.summary.value:
            out.append((v.tag, event.step, v.simple_value))
    return out


def test_tensorboard_event_files_per_seed(trained):
    ev = trained["evaluated"]
    for seed in range(2):
        files = list((trained["run"] / "tensorboard" / f"seed_{seed}").glob("events.out.tfevents*"))
        assert len(files) == 1
        scalars = _read_events(files[0])
        ret = [(s, v) for t, s, v in scalars if t == "charts/episode_return_mean"]
        evals = [(s, v) for t, s, v in scalars if t == "eval/return_mean"]
        assert [s for s, _ in evals] == [3 * 64, 4 * 64]
        assert evals[-1][1] == pytest.approx(float(ev.metrics["eval_return_mean"][seed, -1]))
        assert len(ret) >= 1 and all(s % 64 == 0 for s, _ in ret)


def test_seed_indices_and_bounds_out_of_range_are_errors(trained, capsys):
    seeds = CFG.num_seeds
    with pytest.raises(ValueError, match=f"seed_index={seeds}, but .* holds {seeds} seed"):
        jaxppo.load_policy(trained["run"], seed_index=seeds)
    obs = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=f"seed=7, but the run trained {seeds} seed"):
        trained["plain"].policy(obs, deterministic=True, seed=7)
    with pytest.raises(ValueError, match="max_steps=0 must be an integer >= 1"):
        jaxppo.load_policy(trained["run"]).evaluate(episodes=2, max_steps=0)
    assert cli.main(["eval", str(trained["run"]), "--max-steps", "0"]) == 2
    assert cli.main(["eval", str(trained["run"]), "--seed-index", str(seeds + 2)]) == 2
    err = capsys.readouterr().err
    assert "max_steps=0 must be" in err and f"seed_index={seeds + 2}" in err


# ---------------------------------------------------------------------- bad arguments to a trained policy
@pytest.mark.parametrize("obs,error,match", [
    (np.zeros(3, np.float32), ValueError,
     r"^obs has shape \(3,\), but CartPole-v1's observations have shape \(4,\); pass one observation"),
    (np.zeros((5, 3), np.float32), ValueError, r"^obs has shape \(5, 3\), but CartPole-v1's observations"),
    (np.array(["a", "b", "c", "d"]), TypeError, r"is not an array of numbers; pass one observation of shape \(4,\)"),
    (None, TypeError, r"^obs=None is not an array of numbers"),
])
def test_observations_of_the_wrong_shape_or_kind(trained, obs, error, match):
    """A clear error at the edge, not flax's ScopeParamShapeError from inside the network."""
    policy = jaxppo.load_policy(trained["run"])
    for call in (lambda: trained["plain"].policy(obs, deterministic=True),
                 lambda: trained["plain"].value(obs), lambda: policy(obs),
                 lambda: policy.step(obs, ())):
        with pytest.raises(error, match=match):
            call()


def test_observations_as_lists_and_with_extra_batch_axes_work(trained):
    policy = jaxppo.load_policy(trained["run"])
    obs = np.asarray(_some_obs(6))
    np.testing.assert_array_equal(policy(obs.tolist()), policy(obs))
    np.testing.assert_array_equal(trained["plain"].policy(obs.tolist(), deterministic=True),
                                  trained["plain"].policy(obs, deterministic=True))
    assert policy(obs.reshape(2, 3, 4)).shape == (2, 3)


@pytest.mark.parametrize("key,got", [(5, "got int 5"), (jnp.zeros(3, jnp.uint32), r"shape \(3,\)"),
                                     (jax.random.split(jax.random.PRNGKey(0), 4), r"shape \(4, 2\)")])
def test_keys_that_are_not_one_prng_key(trained, key, got):
    obs = _some_obs(4)
    match = rf"^key must be one PRNG key, e\.g\. jax\.random\.PRNGKey\(0\).*{got}"
    with pytest.raises(TypeError, match=match):
        trained["plain"].policy(obs, key)
    with pytest.raises(TypeError, match=match):
        jaxppo.load_policy(trained["run"])(obs, key)


def test_policy_carry_batch_shape_and_seed_arguments(trained):
    policy = jaxppo.load_policy(trained["run"])
    with pytest.raises(TypeError, match=r"^carry='c': this policy is feed-forward, its carry is \(\)"):
        policy.step(_some_obs(2), "c")
    with pytest.raises(TypeError, match=r"^batch_shape='x' must be a tuple of sizes"):
        policy.initial_carry("x")
    for seed, shown in ((2**70, "1180591620717411303424"), ("a", "'a'")):
        with pytest.raises(ValueError, match=rf"^seed={shown} must be an integer from -2\*\*63"):
            policy.evaluate(episodes=2, seed=seed)
    with pytest.raises(ValueError, match=r"^max_steps=1099511627776 must be an integer >= 1 and at most 2147483647"):
        trained["plain"].evaluate(episodes=2, max_steps=2**40)


def test_evaluating_more_episodes_than_memory_holds_is_a_value_error(trained, monkeypatch):
    monkeypatch.setattr("jaxppo.run.policy.free_memory", lambda: 1024)
    with pytest.raises(ValueError, match=r"^episodes=64 needs about .* GiB to evaluate .* but 0\.0 GiB "
                                         r"is free; use at most about \d+ episodes"):
        jaxppo.load_policy(trained["run"]).evaluate(episodes=64)


def _damaged(trained, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    damage(run)
    return run


def _edit_config(run, **changes):
    """config.yaml and every checkpoint's record of it, edited alike (config.yaml alone would
    disagree with the record, and be refused for that)."""
    data = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        (data[section] if section else data)[name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(data))
    if (run / "checkpoints").is_dir():
        edit_records(run, lambda r: r.update(config=data))


def _no_checkpoints(run):
    shutil.rmtree(run / "checkpoints")


@pytest.mark.parametrize("damage,kwargs,match", [
    (lambda r: _edit_config(r, **{"network.hidden_sizes": [32, 32]}), {},
     r"^the params in checkpoint .*/checkpoints/4 do not fit the network that .*/config\.yaml describes "
     r"for CartPole-v1 with network\.hidden_sizes=\[32, 32\] \(\['params'\]\['actor_torso'\]"
     r"\['Dense_0'\]\['bias'\] has shape \(16,\), the network needs \(32,\)\).*restore the run's "
     r"own config\.yaml"),
    (lambda r: None, dict(env="Acrobot-v1"),
     r"^the params in .* do not fit the network that the env given describes for Acrobot-v1 .*"
     r"pass the env the run trained on"),
    (lambda r: (_no_checkpoints(r), _edit_config(r, num_seeds=3)), {},
     r"config\.yaml says num_seeds=3, but .*params\.msgpack holds arrays of shape \(2, .*not one per seed"),
    (lambda r: (_no_checkpoints(r), (r / "params.msgpack").write_bytes((r / "params.msgpack").read_bytes()[:40])),
     {}, r"params\.msgpack is not a readable params file \(.*\); it is truncated or was not written by jaxppo"),
    (lambda r: (_no_checkpoints(r), (r / "params.msgpack").write_bytes(b"\x00garbage")), {},
     r"params\.msgpack is not a readable params file"),
])
def test_a_run_folder_whose_files_do_not_match_is_a_checkpoint_error(trained, tmp_path, capsys,
                                                                     damage, kwargs, match):
    run = _damaged(trained, tmp_path, damage)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=match):
        jaxppo.load_policy(run, **kwargs)
    argv = ["eval", str(run)] + (["--env", kwargs["env"]] if kwargs else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the params in") or "params.msgpack" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("call,error,match", [
    (lambda run: jaxppo.load_policy(5), TypeError, r"^run_dir=5 must be the path of a run folder"),
    (lambda run: jaxppo.load_policy(run, step="a"), TypeError, r"^step='a' must be a checkpoint iteration"),
    (lambda run: jaxppo.load_policy(run / "config.yaml"), CheckpointError,
     r"config\.yaml is a file; give the run folder that holds it"),
])
def test_load_policy_arguments_of_the_wrong_kind(trained, call, error, match):
    with pytest.raises(error, match=match):
        call(trained["run"])


@pytest.mark.parametrize("flags,words", [
    (["--seed", str(2**70)], ["--seed 1180591620717411303424 must be an integer from -2**63"]),
    (["--seed-index", "-1"], ["--seed-index -1 must be >= 0"]),
    (["--max-steps", "-1"], ["--max-steps -1: max_steps=-1 must be an integer >= 1"]),
    (["--max-steps", str(2**40)], ["--max-steps 1099511627776: max_steps=1099511627776 must be an "
                                   "integer >= 1 and at most 2147483647"]),
    (["--seed-index", "9"], ["--seed-index 9: seed_index=9, but", "holds 2 seed(s)"]),
    (["--episodes", "0"], ["--episodes 0 must be >= 1"]),
    (["--env", "Acrobot-v1"], ["do not fit the network", "Acrobot-v1"]),
])
def test_cli_eval_bad_flags_exit_2_with_one_line(trained, capsys, flags, words):
    assert cli.main(["eval", str(trained["run"]), *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
