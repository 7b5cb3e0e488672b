"""The only writer of a run folder, whoever started the run (CLI, `jaxppo.train`, a Ray job).

    RUN_DIR/config.yaml        the run's config (rewritten on resume only if it changed)
    RUN_DIR/metrics.jsonl      one row per iteration (and seed), appended as training goes
    RUN_DIR/checkpoints/<it>/  the whole TrainState, unsharded (see jaxppo.layouts)
    RUN_DIR/params.msgpack     the trained params and observation statistics
    RUN_DIR/summary.json       final return, evaluation, speed
    RUN_DIR/curve.png          return vs env steps and vs wall time
    RUN_DIR/tensorboard/       with `tensorboard: true`

Nothing is created before the run has passed every check (`RunFolder` is opened after).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import numpy as np

from jaxppo.checkpoint import CheckpointStore, save_params, write_text_atomic
from jaxppo.config import PPOConfig
from jaxppo.errors import ConfigError
from jaxppo.plotting import plot_runs
from jaxppo.runlog import RunLog
from jaxppo.runtime import process_uptime


LOCK_FILE = ".lock"


class RunFolder:
    """An open run folder: metrics log, checkpoint store, and the final files. It holds an
    exclusive lock on the folder (RUN_DIR/.lock) until closed, so a second process cannot
    write the same run: it gets a ConfigError and writes nothing."""

    def __init__(self, path: str | Path, config: PPOConfig, *, resume_iteration: int | None = None):
        self.path = Path(path)
        self.config = config
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = _lock_folder(self.path)
        try:
            self._open(config, resume_iteration)
        except BaseException:
            self._lock.close()
            raise

    def _open(self, config: PPOConfig, resume_iteration: int | None) -> None:
        write_config(self.path, config, overwrite=resume_iteration is not None)
        self.log = RunLog(
            self.path, tensorboard=config.tensorboard, num_seeds=config.num_seeds,
            resume_iteration=resume_iteration,
            resume_env_steps=None if resume_iteration is None else resume_iteration * config.batch_size)
        self.store = CheckpointStore(self.path, keep=config.keep_checkpoints)

    @property
    def previous_rows(self) -> list[dict]:
        return self.log.previous_rows

    def write_rows(self, rows: list[dict]) -> None:
        self.log.write(rows)

    def save_checkpoint(self, iteration: int, state, meta: dict) -> None:
        self.store.save(iteration, state, meta)

    def finish(self, result, *, plot: bool = True, label: str | None = None,
               extra_summary: dict | None = None) -> dict:
        """params.msgpack, summary.json and (with plot) curve.png; returns the summary."""
        save_params(self.path / "params.msgpack", result)
        info = summary(result)
        info.update(extra_summary or {})
        write_text_atomic(self.path / "summary.json", json.dumps(info, indent=2))
        if plot:
            name = self.config.env_name
            plot_runs([self.path], self.path / "curve.png", labels=[label or name],
                      title=f"{name}: return vs env steps")
        return info

    def close(self) -> None:
        try:
            self.log.close()
        finally:
            try:
                self.store.close()  # waits for a save still being written
            finally:
                self._lock.close()  # closing the file releases the lock


def _lock_folder(path: Path):
    """An exclusive, non-blocking lock on RUN_DIR/.lock (released when the returned file is
    closed, or when the process ends however it ends); ConfigError if another process has it."""
    f = open(path / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(
            f"run folder {path} is in use by {holder}: two processes cannot write one run. Wait "
            "for it to finish (then --resume), or choose another run folder") from None
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()}")
    f.flush()
    return f


def write_config(run_dir: Path, config: PPOConfig, overwrite: bool) -> None:
    """RUN_DIR/config.yaml: written when missing or, on resume, when the config changed (e.g. a
    larger total_timesteps), through a temporary file."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    if not path.exists() or (overwrite and path.read_text() != text):
        write_text_atomic(path, text)


def fresh_run_dir(runs_dir: str | Path, name: str) -> Path:
    """runs_dir/name for a new run; a non-empty existing folder is a ConfigError."""
    run_dir = Path(runs_dir) / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run folder {run_dir} already exists and is not empty; "
                          "choose another --run-name (or continue it with --resume)")
    return run_dir


def summary(result) -> dict:
    """summary.json of a TrainResult: final return per seed, the last evaluation, speed."""
    r = np.atleast_2d(result.metrics["episode_return_mean"])
    tail = []
    for seed_curve in r:
        vals = seed_curve[-10:]
        vals = vals[np.isfinite(vals)]
        tail.append(float(vals.mean()) if len(vals) else float("nan"))
    cfg = result.config
    steps = int(result.iterations_done * cfg.batch_size)
    steps_now = int((result.iterations_done - (result.resumed_from or 0)) * cfg.batch_size)
    out = {
        "env": cfg.env_name,
        "num_seeds": cfg.num_seeds,
        "hosts": int(result.hosts),
        "num_devices": int(result.num_devices),
        "env_steps": steps,
        "iterations": int(result.iterations_done),
        "completed": bool(result.completed),
        "final_return_mean": float(np.mean(tail)),
        "final_return_std": float(np.std(tail)),
        "final_return_per_seed": tail,
        "compile_seconds": result.compile_seconds,
        "train_seconds": result.train_seconds,
        "sps": steps_now * cfg.num_seeds / max(result.train_seconds, 1e-9),
        "process_seconds": process_uptime(),
    }
    if "eval_return_mean" in result.metrics:
        ev = np.atleast_2d(result.metrics["eval_return_mean"])
        done = np.isfinite(ev[0])
        if done.any():
            idx = np.flatnonzero(done)[-1]
            per_seed = [float(v) for v in ev[:, idx]]
            out["final_eval_return_mean"] = float(np.mean(per_seed))
            out["final_eval_return_std"] = float(np.std(per_seed))
            out["final_eval_return_per_seed"] = per_seed
            out["final_eval_iteration"] = int(np.atleast_2d(result.metrics["iteration"])[0, idx])
    return out
