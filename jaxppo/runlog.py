"""A run folder's logs: metrics.jsonl (always) and TensorBoard event files (optional).

metrics.jsonl holds one JSON object per iteration (and seed), NaN/inf written as null. On
resume the rows after the restored iteration are dropped (the file is rewritten through a
temporary file and a rename), so every iteration appears exactly once.
TensorBoard files are written with tensorboardX, which needs no TensorFlow.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl (a run folder may be given instead). A last line cut short by
    a crash is skipped; nulls stay None."""
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
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a partial final write
                continue
            raise ValueError(f"{path}, line {i + 1}: not valid JSON: {line[:80]!r}") from None
    return rows


def rows_through(path: Path, last_iteration: int) -> list[dict]:
    """The rows of `path` with iteration <= last_iteration (none when the file is missing)."""
    if not path.exists():
        return []
    return [r for r in read_metrics(path) if int(r.get("iteration", 0)) <= last_iteration]


def _json_row(row: dict) -> str:
    return json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in row.items()})


class RunLog:
    """Appends metric rows to RUN_DIR/metrics.jsonl and, if asked, TensorBoard scalars.

    resume_iteration: rows past it are dropped from metrics.jsonl first, and TensorBoard
    events past its env-step count are purged from view.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False, num_seeds: int = 1,
                 resume_iteration: int | None = None, resume_env_steps: int | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.previous_rows: list[dict] = []
        if resume_iteration is not None:
            self.previous_rows = rows_through(self.path, resume_iteration)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w") as f:
                for row in self.previous_rows:
                    f.write(_json_row(row) + "\n")
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
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

    def close(self) -> None:
        self.file.close()
        for w in self.writers:
            w.close()


def _tb_tag(key: str) -> str:
    """Group TensorBoard tags: charts/ (returns), eval/, losses/, and perf/ (speed, time)."""
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key.startswith("episode") or key == "episodes":
        return f"charts/{key}"
    if key in ("sps", "wall_time", "iteration"):
        return f"perf/{key}"
    return f"train/{key}"
