"""The only writer of a run folder, whoever started the run (CLI, `jaxppo.train`, a Ray job).

    RUN_DIR/config.yaml        the run's config (rewritten on resume only if it changed)
    RUN_DIR/metrics.jsonl      one row per iteration (and seed), appended as training goes
    RUN_DIR/checkpoints/<it>/  the whole TrainState, unsharded (see jaxppo.program.shards)
    RUN_DIR/params.msgpack     the trained params and observation statistics
    RUN_DIR/summary.json       final return, evaluation, speed (per member, for a sweep)
    RUN_DIR/best/              with eval_every: params.msgpack of the best evaluation so far
                               (mean over seeds) and best.json (its iteration and returns)
    RUN_DIR/sweep.json         a vmapped sweep's hyperparameters per member (jaxppo.search.sweep)
    RUN_DIR/search.json, search.csv, best.yaml, search.png
                               a search's (or PBT's) member table, ranking, best config, plot
                               (jaxppo.search.results)
    RUN_DIR/curve.png          return vs env steps and vs wall time
    RUN_DIR/tensorboard/       with `tensorboard: true`
    RUN_DIR/wandb_id           with `wandb`: the W&B run id of each seed (resume continues them)

Nothing is created before the run has passed every check; a failed write is a
RunFolderError naming the file and what is saved. Resuming is the folder's too
(`begin_resume`, `ResumePoint`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxppo.run.checkpoints import (CHECKPOINT_DIR, CheckpointStore, checkpoint_dir,
                                    find_latest, load_run_config, save_params, write_params,
                                    write_text_atomic)
from jaxppo.config import LOCKED_FIELDS, PPOConfig
from jaxppo.core.hyperparams import follows_lr
from jaxppo.envs.make import refuse_imports
from jaxppo.envs.record import listed
from jaxppo.errors import CheckpointError, ConfigError, RunFolderError, warn
from jaxppo.search import results
from jaxppo.run.files import OTHERS_FOLDERS, name_too_long, refuse_links
from jaxppo.run.plots import plot_runs, plot_search
from jaxppo.run.logs import (METRICS_FILE, TENSORBOARD_DIR, WANDB_ID_FILE, RunLog,
                             order_problem, read_metrics, strict_json)
from jaxppo.process import process_uptime
from jaxppo.search.sweep import SWEEP_FILE


LOCK_FILE = ".lock"
BEST_DIR, BEST_RECORD = "best", "best.json"
# A run folder's own files and folders (the list above, W&B's folder, the lock, and the log
# of a run on several hosts: jaxppo.distributed.cluster.HOSTS_LOG, whose module imports Ray).
# A figure or an export that a user writes into the folder never replaces one of them.
RUN_FOLDERS = frozenset({CHECKPOINT_DIR, BEST_DIR, TENSORBOARD_DIR, *OTHERS_FOLDERS})
RUN_FILES = RUN_FOLDERS | {
    "config.yaml", METRICS_FILE, "params.msgpack", "summary.json", SWEEP_FILE,
    results.SEARCH_FILE, results.TABLE_FILE, results.BEST_FILE, results.PLOT_FILE, "curve.png",
    WANDB_ID_FILE, LOCK_FILE, "hosts.log"}


class RunFolder:
    """An open run folder: metrics log, checkpoint store, and the final files. It holds an
    exclusive lock on the folder (RUN_DIR/.lock) until closed, so a second process cannot
    write the same run: it gets a ConfigError and writes nothing."""

    def __init__(self, path: str | Path, config: PPOConfig, *, resume_iteration: int | None = None):
        self.path = Path(path)
        self.config = config
        self.sweep: dict | None = None
        self.log = self.store = None
        new = resume_iteration is None
        with self._writing("the run folder"):
            made = _make_folder(self.path) if new else False
            self._lock = _lock_folder(self.path, new)
        try:
            with self._writing("config.yaml and metrics.jsonl"):
                self._open(config, resume_iteration)
        except BaseException:
            if self.log is not None:
                self.log.close(failed=True)
            self._lock.close()
            if new:  # a new run refused here (a W&B login) leaves no folder behind
                _remove_new(self.path, made)
            raise

    def _open(self, config: PPOConfig, resume_iteration: int | None) -> None:
        # The log first: a W&B login that fails is then refused before config.yaml is written.
        self.log = RunLog(
            self.path, tensorboard=config.tensorboard, num_seeds=config.num_seeds,
            resume_iteration=resume_iteration,
            resume_env_steps=None if resume_iteration is None else resume_iteration * config.batch_size,
            wandb=config.wandb, config_record=config.to_dict())
        write_config(self.path, config, overwrite=resume_iteration is not None)
        self.store = CheckpointStore(self.path, keep=config.keep_checkpoints)

    @property
    def previous_rows(self) -> list[dict]:
        return self.log.previous_rows

    def write_rows(self, rows: list[dict]) -> None:
        with self._writing("metrics.jsonl"):
            self.log.write(rows)

    def record_sweep(self, record: dict | None) -> None:
        """sweep.json: the hyperparameters of each member of a vmapped sweep
        (`jaxppo.search.sweep.make_record`); with None (every member trains with the same ones) an
        earlier sweep.json is removed, so the folder describes the run as it now trains."""
        self.sweep = record
        if self.log.wandb is not None:
            self.log.wandb.describe_members(record)
        path = self.path / SWEEP_FILE
        with self._writing(SWEEP_FILE):
            if record is not None:
                write_text_atomic(path, strict_json(record))
            elif path.exists():
                path.unlink()

    def save_best(self, record: dict, state) -> None:
        """best/params.msgpack (params and observation statistics of every seed, as
        params.msgpack holds them) and best/best.json (`record`: the iteration and eval
        return), each replaced atomically; `state` is the unsharded TrainState then."""
        best = self.path / BEST_DIR
        with self._writing(f"{BEST_DIR}/"):
            if best.is_symlink():
                raise OSError(errno.ELOOP, "a symbolic link, not written through", str(best))
            best.mkdir(exist_ok=True)
            write_params(best / "params.msgpack", state.params, state.obs_stats)
            write_text_atomic(best / BEST_RECORD, json.dumps(record, indent=2))

    def save_checkpoint(self, iteration: int, state, meta: dict) -> None:
        # orbax writes in the background: a failure shows here at the next save, or at close
        with self._writing(f"the checkpoint of iteration {iteration}"):
            self.store.save(iteration, state, meta)

    def finish(self, result, *, plot: bool = True, label: str | None = None,
               extra_summary: dict | None = None) -> dict:
        """params.msgpack, summary.json and (with plot) curve.png; returns the summary. A plot
        that cannot be drawn or written is a warning: the run's results are already saved."""
        with self._writing("params.msgpack"):
            save_params(self.path / "params.msgpack", result)
        info = summary(result, self.sweep)
        info.update(extra_summary or {})
        with self._writing("summary.json"):
            write_text_atomic(self.path / "summary.json", strict_json(info))
        if self.config.search is not None:
            self._write_search(result, info, plot)
        if plot:
            name = self.config.env_name
            title = (name if self.sweep is None
                     else f"{name}: sweep of {', '.join(self.sweep['differing'])}")
            try:
                plot_runs([self.path], self.path / "curve.png", labels=[label or name], title=title)
            except (OSError, ValueError) as e:
                warn(f"curve.png was not written ({_reason(e)}); draw it later with "
                     f"`jaxppo plot {self.path}`")
        if self.log.wandb is not None:  # the summary and curve.png to W&B
            self.log.wandb.finish(info, self.path / "curve.png" if plot else None)
        return info

    def _write_search(self, result, info: dict, plot: bool) -> None:
        """search.json, search.csv, best.yaml and (with plot) search.png (jaxppo.search.results)."""
        rec = results.report(self.config, info, self.sweep, result.metrics)
        for name, text in ((results.SEARCH_FILE, strict_json(rec)),
                           (results.TABLE_FILE, results.table_csv(rec)),
                           (results.BEST_FILE, results.best_yaml(self.config, rec))):
            with self._writing(name):
                write_text_atomic(self.path / name, text)
        if plot:
            try:
                plot_search(rec, self.path / results.PLOT_FILE)
            except (OSError, ValueError) as e:
                warn(f"{results.PLOT_FILE} was not written ({_reason(e)})")

    def close(self) -> None:
        """Wait for a checkpoint still being written, then release the folder. When another
        error is already on its way out, a failure here is only logged (it must not hide it)."""
        failing = sys.exc_info()[1] is not None
        try:
            with self._writing("metrics.jsonl"):
                if self.log is not None:
                    self.log.close(failed=failing)
            with self._writing("the last checkpoint"):
                if self.store is not None:
                    self.store.close()  # waits for a save still being written
        except RunFolderError as e:
            if not failing:
                raise
            logging.getLogger("jaxppo").debug("%s", e)
        finally:
            self._lock.close()  # closing the file releases the lock

    @contextlib.contextmanager
    def _writing(self, what: str):
        """Turn a failed write into a RunFolderError that says what is saved and what to do."""
        try:
            yield
        except (RunFolderError, ConfigError):
            raise
        except (OSError, ValueError, RuntimeError) as e:  # orbax reports write errors as ValueError
            raise RunFolderError(f"could not write {what} in {self.path}: {_reason(e)}. "
                                 + self._what_next()) from e

    def _what_next(self) -> str:
        """What the folder holds that a resume can use (read from the disk, not from orbax),
        and how to go on."""
        if self.store is not None:
            try:
                self.store.wait()  # a save still being written counts, once it is complete
            except Exception:  # noqa: BLE001 - that save failed too; the older ones stand
                pass
        folder = self.path / CHECKPOINT_DIR
        steps = sorted(int(p.name) for p in folder.iterdir()
                       if p.name.isdigit() and p.is_dir()) if folder.is_dir() else []
        if steps:
            return (f"Saved and intact: the checkpoint of iteration {steps[-1]}. Free space (or "
                    f"fix the folder's permissions), then continue with --resume {self.path}")
        return ("No checkpoint had been saved yet, so there is nothing to resume: free space "
                "(or fix the permissions) and start again, or choose another --runs-dir")


def _reason(err: BaseException) -> str:
    """The system's reason for a failed write, in one line (orbax wraps it in a long one)."""
    text = str(err)
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}" + (f" ({err.filename})" if err.filename else "")
    for marker in ("No space left on device", "Read-only file system", "Permission denied",
                   "Disk quota exceeded"):
        if marker in text:
            return marker
    return (text.strip().splitlines() or [repr(err)])[0][:200]


def _make_folder(path: Path) -> bool:
    """Make a new run's folder (True) or take an empty one that stands there (False).

    Raises:
        ConfigError: the folder is not empty: another run took the name after this run's
            checks (two runs started at once with one --run-name), or it holds other files.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
        return True
    except FileExistsError:
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            return False
        raise ConfigError(
            f"run folder {path} was taken by another run after this run's checks (it is no "
            "longer empty: two runs started with the same --run-name?); a run never writes into "
            "a folder it did not create. Choose another --run-name (or run_dir=). Nothing was "
            "written in it.") from None


def _remove_new(path: Path, made: bool) -> None:
    """Undo a new run folder whose opening failed: the files it had made, then the folder."""
    for name in (METRICS_FILE, "config.yaml", LOCK_FILE):
        with contextlib.suppress(OSError):
            (path / name).unlink()
    if made:
        with contextlib.suppress(OSError):
            path.rmdir()


def _lock_folder(path: Path, new: bool):
    """An exclusive, non-blocking lock on RUN_DIR/.lock (released when the returned file is
    closed, or when the process ends however it ends). A new run creates the lock file
    itself (O_EXCL): of two runs that start at once in one folder, only one gets it. The
    file is never opened through a link.

    Raises:
        ConfigError: another process holds the lock, or (new) made the lock file first.
    """
    lock = path / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if new else 0)
    try:
        fd = os.open(lock, flags, 0o644)
    except FileExistsError:
        raise ConfigError(
            f"run folder {path} was taken by another run after this run's checks (it made "
            f"{LOCK_FILE} first: two runs started with the same --run-name?); a run never writes "
            "into a folder it did not create. Choose another --run-name (or run_dir=). Nothing "
            "was written in it.") from None
    f = os.fdopen(fd, "r+")
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


def check_run_dir(run_dir: str | Path) -> None:
    """ConfigError when no run folder can be made at `run_dir`: a file stands there, or where
    one of the folders above it would be (found before anything compiles or is written)."""
    path = Path(run_dir)
    too_long = name_too_long(path)
    if too_long:
        raise ConfigError(f"cannot make the run folder: {too_long}; choose a shorter name "
                          "(--runs-dir / --run-name, or run_dir=)")
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(
                    f"cannot make the run folder {path}: {p} is a file, not a folder; choose "
                    "another folder (--runs-dir / --run-name, or run_dir=)")
            return


def fresh_run_dir(runs_dir: str | Path, name: str) -> Path:
    """runs_dir/name for a new run; a non-empty existing folder is a ConfigError."""
    run_dir = Path(runs_dir) / name
    check_run_dir(run_dir)
    refuse_used_run_dir(run_dir)
    return run_dir


def output_problem(run_dir: str | Path, path: str | Path, written_with: Path | None = None
                   ) -> str | None:
    """Why a file a user asked for (a figure, an export) may not be written at `path`, given
    the run folder `run_dir` it comes from; None when it may.

    It may not be a symbolic link inside the folder, or below one: jaxppo writes through no
    link in a run folder. Nor may it be (after resolving links and "..") the folder itself,
    one of the folder's own files (`RUN_FILES`, their .tmp files included) or inside one of
    its folders. Anywhere else is the user's choice. `written_with`: the file `path` is
    written next to (an export's .json), for the message.
    """
    run_dir, path = Path(run_dir), Path(path)
    run, target = run_dir.resolve(), path.resolve()
    with_text = "" if written_with is None else f" (written with {written_with})"
    link = _link_on_the_way(run_dir, path)
    if link is not None:
        return (f"{link}{with_text} is a symbolic link (to {os.readlink(link)}) in the run "
                f"folder {run_dir}, and jaxppo writes nothing through a link in a run folder, so "
                "a folder from elsewhere cannot make it write outside itself. Remove the link "
                f"(its target stays as it is) to write {path.name} there, or write it "
                "elsewhere. Nothing was written")
    if target == run:
        return (f"{path}{with_text} is a folder; give a file name (it is the run folder "
                f"{run_dir} itself)")
    first = target.relative_to(run).parts[0] if target.is_relative_to(run) else None
    if first in RUN_FILES or (first or "").removesuffix(".tmp") in RUN_FILES:
        own = ", ".join(n + "/" * (n in RUN_FOLDERS) for n in sorted(RUN_FILES))
        first += "/" * (first in RUN_FOLDERS)
        return (f"{path}{with_text} would overwrite {run_dir}'s own {first}: jaxppo writes no "
                f"figure or export over a file the run folder uses ({own}). Write it outside "
                "the run folder or under another name. Nothing was written")
    return None


def _link_on_the_way(run_dir: Path, path: Path) -> Path | None:
    """The first symbolic link inside `run_dir` that writing `path` would go through: `path`
    itself or a folder between the run folder and it (the run folder's own path may be a
    link); None if none."""
    run, here = Path(os.path.abspath(run_dir)), Path(os.path.abspath(path))
    if not here.is_relative_to(run):  # reached by another way (links, ".."): where it lands
        inside = path.parent.resolve().is_relative_to(run_dir.resolve())
        return path if inside and path.is_symlink() else None
    on_the_way = run_dir
    for part in here.relative_to(run).parts:
        on_the_way = on_the_way / part
        if on_the_way.is_symlink():
            return on_the_way
    return None


# ---------------------------------------------------------------------- resuming a run
@dataclass
class ResumePoint:
    """The newest checkpoint of a run folder being continued, opened read-only.

    Attributes:
        run_dir: the run folder.
        store: its checkpoints, read-only until closed (`close`, by whoever opened it).
        step: the checkpoint's step (its iteration).
        meta: the checkpoint's record (iteration, env steps, layout, the run's config, ...).
    """

    run_dir: Path
    store: CheckpointStore
    step: int
    meta: dict

    def check(self, config: PPOConfig) -> None:
        """Check that `config` can continue the run.

        Raises:
            ConfigError: `config` changes a field that fixes the saved state's shape or meaning.
            CheckpointError: metrics.jsonl lacks rows up to the checkpoint, or repeats some.
        """
        refuse_links(self.run_dir)
        check_resumable(self.meta.get("config") or {}, config, self.run_dir)
        check_metrics_file(self.run_dir, int(self.meta["iteration"]), config.num_seeds)

    def restore(self, abstract: Any, config: PPOConfig) -> tuple[Any, int, float]:
        """Restore the checkpoint's state into the structure of `abstract`.

        Args:
            abstract: the unsharded TrainState's shapes and dtypes (`jax.eval_shape` of init).
            config: the config the run continues with.

        Returns:
            (the unsharded numpy state, the iteration it was saved at, the run's wall time then).

        Raises:
            CheckpointError: the checkpoint is unreadable or its arrays do not fit `abstract`.
            ConfigError: the checkpoint is past the config's last iteration.
        """
        restored, meta = self._restore_state(abstract)
        start_iter = int(meta["iteration"])
        if start_iter > config.num_iterations:
            raise ConfigError(
                f"cannot resume {self.run_dir}: its checkpoint is at iteration {start_iter}, past "
                f"the {config.num_iterations} iterations of total_timesteps="
                f"{config.total_timesteps}; raise total_timesteps to at least "
                f"{start_iter * config.batch_size}. Nothing was changed.")
        return restored, start_iter, float(meta.get("wall_time", 0.0))

    def _restore_state(self, abstract: Any) -> tuple[Any, dict]:
        """The checkpoint's (state, meta) in the structure of `abstract`. A population's
        checkpoint (PBT) written before `critic_lr` existed has no `critic_lr_points` among
        its hyperparameters: it is read as saved and given the null value (lr for the
        critic, what that run trained with)."""
        try:
            return self.store.restore(self.step, target=abstract)
        except CheckpointError as error:
            if getattr(abstract, "hparams", None) is None:
                raise
            saved, meta = self.store.restore(self.step)  # as saved, digest checked
            leaves = []
            for path, want in jax.tree_util.tree_flatten_with_path(abstract)[0]:
                keys = [getattr(k, "name", getattr(k, "key", getattr(k, "idx", None)))
                        for k in path]
                if keys == ["hparams", "critic_lr_points"] and \
                        "critic_lr_points" not in saved["hparams"]:
                    got = follows_lr(saved["hparams"]["lr_points"])
                else:
                    got = saved
                    for k in keys:
                        try:
                            got = got[k]
                        except (KeyError, IndexError, TypeError):
                            raise error from None
                if np.shape(got) != want.shape or np.asarray(got).dtype != want.dtype:
                    raise error from None
                leaves.append(np.array(got))
            return jax.tree.unflatten(jax.tree.structure(abstract), leaves), meta

    def close(self) -> None:
        """Close the read-only store."""
        self.store.close()


def begin_resume(caller: str, config: PPOConfig | None, run_dir, resume, trust_config: bool = True
                 ) -> tuple[PPOConfig, Path | None, ResumePoint | None]:
    """The config, run folder and resume point of `caller(config, run_dir=, resume=)`.

    Args:
        caller: the function's name, for the messages.
        config: the run's config; None to take a resumed run's own.
        run_dir: the folder of a new run (or None), or the resumed one's.
        resume: the run folder to continue from its newest checkpoint, or None.
        trust_config: False refuses a resumed folder's config that names a module to import
            (when `config` is None and the folder's config is used).

    Returns:
        (config, run_dir, the resume point or None): without resume, the config and run_dir
        as given; with it, resume's folder and its newest checkpoint, which the caller closes.

    Raises:
        ConfigError: a bad argument, or no config for a new run.
        CheckpointError: no complete checkpoint to resume (the store is closed then).
    """
    for name, value in (("run_dir", run_dir), ("resume", resume)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"{caller}({name}={value!r}): {name} must be the path of a run "
                              "folder (a str or Path), or None")
    if resume is None:
        if config is None:
            raise ConfigError(f"{caller}(config): a PPOConfig is needed unless resume=RUN_DIR "
                              "is given")
        return config, run_dir, None
    if run_dir is not None and Path(run_dir).resolve() != Path(resume).resolve():
        raise ConfigError(f"{caller}(run_dir={str(run_dir)!r}, resume={str(resume)!r}): a "
                          "resumed run continues in its own folder; pass only resume=")
    run_dir = Path(resume)
    store, step = find_latest(run_dir)
    try:
        meta = store.read_meta(step)
        if config is None:
            config = load_run_config(run_dir, meta)
            if not trust_config:
                refuse_imports(config.env, f"{run_dir}/config.yaml", network=config.network, fix=(
                    f"Pass the config yourself ({caller}(config, resume=...)), or, if you trust "
                    f"{run_dir}, leave out trust_config=False"))
    except BaseException:
        store.close()
        raise
    return config, run_dir, ResumePoint(run_dir, store, step, meta)


def check_start(run_dir, point: ResumePoint | None, config: PPOConfig, resume_command: str) -> None:
    """Check, before anything is built, that the run can start in its folder.

    Args:
        run_dir: the run folder, or None (nothing is written).
        point: the checkpoint a resumed run continues from; None for a new run.
        config: the (resolved) config the run trains with.
        resume_command: the command a user continues a run with, for the messages.

    Raises:
        ConfigError: a new run's folder cannot be made or already holds checkpoints, or the
            config cannot continue the resumed one.
        CheckpointError: the resumed run's metrics.jsonl lacks rows up to the checkpoint, or
            repeats some.
    """
    if point is not None:
        point.check(config)
        return
    if run_dir is not None:
        check_run_dir(run_dir)
    refuse_checkpointed_run_dir(run_dir, resume_command)
    refuse_used_run_dir(run_dir)


def check_resumable(saved: dict, config: PPOConfig, run_dir: str | Path) -> None:
    """Check that `config` keeps every locked field of the saved run's config `saved`.

    The number of devices or hosts may change: the state is saved unsharded
    (jaxppo.program.shards).

    Raises:
        ConfigError: naming the field, the saved and the new value.
    """
    new = config.to_dict()
    pairs = []
    for name in LOCKED_FIELDS:
        if name == "network":
            old_net, new_net = saved.get("network") or {}, new.get("network") or {}
            pairs += [(f"network.{k}", old_net[k], new_net.get(k)) for k in old_net]
        elif name in saved:  # a field the saving version did not have is not checked
            pairs.append((name, saved[name], new.get(name)))
    for name, old_v, new_v in pairs:
        if listed(old_v) != listed(new_v):
            raise ConfigError(
                f"cannot resume {run_dir} with {name}={new_v!r}: its checkpoint was made with "
                f"{name}={old_v!r}, and {name} fixes the shape or meaning of the saved state. "
                f"Resume with {name}={old_v!r} (only fields such as total_timesteps, lr or "
                "eval_every may change), or start a new run. Nothing was changed."
            )


def check_metrics_file(run_dir: str | Path, iteration: int, num_seeds: int) -> None:
    """CheckpointError unless RUN_DIR/metrics.jsonl holds one row for every iteration up to
    the checkpoint's (for every seed), in order: resuming would otherwise leave a hole in the
    record, or keep a row twice (`order_problem`)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise CheckpointError(
            f"{path} is missing, but the checkpoint is at iteration {iteration}: resuming would "
            "leave iterations without metrics. Restore the file (or start a new run). Nothing "
            "was changed.")
    try:
        rows = read_metrics(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read ({str(e)[:160]}); restore it. Nothing "
                              "was changed.") from None
    damaged = order_problem(path, through=iteration)
    if damaged:
        raise CheckpointError(f"cannot resume {run_dir}: {damaged}. Nothing was changed.")
    have = {(r.get("iteration"), r.get("seed", 0)) for r in rows if isinstance(r, dict)}
    missing = sorted({it for it in range(1, iteration + 1) for s in range(num_seeds)
                      if (it, s) not in have})
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise CheckpointError(
            f"{path} has no rows for iteration(s) {shown} of the {iteration} the checkpoint "
            "holds: resuming would leave a hole in the record. Restore the file (or start a new "
            "run). Nothing was changed.")


def refuse_checkpointed_run_dir(run_dir, resume_command: str) -> None:
    """ConfigError when a fresh run would start in a folder that already holds checkpoints."""
    if run_dir is not None and checkpoint_dir(run_dir).is_dir() and any(
            checkpoint_dir(run_dir).iterdir()):
        raise ConfigError(
            f"run folder {run_dir} already holds checkpoints; continue it with "
            f"resume={str(run_dir)!r} (`{resume_command} --resume {run_dir}`) or choose a new "
            "folder")


def refuse_used_run_dir(run_dir) -> None:
    """ConfigError when a new run's folder exists and holds anything: a run writes only into
    a folder it creates (or an empty one), never appends to another's."""
    path = None if run_dir is None else Path(run_dir)
    if path is not None and path.is_dir() and any(path.iterdir()):
        names = sorted(p.name for p in path.iterdir())
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ConfigError(
            f"run folder {path} already exists and is not empty (it holds {shown}); a new run "
            "needs a new or empty folder: choose another --run-name (or run_dir=), or continue "
            "a run with --resume (resume=)")


def summary(result, sweep: dict | None = None) -> dict:
    """summary.json of a TrainResult: final return per seed, the last evaluation, steps and
    speed; for a sweep (`sweep`, sweep.json's record) also `members`: per seed index its
    label, differing hyperparameters, final return and last evaluation.

    Steps: `env_steps` is per seed and counts the whole run (all calls of a resumed run),
    `env_steps_all_seeds` the same over all seeds; `env_steps_this_call` (all seeds),
    `train_seconds` and `sps` are this call's. A seed on which no episode ended in the last
    10 iterations has NaN as its final return, and the mean and std are over the others
    (NaN when none); `strict_json` writes NaN as null."""
    r = np.atleast_2d(result.metrics["episode_return_mean"])
    tail = []
    for seed_curve in r:
        vals = seed_curve[-10:]
        vals = vals[np.isfinite(vals)]
        tail.append(float(vals.mean()) if len(vals) else float("nan"))
    ended = [v for v in tail if math.isfinite(v)]
    cfg = result.config
    steps = int(result.iterations_done * cfg.batch_size)
    steps_now = int((result.iterations_done - (result.resumed_from or 0)) * cfg.batch_size)
    out = {
        "env": cfg.env_name,
        "num_seeds": cfg.num_seeds,
        "hosts": int(result.hosts),
        "num_devices": int(result.num_devices),
        "layout": getattr(result, "layout", ""),
        "env_steps": steps,
        "env_steps_all_seeds": steps * cfg.num_seeds,
        "iterations": int(result.iterations_done),
        "completed": bool(result.completed),
        "resumed_from": result.resumed_from,
        "final_return_mean": float(np.mean(ended)) if ended else float("nan"),
        "final_return_std": float(np.std(ended)) if ended else float("nan"),
        "final_return_per_seed": tail,
        "compile_seconds": result.compile_seconds,
        "train_seconds": result.train_seconds,
        "env_steps_this_call": steps_now * cfg.num_seeds,
        "sps": steps_now * cfg.num_seeds / max(result.train_seconds, 1e-9),
        "process_seconds": process_uptime(),
    }
    if getattr(result, "stopped", None):  # stopped early by a stop rule or the callback
        out["stopped"] = result.stopped
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
    if sweep is not None:
        out["members"] = []
        for i, label in enumerate(sweep["labels"]):
            member = {"seed_index": i, "label": label,
                      "hparams": {k: v[i] for k, v in sweep["differing"].items()},
                      "final_return": tail[i]}
            if "final_eval_return_per_seed" in out:
                member["final_eval_return"] = out["final_eval_return_per_seed"][i]
            out["members"].append(member)
    return out
