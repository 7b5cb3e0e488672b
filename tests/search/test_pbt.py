"""Hyperparameter search and population-based training (jaxppo.search.space, jaxppo.search.pbt,
jaxppo.search.results): the exploit step copies exactly the parent's learner state, explore stays in
bounds, a PBT run is deterministic and resumes bit for bit, the folder's search files agree
with the run, and bad `search`/`pbt` input is a ConfigError naming the fix."""

from __future__ import annotations

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import jaxppo
from jaxppo.core.algorithm import PopulationRecord
from jaxppo.errors import ConfigError
from jaxppo.program.build import build_program
from jaxppo.search.pbt import LEARNER_FIELDS, Explorer
from jaxppo.program.resolved import resolve
from jaxppo.search.sweep import sample_hparams

SEARCH = {"lr": {"loguniform": [1e-4, 1e-2]}, "clip_param": {"uniform": [0.1, 0.3]},
          "gamma": {"choice": [0.98, 0.99, 0.995]}}
PBT = jaxppo.PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=16, total_timesteps=4 * 16 * 24, num_epochs=1,
    num_minibatches=2, network=jaxppo.NetworkConfig((16, 16)), compilation_cache_dir=None,
    search=SEARCH, num_seeds=4, pbt={"interval": 4, "fraction": 0.25}, log_every=4,
    normalize_observations=True)


def _metrics_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


@pytest.fixture(scope="module")
def pbt_runs(tmp_path_factory):
    whole = tmp_path_factory.mktemp("pbt") / "whole"
    split = tmp_path_factory.mktemp("pbt") / "split"
    a = jaxppo.train(PBT, run_dir=whole, progress=False)
    first = jaxppo.train(PBT, run_dir=split, progress=False, stop_after_iterations=10)
    older = tmp_path_factory.mktemp("pbt") / "older"
    shutil.copytree(split, older)
    b = jaxppo.train(None, resume=split, progress=False)
    _drop_critic_lr(older)
    c = jaxppo.train(None, resume=older, progress=False)
    return a, first, b, c


def _drop_critic_lr(run_dir):
    """Rewrite the newest checkpoint of `run_dir` as one written before critic_lr existed:
    its population's hyperparameters without critic_lr_points."""
    from jaxppo.run.checkpoints import CheckpointStore, find_latest

    store, step = find_latest(run_dir)
    with store:
        state, meta = store.restore(step)
    assert state["hparams"].pop("critic_lr_points") is not None
    shutil.rmtree(run_dir / "checkpoints" / str(step))
    with CheckpointStore(run_dir) as store:
        store.save(step, state, {k: v for k, v in meta.items() if k != "state_digest"})


# ---------------------------------------------------------------------- exploit / explore
@pytest.fixture(scope="module")
def population_state():
    run = resolve(PBT)
    hp = sample_hparams(run.config)
    program = build_program(run, hp, 1)
    state = program.init(jax.random.PRNGKey(3), hp)
    # Members differ in params already (own keys); give them distinct optimiser moments and
    # KL coefficients too, so a copy is visible in every learner field.
    state = state.replace(kl_coeff=jnp.arange(4, dtype=jnp.float32),
                          opt_state=jax.tree.map(lambda x: x + jnp.arange(4.0).reshape(
                              (4,) + (1,) * (x.ndim - 1)) if x.dtype == jnp.float32 else x,
                              state.opt_state))
    return program.algorithm, state


def test_exploit_copies_exactly_the_parents_learner_state_and_nothing_of_its_envs(population_state):
    algo, state = population_state
    explorer = Explorer(algo)
    fitness = jnp.asarray([10.0, 50.0, 30.0, 20.0])  # member 0 is the worst, 1 the best
    state = state.replace(population=PopulationRecord(
        return_sum=fitness, episodes=jnp.ones(4), fitness=jnp.full(4, -jnp.inf),
        last_eval=jnp.full(4, jnp.nan)))
    new, parent, got_fitness = jax.jit(explorer.exploit_explore)(state, jnp.int32(4))
    np.testing.assert_array_equal(got_fitness, fitness)
    assert explorer.replaced == 1
    np.testing.assert_array_equal(parent, [1, 1, 2, 3])  # the one worst copies the one best
    for f in LEARNER_FIELDS:
        for m, src in enumerate([1, 1, 2, 3]):
            if f == "hparams":
                continue  # explored below
            jax.tree.map(lambda n, o: np.testing.assert_array_equal(n[m], o[src], err_msg=f),
                         getattr(new, f), getattr(state, f))
    # Its envs, episode bookkeeping and random stream stay its own.
    for f in ("env_state", "last_obs", "episode_return", "episode_length", "env_ids", "rng",
              "discounted_return", "env_steps", "iteration"):
        jax.tree.map(lambda n, o: np.testing.assert_array_equal(n, o, err_msg=f),
                     getattr(new, f), getattr(state, f))
    # Kept members keep their hyperparameters; the copied one starts from its parent's values
    # and changes (perturbed by 0.8 or 1.2, or redrawn) only its searched fields.
    jax.tree.map(lambda n, o: np.testing.assert_array_equal(n[1:], o[1:]), new.hparams,
                 state.hparams)
    for f in ("vf_coeff", "max_grad_norm", "gae_lambda", "entropy_points"):
        np.testing.assert_array_equal(getattr(new.hparams, f)[0], getattr(state.hparams, f)[1])
    # The fitness record starts again for the next interval.
    np.testing.assert_array_equal(new.population.episodes, np.zeros(4))


def test_explore_perturbs_by_the_factors_or_redraws_and_stays_in_bounds(population_state):
    algo, state = population_state
    hp = state.hparams
    # Values at the bounds and inside them, then many explore steps.
    explorer = Explorer(algo)
    hp = explorer.set(hp, "lr", jnp.asarray([1e-4, 1e-2, 1e-3, 5e-3], jnp.float32))
    hp = explorer.set(hp, "clip_param", jnp.asarray([0.1, 0.3, 0.2, 0.25], jnp.float32))
    explore = jax.jit(explorer.explore)
    lrs, clips, gammas = [], [], []
    for i in range(60):
        new = explore(jax.random.PRNGKey(i), hp)
        lrs.append(np.asarray(explorer.get(new, "lr")))
        clips.append(np.asarray(new.clip_param))
        gammas.append(np.asarray(new.gamma))
        # a schedule keeps its form: linear from the new value to 0 at the run's end
        pts = np.asarray(new.lr_points)
        np.testing.assert_allclose(pts[:, 1, 1], 0.0)
        np.testing.assert_allclose(pts[:, 1, 0], PBT.total_timesteps)
    lrs, clips, gammas = map(np.asarray, (lrs, clips, gammas))
    assert lrs.min() >= 1e-4 * (1 - 1e-6) and lrs.max() <= 1e-2 * (1 + 1e-6)
    assert clips.min() >= 0.1 - 1e-7 and clips.max() <= 0.3 + 1e-7
    assert np.isin(gammas, np.float32([0.98, 0.99, 0.995])).all()
    # Member 2 (lr 1e-3, inside the bounds): each new value is 0.8x, 1.2x or a fresh draw;
    # both factors and some draws occur.
    ratio = lrs[:, 2] / 1e-3
    perturbed = np.isclose(ratio, 0.8, rtol=1e-5) | np.isclose(ratio, 1.2, rtol=1e-5)
    assert perturbed.sum() > 30 and (~perturbed).sum() > 3
    assert np.isclose(ratio, 0.8, rtol=1e-5).any() and np.isclose(ratio, 1.2, rtol=1e-5).any()


def test_explore_without_resampling_only_multiplies():
    cfg = PBT.replace(pbt={"interval": 4, "resample_probability": 0.0, "perturb": [0.5, 2.0]})
    explorer = Explorer(jaxppo.core.algorithm.Algorithm.create(resolve(cfg)))
    hp = sample_hparams(cfg)
    hp = explorer.set(hp, "lr", jnp.full((4,), 1e-3, jnp.float32))
    for i in range(10):
        new = jax.jit(explorer.explore)(jax.random.PRNGKey(i), hp)
        r = np.asarray(explorer.get(new, "lr")) / 1e-3
        assert np.all(np.isclose(r, 0.5, rtol=1e-5) | np.isclose(r, 2.0, rtol=1e-5))


# ---------------------------------------------------------------------- whole runs
def test_a_pbt_run_logs_its_exploit_steps_and_is_deterministic(pbt_runs):
    a, _, b, _ = pbt_runs
    m = a.metrics
    parent = m["pbt_parent"]
    steps = np.flatnonzero(np.isfinite(parent[0]))
    # every 4 iterations, never after the last (24)
    np.testing.assert_array_equal(m["iteration"][0, steps], [4, 8, 12, 16, 20])
    assert np.isnan(parent[:, [i for i in range(24) if i not in steps]]).all()
    for j in steps:
        copied = [i for i in range(4) if parent[i, j] != i]
        assert len(copied) == 1  # fraction 0.25 of 4 members
        worst = copied[0]
        fit = m["pbt_fitness"][:, j]
        assert fit[worst] == np.nanmin(fit)
        assert fit[int(parent[worst, j])] == np.nanmax(fit)
    # The live hyperparameters in the metrics: the lr metric follows hp_lr's schedule.
    assert {"hp_lr", "hp_clip_param", "hp_gamma"} <= m.keys()
    # The same config and seed: the same run, exploit steps included (b was interrupted).
    _metrics_equal({k: v for k, v in a.metrics.items() if k not in ("wall_time", "sps")},
                   {k: v for k, v in b.metrics.items() if k not in ("wall_time", "sps")})


def test_resume_mid_pbt_equals_the_uninterrupted_run(pbt_runs):
    """Also from a checkpoint written before critic_lr existed (no critic_lr_points among
    the population's hyperparameters): it resumes with the critic on lr, as it trained."""
    a, first, b, c = pbt_runs
    assert not first.completed and first.iterations_done == 10 and b.completed and c.completed
    for resumed in (b, c):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.state.params),
                     jax.device_get(resumed.state.params))
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.state.hparams),
                     jax.device_get(resumed.state.hparams))


def test_search_files_agree_with_the_run(pbt_runs):
    a, _, _, _ = pbt_runs
    run_dir = a.run_dir
    rec = json.loads((run_dir / "search.json").read_text())
    assert rec["metric"] == "final_return"
    assert len(rec["members"]) == 4 and len(rec["settings"]) == 4
    summary = json.loads((run_dir / "summary.json").read_text())
    for row in rec["members"]:
        assert row["final_return"] == pytest.approx(summary["final_return_per_seed"][row["member"]])
        # PBT: the values each member ended with
        assert row["lr"] == pytest.approx(float(a.metrics["hp_lr"][row["member"], -1]), rel=1e-6)
    ranked = [s["final_return_mean"] for s in rec["settings"]]
    assert ranked == sorted(ranked, reverse=True) and rec["best"]["rank"] == 1
    best = jaxppo.PPOConfig.from_file(run_dir / "best.yaml")
    assert best.search is None and best.pbt is None and best.num_seeds == 1
    assert best.lr == pytest.approx(rec["best"]["hparams"]["lr"])
    assert best.gamma == pytest.approx(rec["best"]["hparams"]["gamma"])
    lines = (run_dir / "search.csv").read_text().splitlines()
    assert lines[0].split(",") == ["member", "setting", "lr", "clip_param", "gamma", "final_return"]
    assert len(lines) == 5
    # The winning lineage: it ends in the best member and follows its copies back.
    lin = rec["pbt"]["lineage"]
    assert lin["member"] == rec["best"]["members"][0] and lin["owner"][-1] == lin["member"]
    for e in lin["exploits"]:
        j = e["iteration"] - 1
        assert a.metrics["pbt_parent"][e["member"], j] == e["parent"]
        assert lin["owner"][j - 1] == e["parent"]
    np.testing.assert_allclose(lin["hparams"]["lr"], a.metrics["hp_lr"][lin["owner"], range(24)])
    assert (run_dir / "search.png").exists() and (run_dir / "curve.png").exists()


def test_plot_of_a_pbt_run_shows_the_winning_lineage(pbt_runs):
    from jaxppo.run.plots import make_figure

    fig, axes = make_figure([pbt_runs[0].run_dir])
    gids = {line.get_gid() for f in fig.subfigs for ax in f.axes for line in ax.get_lines()}
    assert {"lineage:lr", "lineage:clip_param", "lineage:gamma"} <= gids
    # the population is one curve (mean over members), not a curve per initial setting
    assert {g for g in gids if g and g.startswith("train:")} == {"train:0"}


# ---------------------------------------------------------------------- search
def test_search_draws_are_reproducible_and_shared_by_the_seeds_of_a_setting():
    cfg = PBT.replace(pbt=None, num_seeds=6, search={**SEARCH, "population": 3})
    a, b = sample_hparams(cfg), sample_hparams(cfg)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    lr = np.asarray(a.lr_points[:, 0, 1])
    assert lr[0] == lr[1] and lr[2] == lr[3] and lr[4] == lr[5] and len(set(lr)) == 3
    assert np.all((lr >= 1e-4) & (lr <= 1e-2))
    assert np.isin(np.asarray(a.gamma), np.float32([0.98, 0.99, 0.995])).all()
    other = sample_hparams(cfg.replace(seed=1))
    assert not np.array_equal(np.asarray(other.lr_points), np.asarray(a.lr_points))
    # num_seeds follows the population when left at 1
    assert jaxppo.PPOConfig(search={"population": 5, **SEARCH}).num_seeds == 5


def test_cli_search_writes_the_table_and_best_config(tmp_path, capsys):
    from jaxppo.cli import main

    code = main(["search", "--env", "CartPole-v1", "--population", "2", "--seeds", "4",
                 "--runs-dir", str(tmp_path), "--run-name", "s", "--no-progress", "--no-plot",
                 "--set", "num_envs=4", "num_steps=16", "total_timesteps=640", "num_epochs=1",
                 "network.hidden_sizes=[16, 16]", "compilation_cache_dir=null",
                 "search={lr: {loguniform: [1.0e-4, 1.0e-2]}}"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "best of 2 settings: lr=" in err and "best.yaml" in err
    rec = json.loads((tmp_path / "s" / "search.json").read_text())
    assert [s["members"] for s in sorted(rec["settings"], key=lambda s: s["setting"])] == [
        [0, 1], [2, 3]]
    saved = yaml.safe_load((tmp_path / "s" / "config.yaml").read_text())
    assert saved["num_seeds"] == 4 and saved["search"]["population"] == 2
    # without a search in the config: a clear error
    code = main(["search", "--env", "CartPole-v1", "--runs-dir", str(tmp_path), "--no-progress"])
    assert code == 2 and "needs a `search`" in capsys.readouterr().err


BAD = [
    ({"search": {"lr": {"loguniform": [1e-4, 1e-2]}, "num_envs": {"choice": [4, 8]}}},
     "search.num_envs is not a tunable field; it shapes the compiled program"),
    ({"search": {"lrr": {"uniform": [1e-4, 1e-2]}}}, "did you mean 'lr'"),
    ({"search": {"lr": {"normal": [0, 1]}}}, "must be one distribution"),
    ({"search": {"lr": {"loguniform": [0, 1e-2]}}}, "needs low > 0"),
    ({"search": {"lr": {"uniform": [1e-2, 1e-4]}}}, "low < high"),
    ({"search": {"gamma": {"choice": [0.99, 1.5]}}}, "search.gamma: 1.5 is not a valid gamma"),
    ({"search": {"population": 3, "lr": {"uniform": [1e-4, 1e-2]}}, "num_seeds": 4},
     "search.population=3 does not divide num_seeds=4"),
    ({"search": {"lr": {"uniform": [1e-4, 1e-2]}}}, "at least 2 members"),
    ({"pbt": {"interval": 2}, "num_seeds": 4}, "pbt explores the fields of `search`"),
    ({"pbt": {"interval": 0}}, "pbt.interval=0 must be an integer >= 1"),
    ({"pbt": {"interval": 2, "fraction": 0.75}}, "pbt.fraction=0.75 must be in (0, 0.5]"),
    ({"pbt": {"interval": 2, "fraction": 0}}, "pbt.fraction=0 must be in (0, 0.5]"),
    ({"pbt": {"interval": 2, "fitnes": "eval"}}, "unknown config key 'pbt.fitnes'"),
    ({"pbt": {"interval": 2, "fitness": "eval"}}, "eval_every"),
    ({"pbt": {"interval": 10_000}}, "no exploit/explore step would happen"),
    ({"pbt": {"interval": 2}, "search": {"population": 2, "lr": {"uniform": [1e-4, 1e-2]}}},
     "search.population=2 must equal num_seeds=4"),
]


@pytest.mark.parametrize("changes, words", BAD, ids=[w[:30] for _, w in BAD])
def test_bad_search_and_pbt_input_is_a_clear_config_error(changes, words):
    # pbt cases start from a valid search of 4 members (but for the one about its absence)
    base = {}
    if "pbt" in changes:
        base = {"num_seeds": 4} if "pbt explores" in words else {"search": SEARCH, "num_seeds": 4}
    with pytest.raises(ConfigError) as e:
        jaxppo.PPOConfig(**{**base, **changes}).validate()
    assert words in str(e.value)


def test_make_train_refuses_a_population_config():
    with pytest.raises(ConfigError, match="use jaxppo.train"):
        jaxppo.make_train(PBT)


def test_hyperparams_of_a_pbt_member_are_recorded_per_iteration(pbt_runs):
    a, _, _, _ = pbt_runs
    m = a.metrics
    # hp_lr is the schedule's first value; the lr metric its value at the iteration's start.
    lr0, lr = m["hp_lr"], m["lr"]
    frac = 1 - (m["iteration"] - 1) * PBT.batch_size / PBT.total_timesteps
    # where the member was not just copied the lr used is hp_lr (of the row before) x frac
    ok = np.isclose(lr[:, 1:], lr0[:, :-1] * frac[:, 1:], rtol=1e-4)
    assert ok.all() and math.isfinite(float(lr0.min()))


# What a run split over devices is compared on with one device (tests/search/pbt_worker.py).
COMPARED = ("pbt_parent", "episodes", "episode_return_mean", "value_loss", "grad_norm", "hp_lr",
            "hp_clip_param")


def _rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.nanmax(np.abs(a - b) / (1e-6 + np.abs(b)))) if a.size else 0.0


def test_a_population_split_over_devices_trains_the_same_members(pbt_runs, tmp_path):
    """Members split over 2 or 4 devices (no collective between exploit steps) train as on
    one device, and a checkpoint moves between device counts (2 -> 4 in a process of 4
    devices, 2 -> 1 here). Equal up to float rounding: XLA's batched matmuls over 1, 2 or 4
    members may sum in another order. The one-device run is this module's (pbt_runs)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("pbt_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=worker.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = pbt_runs[0]
    resumed1 = jaxppo.train(PBT.replace(num_devices=1), resume=tmp_path / "stopped",
                            progress=False, plot=False)
    runs = {name: dict(np.load(tmp_path / f"{name}.npz")) for name in ("d2", "d4", "resumed4")}
    runs["resumed1"] = {"devices": resumed1.num_devices,
                        **{f"metric:{k}": resumed1.metrics[k] for k in COMPARED},
                        **{f"param:{i}": x for i, x in
                           enumerate(jax.tree.leaves(jax.device_get(resumed1.params)))}}
    assert {name: int(r["devices"]) for name, r in runs.items()} == {
        "d2": 2, "d4": 4, "resumed4": 4, "resumed1": 1} and one.num_devices == 1
    base = jax.tree.leaves(jax.device_get(one.params))
    for name, r in runs.items():
        m = {k: r[f"metric:{k}"] for k in COMPARED}
        params = [r[f"param:{i}"] for i in range(len(base))]
        assert f"param:{len(base)}" not in r and np.shape(params[0])[0] == 4, name  # [members]
        np.testing.assert_array_equal(m["pbt_parent"], one.metrics["pbt_parent"], err_msg=name)
        np.testing.assert_array_equal(m["episodes"], one.metrics["episodes"], err_msg=name)
        np.testing.assert_array_equal(m["episode_return_mean"], one.metrics["episode_return_mean"],
                                      err_msg=name)
        for k in ("value_loss", "grad_norm", "hp_lr", "hp_clip_param"):
            assert _rel_diff(m[k], one.metrics[k]) < 1e-3, (name, k)
        assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(params, base)) < 1e-4, name


# ---------------------------------------------------------------------- learning
@pytest.mark.slow
def test_a_tiny_pbt_run_beats_a_deliberately_bad_fixed_lr_on_cartpole():
    """4 seeds at lr=1e-5 (the bottom of the searched range) barely move; a PBT population of
    4 drawn from [1e-5, 1e-2] at the same per-member budget learns, and its exploit steps
    leave every member with an lr well above the bad one."""
    base = dict(env="CartPole-v1", num_envs=8, num_steps=32, total_timesteps=8 * 32 * 32,
                num_epochs=2, num_minibatches=2, network=jaxppo.NetworkConfig((32, 32)),
                lr_schedule="constant", compilation_cache_dir=None, num_seeds=4, log_every=8)
    fixed = jaxppo.train(jaxppo.PPOConfig(**base, lr=1e-5), progress=False)
    pbt = jaxppo.train(jaxppo.PPOConfig(**base, search={"lr": {"loguniform": [1e-5, 1e-2]}},
                                        pbt={"interval": 4, "fraction": 0.25}), progress=False)
    last = np.s_[:, -4:]
    fixed_return = np.nanmean(fixed.metrics["episode_return_mean"][last])
    pbt_return = np.nanmean(pbt.metrics["episode_return_mean"][last])
    assert fixed_return < 40, fixed_return
    assert pbt_return > 2 * fixed_return, (pbt_return, fixed_return)
    assert np.isfinite(pbt.metrics["pbt_parent"]).any()
    assert (pbt.metrics["hp_lr"][:, -1] > 1e-4).all(), pbt.metrics["hp_lr"][:, -1]
