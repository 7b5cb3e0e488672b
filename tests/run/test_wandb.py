"""Weights & Biases logging (config.wandb): validation, the missing-package error, that it is
logging only (same compiled program, not locked on resume), and an offline run and its
resume read back from W&B's own `.wandb` files (no network)."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import jax
import pytest
import yaml

import jaxppo
from jaxppo.config import LOCKED_FIELDS, PPOConfig
from jaxppo.errors import ConfigError
from jaxppo.run.folder import check_resumable
from jaxppo.run.plots import _NOT_IN_LEGEND
from jaxppo.run.logs import WANDB_ID_FILE, read_metrics

TINY = PPOConfig(num_envs=4, num_steps=8, total_timesteps=4 * 8 * 4, num_epochs=1,
                 num_minibatches=2, compilation_cache_dir=None, checkpoint_minutes=0,
                 network=jaxppo.NetworkConfig(hidden_sizes=(8,)))


def bad(pattern: str, **fields):
    with pytest.raises(ConfigError, match=pattern):
        TINY.replace(**fields).validate()


# ---------------------------------------------------------------------- config
def test_wandb_settings_are_validated():
    TINY.replace(wandb={"project": "p", "mode": "offline", "entity": "me", "name": "n",
                        "dir": "/tmp", "group": "g", "tags": ["a"], "notes": "x"}).validate()
    TINY.replace(wandb={"project": "p"}).validate()  # mode from WANDB_MODE, else online
    bad(r"unknown config key 'wandb\.projet'; did you mean 'wandb\.project'\?; valid keys: "
        r"wandb\.project, wandb\.mode", wandb={"projet": "p"})
    bad(r"^wandb\.mode='ofline' is not one of \('online', 'offline', 'disabled'\); did you "
        r"mean 'offline'", wandb={"project": "p", "mode": "ofline"})
    bad(r"^wandb\.project=None must be the name of a W&B project", wandb={"mode": "offline"})
    bad(r"^wandb='p' must be a mapping of W&B settings or null", wandb="p")
    bad(r"^wandb\.tags='a' must be a list of strings", wandb={"project": "p", "tags": "a"})
    bad(r"^wandb\.entity=3 must be a non-empty string", wandb={"project": "p", "entity": 3})


def test_wandb_from_the_command_line_and_yaml(tmp_path):
    cfg = TINY.with_overrides(["wandb.project=jaxppo", "wandb.mode=offline"]).validate()
    assert cfg.wandb == {"project": "jaxppo", "mode": "offline"}
    cfg = cfg.with_overrides(["wandb.name=run1"])  # adds to the config's settings
    assert cfg.wandb == {"project": "jaxppo", "mode": "offline", "name": "run1"}
    assert TINY.with_overrides(["wandb={project: p, mode: disabled}"]).wandb["mode"] == "disabled"
    assert cfg.with_overrides(["wandb=null"]).wandb is None
    path = tmp_path / "c.yaml"
    path.write_text("wandb:\n  project: p\n  mode: offline\n")
    assert PPOConfig.from_file(path).validate().wandb == {"project": "p", "mode": "offline"}
    full = TINY.replace(wandb={"project": "p", "tags": ["a", "b"], "dir": "/tmp/w"})
    assert PPOConfig.from_dict(yaml.safe_load(yaml.safe_dump(full.to_dict()))) == full


def test_wandb_is_logging_only():
    """Not a locked field on resume, not a legend difference, and the compiled program is
    the same with it or without."""
    with_wandb = TINY.replace(wandb={"project": "p", "mode": "offline"})
    assert "wandb" not in LOCKED_FIELDS and "wandb" in _NOT_IN_LEGEND
    check_resumable(TINY.to_dict(), with_wandb, "run")  # no error
    check_resumable(with_wandb.to_dict(), TINY, "run")
    key = jax.random.PRNGKey(0)
    texts = [jax.jit(jaxppo.make_train(c)).lower(key).as_text() for c in (TINY, with_wandb)]
    assert texts[0] == texts[1]


def test_missing_wandb_package_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"the wandb package is not installed: pip install "
                                          r"'jaxppo\[wandb\]'"):
        jaxppo.train(TINY.replace(wandb={"project": "p", "mode": "offline"}), run_dir=run_dir,
                     progress=False)
    assert not run_dir.exists()  # refused before anything was written
    # mode: disabled needs no package
    jaxppo.run.logs.check_wandb(TINY.replace(wandb={"project": "p", "mode": "disabled"}))


# ---------------------------------------------------------------------- offline run + resume
def wandb_records(path: Path):
    """The records of a W&B `.wandb` file: a 7-byte header (':W&B', 0xBEE1, version), then
    LevelDB-log records in 32 KiB blocks (7-byte header: crc, length, type FULL/FIRST/MIDDLE/
    LAST), each a wandb_internal Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        buf = data[pos + 7:pos + 7 + n] if kind in (1, 2) else buf + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def offline_runs(local: Path) -> list[Path]:
    """The offline-run-* folders in `local`, once W&B has written them out: run.finish()
    returns before W&B's service process has flushed and closed the run's file (finishing is
    announced to it, not awaited), so wait for that process to end, as a process's exit does."""
    import wandb

    wandb.teardown()
    return sorted(local.glob("offline-run-*"))


def read_offline_run(run_dir: Path) -> dict:
    """What W&B holds of one offline-run-* folder: id, group, name, config, history rows
    (by step), the last summary values and the files it saved."""
    (path,) = run_dir.glob("run-*.wandb")
    out = {"history": {}, "summary": {}, "config": {}, "files": []}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, group=r.run.run_group, name=r.run.display_name,
                       project=r.run.project)
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out["history"][row["_step"]] = row
        elif kind == "summary":
            out["summary"].update({i.key: json.loads(i.value_json) for i in r.summary.update if i.key})
        elif kind == "files":
            out["files"] += [f.path for f in r.files.files]
    return out


def test_offline_run_and_resume_continue_the_same_wandb_runs(tmp_path, monkeypatch):
    """Iteration 1 without W&B; wandb set on the first resume (its new runs get iteration 1
    first, then 2 and 3); a second resume continues the same W&B runs with iteration 4."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "cartpole"
    cfg = TINY.replace(num_seeds=2)
    jaxppo.train(cfg, run_dir=run_dir, progress=False, stop_after_iterations=1)
    assert not (run_dir / WANDB_ID_FILE).exists()
    cfg = cfg.replace(wandb={"project": "jaxppo-test"})
    second = jaxppo.train(cfg, resume=run_dir, progress=False, stop_after_iterations=2)
    assert second.iterations_done == 3 and not second.completed
    ids = (run_dir / WANDB_ID_FILE).read_text().split()
    assert len(ids) == 2 and len(set(ids)) == 2
    result = jaxppo.train(None, resume=run_dir, progress=False)
    assert result.completed and (run_dir / WANDB_ID_FILE).read_text().split() == ids

    folders = offline_runs(tmp_path / "wandb-dir" / "wandb")
    assert len(folders) == 4  # two W&B runs, each started twice
    rows = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    for seed, run_id in enumerate(ids):
        parts = [read_offline_run(f) for f in folders if f.name.endswith(run_id)]
        assert len(parts) == 2 and all(p["id"] == run_id for p in parts)  # resume: same run
        assert {p["group"] for p in parts} == {"cartpole"}
        assert {p["name"] for p in parts} == {f"cartpole-seed{seed}"}
        assert parts[0]["project"] == "jaxppo-test"
        config = parts[0]["config"]
        assert config["seed_index"] == seed and config["lr"] == cfg.lr and config["num_seeds"] == 2
        assert sorted(parts[0]["history"]) == [32, 64, 96] and sorted(parts[1]["history"]) == [128]
        assert "wandb" not in config
        # Every iteration once, at step = env steps, with metrics.jsonl's numbers.
        history = {**parts[0]["history"], **parts[1]["history"]}
        assert not set(parts[0]["history"]) & set(parts[1]["history"])
        own = [r for r in rows if r["seed"] == seed]
        assert sorted(history) == [r["env_steps"] for r in own] == [32, 64, 96, 128]
        for r in own:
            h = history[r["env_steps"]]
            assert h["perf/iteration"] == r["iteration"] and h["env_steps"] == r["env_steps"]
            for key, tag in (("policy_loss", "train/policy_loss"), ("kl", "train/kl"),
                             ("episode_return_mean", "charts/episode_return_mean")):
                if r[key] is None:
                    assert tag not in h
                else:
                    assert h[tag] == pytest.approx(r[key])
        # The final summary, and curve.png as an image, in the resumed part.
        final = parts[1]["summary"]
        assert final["final_return"] == pytest.approx(summary["final_return_per_seed"][seed])
        assert final["env_steps"] == 128 and final["completed"] is True
        assert history[128]["curve/_type"] == "image-file"
        assert any(re.fullmatch(r"media/images/curve_128_.*\.png", f) for f in parts[1]["files"])


def test_offline_logging_is_quiet_but_says_where_its_files_are(tmp_path, monkeypatch, capfd):
    """W&B's banner, resume warning and run summary (some 15 lines per seed) are silenced and
    the console is not captured; one line names the offline files and the upload command.
    No training: the writer of a two-seed run folder, fed rows by hand."""
    from jaxppo.run.logs import WandbWriter

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "quiet"
    run_dir.mkdir()
    rows = [{"iteration": 1, "env_steps": 32, "episode_return_mean": 9.0, "seed": s} for s in (0, 1)]
    for resumed in (False, True):  # a resume of an offline run: no "resume will be ignored"
        writer = WandbWriter(run_dir, {"project": "jaxppo-test"}, {"lr": 0.001}, 2, resumed=resumed)
        print("progress line")  # the run's own output goes through untouched
        writer.write(rows)
        writer.close()
    out, err = capfd.readouterr()
    assert "wandb:" not in out + err and "WARNING" not in out + err, out + err
    assert out == "progress line\nprogress line\n"
    local = run_dir / "wandb"
    line = f"W&B (offline): 2 run(s) in {local}; upload with `wandb sync {local}/offline-run-*`"
    assert err.splitlines() == [line, line]
    folders = offline_runs(local)
    assert len(folders) == 4 and not list(local.glob("offline-run-*/files/output.log"))
    first = read_offline_run(folders[0])
    assert first["history"][32]["charts/episode_return_mean"] == 9.0
