"""Checkpoints and resume: bit-exact continuation, kept checkpoints, and clear errors (with
nothing in the run folder changed) for missing, corrupt or mismatched checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import jaxppo
from checkpoint_records import edit_records  # tests/ is on sys.path
from jaxppo import cli
from jaxppo.run.checkpoints import CheckpointError, CheckpointStore, find_latest
from jaxppo.config import ConfigError, NetworkConfig, PPOConfig

# 8 iterations; chunks of 3 and checkpoints every 3 so that stopping after 4 falls inside a
# chunk and resuming starts a chunk off the grid; evaluation every 2 iterations.
CFG = PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=16, total_timesteps=8 * 64, num_minibatches=2,
    network=NetworkConfig((16, 16)), log_every=3, checkpoint_every=3, keep_checkpoints=2,
    eval_every=2, eval_episodes=4, normalize_observations=True, use_kl_loss=True,
    compilation_cache_dir=None,
)
STOP = 4
TIMING_KEYS = ("wall_time", "sps")


def _tree_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb))


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def _folder_digest(path: Path) -> dict:
    """relative path -> sha256 of every file under path (and the set of folders)."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, a run stopped after STOP iterations (a copy of its folder is
    kept as `stopped`), and that run resumed to the end."""
    base = tmp_path_factory.mktemp("ckpt")
    full = jaxppo.train(CFG, run_dir=base / "full", progress=False)
    part = jaxppo.train(CFG, run_dir=base / "part", progress=False, stop_after_iterations=STOP)
    shutil.copytree(base / "part", base / "stopped")
    resumed = jaxppo.train(None, resume=base / "part", progress=False)
    return dict(base=base, full=full, part=part, resumed=resumed)


@pytest.fixture
def stopped_copy(runs, tmp_path):
    """A fresh copy of the run folder as it was after stopping at iteration STOP."""
    dst = tmp_path / "run"
    shutil.copytree(runs["base"] / "stopped", dst)
    return dst


# ---------------------------------------------------------------------- exact resume
def test_a_result_saved_afterwards_is_the_folder_training_in_it_leaves(runs, tmp_path):
    """TrainResult.save writes what train(run_dir=) would have: the same config.yaml and
    metrics.jsonl rows (timings aside), a checkpoint from which --resume continues bit for bit
    to the uninterrupted run's end, a policy that load_policy loads, and the curve; it never
    writes into a folder that holds files."""
    unsaved = jaxppo.train(CFG, progress=False, stop_after_iterations=STOP)
    assert unsaved.run_dir is None
    saved = unsaved.save(tmp_path / "saved")
    stopped = runs["base"] / "stopped"
    assert (saved / "config.yaml").read_text() == (stopped / "config.yaml").read_text()
    assert _strip_timing(_rows(saved)) == _strip_timing(_rows(stopped))
    assert find_latest(saved)[1] == STOP and (saved / "curve.png").stat().st_size > 0
    summary = json.loads((saved / "summary.json").read_text())
    assert summary["iterations"] == STOP and summary["completed"] is False
    loaded, trained = jaxppo.load_policy(saved).evaluate(episodes=4), unsaved.evaluate(episodes=4)
    np.testing.assert_array_equal(loaded["returns"], trained["returns"])
    resumed = jaxppo.train(None, resume=saved, progress=False, plot=False)
    full = runs["full"]
    assert _tree_equal(full.state, resumed.state)
    for k, v in full.metrics.items():
        if k not in TIMING_KEYS:
            np.testing.assert_array_equal(v, resumed.metrics[k], err_msg=k)
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        unsaved.save(saved)
    assert find_latest(saved)[1] == CFG.num_iterations  # the refused save changed nothing


def test_stopped_run_reports_where_it_stopped(runs):
    part = runs["part"]
    assert part.iterations_done == STOP and not part.completed
    assert part.metrics["iteration"].shape == (1, STOP)
    with CheckpointStore(runs["base"] / "stopped", read_only=True) as store:
        assert store.steps() == [3, 4]  # every 3 iterations, and where it stopped (keep 2)
    resumed = runs["resumed"]
    assert resumed.completed and resumed.resumed_from == STOP
    assert resumed.iterations_done == CFG.num_iterations


def test_resumed_run_is_bit_identical_to_uninterrupted(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert _tree_equal(full.params, resumed.params)
    # The whole state: optimizer, kl_coeff, normalisation stats, rng, env state, trackers.
    assert _tree_equal(full.state, resumed.state)
    assert set(full.metrics) == set(resumed.metrics)
    for k, v in full.metrics.items():
        if k in TIMING_KEYS:
            continue
        assert v.dtype == resumed.metrics[k].dtype, k
        np.testing.assert_array_equal(v, resumed.metrics[k], err_msg=k)
    # Evaluation ran (and resumed) too: iterations 2, 4, 6, 8.
    ev = full.metrics["eval_return_mean"][0]
    assert np.isfinite(ev[1::2]).all() and np.isnan(ev[0::2]).all()


def test_resumed_metrics_file_has_every_iteration_once(runs):
    full_rows = _rows(runs["base"] / "full")
    part_rows = _rows(runs["base"] / "part")
    assert [r["iteration"] for r in part_rows] == list(range(1, CFG.num_iterations + 1))
    assert _strip_timing(part_rows) == _strip_timing(full_rows)
    assert all(b["wall_time"] >= a["wall_time"] for a, b in zip(part_rows, part_rows[1:]))


def test_checkpoints_keep_the_newest_and_record_the_run(runs):
    with CheckpointStore(runs["base"] / "full", read_only=True) as store:
        assert store.steps() == [6, 8]
        state, meta = store.restore(8)
    assert meta["iteration"] == 8 and meta["env_steps"] == 8 * CFG.batch_size
    assert meta["config"]["num_envs"] == CFG.num_envs and meta["num_devices"] == 1
    assert _tree_equal(state["params"], runs["full"].params)


def test_resume_drops_rows_written_after_the_checkpoint(runs, stopped_copy):
    # As after a crash between writing rows and the next checkpoint: rows 5-6 and half a line.
    rows = (stopped_copy / "metrics.jsonl").read_text().splitlines()
    fake = [json.dumps({**json.loads(rows[-1]), "iteration": i, "policy_loss": 123.0}) for i in (5, 6)]
    (stopped_copy / "metrics.jsonl").write_text("\n".join(rows + fake) + '\n{"episode_ret')
    result = jaxppo.train(None, resume=stopped_copy, progress=False, stop_after_iterations=1)
    assert result.iterations_done == STOP + 1
    got = _rows(stopped_copy)
    assert [r["iteration"] for r in got] == list(range(1, STOP + 2))
    assert _strip_timing(got) == _strip_timing(_rows(runs["base"] / "full")[: STOP + 1])


# Every extension below goes to 12 iterations (EXTENDED env steps): the programs of a run
# count its iterations, so one total for all of them compiles one program, not one each.
EXTENDED = 12 * CFG.batch_size


def test_cli_resume_extends_a_run_with_a_larger_total_timesteps(runs, tmp_path, capsys):
    """A finished run (lr annealed to 0 at 512 steps) extended to 768: by default the lr is
    the anneal a run of 768 steps has, 2.5e-4 * (1 - step / 768), from the checkpoint on."""
    run = tmp_path / "full"
    shutil.copytree(runs["base"] / "full", run)
    old, more = CFG.total_timesteps, EXTENDED
    capsys.readouterr()
    rc = cli.main(["train", "--resume", str(run), "--set", f"total_timesteps={more}",
                   "--no-progress", "--no-plot"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert (f"resuming at env step {old:,} of {more:,} (total_timesteps was {old:,}: each "
            "schedule is now the one a run started with the new total has") in err, err
    assert f"lr: linear from 8.33e-05 at step {old:,} to 0 at step {more:,}" in err, err
    assert "nearly run out" not in err
    rows = _rows(run)
    assert [r["iteration"] for r in rows] == list(range(1, 13))
    assert rows[8]["lr"] == pytest.approx(2.5e-4 / 3, rel=1e-5)  # 2.5e-4 * (1 - 512 / 768)
    assert rows[9]["lr"] == pytest.approx(6.25e-05, rel=1e-5)  # 2.5e-4 * (1 - 576 / 768)
    assert rows[11]["lr"] == pytest.approx(2.5e-4 / 12, rel=1e-5)  # 2.5e-4 * (1 - 704 / 768)
    assert f"total_timesteps: {more}" in (run / "config.yaml").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 12 and summary["completed"]


def test_a_resumed_folder_chooses_no_path_of_this_machine(runs, stopped_copy):
    """A folder whose config (and checkpoint record) names a compilation cache and a W&B
    folder outside it, as one from elsewhere may: a resume uses neither (JAX would also load
    compiled code from the cache), each with a warning, unless given with --set; a policy's
    load, which uses neither, says nothing. (Checked on the config the command builds: a
    training here would move this test process's JAX cache.)"""
    import warnings

    from jaxppo.cli import _build_parser
    from jaxppo.run.command import resumed_config

    cache, wandb_dir = "/elsewhere/xla", "/elsewhere/wandb"
    wandb = {"project": "p", "mode": "offline", "dir": wandb_dir}
    yaml_path = stopped_copy / "config.yaml"
    record = yaml.safe_load(yaml_path.read_text())
    record.update(compilation_cache_dir=cache, wandb=wandb)
    yaml_path.write_text(yaml.safe_dump(record))
    for meta in stopped_copy.glob("checkpoints/*/meta/metadata"):
        data = json.loads(meta.read_text())
        data["config"].update(compilation_cache_dir=cache, wandb=wandb)
        meta.write_text(json.dumps(data))

    def resumed(*sets):
        args = _build_parser().parse_args(["train", "--resume", str(stopped_copy),
                                           *(["--set", *sets] if sets else [])])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config, _ = resumed_config(args)
        return config, [str(w.message) for w in caught if "path of this machine" in str(w.message)]

    config, notes = resumed()
    assert config.compilation_cache_dir == jaxppo.PPOConfig().compilation_cache_dir
    assert config.wandb == {"project": "p", "mode": "offline"}  # logging kept, in RUN_DIR/wandb
    assert len(notes) == 2, notes
    assert f"sets compilation_cache_dir={cache!r}, a path of this machine" in notes[0]
    assert f"sets wandb.dir={wandb_dir!r}" in notes[1] and "--set wandb.dir=" in notes[1]
    config, notes = resumed("compilation_cache_dir=/mine", "wandb.dir=/mine/wandb")
    assert config.compilation_cache_dir == "/mine" and config.wandb["dir"] == "/mine/wandb"
    assert notes == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxppo.load_policy(stopped_copy)
    assert not [w for w in caught if "path of this machine" in str(w.message)]


def test_extending_a_finished_run_with_continue_keeps_its_spent_schedule(runs, tmp_path, capsys):
    """schedule_on_extend=continue: the lr goes on from its value at the checkpoint, 0 at the
    end of a finished anneal, and the lines say how to train the extension instead."""
    run = tmp_path / "full"
    shutil.copytree(runs["base"] / "full", run)
    old, more = CFG.total_timesteps, EXTENDED
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run), "--set", f"total_timesteps={more}",
                     "--set", "schedule_on_extend=continue", "--no-progress", "--no-plot"]) == 0
    err = capsys.readouterr().err
    assert (f"(total_timesteps was {old:,}: each schedule goes on from its value at the "
            "checkpoint, stretched to the new total):") in err, err
    assert "lr: constant 0" in err
    assert ("(the lr schedule had nearly run out; to train the extension, let it anneal over "
            "the new total (schedule_on_extend=new_total) or give it as points from here, e.g. "
            f"--set 'lr=[[{old}, 0.00025], [{more}, 2.5e-06]]')") in err, err
    assert [r["lr"] for r in _rows(run)[8:]] == [0.0] * 4
    assert _rows(run)[-1]["iteration"] == 12
    assert "schedule_on_extend: continue" in (run / "config.yaml").read_text()


def test_an_extended_run_anneals_over_the_new_total(runs, stopped_copy, capsys):
    """Extended at iteration STOP from 8 to 12 iterations, the lr is the anneal of a run of
    12 iterations from there on (up from the old one's value), and a second resume keeps it."""
    old, new = CFG.total_timesteps, EXTENDED
    capsys.readouterr()
    jaxppo.train(CFG.replace(total_timesteps=new), resume=stopped_copy, progress=False,
                 stop_after_iterations=2, plot=False)  # to iteration 6, a checkpoint
    err = capsys.readouterr().err
    assert f"lr: linear from {CFG.lr * (1 - 256 / 768):.3g} at step 256 to 0 at step 768" in err
    assert "entropy_coeff: constant 0.01" in err
    jaxppo.train(None, resume=stopped_copy, progress=False, plot=False)  # as recorded
    assert f"lr: linear from {CFG.lr * (1 - 384 / 768):.3g} at step 384 to 0 at step 768" in (
        capsys.readouterr().err)
    lrs = {r["iteration"]: r["lr"] for r in _rows(stopped_copy)}
    assert sorted(lrs) == list(range(1, 13))
    for it in range(1, 13):  # before the resume over 512 steps, after it over 768
        assert lrs[it] == pytest.approx(CFG.lr * (1 - (it - 1) * 64 / (old if it <= STOP else new)),
                                        rel=1e-5), it
    # up from 1.25e-4, the old anneal's value at the checkpoint
    assert lrs[STOP + 1] == pytest.approx(2.5e-4 * 2 / 3, rel=1e-6)


def test_an_extended_run_continues_its_schedule_from_the_checkpoint(runs, stopped_copy, capsys):
    """schedule_on_extend=continue: lr anneals linearly to 0 at total_timesteps; extended at
    iteration STOP, it goes on from its value there to 0 at the new total, and a second
    resume keeps that schedule."""
    step, old, new = STOP * CFG.batch_size, CFG.total_timesteps, EXTENDED
    at_checkpoint = CFG.lr * (1 - step / old)
    capsys.readouterr()
    jaxppo.train(CFG.replace(total_timesteps=new, schedule_on_extend="continue"),
                 resume=stopped_copy, progress=False, stop_after_iterations=2)  # to iteration 6
    err = capsys.readouterr().err
    assert (f"lr: linear from {at_checkpoint:.3g} at step {step:,} to 0 at step {new:,}"
            in err), err
    assert "entropy_coeff: constant 0.01" in err
    jaxppo.train(None, resume=stopped_copy, progress=False)  # total unchanged: as recorded
    assert f"lr: linear from {at_checkpoint * (1 - 2 / 8):.3g} at step {6 * 64:,}" in (
        capsys.readouterr().err)
    lrs = {r["iteration"]: r["lr"] for r in _rows(stopped_copy)}
    assert sorted(lrs) == list(range(1, 13))
    for it in range(1, STOP + 1):  # before the resume: the original anneal
        assert lrs[it] == pytest.approx(CFG.lr * (1 - (it - 1) * 64 / old), rel=1e-5)
    for it in range(STOP + 1, 13):  # after: from the checkpoint's value to 0 at the new total
        done = (it - 1) * 64 - step
        assert lrs[it] == pytest.approx(at_checkpoint * (1 - done / (new - step)), rel=1e-5), it
    assert lrs[STOP + 1] == pytest.approx(at_checkpoint, rel=1e-6)


def _extended(config: PPOConfig, meta_config: PPOConfig, recorded=None, hp=None, labels=None):
    """The schedules and lines of a resume at env step 256 (continue_schedules), the
    checkpoint having recorded `meta_config` (and `recorded` schedules, else its own)."""
    from jaxppo.run.schedules import continue_schedules, schedule_record

    hp0 = jaxppo.HyperParams.from_config(meta_config)
    meta = {"config": meta_config.to_dict(), "env_steps": 256,
            **schedule_record(hp0, meta_config), **({"schedules": recorded} if recorded else {})}
    return continue_schedules(hp if hp is not None else jaxppo.HyperParams.from_config(config),
                              meta, config, given=False, from_record=hp is not None,
                              labels=labels)


@pytest.mark.parametrize("mode", ["new_total", "continue"])
def test_schedules_given_as_points_on_extend(mode):
    """lr given as points keeps them with new_total (a run started with 768 steps has just
    those) and is re-anchored at the checkpoint with continue; a linear entropy anneal runs
    over the new total, or goes on from its value at step 256."""
    pts = [[0.0, 1e-3], [400.0, 1e-4]]
    cfg = CFG.replace(lr=pts, entropy_coeff=0.02, entropy_schedule="linear",
                      schedule_on_extend=mode)
    hp, lines = _extended(cfg.replace(total_timesteps=768), cfg)
    lr, ent = np.asarray(hp.lr_points), np.asarray(hp.entropy_points)
    if mode == "new_total":
        np.testing.assert_allclose(lr, pts)
        np.testing.assert_allclose(ent, [[0, 0.02], [768, 0]])
        assert lines[1].startswith(  # 1e-3 - 9e-4 * 256 / 400 at step 256
            "  lr: from 0.000424 at step 256, linear to 0.0001 at step 400, "), lines
    else:  # value at 256 kept; what came at 400 of 512 comes at 256 + 144 * 512 / 256
        np.testing.assert_allclose(lr, [[256, 1e-3 - 9e-4 * 256 / 400], [544, 1e-4]], rtol=1e-6)
        np.testing.assert_allclose(ent, [[256, 0.01], [768, 0]], rtol=1e-6)
    assert any("schedule_on_extend=continue" in line for line in lines) == (mode == "new_total")


def test_an_extended_sweep_record_anneals_each_linear_member_over_the_new_total():
    """A sweep's members (from sweep.json) keep their own start values: a linear anneal ends
    at the new total, points that do not anneal to 0 stay; the recorded schedules are not
    used."""
    cfg = CFG.replace(num_seeds=2)
    hp = jaxppo.HyperParams.stack([jaxppo.HyperParams.from_config(CFG.replace(lr=1e-3)),
                                   jaxppo.HyperParams.from_config(
                                       CFG.replace(lr=[[0, 3e-3], [512, 3e-3]]))])
    spent = {"lr_points": [[[256, 0.0], [512, 0.0]], [[256, 3e-3], [512, 3e-3]]]}
    out, lines = _extended(cfg.replace(total_timesteps=1024), cfg, spent, hp,
                           ["lr=0.001→0", "lr=0.003"])
    np.testing.assert_allclose(np.asarray(out.lr_points),
                               [[[0, 1e-3], [1024, 0]], [[0, 3e-3], [512, 3e-3]]])
    assert "  lr: linear from 0.00075 at step 256 to 0 at step 1,024 [lr=0.001→0]" in lines
    assert "  lr: constant 0.003 [lr=0.003]" in lines


# ---------------------------------------------------------------------- early stopping
def test_a_callback_stops_the_run_or_fails_with_everything_saved(stopped_copy):
    """A callback returning False stops after its chunk (checkpointed, completed False); one
    that raises gets its error back once the checkpoint, params and summary are written. One
    of two arguments also gets the run as the chunk left it (its state and params)."""
    seen, got = [], {}

    def enough(rows, run):
        seen.append(rows[-1]["iteration"])
        got.update(iteration=run.iteration, env_steps=run.env_steps, params=run.params,
                   state_iteration=int(run.state.iteration))
        return False

    result = jaxppo.train(None, resume=stopped_copy, progress=False, plot=False, callback=enough)
    assert seen == [6]  # from 4, the chunk ends at the checkpoint and evaluation of 6
    assert result.iterations_done == 6 and not result.completed
    assert result.stopped == "the callback returned False"
    assert find_latest(stopped_copy)[1] == 6
    assert (got["iteration"], got["state_iteration"], got["env_steps"]) == (6, 6, 6 * CFG.batch_size)
    store, _ = find_latest(stopped_copy)
    with store:
        assert _tree_equal(got["params"], store.restore(6)[0]["params"])
    assert json.loads((stopped_copy / "summary.json").read_text())["stopped"] == result.stopped

    def broken(rows):
        raise ValueError("the callback's own bug")

    with pytest.raises(ValueError, match="the callback's own bug") as info:
        jaxppo.train(None, resume=stopped_copy, progress=False, plot=False, callback=broken)
    assert any(f"--resume {stopped_copy}" in note for note in info.value.__notes__)
    store, step = find_latest(stopped_copy)
    with store:
        assert step == 8  # the end of the chunk it was called for (no checkpoint_every there)
        state, _ = store.restore(8)
    from jaxppo.run.checkpoints import load_params_dict
    saved = load_params_dict(stopped_copy / "params.msgpack")
    assert _tree_equal(saved["params"], state["params"])
    assert jaxppo.load_policy(stopped_copy).iteration == 8


def test_stop_at_return_stops_at_the_evaluation_that_reaches_it(stopped_copy):
    result = jaxppo.train(CFG.replace(stop_at_return=1.0), resume=stopped_copy, progress=False,
                          plot=False, callback=lambda rows: None)
    assert result.iterations_done == 6 and not result.completed
    ev = result.metrics["eval_return_mean"][0, 5]
    assert result.stopped == (f"the eval return {ev:.1f} reached stop_at_return=1 at "
                              "iteration 6")
    assert find_latest(stopped_copy)[1] == 6


def test_stop_rules_use_the_mean_over_seeds_and_count_evaluations():
    from jaxppo.run.stop_rules import StopRules

    def rows(it, evals=(), returns=()):
        out = [{"iteration": it, "seed": s, "eval_return_mean": e, "episode_return_mean": r}
               for s, (e, r) in enumerate(zip(evals or [math.nan] * 2, returns or [math.nan] * 2))]
        return out

    cfg = CFG.replace(num_seeds=2, stop_at_return=100.0, stop_after_no_improvement=2)
    earlier = rows(2, (10.0, 30.0))  # a resumed run's evaluations count
    rules = StopRules(cfg, earlier)
    assert rules.best == 20.0 and rules.best_iter == 2
    assert rules.after_chunk(rows(4, (90.0, 109.0))) is None  # mean 99.5 < 100
    assert rules.improved and rules.best_record() == {
        "iteration": 4, "env_steps": 4 * CFG.batch_size, "eval_return_mean": 99.5,
        "eval_return_per_seed": [90.0, 109.0]}
    assert rules.after_chunk(rows(6, (99.0, 0.0))) is None and not rules.improved
    assert rules.after_chunk(rows(8, (99.0, 99.0))) == (
        "no better eval return (mean over 2 seeds) in 2 evaluations (the best, 99.5, was at "
        "iteration 4)")
    assert StopRules(cfg, earlier).after_chunk(rows(4, (100.0, 100.0))) == (
        "the eval return 100.0 (mean over 2 seeds) reached stop_at_return=100 at iteration 4")
    # without evaluation: the training return, once every seed has one
    train_rules = StopRules(cfg.replace(eval_every=0, stop_after_no_improvement=0), [])
    assert train_rules.after_chunk(rows(1, returns=(500.0, math.nan))) is None
    assert train_rules.after_chunk(rows(2, returns=(120.0, 90.0))) == (
        "the training return 105.0 (mean over 2 seeds) reached stop_at_return=100 at iteration 2")
    with pytest.raises(ConfigError, match="stop_after_no_improvement=3 counts evaluations"):
        CFG.replace(eval_every=0, stop_after_no_improvement=3).validate()


def test_best_holds_the_params_of_the_best_evaluation(tmp_path, capsys):
    """best/ keeps the params of the best evaluation (mean over seeds): the same as the
    checkpoint of that iteration; load_policy(best=True) and `jaxppo eval --best` load them."""
    cfg = CFG.replace(checkpoint_every=0, checkpoint_minutes=1e-9, keep_checkpoints=10)
    run = tmp_path / "run"
    jaxppo.train(cfg, run_dir=run, progress=False, plot=False)
    evals = {r["iteration"]: r["eval_return_mean"] for r in _rows(run)
             if r.get("eval_return_mean") is not None and math.isfinite(r["eval_return_mean"])}
    assert sorted(evals) == [2, 4, 6, 8]
    best = max(evals, key=lambda it: (evals[it], -it))  # the first of equal ones
    record = json.loads((run / "best" / "best.json").read_text())
    assert record["iteration"] == best and record["eval_return_mean"] == evals[best]
    from jaxppo.run.checkpoints import load_params_dict
    saved = load_params_dict(run / "best" / "params.msgpack")
    with CheckpointStore(run, read_only=True) as store:
        state, _ = store.restore(best)
    assert _tree_equal(saved["params"], state["params"])
    assert _tree_equal(saved["obs_stats"], state["obs_stats"])
    policy = jaxppo.load_policy(run, best=True)
    assert policy.iteration == best
    assert _tree_equal(policy.params, state["params"])
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--best", "--episodes", "2"]) == 0
    assert f"best evaluation, iteration {best} (best/)" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="has no best/params.msgpack"):
        jaxppo.load_policy(tmp_path, best=True)


# ---------------------------------------------------------------------- bad input
def _corrupt_garbage_data(step_dir: Path):
    data = max((p for p in (step_dir / "state" / "d").iterdir()), key=lambda p: p.stat().st_size)
    data.write_bytes(np.random.default_rng(0).bytes(data.stat().st_size))


def _remove_state_metadata(step_dir: Path):
    (step_dir / "state" / "_METADATA").unlink()


def _garbage_meta(step_dir: Path):
    (step_dir / "meta" / "metadata").write_bytes(b"\x00\xff garbage \x13")


def _edit_yaml(path: Path, **changes) -> None:
    import yaml

    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _edit_record(run: Path, step: int, edit) -> None:
    edit_records(run, edit, step)


def _truncate_manifest(step_dir: Path):
    p = step_dir / "state" / "manifest.ocdbt"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_corrupt_garbage_data, _remove_state_metadata, _garbage_meta,
                                    _truncate_manifest])
def test_corrupt_checkpoint_is_a_clear_error_and_nothing_changes(stopped_copy, damage):
    step_dir = stopped_copy / "checkpoints" / str(STOP)
    damage(step_dir)
    before = _folder_digest(stopped_copy)
    with pytest.raises(CheckpointError) as info:
        jaxppo.train(None, resume=stopped_copy, progress=False)
    msg = str(info.value)
    assert str(step_dir) in msg and "corrupt or incomplete" in msg
    assert "move" in msg and "back to iteration 3" in msg  # the way back to the earlier checkpoint
    assert _folder_digest(stopped_copy) == before


def test_resuming_from_the_earlier_checkpoint_after_moving_a_corrupt_one(runs, stopped_copy, tmp_path):
    _garbage_meta(stopped_copy / "checkpoints" / str(STOP))
    shutil.move(stopped_copy / "checkpoints" / str(STOP), tmp_path / "bad")
    store, step = find_latest(stopped_copy)
    store.close()
    assert step == 3


def test_missing_run_folder_and_missing_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        jaxppo.train(None, resume=tmp_path / "nope", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints/ folder"):
        jaxppo.train(None, resume=tmp_path / "empty", progress=False)
    (tmp_path / "crashed" / "checkpoints" / "3.orbax-checkpoint-tmp-123").mkdir(parents=True)
    before = _folder_digest(tmp_path / "crashed")
    with pytest.raises(CheckpointError, match="unfinished saves"):
        jaxppo.train(None, resume=tmp_path / "crashed", progress=False)
    assert _folder_digest(tmp_path / "crashed") == before
    assert cli.main(["train", "--resume", str(tmp_path / "nope")]) == 2


@pytest.mark.parametrize("change, field, old, new", [
    (dict(num_envs=8), "num_envs", 4, 8),
    (dict(network=NetworkConfig((32, 16))), "network.hidden_sizes", [16, 16], [32, 16]),
    (dict(env="Acrobot-v1"), "env", "CartPole-v1", "Acrobot-v1"),
    (dict(num_seeds=2), "num_seeds", 1, 2),
    (dict(num_steps=32, total_timesteps=8 * 128), "num_steps", 16, 32),
])
def test_shape_change_on_resume_is_a_clear_error(stopped_copy, change, field, old, new):
    before = _folder_digest(stopped_copy)
    with pytest.raises(ConfigError) as info:
        jaxppo.train(CFG.replace(**change), resume=stopped_copy, progress=False)
    msg = str(info.value)
    assert f"{field}={new!r}" in msg and f"{field}={old!r}" in msg, msg
    assert _folder_digest(stopped_copy) == before


def test_cli_resume_shape_change_exits_2_and_changes_nothing(stopped_copy, capsys):
    before = _folder_digest(stopped_copy)
    rc = cli.main(["train", "--resume", str(stopped_copy), "--set", "num_envs=8", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "num_envs=8" in err and "num_envs=4" in err
    assert _folder_digest(stopped_copy) == before


def test_fresh_run_into_a_folder_with_checkpoints_is_refused(stopped_copy):
    before = _folder_digest(stopped_copy)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        jaxppo.train(CFG, run_dir=stopped_copy, progress=False)
    assert _folder_digest(stopped_copy) == before


def test_config_fields_are_validated():
    for bad in (dict(checkpoint_every=-1), dict(keep_checkpoints=0), dict(eval_every=-2),
                dict(eval_episodes=0), dict(eval_max_steps=0), dict(tensorboard="yes")):
        field = next(iter(bad))
        with pytest.raises(ConfigError, match=field):
            CFG.replace(**bad).validate()
    with pytest.raises(ConfigError, match=r"^schedule_on_extend='contine' is not one of "
                       r"\('new_total', 'continue'\).*did you mean 'continue'"):
        CFG.replace(schedule_on_extend="contine").validate()


# ---------------------------------------------------------------------- atomic saves
CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    from jaxppo.run.checkpoints import CheckpointStore
    from orbax.checkpoint._src.path import atomicity

    store = CheckpointStore(sys.argv[1], keep=3)
    store.save(1, {"w": np.arange(1000, dtype=np.float32)}, {"note": "first"})
    store.wait()

    async def crash(self):  # the process dies after writing step 2 but before its rename
        os._exit(17)

    atomicity.AtomicRenameTemporaryPath.finalize = crash
    store.save(2, {"w": np.full(1000, 7.0, np.float32)}, {"note": "second"})
    store.wait()
    sys.exit(0)
""")


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "1" in names and "2" not in names
    assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
    store, step = find_latest(tmp_path)
    with store:
        assert step == 1 and store.steps() == [1]
        state, meta = store.restore(1)
    np.testing.assert_array_equal(state["w"], np.arange(1000, dtype=np.float32))
    assert meta["note"] == "first"


def test_time_based_checkpoints_by_default_change_no_number(runs, tmp_path):
    """checkpoint_minutes (on by default) saves at the end of every chunk that passes the
    mark, without checkpoint_every, and changes nothing the run computes."""
    assert PPOConfig().checkpoint_minutes == 5 and PPOConfig().checkpoint_every == 0
    cfg = CFG.replace(checkpoint_every=0, checkpoint_minutes=1e-9, keep_checkpoints=10)
    result = jaxppo.train(cfg, run_dir=tmp_path / "run", progress=False)
    store, step = find_latest(tmp_path / "run")
    with store:
        # chunks of log_every=3 that end at each evaluation (every 2) too
        assert store.steps() == [2, 4, 6, 8]
    assert _tree_equal(runs["full"].state, result.state)


# ---------------------------------------------------------------------- interrupts
def test_sigint_stops_after_the_chunk_saves_everything_and_resumes_exactly(runs, tmp_path):
    """Ctrl-C (SIGINT) during the first chunk: training stops once that chunk is done,
    writes a checkpoint of its last iteration, params and summary, then raises
    TrainingInterrupted; resuming ends with the numbers of an uninterrupted run."""
    import os
    import signal

    run = tmp_path / "run"
    sent = []
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a background job

    def interrupt(rows):
        if not sent:
            sent.append(rows[-1]["iteration"])
            os.kill(os.getpid(), signal.SIGINT)

    # The first chunk ends at the first evaluation (iteration 2; eval_every=2).
    with pytest.raises(jaxppo.TrainingInterrupted, match=r"SIGINT stopped training after "
                       r"iteration 2 of 8: .* continue with: jaxppo train --resume") as info:
        jaxppo.train(CFG, run_dir=run, progress=False, callback=interrupt)
    assert sent == [2] and info.value.signal_name == "SIGINT"
    assert info.value.result.iterations_done == 2 and not info.value.result.completed
    assert find_latest(run)[1] == 2
    assert (run / "params.msgpack").exists()
    assert json.loads((run / "summary.json").read_text())["iterations"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler is restored
    resumed = jaxppo.train(None, resume=run, progress=False)
    assert _tree_equal(runs["full"].state, resumed.state)
    assert [r["iteration"] for r in _rows(run)] == list(range(1, CFG.num_iterations + 1))


def _cli_train(cache_dir: str | None, *settings: str) -> list[str]:
    """`python -m jaxppo train` of a long CartPole run in chunks of 1 iteration, with the
    suite's compilation cache: the CLI tests below train one program, compiled once."""
    return [sys.executable, "-m", "jaxppo", "train", "--env", "CartPole-v1", "--defaults",
            "--set", "num_envs=4", "num_steps=16", "num_minibatches=2", "total_timesteps=200000",
            "log_every=1", "network.hidden_sizes=[16,16]",
            f"compilation_cache_dir={cache_dir or 'null'}", *settings]


def test_cli_sigterm_saves_and_exits_143(tmp_path, compile_cache_dir):
    """SIGTERM to `jaxppo train` (what a scheduler sends) mid-run: exit code 143, a
    checkpoint at the last finished iteration, and the resume command on stderr."""
    import os
    import signal
    import subprocess
    import time

    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        _cli_train(compile_cache_dir) + ["--runs-dir", str(tmp_path), "--run-name", "run",
                                         "--no-progress", "--no-plot"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (
            (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    done = len(_rows(run))
    assert 2 <= done < 3125
    assert find_latest(run)[1] == done
    assert (run / "params.msgpack").exists() and (run / "summary.json").exists()
    assert f"SIGTERM stopped training after iteration {done} of 3125" in err
    assert f"jaxppo train --resume {run}" in err


@pytest.mark.parametrize("damage,match", [
    (lambda run: (run / "config.yaml").write_text(""), r"config\.yaml is empty, so the run's config is unknown"),
    (lambda run: (run / "metrics.jsonl").unlink(), r"metrics\.jsonl is missing, but the checkpoint is at iteration 4"),
    (lambda run: (run / "metrics.jsonl").write_text(
        "\n".join((run / "metrics.jsonl").read_text().splitlines()[2:]) + "\n"),
     r"metrics\.jsonl has no rows for iteration\(s\) 1, 2 of the 4"),
    (lambda run: (run / "metrics.jsonl").write_text(
        "garbage\n" + (run / "metrics.jsonl").read_text()), r"metrics\.jsonl cannot be read"),
    # Rows of iterations 2-4 written twice before the checkpoint's (a file joined by hand):
    # a resume would keep them, so each iteration would no longer appear once.
    (lambda run: (run / "metrics.jsonl").write_text(
        "".join((lines := (run / "metrics.jsonl").read_text().splitlines(keepends=True))
                + lines[1:])),
     r"metrics\.jsonl, line 5: iteration 2 comes after iteration 4 \(line 4\), but a run "
     r"writes each iteration once, in order: rows are repeated or out of order .* Keep one row "
     r"per iteration, in order"),
    (lambda run: (run / "metrics.jsonl").write_text("".join(
        (lines := (run / "metrics.jsonl").read_text().splitlines(keepends=True))[:1]
        + lines[2:3] + lines[1:2] + lines[3:])),
     r"metrics\.jsonl, line 3: iteration 2 comes after iteration 3 \(line 2\)"),
    # The checkpoint's record of the config is the reference: a truncated or edited
    # config.yaml (or record) is refused with both values named.
    (lambda run: (run / "config.yaml").write_text("".join(  # cut after half of its lines
        (run / "config.yaml").read_text().splitlines(keepends=True)[:20])),
     r"disagrees with the config the run's newest checkpoint recorded: "),
    (lambda run: (run / "config.yaml").write_text("env: CartPole-v1\nnum_envs: 4\nnetwork: {hid"),
     r"config\.yaml is not valid YAML .*restore it, or delete it to use the config the newest "
     r"checkpoint recorded"),
    (lambda run: _edit_yaml(run / "config.yaml", total_timesteps=4 * 64),
     r"total_timesteps is 256 in config.yaml but 512 in the checkpoint.*to continue training "
     r"with another value on purpose, give it: --set total_timesteps=256"),
    (lambda run: _edit_record(run, STOP, lambda r: r["config"].update(total_timesteps=16 * 64)),
     r"total_timesteps is 512 in config.yaml but 1024 in the checkpoint"),
    (lambda run: _edit_record(run, STOP, lambda r: r.update(iteration=2)),
     r"its record says iteration 2 and wall time .*, not iteration 4"),
    (lambda run: _edit_record(run, STOP, lambda r: r.update(config=[1, 2])),
     r"records its config as '\[1, 2\]', not a mapping"),
], ids=["empty-config", "no-metrics", "missing-rows", "garbage-row", "repeated-rows",
         "rows-out-of-order", "truncated-config", "cut-mid-value", "edited-config", "edited-record", "record-iteration", "record-config"])
def test_resume_refuses_a_damaged_record_and_changes_nothing(stopped_copy, damage, match, capsys):
    damage(stopped_copy)
    before = _folder_digest(stopped_copy)
    with pytest.raises((ConfigError, CheckpointError), match=match):
        jaxppo.train(None, resume=stopped_copy, progress=False)
    assert cli.main(["train", "--resume", str(stopped_copy), "--no-progress"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert _folder_digest(stopped_copy) == before


def test_a_run_folder_in_use_is_refused_and_left_alone(stopped_copy, tmp_path, capsys):
    """A second process cannot write a run folder another one holds (RUN_DIR/.lock): resuming
    it is a ConfigError naming the holder, and nothing in the folder changes."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); f.seek(0); f.truncate(); f.write('process 4242'); f.flush(); "
         "print('held', flush=True); "
         "time.sleep(60)", str(stopped_copy / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _folder_digest(stopped_copy)
        with pytest.raises(ConfigError, match=r"is in use by process 4242: two processes cannot "
                                              r"write one run"):
            jaxppo.train(None, resume=stopped_copy, progress=False)
        assert cli.main(["train", "--resume", str(stopped_copy), "--no-progress"]) == 2
        assert "in use by process 4242" in capsys.readouterr().err
        assert _folder_digest(stopped_copy) == before
    finally:
        holder.kill()
        holder.wait()
    # Released with its holder: the resume now runs to the end, and leaves the lock free.
    res = jaxppo.train(None, resume=stopped_copy, progress=False, plot=False)
    assert res.completed
    jaxppo.train(None, resume=stopped_copy, progress=False, plot=False)  # free again


# ---------------------------------------------------------------------- a failing disk
def test_a_full_disk_mid_run_is_a_clear_error_and_the_run_resumes(runs, tmp_path, monkeypatch):
    """metrics.jsonl cannot be appended after iteration 6 (No space left on device): a
    RunFolderError names the file, the reason and the intact checkpoint; once there is room
    again, --resume ends with the numbers of an uninterrupted run."""
    import errno

    from jaxppo.run.logs import RunLog

    real_write, calls = RunLog.write, []

    def write(self, rows):
        calls.append(rows[-1]["iteration"])
        if rows[-1]["iteration"] > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, rows)

    monkeypatch.setattr(RunLog, "write", write)
    run = tmp_path / "run"
    with pytest.raises(jaxppo.RunFolderError, match=(
            rf"could not write metrics\.jsonl in {run}: No space left on device\. Saved and "
            rf"intact: the checkpoint of iteration 6\. .* continue with --resume {run}")):
        jaxppo.train(CFG, run_dir=run, progress=False)
    monkeypatch.setattr(RunLog, "write", real_write)
    assert find_latest(run)[1] == 6
    resumed = jaxppo.train(None, resume=run, progress=False, plot=False)
    assert _tree_equal(runs["full"].state, resumed.state)
    assert [r["iteration"] for r in _rows(run)] == list(range(1, CFG.num_iterations + 1))


def test_a_plot_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch):
    """The results (params, summary, checkpoint) are saved before the plot; a failing plot
    only warns, naming how to draw it later."""
    import errno

    from jaxppo.run import folder

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(folder, "plot_runs", no_room)
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match=rf"curve\.png was not written \(No space left on device\); "
                                         rf"draw it later with `jaxppo plot {run}`"):
        res = jaxppo.train(CFG, run_dir=run, progress=False)  # CFG's program, compiled once
    assert res.completed and (run / "params.msgpack").exists() and (run / "summary.json").exists()


def _small_tmpfs(path: Path, size: str) -> bool:
    """A tmpfs of `size` at `path` (root only); False where it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def tiny_disk(tmp_path):
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "48k"):
        pytest.skip("needs root to mount a small tmpfs")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_cli_on_a_really_full_disk_and_a_read_only_folder(tiny_disk, tmp_path, compile_cache_dir):
    """A real 48 KiB file system: the CLI stops with one clear line naming the file and the
    reason (no traceback, no orbax log), and exit code 1; the same for a read-only one."""
    import os

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    argv = _cli_train(compile_cache_dir, "checkpoint_every=20") + [
        "--runs-dir", str(tiny_disk), "--run-name", "run", "--no-progress"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ERROR:absl" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(rf"error: could not write .* in {tiny_disk / 'run'}: No space left on device",
                     proc.stderr), proc.stderr[-3000:]
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    proc = subprocess.run(argv[:-5] + ["--runs-dir", str(tiny_disk), "--run-name", "other",
                                       "--no-progress"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert re.search(r"error: could not write the run folder in .*other: Read-only file system",
                     proc.stderr), proc.stderr[-3000:]


def test_unretrieved_orbax_write_task_errors_are_not_logged(tmp_path, caplog):
    """A failed save leaves orbax's other per-array write tasks holding exceptions nobody
    awaits; asyncio logs each with a traceback whenever the task is garbage-collected. Those
    (and only those of orbax's tasks) are dropped once a checkpoint store exists."""
    import asyncio
    import gc
    import logging

    CheckpointStore(tmp_path / "checkpoints")  # installs the filter
    namespace: dict = {}
    for label, filename in (("orbax", "/site-packages/orbax/checkpoint/type_handlers.py"),
                            ("other", "/site-packages/something/else.py")):
        src = f"async def write_{label}():\n    raise ValueError('RESOURCE_EXHAUSTED: {label}')\n"
        exec(compile(src, filename, "exec"), namespace)

    def leave_unretrieved(coro_fn):
        loop = asyncio.new_event_loop()
        task = loop.create_task(coro_fn())
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        del task
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        leave_unretrieved(namespace["write_orbax"])
        assert not [r for r in caplog.records if r.name == "asyncio"]
        leave_unretrieved(namespace["write_other"])
        kept = [r for r in caplog.records if r.name == "asyncio"]
        assert len(kept) == 1 and "never retrieved" in kept[0].getMessage()


def test_an_unusable_compilation_cache_folder_is_a_warning(tmp_path):
    """A cache folder that cannot be created (here under a file; a read-only HOME alike)
    leaves the cache off with a note; nothing is created elsewhere."""
    from jaxppo.process import enable_compilation_cache

    (tmp_path / "file").write_text("")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.warns(UserWarning, match=r"the compilation cache is off for this run: .*file/xla "
                                         r"cannot be used \(Not a directory\)"):
        enable_compilation_cache(str(tmp_path / "file" / "xla"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_default_cache_folder_gives_way_to_jaxs_environment_variable(tmp_path, monkeypatch):
    """compilation_cache_dir's default yields to JAX_COMPILATION_CACHE_DIR (a cluster's shared
    cache, this suite's); a folder the config names is used whatever the environment says."""
    import jax

    from jaxppo.process import DEFAULT_CACHE_DIR, enable_compilation_cache

    assert jaxppo.PPOConfig().compilation_cache_dir == DEFAULT_CACHE_DIR
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "shared"))
    try:
        enable_compilation_cache(DEFAULT_CACHE_DIR)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "shared")
        enable_compilation_cache(str(tmp_path / "mine"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        enable_compilation_cache(DEFAULT_CACHE_DIR)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "home/.cache/jaxppo/xla")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "mine", "shared"]
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_a_program_too_big_for_the_memory_is_refused_before_it_runs(tmp_path, monkeypatch):
    """XLA's figure for the compiled program against the free memory (here 1 KiB; the
    estimate before compiling is left out to reach it): a ConfigError with the need, the free
    memory, the largest parts with their fields, and the field to lower; no folder."""
    from jaxppo.program import memory

    monkeypatch.setattr(memory, "free_memory", lambda: 1024)
    monkeypatch.setattr(memory, "check_memory_estimate", lambda *args: None)
    with pytest.raises(ConfigError, match=r"the training program needs about [\d.]+ KiB of working "
                                          r"memory beyond its state, but 1\.0 KiB is free on .*"
                                          r"\(network\.hidden_sizes=\[16, 16\]: 755 parameters per "
                                          r"seed\).*\(num_envs\*num_steps = 64 transitions per "
                                          r"iteration\).*Use fewer or narrower layers in "
                                          r"network\.hidden_sizes\.$"):
        jaxppo.train(CFG, run_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- a folder from elsewhere
def _outside(tmp_path: Path) -> Path:
    target = tmp_path / "outside.txt"
    target.write_text("not jaxppo's\n")
    return target


@pytest.mark.parametrize("name", [".lock", "summary.json.tmp", "params.msgpack.tmp",
                                  "metrics.jsonl", "curve.png", "checkpoints/3"])
def test_resume_refuses_a_folder_with_links_and_writes_nothing(stopped_copy, tmp_path, name,
                                                               capsys):
    """A link planted in a run folder could make a resume write outside it: the folder is
    refused, the link named, and neither the folder nor the link's target changes."""
    target = _outside(tmp_path)
    link = stopped_copy / name
    if link.is_dir():
        shutil.move(link, tmp_path / "moved")
        target = tmp_path / "moved"
    elif link.exists():
        link.unlink()
    link.symlink_to(target)
    before, outside = _folder_digest(stopped_copy), _folder_digest(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(f"{link} is a symbolic link")):
        jaxppo.train(None, resume=stopped_copy, progress=False)
    assert cli.main(["train", "--resume", str(stopped_copy), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and "Traceback" not in err
    assert _folder_digest(stopped_copy) == before and _folder_digest(tmp_path) == outside
    assert link.is_symlink()


def test_run_folder_files_are_replaced_not_written_through_links(tmp_path):
    from jaxppo.run.files import open_append, write_atomic

    target = _outside(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("summary.json.tmp", "summary.json"):
        (folder / name).symlink_to(target)
    write_atomic(folder / "summary.json", "{}")
    assert target.read_text() == "not jaxppo's\n"
    assert not (folder / "summary.json").is_symlink() and (folder / "summary.json").read_text() == "{}"
    assert not (folder / "summary.json.tmp").exists()
    (folder / "metrics.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        open_append(folder / "metrics.jsonl")
    assert target.read_text() == "not jaxppo's\n"


def test_two_runs_that_take_one_folder_at_once_cannot_both_write_it(tmp_path):
    """Both passed the "empty folder" check; the one that creates the folder's lock first
    writes it, the other is refused before writing anything in it."""
    from jaxppo.run.folder import RunFolder, fresh_run_dir

    run = fresh_run_dir(tmp_path, "same")
    assert fresh_run_dir(tmp_path, "same") == run  # both checks pass: nothing is there yet
    first = RunFolder(run, CFG)
    try:
        before = _folder_digest(run)
        with pytest.raises(ConfigError, match="taken by another run after this run's checks"):
            RunFolder(run, CFG.replace(network=NetworkConfig((32, 32))))
        assert _folder_digest(run) == before
    finally:
        first.close()
    with pytest.raises(ConfigError, match=r"already exists and is not empty \(it holds \.lock, "):
        fresh_run_dir(tmp_path, "same")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="a new run needs a new or empty folder"):
        jaxppo.train(CFG, run_dir=tmp_path / "other", progress=False)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]


def test_a_new_folder_refused_while_opening_is_removed(tmp_path, monkeypatch):
    """A run refused while its folder is being opened (here the metrics log cannot be made)
    leaves no folder behind, so the same --run-name works once the cause is fixed."""
    from jaxppo.run import folder as folder_mod

    def refuse(*args, **kwargs):
        raise ConfigError("no log for you")

    monkeypatch.setattr(folder_mod, "RunLog", refuse)
    with pytest.raises(ConfigError, match="no log for you"):
        folder_mod.RunFolder(tmp_path / "runs" / "new", CFG)
    assert not (tmp_path / "runs" / "new").exists()


def test_resume_without_config_yaml_uses_the_checkpoint_record(runs, stopped_copy):
    (stopped_copy / "config.yaml").unlink()
    res = jaxppo.train(None, resume=stopped_copy, progress=False, plot=False)
    assert res.completed and res.config.total_timesteps == CFG.total_timesteps
    assert _tree_equal(res.params, runs["full"].params)
    assert jaxppo.PPOConfig.from_file(stopped_copy / "config.yaml") == res.config


def test_a_value_set_on_purpose_may_differ_from_the_record(stopped_copy, capsys):
    """A resume that extended the run and stopped before its next checkpoint leaves a
    config.yaml ahead of the record: the error names the --set that continues it."""
    _edit_yaml(stopped_copy / "config.yaml", total_timesteps=12 * 64)
    assert cli.main(["train", "--resume", str(stopped_copy), "--no-progress", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "--set total_timesteps=768" in err
    assert cli.main(["train", "--resume", str(stopped_copy), "--no-progress", "--no-plot",
                     "--set", "total_timesteps=768"]) == 0
    assert len(_rows(stopped_copy)) == 12


def test_untrusted_resume_refuses_a_config_that_imports(stopped_copy):
    """trust_config=False: a folder whose config (and record) name a module is refused before
    the module is imported."""
    module_env = "planted_env_module:Env"
    _edit_yaml(stopped_copy / "config.yaml", env=module_env)
    _edit_record(stopped_copy, STOP, lambda r: r["config"].update(env=module_env))
    before = _folder_digest(stopped_copy)
    with pytest.raises(ConfigError, match="would import the module 'planted_env_module'"):
        jaxppo.train(None, resume=stopped_copy, progress=False, trust_config=False)
    assert "planted_env_module" not in sys.modules
    assert _folder_digest(stopped_copy) == before


def test_orbax_reading_a_save_still_being_written_says_nothing(tmp_path, caplog):
    """Orbax may read the metadata of a step whose save is still in progress (its
    `<step>.orbax-checkpoint-tmp` folder, before the file is written) and warn that it does not
    exist: a run's output stays free of that line. The same warning about a finished step's
    folder still reaches the log."""
    from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata

    store = CheckpointStore(tmp_path / "run")  # a store that writes: the filter is installed
    store.close()
    reader = orbax_metadata.metadata_store(enable_write=False)
    checkpoints = tmp_path / "run" / "checkpoints"
    with caplog.at_level("WARNING", logger="absl"):
        assert reader.read(checkpoints / "20.orbax-checkpoint-tmp/_CHECKPOINT_METADATA") is None
        assert reader.read(checkpoints / "20/_CHECKPOINT_METADATA") is None
    messages = [r.getMessage() for r in caplog.records
                if "Metadata file does not exist" in r.getMessage()]
    assert len(messages) == 1 and messages[0].endswith("checkpoints/20/_CHECKPOINT_METADATA"), messages
