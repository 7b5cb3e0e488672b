"""Checkpoints of the whole TrainState (orbax) and the trained parameters (msgpack).

A checkpoint is RUN_DIR/checkpoints/<iteration>/ written by orbax's CheckpointManager: the
TrainState pytree (params, optimizer state, kl_coeff, normalisation statistics, rng,
counters, env state and episode trackers, as numpy arrays in the unsharded layout of
jaxppo.program.shards: every env in global order, with a leading [seeds] axis when num_seeds > 1)
plus a JSON record (iteration, env steps, devices, hosts, seeds, the run's config and a
digest of every array). A run saved on any number of devices or hosts resumes on any other.
Orbax writes each step into a temporary folder and renames it when complete, so a crash
while saving leaves the earlier checkpoints as they were; only the newest
`keep_checkpoints` are kept.

Nothing here deletes or rewrites anything while a run is being checked for resuming: the
manager is opened read-only until every check has passed (the resume steps themselves are
the run folder's, jaxppo.run.folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from flax import serialization

from jaxppo.config import PPOConfig
from jaxppo.envs.record import listed
from jaxppo.errors import CheckpointError, ConfigError
from jaxppo.run.files import write_atomic

CHECKPOINT_DIR = "checkpoints"
FORMAT_VERSION = 1
_ITEMS = ("state", "meta")


# ---------------------------------------------------------------------- orbax store
def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def state_digest(tree) -> str:
    """sha256 over every array (dtype, shape, bytes), independent of the tree's structure,
    so a state restored as plain dicts and one restored as a TrainState give the same digest."""
    parts = []
    for leaf in jax.tree.leaves(tree):
        a = np.ascontiguousarray(np.asarray(leaf))
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
        parts.append(h.hexdigest())
    return hashlib.sha256("".join(sorted(parts)).encode()).hexdigest()


class CheckpointStore:
    """RUN_DIR/checkpoints through an orbax CheckpointManager.

    read_only=True never writes, renames or deletes anything (used to check a run before
    resuming it and by `load_policy`).
    """

    def __init__(self, run_dir: str | Path, keep: int = 3, read_only: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.run_dir = Path(run_dir)
        self.directory = checkpoint_dir(run_dir)
        with _quiet_absl(read_only):  # it warns that read-only mode is read-only
            options = ocp.CheckpointManagerOptions(
                create=not read_only,
                read_only=read_only,
                preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            )
            self.manager = ocp.CheckpointManager(self.directory.absolute(), item_names=_ITEMS,
                                                 options=options)
        if not read_only:
            _drop_background_save_tracebacks()
            _ignore_closed_loop_reports()  # a failed save's late reports, as for a failed restore

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` (device arrays are copied to host first, so the caller may
        donate them to the next chunk) with `meta`; the write finishes in the background."""
        ocp = self._ocp
        host_state = jax.device_get(state)
        meta = {**meta, "format": FORMAT_VERSION, "state_layout": "unsharded", "iteration": int(step),
                "state_digest": state_digest(host_state)}
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(host_state),
                                    meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def read_meta(self, step: int) -> dict:
        ocp = self._ocp
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = out.meta
            if not isinstance(meta, dict) or "iteration" not in meta:
                raise ValueError(f"its record is {str(meta)[:80]!r}, not a jaxppo checkpoint record")
            if meta["iteration"] != step or not isinstance(meta.get("wall_time", 0.0), (int, float)):
                raise ValueError(f"its record says iteration {meta['iteration']!r} and wall time "
                                 f"{meta.get('wall_time')!r}, not iteration {step} and seconds")
        except Exception as e:  # orbax/tensorstore raise many types for unreadable files
            raise self._unreadable(step, e) from None
        if meta.get("state_layout") != "unsharded":
            raise CheckpointError(
                f"checkpoint {self.step_path(step)} holds the state split over devices, as "
                "pre-release versions of jaxppo saved it; this version reads only whole "
                "(unsharded) states. Resume it with the version that wrote it, or start a new "
                "run. Nothing was changed.")
        return meta

    def restore(self, step: int, target=None) -> tuple[Any, dict]:
        """(state, meta) of `step`. With `target` (a pytree of arrays or ShapeDtypeStructs) the
        state comes back in that structure and every shape and dtype is checked; without it, as
        nested dicts. The arrays are checked against the digest recorded at save time."""
        ocp = self._ocp
        meta = self.read_meta(step)
        if target is not None:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), target)
            state_args = ocp.args.StandardRestore(abstract)
        else:
            state_args = ocp.args.StandardRestore()
        try:
            out = self.manager.restore(
                step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore()))
            state = out.state
        except Exception as e:
            raise self._unreadable(step, e) from None
        if target is not None:
            _check_shapes(state, target, self.step_path(step))
        digest = meta.get("state_digest")
        if digest is not None and state_digest(state) != digest:
            raise self._unreadable(step, ValueError(
                "its arrays do not match the digest recorded when it was saved"))
        return state, meta

    def _unreadable(self, step: int, err: Exception) -> CheckpointError:
        _ignore_closed_loop_reports()
        path = self.step_path(step)
        earlier = [s for s in self.steps() if s < step]
        msg = f"checkpoint {path} is corrupt or incomplete ({type(err).__name__}: {_first_line(err)})."
        if earlier:
            msg += (f" Earlier checkpoints: {', '.join(str(s) for s in earlier)}; to go back to "
                    f"iteration {earlier[-1]}, move {path} out of {self.directory} and run again.")
        else:
            msg += " No earlier checkpoint is left; start a new run."
        return CheckpointError(msg + " Nothing in the run folder was changed.")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ignore_closed_loop_reports() -> None:
    """After a failed restore, tensorstore's still-pending reads report back to orbax's event
    loop, which is already closed; each prints an 'Event loop is closed' traceback after our
    clear error. Swallow exactly those reports; every other one goes to the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxppo_closed_loop_filter", False):
        return

    def hook(report):
        if (report.object is None and isinstance(report.exc_value, RuntimeError)
                and str(report.exc_value) == "Event loop is closed"):
            return
        previous(report)

    hook._jaxppo_closed_loop_filter = True
    sys.unraisablehook = hook


class _BackgroundSaveErrors(logging.Filter):
    """Orbax logs a save that fails in its background threads (a full disk) as several ERROR
    records with tracebacks, then raises the same error in the caller at the next save, wait
    or close, where the run folder turns it into one clear RunFolderError. Drop those records.

    The same failure also leaves orbax's other write tasks (one per array) with exceptions
    nobody awaits; asyncio logs each as "Task exception was never retrieved" with a traceback
    when the task is garbage-collected, which can be at any later moment. Drop those too (only
    those whose task is orbax's).

    And one WARNING: while a save is still being written in the background, orbax may read
    that step's own unfinished folder (`<step>.orbax-checkpoint-tmp`) before it holds its
    metadata file, and warns "Metadata file does not exist" (seen on a loaded machine). The
    save goes on and completes; the same warning about any other folder is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return not (record.levelno == logging.WARNING and "orbax" in record.pathname
                        and str(record.msg).startswith("Metadata file does not exist")
                        and ".orbax-checkpoint-tmp" in record.getMessage())
        if record.name == "asyncio":
            text = record.getMessage()
            return not ("exception was never retrieved" in text and "orbax" in text)
        if "orbax" not in record.pathname:
            return True
        text = str(record.msg).lower()
        return not ("raised an exception" in text or "failed" in text)


def _drop_background_save_tracebacks() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _BackgroundSaveErrors) for f in logger.filters):
            logger.addFilter(_BackgroundSaveErrors())


@contextlib.contextmanager
def _quiet_absl(active: bool):
    logger = logging.getLogger("absl")
    level = logger.level
    if active:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else repr(err))[:300]


def _check_shapes(state, target, path: Path) -> None:
    got = jax.tree_util.tree_flatten_with_path(state)[0]
    want = jax.tree_util.tree_flatten_with_path(target)[0]
    if len(got) != len(want):
        raise CheckpointError(
            f"checkpoint {path} holds {len(got)} arrays but this config's TrainState has "
            f"{len(want)}; it was written by a different version or config. Nothing was changed."
        )
    for (kp, g), (_, w) in zip(got, want):
        if np.shape(g) != np.shape(w) or np.asarray(g).dtype != w.dtype:
            raise CheckpointError(
                f"checkpoint {path}: {jax.tree_util.keystr(kp)} has shape {np.shape(g)} "
                f"{np.asarray(g).dtype}, but this config needs {np.shape(w)} {w.dtype}; resume "
                "with the run's own config (config.yaml). Nothing was changed."
            )


# ---------------------------------------------------------------------- finding a run's checkpoint
def find_latest(run_dir: str | Path) -> tuple[CheckpointStore, int]:
    """A read-only store on RUN_DIR's checkpoints and its newest step; CheckpointError when
    the folder or a complete checkpoint is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(
            f"run folder {run_dir} does not exist; check the path (`jaxppo train` creates run "
            "folders under runs/ by default)"
        )
    ckdir = checkpoint_dir(run_dir)
    if not ckdir.is_dir():
        raise CheckpointError(
            f"run folder {run_dir} has no {CHECKPOINT_DIR}/ folder, so there is nothing to resume "
            "from (the run stopped before its first checkpoint, or was made without a run "
            "folder); start a new run"
        )
    store = CheckpointStore(run_dir, read_only=True)
    step = store.latest_step()
    if step is None:
        unfinished = sorted(p.name for p in ckdir.iterdir() if ".orbax-checkpoint-tmp" in p.name)
        store.close()
        extra = (f" (only unfinished saves, left by a crash while saving: {', '.join(unfinished)})"
                 if unfinished else "")
        raise CheckpointError(
            f"no complete checkpoint in {ckdir}{extra}; the run stopped before its first "
            "checkpoint was written, so start a new run. Nothing was changed."
        )
    return store, step


def newest_record(run_dir: str | Path) -> dict:
    """The record of RUN_DIR's newest checkpoint (read-only); CheckpointError without one."""
    store, step = find_latest(run_dir)
    try:
        return store.read_meta(step)
    finally:
        store.close()


def load_run_config(run_dir: str | Path, meta: dict | None = None, *,
                    given: Iterable[str] = (), fields: Iterable[str] | None = None):
    """The PPOConfig of a run folder, checked against its newest checkpoint's record.

    The checkpoint's record of the config (`meta["config"]`) is the reference: it is what the
    saved state was trained with. config.yaml is read and must agree with it field by field
    (a truncated or edited file would otherwise train with defaults without a word); without
    config.yaml the record is used.

    Args:
        run_dir: the run folder.
        meta: the newest checkpoint's record (`CheckpointStore.read_meta`), if there is one.
        given: fields the caller sets itself (`--set NAME=...`), which may disagree; the
            paths of this machine the folder names (`PPOConfig.machine_paths_from`) are
            replaced by the defaults unless given.
        fields: the fields that must agree (default: all; a policy needs only the fields
            that fix the saved state's shape and meaning).

    Raises:
        ConfigError: no config, an unreadable config.yaml, or a disagreement (both values named).
    """
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    record = None if meta is None else meta.get("config")
    if record is not None and not isinstance(record, dict):
        raise CheckpointError(f"the newest checkpoint of {run_dir} records its config as "
                              f"{str(record)[:60]!r}, not a mapping; it was not written by jaxppo")
    if not path.exists():
        if record is None:
            raise ConfigError(f"run folder {run_dir} has no config.yaml and no checkpoint that "
                              "records its config; it is not a jaxppo run folder")
        source = f"the config recorded by the newest checkpoint of {run_dir}"
        return _config_from(dict(record), source).machine_paths_from(source, given, fields is None)
    config = _config_from(_read_yaml(path), str(path))
    if record is not None:
        saved = _config_from(dict(record), f"the config recorded by the newest checkpoint of {run_dir}")
        _check_agree(config, saved, path, given, fields)
    return config.machine_paths_from(str(path), given, say=fields is None)


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid YAML ({_first_line(e)}); restore it, or delete "
                          "it to use the config the newest checkpoint recorded") from None
    if not data:
        raise ConfigError(
            f"{path} is empty, so the run's config is unknown (resuming would train with the "
            "library defaults); restore the file, or delete it to resume with the config the "
            "newest checkpoint recorded")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config fields")
    return data


def _config_from(data: dict, source: str) -> PPOConfig:
    if data.get("env_params") is not None:
        raise ConfigError(
            f"{source} records env_params={data['env_params']!r}, which cannot be rebuilt from the "
            "file; pass a PPOConfig with the same env_params (train(config, resume=...))"
        )
    # A run folder written before action masks existed trained without them (jaxppo writes
    # every field, so a missing one is that age, not a default to fill in).
    return PPOConfig.from_dict({"mask_actions": False, **data})


_ABSENT = "(absent)"


def _differences(new, old, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted field, new value, old value) wherever two config dicts differ, down to the
    leaves of nested mappings (network.hidden_sizes); tuples and lists compare equal."""
    if isinstance(new, dict) and isinstance(old, dict):
        out = []
        for k in dict.fromkeys([*old, *new]):
            out += _differences(new.get(k, _ABSENT), old.get(k, _ABSENT), f"{prefix}{k}.")
        return out
    return [] if listed(new) == listed(old) else [(prefix[:-1], new, old)]


def _check_agree(config: PPOConfig, saved: PPOConfig, path: Path, given: Iterable[str],
                 fields: Iterable[str] | None) -> None:
    """ConfigError naming each field where config.yaml (`config`) and the checkpoint's record
    (`saved`) differ, outside `given` and inside `fields`."""
    given, fields = tuple(given), None if fields is None else tuple(fields)

    def checked(name: str) -> bool:
        top = name.split(".")[0]
        return ((fields is None or top in fields)
                and not any(name == g or name.startswith(g + ".") or g.startswith(name + ".")
                            for g in given))

    differ = [d for d in _differences(config.to_dict(), saved.to_dict()) if checked(d[0])]
    if not differ:
        return
    shown = "; ".join(f"{n} is {a!r} in config.yaml but {b!r} in the checkpoint"
                      for n, a, b in differ[:4]) + ("; ..." if len(differ) > 4 else "")
    first, value = differ[0][0], differ[0][1]
    # Loading a policy (`fields` given: those that fix the saved params) takes no other value:
    # only training continues with one on purpose.
    on_purpose = "" if fields is not None else (
        f"; to continue training with another value on purpose, give it: --set {first}={value!r} "
        "(from Python, pass the config: train(config, resume=...))")
    raise ConfigError(
        f"{path} disagrees with the config the run's newest checkpoint recorded: {shown}. The "
        "checkpoint's record is what the saved state was trained with. Restore config.yaml (or "
        f"delete it to use the record){on_purpose}. Nothing was changed.")


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` through PATH.tmp, never writing through a link
    (`jaxppo.run.files.write_atomic`)."""
    write_atomic(path, text)


# ---------------------------------------------------------------------- params only
def save_params(path: str | Path, result) -> Path:
    """Write a TrainResult's {params, obs_stats} of every seed (`write_params`)."""
    obs_stats = result.state.obs_stats
    if getattr(result, "device_axis", getattr(result, "num_devices", 1) > 1):  # one copy per device
        obs_stats = jax.tree.map(lambda x: x[0], obs_stats)
    return write_params(path, result.params, obs_stats)


def write_params(path: str | Path, params, obs_stats) -> Path:
    """Write {params, obs_stats} as msgpack, atomically (tmp file + rename)."""
    payload = {"params": jax.device_get(params), "obs_stats": jax.device_get(obs_stats)}
    write_atomic(path, serialization.msgpack_serialize(serialization.to_state_dict(payload)),
                 sync=True)
    return Path(path)


def load_params_dict(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no params file at {path}; train with `jaxppo train` first")
    try:
        data = serialization.msgpack_restore(path.read_bytes())
    except Exception as e:  # msgpack raises many types for a truncated or foreign file
        raise CheckpointError(
            f"{path} is not a readable params file ({type(e).__name__}: {_first_line(e)}); it "
            "is truncated or was not written by jaxppo. Load a checkpoint of the run instead "
            "(checkpoints/), or train again") from None
    if not isinstance(data, dict) or not {"params", "obs_stats"} <= set(data):
        raise CheckpointError(f"{path} does not hold jaxppo's params and obs_stats (keys: "
                              f"{sorted(data)[:5] if isinstance(data, dict) else type(data).__name__}); "
                              "it was not written by jaxppo")
    return jax.tree.map(np.asarray, data)
