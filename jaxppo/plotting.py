"""Learning-curve figures from run folders (matplotlib, headless).

`plot_runs` draws return vs env steps and vs wall-clock time, mean ± std over seeds, one
curve per run; evaluation returns, where the run has them, are dashed lines with markers in
the run's colour. Legends name the env and the config fields whose values differ between the
runs' config.yaml files. `jaxppo plot` and every run folder's curve.png use it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from jaxppo.runlog import read_metrics

# Fields that do not change what a run learns (or, num_seeds, are shown as "(N seeds)"); left
# out of the legend's differences.
_NOT_IN_LEGEND = {
    "compilation_cache_dir", "log_every", "checkpoint_every", "keep_checkpoints", "tensorboard",
    "num_devices", "num_seeds", "eval_every", "eval_episodes", "eval_deterministic", "eval_max_steps",
}

__all__ = ["read_metrics", "return_curve", "eval_curve", "config_differences", "make_figure",
           "plot_runs"]


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


def eval_curve(rows: list[dict]):
    """(env_steps [K], wall_time [K], eval returns [S, K]) at the iterations that evaluated;
    None when the run has no evaluation."""
    seeds = sorted({r.get("seed", 0) for r in rows})
    by_seed = [[r for r in rows if r.get("seed", 0) == s] for s in seeds]
    n = min(len(b) for b in by_seed)
    points = [j for j in range(n) if all(b[j].get("eval_return_mean") is not None for b in by_seed)]
    if not points:
        return None
    first = by_seed[0]
    steps = np.asarray([first[j]["env_steps"] for j in points], float)
    wall = np.asarray([first[j]["wall_time"] for j in points], float)
    returns = np.asarray([[b[j]["eval_return_mean"] for j in points] for b in by_seed], float)
    return steps, wall, returns


def _ffill(x: np.ndarray) -> np.ndarray:
    out = x.copy()
    last = np.nan
    for i, v in enumerate(out):
        if np.isnan(v):
            out[i] = last
        else:
            last = v
    return out


def _run_folder(run) -> Path:
    p = Path(run)
    return p.parent if p.is_file() else p


def _flat_config(run) -> dict:
    path = _run_folder(run) / "config.yaml"
    if not path.exists():
        return {}
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    flat = {}
    for k, v in data.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                flat[f"{k}.{kk}"] = vv
        else:
            flat[k] = v
    return flat


def config_differences(runs) -> list[dict]:
    """For each run, {field: value} of the config fields (from config.yaml) whose values are
    not the same in every run; fields that do not affect learning are left out."""
    configs = [_flat_config(r) for r in runs]
    keys = sorted(set().union(*configs)) if configs else []
    differing = [k for k in keys if k not in _NOT_IN_LEGEND and k != "env"
                 and len({repr(c.get(k)) for c in configs}) > 1]
    return [{k: c.get(k) for k in differing} for c in configs]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    return str(v)


def run_labels(runs) -> list[str]:
    """Legend labels: the env name, then the config fields that differ between the runs; the
    folder name is added where that still leaves two runs with the same label (and stands
    alone for a folder without config.yaml)."""
    diffs = config_differences(runs)
    labels = []
    for run, diff in zip(runs, diffs):
        env = _flat_config(run).get("env")
        if env is None:
            labels.append(_run_folder(run).name)
            continue
        labels.append(env + (": " + ", ".join(f"{k}={_fmt(v)}" for k, v in diff.items()) if diff else ""))
    base = list(labels)
    for i, lab in enumerate(base):
        if base.count(lab) > 1:
            labels[i] = f"{lab} [{_run_folder(runs[i]).name}]"
    return labels


def make_figure(run_dirs, labels=None, title: str | None = None):
    """The figure of `plot_runs`, not saved: (fig, axes). Each line's gid is
    'train:<i>', 'train-band:<i>' or 'eval:<i>' for run i."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = list(run_dirs)
    labels = list(labels) if labels else run_labels(run_dirs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    any_eval = False
    for i, run in enumerate(run_dirs):
        rows = read_metrics(run)
        if not rows:
            continue
        steps, wall, curves = return_curve(rows)
        with warnings.catch_warnings():
            # Iterations where no seed finished an episode are all-NaN columns: a gap in the
            # curve, not a problem worth a warning.
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(curves, axis=0) if curves.shape[0] > 1 else curves[0]
            std = np.nanstd(curves, axis=0) if curves.shape[0] > 1 else np.zeros_like(mean)
        label = labels[i]
        if curves.shape[0] > 1:
            label += f" ({curves.shape[0]} seeds)"
        ev = eval_curve(rows)
        for ax, x, xi in ((axes[0], steps, 0), (axes[1], wall, 1)):
            (line,) = ax.plot(x, mean, label=label, gid=f"train:{i}")
            band = ax.fill_between(x, mean - std, mean + std, alpha=0.2, color=line.get_color())
            band.set_gid(f"train-band:{i}")
            if ev is not None and ev[0].size:
                any_eval = True
                ex = ev[xi]
                em = ev[2].mean(axis=0)
                ax.plot(ex, em, linestyle="--", marker="o", markersize=3, color=line.get_color(),
                        label="_nolegend_", gid=f"eval:{i}")
    axes[0].set_xlabel("env steps")
    axes[1].set_xlabel("wall-clock seconds (summed over resumed processes)")
    for ax in axes:
        ax.set_ylabel("episode return" + (" (dashed: evaluation)" if any_eval else ""))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig, axes


def plot_runs(run_dirs, out: str | Path, labels=None, title: str | None = None) -> Path:
    """Return vs env steps and vs wall time, mean ± std over seeds, one curve per run; writes
    the PNG `out` and returns its path."""
    import matplotlib.pyplot as plt

    fig, _ = make_figure(run_dirs, labels=labels, title=title)
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
