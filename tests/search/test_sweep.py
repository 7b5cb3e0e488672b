"""A vmapped sweep's run folder: sweep.json, per-member summary, plot curves, progress and
eval labelled by the hyperparameters that differ, and a resume that keeps them. One tiny
training program (3 lrs), compiled once and reused through the persistent cache."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import yaml

import jaxppo
from jaxppo import cli
from jaxppo.search import sweep
from jaxppo.config import PPOConfig
from jaxppo.run.progress import Reporter
from jaxppo.run.plots import make_figure, run_labels
from jaxppo.run.logs import read_metrics

LRS = (1e-4, 3e-4, 1e-3)
TINY = jaxppo.PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=8, num_minibatches=2, num_epochs=1,
    total_timesteps=4 * 8 * 6, log_every=3, lr_schedule="constant",
    network=jaxppo.NetworkConfig((8, 8)), compilation_cache_dir=None, num_seeds=3,
)


def _sweep(config=TINY, lrs=LRS):
    return jaxppo.HyperParams.stack(
        [jaxppo.HyperParams.from_config(config.replace(lr=lr)) for lr in lrs])


def _train_lines(ax):
    return [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("train:")]


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    """A 3-lr sweep stopped after 3 of its 6 iterations and resumed without hparams; the
    progress lines of both calls."""
    run_dir = tmp_path_factory.mktemp("sweep") / "run"
    capture = tmp_path_factory.mktemp("progress") / "stderr.txt"
    with open(capture, "w") as err, contextlib.redirect_stderr(err):
        first = jaxppo.train(TINY, hparams=_sweep(), run_dir=run_dir, progress=None,
                             stop_after_iterations=3)
        record_before = json.loads((run_dir / "sweep.json").read_text())
        result = jaxppo.train(None, resume=run_dir, progress=None)
    return run_dir, first, result, record_before, capture.read_text()


def test_sweep_json_records_each_members_hyperparameters(sweep_run):
    run_dir, _, _, record_before, _ = sweep_run
    record = json.loads((run_dir / "sweep.json").read_text())
    assert record == record_before  # the resume kept it
    assert record["members"] == 3
    assert record["differing"] == {"lr": [0.0001, 0.0003, 0.001]}
    assert record["labels"] == ["lr=0.0001", "lr=0.0003", "lr=0.001"]
    assert [m["lr"] for m in record["hparams"]] == [0.0001, 0.0003, 0.001]
    assert all(m["clip_param"] == TINY.clip_param and m["gamma"] == pytest.approx(TINY.gamma)
               for m in record["hparams"])


def test_resumed_sweep_trains_each_member_with_its_own_lr(sweep_run):
    run_dir, first, result, _, _ = sweep_run
    assert not first.completed and result.completed and result.resumed_from == 3
    rows = read_metrics(run_dir)
    for r in rows:  # before and after the resume, the lr each member logged is its own
        assert r["lr"] == pytest.approx(LRS[r["seed"]], rel=1e-6)
    assert {r["iteration"] for r in rows} == set(range(1, 7))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [m["label"] for m in summary["members"]] == ["lr=0.0001", "lr=0.0003", "lr=0.001"]
    assert [m["hparams"] for m in summary["members"]] == [{"lr": lr} for lr in (0.0001, 0.0003, 0.001)]
    assert [m["final_return"] for m in summary["members"]] == summary["final_return_per_seed"]


def test_progress_names_members_by_hyperparameter(sweep_run):
    *_, progress = sweep_run
    lines = [ln for ln in progress.splitlines() if ln.startswith("[CartPole-v1] iter")]
    assert len(lines) == 2  # one chunk in each call
    assert "best lr=" in lines[-1] and "worst lr=" in lines[-1]

    reporter = Reporter(TINY, 6, progress=False, member_labels=["lr=0.0001", "lr=0.001", "lr=0.001"])
    rows = [{"iteration": 1, "seed": s, "episode_return_mean": v}
            for s, v in enumerate([10.0, 30.0, 50.0])]
    reporter.update(1, rows, 100.0)
    assert reporter.return_text() == "best lr=0.001: 40.0, worst lr=0.0001: 10.0"
    plain = Reporter(TINY.replace(num_seeds=1), 6, progress=False)
    plain.update(1, [{"iteration": 1, "episode_return_mean": float("nan")}], 100.0)
    assert plain.return_text() == "-"  # no episode has ended yet: no "nan"
    plain.update(1, [{"iteration": 1, "episode_return_mean": 7.0}], 100.0)
    assert plain.return_text() == "7.0"


def test_plot_of_a_sweep_has_one_line_per_member(sweep_run):
    run_dir, *_ = sweep_run
    assert run_labels([run_dir]) == ["CartPole-v1"]  # config.yaml's lr is not what they used
    fig, axes = make_figure([run_dir])
    for ax in axes:
        assert [ln.get_gid() for ln in _train_lines(ax)] == ["train:0/0", "train:0/1", "train:0/2"]
        assert not ax.collections  # no band: each curve is one member
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == ["CartPole-v1: lr=0.0001", "CartPole-v1: lr=0.0003", "CartPole-v1: lr=0.001"]
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert (run_dir / "curve.png").stat().st_size > 10_000


def test_eval_json_names_the_seed_index_and_the_members_hyperparameters(sweep_run, capsys):
    run_dir, *_ = sweep_run
    assert cli.main(["eval", str(run_dir), "--seed-index", "2", "--episodes", "2",
                     "--max-steps", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seed_index"] == 2 and out["member"] == "lr=0.001"
    assert out["hparams"]["lr"] == 0.001


def test_members_with_the_same_hyperparameters_are_seeds_of_one_curve(tmp_path):
    """Written by hand: 2 lrs x 2 seeds as one 4-member sweep."""
    run = tmp_path / "r"
    run.mkdir()
    cfg = PPOConfig(compilation_cache_dir=None, num_seeds=4, lr_schedule="constant")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    hp = _sweep(cfg, (1e-3, 1e-3, 1e-2, 1e-2))
    record = sweep.make_record(hp, 4)
    (run / "sweep.json").write_text(json.dumps(record))
    returns = np.array([[1.0, 2.0], [3.0, 4.0], [10.0, 20.0], [30.0, 40.0]])
    rows = [{"iteration": i + 1, "env_steps": (i + 1) * 512, "wall_time": 1.0 + i, "sps": 1e3,
             "episode_return_mean": returns[s, i], "seed": s} for i in range(2) for s in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig, axes = make_figure([run])
    lines = _train_lines(axes[0])
    assert [ln.get_gid() for ln in lines] == ["train:0/0", "train:0/2"]
    np.testing.assert_allclose(lines[1].get_ydata(), [20.0, 30.0])
    assert sorted(c.get_gid() for c in axes[0].collections) == ["train-band:0/0", "train-band:0/2"]
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == ["CartPole-v1: lr=0.001 (2 seeds, mean, 95% bootstrap CI)",
                     "CartPole-v1: lr=0.01 (2 seeds, mean, 95% bootstrap CI)"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_record_round_trips_schedules_and_is_absent_without_differences():
    cfg = TINY.replace(lr_schedule="linear")
    hp = _sweep(cfg, (1e-3, 2.5e-4, 1e-3))
    record = sweep.make_record(hp, 3)
    assert record["differing"]["lr"][1] == [[0.0, 0.00025], [float(cfg.total_timesteps), 0.0]]
    assert record["labels"] == ["lr=0.001→0", "lr=0.00025→0", "lr=0.001→0"]
    back = sweep.hparams_from_record(json.loads(json.dumps(record)))
    for a, b in zip(np.asarray(hp.lr_points), np.asarray(back.lr_points)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(hp.vf_clip_param), np.asarray(back.vf_clip_param))
    assert sweep.make_record(_sweep(cfg, (1e-3, 1e-3, 1e-3)), 3) is None  # seeds, not a sweep
    assert sweep.make_record(jaxppo.HyperParams.from_config(cfg), 3) is None


def test_an_extended_sweep_anneals_each_members_schedule_over_the_new_total(tmp_path, capsys):
    """A sweep of linear anneals extended at iteration 3 of 6 to 10 iterations: each member's
    lr is from there on its own anneal over the new total, as a plain run's is."""
    config = TINY.replace(lr_schedule="linear")
    lrs, old, new, step = (1e-3, 3e-3), 6 * 32, 10 * 32, 3 * 32
    run_dir = tmp_path / "run"
    jaxppo.train(config.replace(num_seeds=2), hparams=_sweep(config, lrs), run_dir=run_dir,
                 progress=False, stop_after_iterations=3, plot=False)
    capsys.readouterr()
    jaxppo.train(config.replace(num_seeds=2, total_timesteps=new), resume=run_dir,
                 progress=False, plot=False, stop_after_iterations=2)
    err = capsys.readouterr().err
    for lr in lrs:
        assert (f"lr: linear from {lr * 0.7:.3g} at step {step:,} to 0 at step {new:,} "
                f"[lr={lr:g}→0]") in err, err  # lr * (1 - 96 / 320)
    for r in read_metrics(run_dir):
        lr = lrs[r["seed"]]
        it = r["iteration"]
        want = lr * (1 - (it - 1) * 32 / (old if it <= 3 else new))
        assert r["lr"] == pytest.approx(want, rel=1e-5), (it, r["seed"])
    assert {r["iteration"] for r in read_metrics(run_dir)} == set(range(1, 6))
