"""Learning-curve figures from run folders (matplotlib, headless), for `jaxppo plot` and
every run folder's curve.png: return vs env steps and vs wall-clock time, one curve per run
(or per setting of a sweep) with a 95% bootstrap interval of the mean over seeds, evaluation
returns dashed.
"""

from __future__ import annotations

import io
import itertools
import json
import warnings
from pathlib import Path

import numpy as np

from jaxppo.errors import warn
from jaxppo.run.files import write_atomic
from jaxppo.run.logs import order_problem, read_metrics
from jaxppo.search.results import SEARCH_FILE, lineage
from jaxppo.search.sweep import SWEPT_CONFIG_FIELDS, fmt_value, read_record

# Fields that do not change what a run learns (or, num_seeds, are shown as "(N seeds)"); left
# out of the legend's differences.
_NOT_IN_LEGEND = {
    "compilation_cache_dir", "log_every", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints",
    "tensorboard", "wandb",
    "num_devices", "num_seeds", "eval_every", "eval_episodes", "eval_deterministic", "eval_max_steps",
}

# Envs whose episode return is bounded by their time limit (+1 or -1 per step), at their
# default settings: a band never leaves these. Other envs' bands stay within the seeds' own
# returns.
RETURN_BOUNDS = {"CartPole-v1": (0.0, 500.0), "Acrobot-v1": (-500.0, 0.0),
                 "MountainCar-v0": (-200.0, 0.0)}
BOOTSTRAP_SAMPLES = 2000  # resamples of the seeds for each interval
INTERVAL = "mean, 95% bootstrap CI"  # how a legend describes the band

__all__ = ["compact_number", "config_differences", "elapsed_seconds", "eval_curve",
           "make_figure", "mean_interval", "moving_average", "pbt_lineage", "plot_runs",
           "plot_search", "read_metrics", "return_bounds", "return_curve", "search_figure",
           "unplottable"]


def _by_seed(rows: list[dict]):
    """(seed ids, rows of each seed cut to the length of the shortest)."""
    seeds = sorted({r.get("seed", 0) for r in rows})
    by_seed = [[r for r in rows if r.get("seed", 0) == s] for s in seeds]
    n = min(len(b) for b in by_seed)
    return seeds, [b[:n] for b in by_seed]


def elapsed_seconds(rows: list[dict], num_seeds: int = 1) -> np.ndarray:
    """Wall-clock seconds of each row [N] (one seed's rows, in order) since the first
    iteration: 0 first, never decreasing.

    A chunk's rows share its end time (`wall_time`, seconds since the process started). The
    chunk's iterations are spread evenly over its training time, which its `sps` gives (env
    steps of all `num_seeds` seeds per second), and never before the previous chunk's end;
    without sps, over the gap since the previous chunk."""
    end = np.asarray([r["wall_time"] for r in rows], float)
    steps = np.asarray([r["env_steps"] for r in rows], float)
    iters = np.asarray([r.get("iteration") or i + 1 for i, r in enumerate(rows)], float)
    t = np.empty_like(end)
    bounds = np.r_[np.flatnonzero(np.r_[True, end[1:] != end[:-1]]), len(end)]
    prev_end = None
    for a, b in itertools.pairwise(bounds):
        k, t_end = b - a, end[a]
        sps = rows[b - 1].get("sps")
        start = prev_end if prev_end is not None else t_end
        if sps:  # per-iteration env steps: a run's env_steps are iteration x batch_size
            batch = steps[b - 1] / max(iters[b - 1], 1.0)
            start = t_end - k * batch * num_seeds / sps
            if prev_end is not None:
                start = max(start, prev_end)
        start = min(start, t_end)
        t[a:b] = start + (t_end - start) * np.arange(1, k + 1) / k
        prev_end = t_end
    if not len(t):
        return t
    # Rows of resumed processes continue from the checkpoint's time: keep the axis monotone
    # even where a row was written out of order.
    return np.maximum.accumulate(t - t[0])


def unplottable(rows: list[dict]) -> str | None:
    """Why metric rows cannot be drawn (rows of another program, or damaged), or None: each
    row a mapping with numeric env_steps and wall_time, and a numeric or null return."""
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            return f"row {i + 1} is {type(r).__name__}, not a mapping of metrics"
        for k in ("env_steps", "wall_time"):
            if not _is_real(r.get(k)):
                return f"row {i + 1} has {k}={r.get(k)!r}, not a number"
        for k in ("episode_return_mean", "eval_return_mean", "sps", "iteration", "seed"):
            if r.get(k) is not None and not _is_real(r[k]):
                return f"row {i + 1} has {k}={r[k]!r}, not a number"
    return None


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def return_curve(rows: list[dict], key: str = "episode_return_mean"):
    """(env_steps [N], wall-clock seconds since the first iteration [N] (`elapsed_seconds`),
    returns [S, N]) with NaN gaps forward-filled per seed."""
    _, by_seed = _by_seed(rows)
    steps = np.asarray([r["env_steps"] for r in by_seed[0]], float)
    wall = elapsed_seconds(by_seed[0], len(by_seed))
    curves = []
    for b in by_seed:
        vals = np.asarray([np.nan if r.get(key) is None else r[key] for r in b], float)
        curves.append(_ffill(vals))
    return steps, wall, np.stack(curves)


def eval_curve(rows: list[dict]):
    """(env_steps [K], wall-clock seconds since the first iteration [K], eval returns [S, K])
    at the iterations that evaluated; None when the run has no evaluation."""
    _, by_seed = _by_seed(rows)
    n = len(by_seed[0])
    points = [j for j in range(n) if all(b[j].get("eval_return_mean") is not None for b in by_seed)]
    if not points:
        return None
    first = by_seed[0]
    steps = np.asarray([first[j]["env_steps"] for j in points], float)
    wall = elapsed_seconds(first, len(by_seed))[points]
    returns = np.asarray([[b[j]["eval_return_mean"] for j in points] for b in by_seed], float)
    return steps, wall, returns


def mean_interval(curves: np.ndarray, confidence: float = 0.95,
                  samples: int = BOOTSTRAP_SAMPLES, seed: int = 0):
    """(mean [N], low [N], high [N]) of curves [S, N] over seeds, ignoring NaN: the mean and
    its percentile-bootstrap interval.

    The seeds are resampled with replacement `samples` times, the same draw at every x (a
    resample is a set of whole curves, as rliable resamples runs); low and high are the
    (1 - confidence)/2 and (1 + confidence)/2 quantiles of the resampled means. They are NaN
    where fewer than 2 seeds are finite. The draw is seeded, so a figure is reproducible.
    With few seeds the interval is narrow (2 seeds: their range), as any bootstrap is."""
    curves = np.asarray(curves, float)
    num_seeds, n = curves.shape
    finite = np.isfinite(curves)
    with warnings.catch_warnings():
        # Iterations where no seed finished an episode are all-NaN columns: a gap in the
        # curve, not a problem worth a warning.
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(curves, axis=0)
        low, high = np.full(n, np.nan), np.full(n, np.nan)
        if num_seeds < 2:
            return mean, low, high
        counts = np.random.default_rng(seed).multinomial(
            num_seeds, np.full(num_seeds, 1.0 / num_seeds), size=samples).astype(float)
        values = np.where(finite, curves, 0.0)
        tail = (1.0 - confidence) / 2
        step = max(1, 2_000_000 // samples)  # columns at a time: bounded memory
        for a in range(0, n, step):
            sums, seen = counts @ values[:, a:a + step], counts @ finite[:, a:a + step]
            means = np.where(seen > 0, sums / np.maximum(seen, 1), np.nan)
            low[a:a + step], high[a:a + step] = np.nanquantile(means, [tail, 1 - tail], axis=0)
        few = finite.sum(axis=0) < 2
        low[few], high[few] = np.nan, np.nan
    return mean, low, high


def moving_average(curves: np.ndarray, window: int) -> np.ndarray:
    """Each curve [..., N] averaged over its last `window` points (fewer at the start),
    ignoring NaN; window 1 returns the curves unchanged."""
    curves = np.asarray(curves, float)
    if window <= 1:
        return curves
    finite = np.isfinite(curves)
    sums = np.cumsum(np.where(finite, curves, 0.0), axis=-1)
    seen = np.cumsum(finite, axis=-1)
    sums[..., window:] = sums[..., window:] - sums[..., :-window].copy()
    seen[..., window:] = seen[..., window:] - seen[..., :-window].copy()
    return np.where(seen > 0, sums / np.maximum(seen, 1), np.nan)


def return_bounds(run) -> tuple[float, float] | None:
    """The range an episode return of the run's env can take (`RETURN_BOUNDS`), or None
    when it is not known: another env, or one whose time limit or rewards the config
    changes (env_kwargs, env_params, transforms)."""
    cfg = _flat_config(run)
    if (any(k.startswith("env_kwargs") for k in cfg) or cfg.get("env_params") is not None
            or cfg.get("transforms")):
        return None
    env = cfg.get("env")
    if not isinstance(env, str):
        return None
    return RETURN_BOUNDS.get(env.removeprefix("gymnasium:").removeprefix("envpool:"))


def compact_number(x, pos=None) -> str:
    """A tick label: 0, 500, 1.5k, 100k, 1M, 2.5M, 1B (a matplotlib FuncFormatter)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= 0.9995 * scale:  # 999,999 is "1M", not "1e+03k"
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


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

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        data = e
    if not isinstance(data, dict):  # the legend then names the folder; the curves need no config
        warn(f"{path} is not a readable config (a mapping of fields); the legend "
             "leaves out its config fields")
        return {}
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


def run_labels(runs) -> list[str]:
    """Legend labels: the env name, then the config fields that differ between the runs (for
    a sweep folder, not the hyperparameters its members override: each member's curve names
    its own); the folder name is added where that still leaves two runs with the same label
    (and stands alone for a folder without config.yaml)."""
    diffs = config_differences(runs)
    labels = []
    for run, diff in zip(runs, diffs):
        env = _flat_config(run).get("env")
        if env is None:
            labels.append(_run_folder(run).name)
            continue
        if read_record(run) is not None:
            diff = {k: v for k, v in diff.items() if k not in SWEPT_CONFIG_FIELDS}
        env = str(env).rpartition(":")[2]  # a custom env's "module:Class" -> "Class"
        labels.append(env + (": " + ", ".join(f"{k}={fmt_value(v)}" for k, v in diff.items())
                             if diff else ""))
    base = list(labels)
    for i, lab in enumerate(base):
        if base.count(lab) > 1:
            labels[i] = f"{lab} [{_run_folder(runs[i]).name}]"
    return labels


def _groups(run_label: str, num_curves: int, record: dict | None, unit: str = "seeds"):
    """The curves of one run: [(legend label, seed indices, gid key)]. A run is one curve
    (mean over its seeds, or a PBT population's members); a sweep one per setting, the
    members with the same label."""
    ci = INTERVAL
    if record is None or len(record["labels"]) != num_curves:
        seeds = f" ({num_curves} {unit}, {ci})" if num_curves > 1 else ""
        return [(run_label + seeds, list(range(num_curves)), "")]
    out = []
    for lab in dict.fromkeys(record["labels"]):
        idx = [s for s, m in enumerate(record["labels"]) if m == lab]
        text = f"{run_label}: {lab}" if run_label else lab
        out.append((text + (f" ({len(idx)} seeds, {ci})" if len(idx) > 1 else ""), idx,
                    f"/{idx[0]}"))
    return out


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds > 3 * 3600:
        return 3600.0, "hours"
    if seconds > 300:
        return 60.0, "minutes"
    return 1.0, "seconds"


def make_figure(run_dirs, labels=None, title: str | None = None, smooth: int = 1):
    """The figure of `plot_runs`, not saved.

    Each line's gid is 'train:<k>', 'train-band:<k>' (the 95% bootstrap interval of the
    mean, runs of several seeds; `mean_interval`) or 'eval:<k>', where k is the run's index i, or 'i/j' for the setting of a sweep's
    member j (sweep.json). The legend is the figure's, below the panels. A single PBT run
    also gets its winning lineage's hyperparameters below the curves.

    Args:
      run_dirs: run folders.
      labels: a legend label per run (default: `run_labels`).
      title: the figure's title.
      smooth: each seed's training return as the moving average of its last `smooth`
        iterations (`moving_average`) before the mean and interval; 1 = none. Evaluation
        returns are drawn as measured.

    Returns:
      (fig, axes): the matplotlib figure and its two panels (steps, wall-clock time).
    """
    import matplotlib

    matplotlib.use("Agg")

    if isinstance(smooth, bool) or not isinstance(smooth, (int, np.integer)) or smooth < 1:
        raise ValueError(f"smooth={smooth!r} must be a whole number of iterations >= 1 "
                         "(1 = no smoothing)")
    run_dirs = list(run_dirs)
    labels = list(labels) if labels else run_labels(run_dirs)
    data, bounds = _read_runs(run_dirs)
    scale, unit = _time_unit(max((float(c[1][-1]) for _, c, _, _, _ in data if len(c[1])),
                                 default=0.0))
    fig, top, axes = _panels(run_dirs)
    any_eval = False
    for i, curve, ev, record, pbt in data:
        any_eval |= _draw_run(axes, i, labels[i], curve, ev, record, pbt, bounds[i], smooth,
                              scale)
    _label_panels(axes, unit, smooth, any_eval)
    handles, texts = axes[0].get_legend_handles_labels()
    if handles:
        # Below the panels, in as many columns as the labels' length allows: it cannot cover
        # a curve or the y label, and the layout makes room for it.
        ncol = max(1, min(len(texts), 150 // (max(map(len, texts)) + 6)))
        top.legend(handles, texts, loc="outside lower center", ncol=ncol, fontsize=8)
    if title:
        fig.suptitle(title)
    return fig, axes


def _read_runs(run_dirs: list) -> tuple[list[tuple], dict]:
    """The curves of each run folder with metrics: (index, `return_curve`, `eval_curve`,
    sweep record, whether PBT) and, by index, the run's `return_bounds`."""
    data, bounds = [], {}
    for i, run in enumerate(run_dirs):
        rows = read_metrics(run)
        damaged = order_problem(run)
        if damaged:  # a curve through repeated rows would go back on itself
            raise ValueError(damaged)
        if rows:
            data.append((i, return_curve(rows), eval_curve(rows), read_record(run), _is_pbt(rows)))
            bounds[i] = return_bounds(run)
    return data, bounds


def _panels(run_dirs: list):
    """(fig, the (sub)figure that holds the panels and the legend, the two panels); a PBT run
    (one folder) also gets its winning lineage's hyperparameters below the curves."""
    import matplotlib.pyplot as plt

    lineage = pbt_lineage(run_dirs[0]) if len(run_dirs) == 1 else None
    if lineage is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
        return fig, fig, axes
    fig = plt.figure(figsize=(12, 8.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[5, 3.2])
    axes = top.subplots(1, 2)
    _draw_lineage(bottom, lineage)
    return fig, top, axes


def _draw_run(axes, i: int, run_label: str, curve, ev, record: dict | None, pbt: bool,
              bounds: tuple[float, float] | None, smooth: int, scale: float) -> bool:
    """Run i's training return (mean and band over seeds or a PBT population's members, one
    line per setting of a sweep) and its evaluations on both panels; whether it drew any
    evaluation."""
    steps, wall, curves = curve
    any_eval = False
    for label, idx, key in _groups(run_label, curves.shape[0], None if pbt else record,
                                   "members" if pbt else "seeds"):
        seeds = moving_average(curves[idx], smooth)
        mean, low, high = mean_interval(seeds)
        # Never past what a return can be: the env's known range, else the seeds' own.
        lo, hi = bounds or (np.nanmin(seeds, initial=np.inf), np.nanmax(seeds, initial=-np.inf))
        low, high = np.clip(low, lo, hi), np.clip(high, lo, hi)
        for ax, x, xi in ((axes[0], steps, 0), (axes[1], wall / scale, 1)):
            (line,) = ax.plot(x, mean, label=label if xi == 0 else "_nolegend_",
                              gid=f"train:{i}{key}")
            if len(idx) > 1:
                band = ax.fill_between(x, low, high, alpha=0.2, color=line.get_color())
                band.set_gid(f"train-band:{i}{key}")
            if ev is not None and ev[0].size:
                any_eval = True
                ex = ev[xi] if xi == 0 else ev[xi] / scale
                ax.plot(ex, ev[2][idx].mean(axis=0), linestyle="--", marker="o",
                        markersize=3, color=line.get_color(), label="_nolegend_",
                        gid=f"eval:{i}{key}")
    return any_eval


def _label_panels(axes, unit: str, smooth: int, any_eval: bool) -> None:
    """The panels' titles, axis labels, grid and tick format."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axes[0].set_title("return vs env steps")
    axes[1].set_title("return vs wall-clock time")
    axes[0].set_xlabel("env steps")
    axes[1].set_xlabel(f"wall-clock {unit} since the first iteration (resumed runs: summed "
                       "over processes)")
    ylabel = "episode return" + (f" (moving average of {smooth} iterations)" if smooth > 1 else "")
    for ax in axes:
        ax.set_ylabel(ylabel + (" (dashed: evaluation)" if any_eval else ""))
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        ax.xaxis.set_major_formatter(FuncFormatter(compact_number))


def _is_pbt(rows: list[dict]) -> bool:
    return bool(rows) and "pbt_parent" in rows[0]


def pbt_lineage(run) -> dict | None:
    """The winning lineage of a PBT run folder (jaxppo.search.results.lineage), None for other runs.
    The winner is search.json's best member, else the member with the best final return."""
    rows = read_metrics(run)
    if not _is_pbt(rows):
        return None
    _, by_seed = _by_seed(rows)
    keys = ["iteration", "pbt_parent"] + [k for k in rows[0] if k.startswith("hp_")]
    metrics = {k: np.asarray([[np.nan if r.get(k) is None else r[k] for r in b] for b in by_seed],
                             float) for k in keys}
    metrics["iteration"] = metrics["iteration"].astype(np.int64)
    path = _run_folder(run) / SEARCH_FILE
    try:
        best = json.loads(path.read_text())["best"]["members"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        _, _, curves = return_curve(rows)
        tail = np.nanmean(curves[:, -10:], axis=1)
        best = int(np.nanargmax(tail)) if np.isfinite(tail).any() else 0
    return lineage(metrics, best)


def _draw_lineage(fig, lin: dict) -> None:
    """One panel per searched hyperparameter: its value along the winning lineage, with the
    iterations where the lineage copied another member marked."""
    from matplotlib.ticker import FuncFormatter

    fields = list(lin["hparams"])
    axes = fig.subplots(1, max(1, len(fields)), squeeze=False)[0]
    it = np.asarray(lin["iteration"])
    for ax, f in zip(axes, fields):
        ax.step(it, lin["hparams"][f], where="post", gid=f"lineage:{f}")
        for e in lin["exploits"]:
            ax.axvline(e["iteration"], color="0.6", linewidth=0.8, linestyle=":")
        ax.set_title(f, fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_formatter(FuncFormatter(compact_number))
    fig.suptitle(f"winning lineage (ends in member {lin['member']}; dotted: it copied "
                 f"another member, {len(lin['exploits'])} times)", fontsize=10)


def plot_search(rec: dict, out: str | Path) -> Path:
    """Draws search.png (`search_figure`); a link at `out` is replaced, not written through.

    Args:
      rec: search.json's content (`jaxppo.search.results.report`).
      out: the PNG to write.

    Returns:
      The path of the PNG.
    """
    return _save(search_figure(rec)[0], out)


def search_figure(rec: dict):
    """The figure of search.png, not saved: each member's final return (or evaluation)
    against each searched hyperparameter (a log axis for loguniform ones), the best setting
    ringed (gid 'search-best:<field>') unless every setting scored the same (then there is
    no best to mark).

    Returns:
      (fig, axes): the figure and its panels, one per searched field.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fields = list(rec["searched"])
    fig, axes = plt.subplots(1, len(fields), figsize=(4 * len(fields), 3.8),
                             layout="constrained", squeeze=False)
    metric = rec["metric"]
    scores = np.asarray([np.nan if m.get(metric) is None else m[metric] for m in rec["members"]],
                        float)
    # Every setting tied (or none scored): no setting is better than another.
    means = np.asarray([np.nan if e.get(f"{metric}_mean") is None else e[f"{metric}_mean"]
                        for e in rec["settings"]], float)
    tied = len(np.unique(means[np.isfinite(means)])) < 2
    best = set() if tied else set(rec["best"]["members"])
    for ax, f in zip(axes[0], fields):
        x = [m[f] for m in rec["members"]]
        ax.scatter(x, scores, s=18, gid=f"search:{f}")
        if best:
            bx = [xv for m, xv in zip(rec["members"], x) if m["member"] in best]
            by = [yv for m, yv in zip(rec["members"], scores) if m["member"] in best]
            ax.scatter(bx, by, s=90, facecolors="none", edgecolors="tab:red", label="best",
                       gid=f"search-best:{f}")
        if "loguniform" in rec["searched"][f]:
            _log_axis(ax, [v for v in x if _is_real(v) and v > 0])
        ax.set_xlabel(f)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric.replace("_", " "))
    if best:
        axes[0][0].legend(fontsize=8)
    kind = "PBT (final values)" if "pbt" in rec else "search"
    fig.suptitle(f"{kind}: {len(rec['members'])} members, {len(rec['settings'])} settings"
                 + ("; every setting scored the same: no best" if tied else ""))
    return fig, axes[0]


def _log_axis(ax, values) -> None:
    """A log x axis whose tick labels cannot run into each other: over less than a decade,
    four or five evenly spaced ticks; over one to two decades, 1 and 3 of each decade; over
    more, the decades (every few, over very many). Labels are plain numbers (0.0035, 1e-5);
    minor ticks have none."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    ax.set_xscale("log")
    decades = np.log10(max(values) / min(values)) if values else 0.0
    if decades < 1:
        locator = MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10])
    else:
        locator = LogLocator(base=10, subs=(1.0, 3.0) if decades < 2 else (1.0,), numticks=6)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(FuncFormatter(_short_number))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _short_number(v, _pos=None) -> str:
    """A log-axis tick label: 0.003, 0.0035, 30, 1e-05 -> "1e-5"."""
    text = f"{v:.2g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


def plot_runs(run_dirs, out: str | Path, labels=None, title: str | None = None,
              smooth: int = 1) -> Path:
    """Draws learning curves of run folders into a PNG (a link at `out` is replaced, not
    written through).

    Return vs env steps and vs wall-clock time, one curve per run (the mean over its seeds
    with a shaded 95% bootstrap interval of that mean, kept within the returns the env can
    give) or per setting of a sweep, labelled by the config fields that differ; evaluation
    returns are dashed in the curve's colour.

    Args:
      run_dirs: run folders.
      out: the PNG to write.
      labels: a legend label per run (default: the env and the config fields that differ).
      title: the figure's title.
      smooth: a moving average of this many iterations over each seed's training return
        (1 = none).

    Returns:
      The path of the PNG.
    """
    return _save(make_figure(run_dirs, labels=labels, title=title, smooth=smooth)[0], out)


def _save(fig, out: str | Path) -> Path:
    """Write `fig` to `out` (its format from the suffix), then close it. The image replaces
    whatever stands at `out` (`jaxppo.run.files.write_atomic`): a link there is replaced,
    never written through."""
    import matplotlib.pyplot as plt

    out = Path(out)
    buf = io.BytesIO()
    try:  # "tight": nothing drawn is cut off
        fig.savefig(buf, format=out.suffix.lstrip(".").lower() or None, dpi=110,
                    bbox_inches="tight")
    finally:
        plt.close(fig)
    write_atomic(out, buf.getvalue())
    return out
