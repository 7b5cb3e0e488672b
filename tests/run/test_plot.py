"""Plots and logs from run folders written by hand (no training): curves per run, mean and
95% bootstrap interval over seeds (within the env's returns), smoothing, the wall-clock axis,
tick labels, legends with the config differences (inside the figure), search.png's axes and
best mark, the default output, metrics.jsonl handling."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxppo import cli
from jaxppo.config import PPOConfig
from jaxppo.run.logs import RunLog, read_metrics
from jaxppo.run.plots import (compact_number, config_differences, elapsed_seconds, make_figure,
                              mean_interval, moving_average, plot_runs, return_bounds, run_labels,
                              search_figure)


def _write_run(path: Path, returns: np.ndarray, evals: dict | None = None, wall=None,
               **config) -> Path:
    """A run folder: config.yaml and metrics.jsonl with returns [S, N] (S seeds); wall_time
    of iteration i is wall[i] (default 2 + 0.5 i: one iteration per chunk)."""
    path.mkdir(parents=True)
    cfg = PPOConfig(compilation_cache_dir=None).replace(**config)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    seeds, n = returns.shape
    rows = []
    for i in range(n):
        for s in range(seeds):
            row = {"iteration": i + 1, "env_steps": (i + 1) * 512,
                   "wall_time": 2.0 + 0.5 * i if wall is None else float(wall[i]),
                   "sps": 1000.0, "episode_return_mean": float(returns[s, i])}
            if evals is not None:
                row["eval_return_mean"] = evals.get(i + 1)
            if seeds > 1:
                row["seed"] = s
            rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def three_runs(tmp_path):
    a = _write_run(tmp_path / "a", np.arange(10.0)[None], lr=0.001)
    b = _write_run(tmp_path / "b", np.stack([np.arange(10.0), np.arange(10.0) + 2]), lr=0.002,
                   num_seeds=2)
    c = _write_run(tmp_path / "c", np.full((1, 10), 5.0), evals={5: 7.0, 10: 9.0}, lr=0.001,
                   env="Acrobot-v1")
    return [a, b, c]


def _lines(ax, kind):
    return [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith(kind + ":")]


def test_one_curve_per_run_on_both_axes(three_runs):
    fig, axes = make_figure(three_runs)
    for ax in axes:
        assert len(_lines(ax, "train")) == 3
        assert [ln.get_gid() for ln in _lines(ax, "eval")] == ["eval:2"]
    # Mean over the two seeds of run b; wall-clock seconds since its first iteration.
    np.testing.assert_allclose(_lines(axes[0], "train")[1].get_ydata(), np.arange(10.0) + 1)
    np.testing.assert_allclose(_lines(axes[0], "train")[1].get_xdata(), np.arange(1, 11) * 512)
    np.testing.assert_allclose(_lines(axes[1], "train")[1].get_xdata(), 0.5 * np.arange(10))
    ev = _lines(axes[0], "eval")[0]
    np.testing.assert_allclose(ev.get_xdata(), [5 * 512, 10 * 512])
    np.testing.assert_allclose(ev.get_ydata(), [7.0, 9.0])
    assert [ax.get_title() for ax in axes] == ["return vs env steps", "return vs wall-clock time"]
    (fig_legend,) = fig.legends
    legend = [t.get_text() for t in fig_legend.get_texts()]
    assert len(legend) == 3
    assert legend[0].startswith("CartPole-v1") and "lr=0.001" in legend[0]
    assert legend[1].startswith("CartPole-v1") and "lr=0.002" in legend[1]
    assert "(2 seeds, mean, 95% bootstrap CI)" in legend[1]
    assert legend[2].startswith("Acrobot-v1")
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_config_differences_name_only_fields_that_differ(three_runs):
    diffs = config_differences(three_runs)
    assert diffs == [{"lr": 0.001}, {"lr": 0.002}, {"lr": 0.001}]  # env and num_seeds are shown apart


def test_identical_configs_are_told_apart_by_folder(tmp_path):
    runs = [_write_run(tmp_path / n, np.zeros((1, 3))) for n in ("x", "y")]
    assert run_labels(runs) == ["CartPole-v1 [x]", "CartPole-v1 [y]"]


def test_plot_writes_a_png(three_runs, tmp_path):
    out = plot_runs(three_runs, tmp_path / "out.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["plot", *map(str, three_runs), "-o", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").stat().st_size > 10_000
    assert cli.main(["plot", str(tmp_path / "missing"), "-o", str(tmp_path / "x.png")]) == 2


def test_read_metrics_skips_a_half_written_last_line(tmp_path):
    run = _write_run(tmp_path / "r", np.ones((1, 3)))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 4, "env_st')
    assert [r["iteration"] for r in read_metrics(run)] == [1, 2, 3]


def test_runlog_resume_keeps_rows_up_to_the_checkpoint(tmp_path):
    run = _write_run(tmp_path / "r", np.ones((2, 5)), num_seeds=2)
    log = RunLog(run, num_seeds=2, resume_iteration=3)
    assert [r["iteration"] for r in log.previous_rows] == [1, 1, 2, 2, 3, 3]
    log.write([{"iteration": 4, "env_steps": 2048, "episode_return_mean": float("nan"), "seed": 0}])
    log.close()
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [1, 1, 2, 2, 3, 3, 4]
    assert rows[-1]["episode_return_mean"] is None  # NaN is written as null


def test_plot_of_an_empty_or_foreign_file_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"loss": 1}\n{"loss": 2}\n')
    binary = tmp_path / "img.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    for path in (empty, foreign, binary):
        assert cli.main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "holds no metric rows" in err and "not a jaxppo metrics file" in err
    assert not (tmp_path / "x.png").exists()


def _band(ax, gid):
    (band,) = [c for c in ax.collections if c.get_gid() == gid]
    return band.get_paths()[0].vertices[:, 1]


def test_band_is_a_bootstrap_interval_of_the_mean(three_runs):
    fig, axes = make_figure(three_runs)
    # Run b: seeds arange(10) and arange(10) + 2. A bootstrap of the mean of two seeds draws
    # both of one seed a quarter of the time each: its 95% interval is their range.
    ys = _band(axes[0], "train-band:1")
    np.testing.assert_allclose([ys.min(), ys.max()], [0.0, 11.0])
    assert not [c for c in axes[0].collections if c.get_gid() in ("train-band:0", "train-band:2")]
    import matplotlib.pyplot as plt

    plt.close(fig)
    curves = np.array([[1.0, 2.0, np.nan], [3.0, 6.0, np.nan], [5.0, np.nan, 4.0]])
    mean, low, high = mean_interval(curves)
    np.testing.assert_allclose(mean, [3.0, 4.0, 4.0])
    # Three seeds 1, 3, 5: all three draws the same seed is 1/27 > 2.5% of the resamples, so
    # the interval reaches the extremes; the second column's two finite seeds give their range.
    np.testing.assert_allclose([low[0], high[0], low[1], high[1]], [1.0, 5.0, 2.0, 6.0])
    assert np.isnan(low[2]) and np.isnan(high[2])  # one finite seed: no interval
    # Many seeds: close to the normal interval mean ± 1.96·s/√n (the bootstrap's s uses 1/n).
    seeds = np.random.default_rng(3).normal(100.0, 10.0, size=(40, 2))
    mean, low, high = mean_interval(seeds)
    half = 1.96 * seeds.std(axis=0) / np.sqrt(40)
    np.testing.assert_allclose(high - low, 2 * half, rtol=0.1)
    np.testing.assert_allclose((low + high) / 2, mean, atol=0.15 * half.max())
    again = mean_interval(seeds)  # seeded: the same figure every time
    np.testing.assert_array_equal(again[1], low) and np.testing.assert_array_equal(again[2], high)
    assert all(np.isnan(v).all() for v in mean_interval(seeds[:1])[1:])


def test_band_stays_within_the_returns_the_env_can_give(tmp_path):
    """CartPole's returns lie in [0, 500]; an env without known bounds keeps the seeds' own
    range."""
    high = np.stack([np.full(6, 560.0), np.full(6, 440.0)])  # past the bound, as a test only
    cart = _write_run(tmp_path / "cart", high, num_seeds=2)
    pend = _write_run(tmp_path / "pend", high, num_seeds=2, env="Pendulum-v1")
    short = _write_run(tmp_path / "short", high, num_seeds=2,
                       env_kwargs={"max_steps_in_episode": 600})
    assert [return_bounds(r) for r in (cart, pend, short)] == [(0.0, 500.0), None, None]
    fig, axes = make_figure([cart, pend, short])
    for gid, top in (("train-band:0", 500.0), ("train-band:1", 560.0), ("train-band:2", 560.0)):
        ys = _band(axes[0], gid)
        assert ys.max() == top and ys.min() == 440.0, gid
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_smoothing_is_a_moving_average_of_each_seed(tmp_path, capsys):
    x = np.array([[0.0, 3.0, 6.0, 9.0, 0.0], [np.nan, 2.0, 4.0, np.nan, 8.0]])
    np.testing.assert_allclose(moving_average(x, 3), [[0.0, 1.5, 3.0, 6.0, 5.0],
                                                      [np.nan, 2.0, 3.0, 3.0, 6.0]])
    np.testing.assert_array_equal(moving_average(x, 1), x)
    returns = np.stack([np.arange(8.0) ** 2, np.arange(8.0) ** 2 + 4])
    run = _write_run(tmp_path / "r", returns, num_seeds=2)
    fig, axes = make_figure([run], smooth=4)
    (line,) = _lines(axes[0], "train")
    np.testing.assert_allclose(line.get_ydata(), moving_average(returns, 4).mean(axis=0))
    assert "moving average of 4 iterations" in axes[0].get_ylabel()
    import matplotlib.pyplot as plt

    plt.close(fig)
    with pytest.raises(ValueError, match="smooth=0 must be a whole number"):
        make_figure([run], smooth=0)
    assert cli.main(["plot", str(run), "--smooth", "0"]) == 2
    assert "--smooth 0 must be >= 1" in capsys.readouterr().err
    assert not (run / "curves.png").exists()


def test_plot_without_output_writes_into_the_run_folder(three_runs, tmp_path, monkeypatch, capsys):
    """One run folder: RUN/curves.png; several: curves.png in the current folder. The path
    written is printed."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plot", str(three_runs[0]), "--smooth", "3"]) == 0
    out = three_runs[0] / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == f"wrote {out.resolve()}\n"
    assert not (tmp_path / "curves.png").exists()
    assert cli.main(["plot", *map(str, three_runs)]) == 0
    assert capsys.readouterr().out == f"wrote {(tmp_path / 'curves.png').resolve()}\n"
    assert not (three_runs[1] / "curves.png").exists()


def _search_record(values, scores):
    members = [{"member": i, "setting": i, "lr": v, "final_return": r}
               for i, (v, r) in enumerate(zip(values, scores))]
    settings = sorted(({"setting": i, "members": [i], "hparams": {"lr": v},
                        "final_return_mean": r} for i, (v, r) in enumerate(zip(values, scores))),
                      key=lambda e: -e["final_return_mean"])
    return {"metric": "final_return", "searched": {"lr": {"loguniform": [values[0], values[-1]]}},
            "members": members, "settings": settings, "best": settings[0]}


@pytest.mark.parametrize("low,high", [(3e-3, 4.5e-3), (2.5e-3, 9e-3), (1e-4, 3e-3), (1e-6, 1e-1)])
def test_search_log_axis_labels_do_not_overlap(low, high):
    values = [float(v) for v in np.geomspace(low, high, 8)]
    fig, (ax,) = search_figure(_search_record(values, list(range(8))))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = [t for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
             if t.get_text() and t.get_visible()
             and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
    assert len(shown) >= 2, [t.get_text() for t in shown]
    boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda b: b.x0)
    for a, b in itertools.pairwise(boxes):
        assert a.x1 < b.x0, [t.get_text() for t in shown]
    assert all(len(t.get_text()) <= 6 for t in shown), [t.get_text() for t in shown]
    assert [c.get_gid() for c in ax.collections] == ["search:lr", "search-best:lr"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_search_plot_marks_no_best_when_every_setting_ties():
    fig, (ax,) = search_figure(_search_record([1e-4, 1e-3, 1e-2], [500.0, 500.0, 500.0]))
    assert [c.get_gid() for c in ax.collections] == ["search:lr"]
    assert ax.get_legend() is None and "no best" in fig._suptitle.get_text()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_wall_clock_axis_starts_at_zero_and_never_goes_back(tmp_path):
    """Chunks of 4 iterations share one wall_time (its end, seconds since the process started);
    a resumed process's first chunk is stamped before the previous one ended."""
    wall = np.repeat([30.0, 34.0, 38.0, 37.5, 41.5], 4)
    run = _write_run(tmp_path / "chunked", np.arange(20.0)[None], wall=wall)
    rows = read_metrics(run)
    x = elapsed_seconds(rows)
    assert x[0] == 0.0 and np.all(np.diff(x) >= 0)
    # 4 iterations x 512 steps at 1000 steps/s is 2.048 s: the first chunk's iterations are
    # spread over that, the later ones over their own 2.048 s before each chunk's end.
    np.testing.assert_allclose(x[:4], 0.512 * np.arange(4))
    np.testing.assert_allclose(x[4:8], 30.0 + 4.0 - 2.048 + 0.512 * np.arange(1, 5) - (30 - 2.048 + 0.512))
    fig, axes = make_figure([run])
    (line,) = _lines(axes[1], "train")
    xs = line.get_xdata()
    assert xs[0] == 0.0 and np.all(np.diff(xs) >= 0)
    np.testing.assert_allclose(xs, x)
    np.testing.assert_allclose(xs[12:16], 38.0 - (30 - 2.048 + 0.512))  # held, not going back
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_tick_labels_are_compact(three_runs):
    assert [compact_number(v) for v in (0, 0.25, 500, 1500, 1e5, 999_999, 1e6, 2.5e6, 3e9, -2e4)] == [
        "0", "0.25", "500", "1.5k", "100k", "1M", "1M", "2.5M", "3B", "-20k"]
    fig, axes = make_figure(three_runs)
    fig.canvas.draw()
    for ax in axes:
        assert ax.xaxis.get_major_formatter()(2e5, 0) == "200k"
        assert len(ax.get_xticks()) <= 7 + 2  # MaxNLocator(6), plus the ends it may add
    labels = [t.get_text() for t in axes[0].get_xticklabels() if t.get_text()]
    assert labels and all(len(t) <= 5 for t in labels)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_legend_of_many_runs_is_inside_the_figure_and_off_the_axes(tmp_path):
    runs = [_write_run(tmp_path / f"r{i}", np.full((1, 5), float(i)), lr=0.001 * (i + 1),
                       clip_param=0.1 + 0.05 * i, gamma=0.9 + 0.01 * i) for i in range(6)]
    fig, axes = make_figure(runs, title="six runs")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert len(legend.get_texts()) == 6
    assert (box.x0 >= fig.bbox.x0 and box.y0 >= fig.bbox.y0 and box.x1 <= fig.bbox.x1
            and box.y1 <= fig.bbox.y1)
    for ax in axes:  # the axes with their tick labels, axis labels and title
        assert not box.overlaps(ax.get_tightbbox(renderer))
    import matplotlib.pyplot as plt

    plt.close(fig)
    out = plot_runs(runs, tmp_path / "many.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("target", ["../victim.txt", "config.yaml"])
def test_plot_writes_nothing_through_a_link_in_the_run_folder(tmp_path, capsys, target):
    """A link planted at the default output (RUN/curves.png) is refused, named, and left as
    it is, and so is what it points to; plot_runs itself replaces a link rather than
    writing through it."""
    run = _write_run(tmp_path / "run", np.ones((1, 5)))
    (tmp_path / "victim.txt").write_text("not jaxppo's\n")
    (run / "curves.png").symlink_to(target)
    before = {p: p.read_bytes() for p in (tmp_path / "victim.txt", run / "config.yaml")}
    assert cli.main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'curves.png'} is a symbolic link (to {target})" in err
    assert "Remove the link" in err and "Nothing was written" in err
    assert (run / "curves.png").is_symlink()
    assert {p: p.read_bytes() for p in before} == before
    plot_runs([run], run / "curves.png")
    assert not (run / "curves.png").is_symlink()
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p: p.read_bytes() for p in before} == before


def test_plot_output_is_never_one_of_the_run_folders_own_files(tmp_path, capsys):
    """-o may name any file but the run folder's own (best/ included), also when reached
    through a link outside the folder; they are left as they were."""
    run = _write_run(tmp_path / "run", np.ones((1, 5)))
    (run / "best").mkdir()
    (run / "best" / "best.json").write_text('{"iteration": 5}')
    (tmp_path / "link.png").symlink_to(run / "config.yaml")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for out, own in ((run / "config.yaml", "config.yaml"), (run / "curve.png", "curve.png"),
                     (run / "best" / "best.png", "best/"), (run / "metrics.jsonl", "metrics.jsonl"),
                     (tmp_path / "link.png", "config.yaml")):
        assert cli.main(["plot", str(run), "-o", str(out)]) == 2, out
        err = capsys.readouterr().err
        assert f"would overwrite {run}'s own {own}" in err and "best/" in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert cli.main(["plot", str(run), "-o", str(run / "mine.png")]) == 0


@pytest.mark.parametrize("seeds", [1, 2])
def test_plot_of_repeated_or_out_of_order_rows_is_an_error(tmp_path, capsys, seeds):
    """Rows of iterations 3-5 written again after 1-5 (a file joined by hand) are named,
    with the line; nothing is drawn."""
    run = _write_run(tmp_path / "run", np.ones((seeds, 5)), num_seeds=seeds)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines + lines[2 * seeds:]) + "\n")
    assert cli.main(["plot", str(run)]) == 2
    seed = " of seed 0" if seeds > 1 else ""
    err = capsys.readouterr().err
    assert (f"metrics.jsonl, line {5 * seeds + 1}: iteration 3{seed} comes after iteration 5 "
            f"(line {4 * seeds + 1})") in err, err
    assert "Keep one row per iteration" in err and "Nothing was drawn" in err
    assert not (run / "curves.png").exists()
    with pytest.raises(ValueError, match="rows are repeated or out of order"):
        plot_runs([run], tmp_path / "out.png")
