"""A run folder's logs: metrics.jsonl (always: one JSON object per iteration and seed, NaN/inf
as null, rows past the restored iteration dropped on resume), TensorBoard event files
(tensorboardX, no TensorFlow) and Weights & Biases runs (both optional).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from pathlib import Path

import numpy as np

from jaxppo.errors import ConfigError
from jaxppo.run.files import open_append, write_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_id"
WANDB_INSTALL = "pip install 'jaxppo[wandb]'"


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl.

    Args:
      path: the file, or a run folder that holds it.

    Returns:
      One dict per line; nulls stay None, and a last line cut short by a crash is skipped.

    Raises:
      ValueError: a line before the last is not valid JSON.
    """
    return [row for _, row in _numbered_rows(path)]


def _numbered_rows(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, row) of each row `read_metrics` returns."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows = []
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append((i + 1, json.loads(line)))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a partial final write
                continue
            raise ValueError(f"{path}, line {i + 1}: not valid JSON: {line[:80]!r}") from None
    return rows


def order_problem(path: str | Path, through: int | None = None) -> str | None:
    """What is wrong with the order of a metrics.jsonl's rows, or None: a run writes each
    iteration of each seed once, in order, so a row whose iteration is not past the one
    before it of the same seed (a row repeated, or rows out of order) is damage. Rows past
    iteration `through` (which a resume drops) and rows without an iteration are not looked at.

    Args:
      path: the file, or a run folder that holds it.
      through: the last iteration to look at (None: all).

    Raises:
      ValueError: as `read_metrics`.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    last: dict = {}  # seed -> (iteration, line) of its latest row
    for line, row in _numbered_rows(path):
        if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
            continue
        it, seed = row["iteration"], row.get("seed", 0)
        if not isinstance(seed, (int, float)):  # not a jaxppo row: others say so
            continue
        if through is not None and it > through:
            continue
        if seed in last and it <= last[seed][0]:
            of_seed = f" of seed {seed}" if "seed" in row else ""
            return (f"{path}, line {line}: iteration {it}{of_seed} comes after iteration "
                    f"{last[seed][0]} (line {last[seed][1]}), but a run writes each iteration"
                    f"{' of each seed' if of_seed else ''} once, in order: rows are repeated or "
                    "out of order (a file edited or joined by hand?). Keep one row per "
                    f"iteration{' and seed' if of_seed else ''}, in order (or restore the file "
                    "from a copy)")
        last[seed] = (it, line)
    return None


def rows_through(path: Path, last_iteration: int) -> list[dict]:
    """The rows of `path` with iteration <= last_iteration (none when the file is missing)."""
    if not path.exists():
        return []
    return [r for r in read_metrics(path) if int(r.get("iteration", 0)) <= last_iteration]


def _json_row(row: dict) -> str:
    return strict_json(row, indent=None)


def strict_json(obj, indent: int | None = 2) -> str:
    """`obj` as JSON that any parser reads: NaN and infinities (a return no episode gave,
    ...) become null, and numpy scalars and arrays plain numbers and lists."""
    return json.dumps(_finite_or_none(obj), indent=indent, allow_nan=False)


def _finite_or_none(obj):
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _finite_or_none(obj.tolist())
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


class RunLog:
    """Appends metric rows to RUN_DIR/metrics.jsonl and, if asked, TensorBoard scalars.

    resume_iteration: rows past it are dropped from metrics.jsonl first, and TensorBoard
    events past its env-step count are purged from view.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False, num_seeds: int = 1,
                 resume_iteration: int | None = None, resume_env_steps: int | None = None,
                 wandb: dict | None = None, config_record: dict | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.previous_rows: list[dict] = []
        # First, as it is the part that can fail for reasons outside the folder (login).
        self.wandb = (WandbWriter(self.run_dir, wandb, config_record or {}, num_seeds,
                                  resumed=resume_iteration is not None,
                                  logged_through=_last_iteration(self.path)
                                  if resume_iteration is not None else 0)
                      if wandb_enabled(wandb) else None)
        if resume_iteration is not None:
            self.previous_rows = rows_through(self.path, resume_iteration)
            write_atomic(self.path, "".join(_json_row(row) + "\n" for row in self.previous_rows))
            if self.wandb is not None and self.wandb.fresh:  # wandb added on resume: the past too
                self.wandb.write(self.previous_rows)
        self.file = open_append(self.path)
        self.writers = []
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_env_steps is None else int(resume_env_steps) + 1
            root = self.run_dir / TENSORBOARD_DIR
            dirs = [root] if num_seeds == 1 else [root / f"seed_{s}" for s in range(num_seeds)]
            self.writers = [SummaryWriter(logdir=str(d), purge_step=purge) for d in dirs]

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            self.file.write(_json_row(row) + "\n")
        self.file.flush()
        for row in rows:
            if not self.writers:
                break
            writer = self.writers[row.get("seed", 0)]
            step = int(row["env_steps"])
            for k, v in row.items():
                if k in ("seed", "env_steps") or v is None:
                    continue
                if isinstance(v, (int, float)) and math.isfinite(v):
                    writer.add_scalar(_tb_tag(k), v, global_step=step)
        for w in self.writers:
            w.flush()
        if self.wandb is not None:
            self.wandb.write(rows)

    def close(self, failed: bool = False) -> None:
        self.file.close()
        for w in self.writers:
            w.close()
        if self.wandb is not None:
            self.wandb.close(failed)


def _last_iteration(path: Path) -> int:
    """The last iteration metrics.jsonl holds (0 when it has none): on resume, the rows up to
    it were logged to W&B before, which cannot take them back."""
    try:
        rows = read_metrics(path) if path.exists() else []
    except (ValueError, UnicodeDecodeError, OSError):
        return 0
    return max((int(r.get("iteration", 0)) for r in rows if isinstance(r, dict)), default=0)


# ---------------------------------------------------------------------- Weights & Biases
def wandb_enabled(settings: dict | None) -> bool:
    """True when the config's `wandb` settings log to W&B (set, and mode is not "disabled")."""
    return bool(settings) and settings.get("mode") != "disabled"


def import_wandb():
    """The wandb module, or a ConfigError naming the install."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "wandb is set in the config, but the wandb package is not installed: "
            f"{WANDB_INSTALL} (or remove wandb from the config)") from None
    return wandb


def check_wandb(config) -> None:
    """Before anything is built or written: the wandb package is there when the config logs
    to W&B (ConfigError otherwise)."""
    if wandb_enabled(getattr(config, "wandb", None)):
        import_wandb()


class WandbWriter:
    """Weights & Biases runs of one run folder: one W&B run per seed (sweep member).

    Several seeds are one W&B group (the run folder's name unless wandb.group is set), a run
    per seed named `<name>-seed<i>` (docs/design.md, "Videos and W&B"). Metrics carry
    TensorBoard's tag groups (charts/, eval/, train/, perf/) at step=env_steps. The ids live in
    RUN_DIR/wandb_id (one line per seed), and a resumed run continues the same W&B runs
    (resume="allow"): rows up to `logged_through` (logged before the resume) are not sent
    again; W&B runs started on a resume (wandb newly set) get the earlier rows first.
    """

    def __init__(self, run_dir: Path, settings: dict, config_record: dict, num_seeds: int, *,
                 resumed: bool, logged_through: int = 0):
        wandb = import_wandb()
        self.run_dir = Path(run_dir)
        self.num_seeds = num_seeds
        base = settings.get("name") or self.run_dir.name
        group = settings.get("group") or (self.run_dir.name if num_seeds > 1 else None)
        ids, stored = self._ids(resumed)
        # New W&B runs (a fresh run, or wandb added on resume) have seen no rows yet.
        self.fresh = not stored
        self.logged_through = logged_through if stored else 0
        record = {k: v for k, v in config_record.items() if k != "wandb"}
        directory = settings.get("dir") or os.environ.get("WANDB_DIR") or str(self.run_dir)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.names = [base if num_seeds == 1 else f"{base}-seed{i}" for i in range(num_seeds)]
        self.runs = []
        mode = settings.get("mode") or os.environ.get("WANDB_MODE") or "online"
        # An offline W&B run cannot resume (W&B warns so, for every seed); each part keeps the
        # seed's id. W&B's own banner and summary are silenced, and the console is not
        # captured: the run's progress is jaxppo's, and one line says where W&B's files are.
        resume = None if mode in ("offline", "dryrun") else "allow"
        quiet = wandb.Settings(silent=True, console="off")
        try:
            for i, run_id in enumerate(ids):
                self.runs.append(wandb.init(
                    project=settings["project"], entity=settings.get("entity"),
                    mode=settings.get("mode"), dir=directory, id=run_id, resume=resume,
                    name=self.names[i], group=group, tags=settings.get("tags"),
                    notes=settings.get("notes"), job_type="train", reinit="create_new",
                    settings=quiet,
                    config={**record, "seed_index": i, "run_dir": str(self.run_dir)}))
        except Exception as e:  # noqa: BLE001 - login, network, permissions: one clear error
            self.close(failed=True)
            raise ConfigError(
                f"wandb.init failed ({type(e).__name__}: {_one_line(e)}). Log in with `wandb "
                "login` (or set WANDB_API_KEY), or set wandb.mode=offline and upload later with "
                "`wandb sync`") from None
        _write_ids(self.run_dir, ids)
        self.offline, self.directory = resume is None, Path(directory)

    def where(self) -> str:
        """One line saying where the W&B runs are: the offline files and how to upload them,
        or the online runs' pages."""
        if self.offline:
            local = self.directory / "wandb"
            return (f"W&B (offline): {len(self.runs)} run(s) in {local}; upload with `wandb sync "
                    f"{local / 'offline-run-*'}`")
        urls = [run.url for run in self.runs if getattr(run, "url", None)]
        return "W&B: " + (", ".join(urls) if urls else f"local files in {self.directory / 'wandb'}")

    def _ids(self, resumed: bool) -> tuple[list[str], bool]:
        """(the stored run ids (on resume), topped up with new ones for seeds without one;
        whether any were stored)."""
        ids: list[str] = []
        path = self.run_dir / WANDB_ID_FILE
        if resumed and path.exists():
            ids = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
        ids = ids[:self.num_seeds]
        return ids + [secrets.token_hex(4) for _ in range(self.num_seeds - len(ids))], bool(ids)

    def describe_members(self, record: dict | None) -> None:
        """A sweep (sweep.json's record): each member's hyperparameters into its run's config,
        and its label into its name."""
        if record is None:
            return
        for i, run in enumerate(self.runs):
            run.config.update({**record["hparams"][i], "sweep_label": record["labels"][i]},
                              allow_val_change=True)
            run.name = f"{self.names[i]} {record['labels'][i]}"

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            if int(row.get("iteration", 0)) <= self.logged_through:
                continue
            data = {_tb_tag(k) if k != "env_steps" else k: v for k, v in row.items()
                    if k != "seed" and isinstance(v, (int, float)) and math.isfinite(v)}
            self.runs[row.get("seed", 0)].log(data, step=int(row["env_steps"]))

    def finish(self, summary: dict, curve: Path | None) -> None:
        """The run's final numbers into each W&B run's summary, and curve.png as an image."""
        wandb = import_wandb()
        common = {k: summary[k] for k in ("env_steps", "iterations", "completed",
                                          "compile_seconds", "train_seconds", "sps")
                  if k in summary}
        for i, run in enumerate(self.runs):
            values = {**common, "final_return": summary["final_return_per_seed"][i]}
            if "final_eval_return_per_seed" in summary:
                values["final_eval_return"] = summary["final_eval_return_per_seed"][i]
            run.summary.update(values)
            if curve is not None and curve.exists():
                run.log({"curve": wandb.Image(str(curve))}, step=int(summary["env_steps"]))

    def close(self, failed: bool = False) -> None:
        """Finish every W&B run; after a run that did not fail, say where they are."""
        where = self.where() if self.runs and not failed else None
        for run in self.runs:
            run.finish(exit_code=1 if failed else 0)
        self.runs = []
        if where:
            print(where, file=sys.stderr)


def _write_ids(run_dir: Path, ids: list[str]) -> None:
    write_atomic(run_dir / WANDB_ID_FILE, "\n".join(ids) + "\n")


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


def _tb_tag(key: str) -> str:
    """Group TensorBoard tags: charts/ (returns), eval/, losses/, and perf/ (speed, time)."""
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key.startswith("episode") or key == "episodes":
        return f"charts/{key}"
    if key in ("sps", "wall_time", "iteration"):
        return f"perf/{key}"
    return f"train/{key}"
