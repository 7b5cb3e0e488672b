"""Learning-curve figures from metrics.jsonl files (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl; a run folder may be given instead of the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def return_curve(rows: list[dict], key: str = "episode_return_mean"):
    """(env_steps [N], wall_time [N], returns [S, N]) with NaN gaps forward-filled per seed."""
    seeds = sorted({r.get("seed", 0) for r in rows})
    by_seed = {s: [r for r in rows if r.get("seed", 0) == s] for s in seeds}
    n = min(len(v) for v in by_seed.values())
    steps = np.asarray([r["env_steps"] for r in by_seed[seeds[0]][:n]], float)
    wall = np.asarray([r["wall_time"] for r in by_seed[seeds[0]][:n]], float)
    curves = []
    for s in seeds:
        vals = np.asarray([np.nan if r.get(key) is None else r[key] for r in by_seed[s][:n]], float)
        curves.append(_ffill(vals))
    return steps, wall, np.stack(curves)


def _ffill(x: np.ndarray) -> np.ndarray:
    out = x.copy()
    last = np.nan
    for i, v in enumerate(out):
        if np.isnan(v):
            out[i] = last
        else:
            last = v
    return out


def plot_runs(run_dirs, out: str | Path, labels=None, title: str | None = None) -> Path:
    """Return vs env steps and vs wall time, mean ± std over seeds, one curve per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, run in enumerate(run_dirs):
        rows = read_metrics(run)
        if not rows:
            continue
        steps, wall, curves = return_curve(rows)
        mean = np.nanmean(curves, axis=0) if curves.shape[0] > 1 else curves[0]
        std = np.nanstd(curves, axis=0) if curves.shape[0] > 1 else np.zeros_like(mean)
        label = labels[i] if labels else Path(run).name
        if curves.shape[0] > 1:
            label += f" ({curves.shape[0]} seeds)"
        for ax, x in ((axes[0], steps), (axes[1], wall)):
            (line,) = ax.plot(x, mean, label=label)
            ax.fill_between(x, mean - std, mean + std, alpha=0.2, color=line.get_color())
    axes[0].set_xlabel("env steps")
    axes[1].set_xlabel("wall-clock seconds since process start")
    for ax in axes:
        ax.set_ylabel("episode return")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
