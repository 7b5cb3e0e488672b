"""Progress between a run's chunks (`Reporter`): a rich bar on a terminal, a plain line per
chunk otherwise, with the recent return, steps/s, the ETA and the last evaluation; and the
note while the program compiles (`compiling`)."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time

import numpy as np

from jaxppo import cpu_devices
from jaxppo.config import PPOConfig


class Reporter:
    """Progress between chunks: a rich bar on a terminal, a plain line otherwise; both show
    the recent return, steps/s, the ETA and the last evaluation. The return is the mean over
    seeds; for a sweep (member_labels) the best and the worst setting instead, each the mean
    of the members with that label, e.g. "best lr=0.001: 480.2, worst lr=0.0001: 21.0".
    A multi-agent env's (`team`) is the team return, the sum over its agents; one that reports
    wins (`wins`, SMAX) shows its recent win rate beside it, and one with an episode value to
    show (`value`, e.g. "dishes" for Overcooked) that value's recent mean (`<value>_mean`)."""

    def __init__(self, config: PPOConfig, n_iter: int, progress: bool | None, start: int = 0,
                 label: str | None = None, member_labels: list[str] | None = None,
                 team: bool = False, wins: bool = False, value: str | None = None):
        self.n_iter = n_iter
        self.start = start
        self.config = config
        self.label = label or config.env_name
        self.member_labels = member_labels
        self.return_word = "team return" if team else "return"
        self.member_return: dict[int, float] = {}  # seed index -> recent return
        self.interactive = sys.stderr.isatty() if progress is None else progress
        self.quiet = progress is False
        self.last_return = float("nan")
        # (label, metrics key, format) of the figures shown beside the return.
        self.shown = ([("win rate", "win_rate", ".2f")] if wins else []) + (
            [(value.replace("_", " "), f"{value}_mean", ".1f")] if value else [])
        self.last_shown = {key: float("nan") for _, key, _ in self.shown}
        self.last_eval = "-"
        self.t0 = time.perf_counter()
        self.bar = None
        if self.interactive and not self.quiet:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            columns = [
                TextColumn(f"[bold]{self.label}[/]"), BarColumn(bar_width=16),
                MofNCompleteColumn(), TextColumn(self.return_word + " {task.fields[ret]}"),
                TextColumn("{task.fields[sps]} steps/s"),
            ]
            for i, (name, _, _) in enumerate(self.shown):
                columns.insert(4 + i, TextColumn(f"{name} {{task.fields[shown{i}]}}"))
            if config.eval_every:
                columns.append(TextColumn("eval {task.fields[eval]}"))
            if config.max_policy_lag:
                columns.append(TextColumn("{task.fields[actors]}"))
            columns += [TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
            self.bar = Progress(*columns)
            self.task = self.bar.add_task("train", total=n_iter, completed=start, ret="   -  ",
                                          sps="-", eval="-", actors="",
                                          **self._shown_fields())
            self.bar.start()

    def show_layout(self, text: str, devices_used: int) -> None:
        """Where the run trains (`jaxppo.run.loop.layout_text`), before the first chunk, and
        whether its CPU devices are jaxppo's per-core ones (`cpu_devices.layout_note`)."""
        if not self.quiet:
            note = cpu_devices.layout_note(devices_used)
            print(f"layout: {text}{note}", file=sys.stderr, flush=True)

    def _by_setting(self, per_seed: dict[int, float]) -> list[tuple[float, str]]:
        """(value, label) per distinct member label, best first; members that share a label
        (seeds of one setting) are averaged."""
        groups: dict[str, list[float]] = {}
        for s, v in per_seed.items():
            groups.setdefault(self.member_labels[s], []).append(v)
        return sorted(((float(np.mean(v)), k) for k, v in groups.items()), reverse=True)

    def return_text(self) -> str:
        """The return the progress shows: the mean over seeds, or a sweep's best and worst."""
        if not self.member_labels:  # "-" until an episode has ended
            return f"{self.last_return:.1f}" if math.isfinite(self.last_return) else "-"
        ranked = self._by_setting(self.member_return)
        if not ranked:
            return "-"
        (best, best_lab), (worst, worst_lab) = ranked[0], ranked[-1]
        if len(ranked) == 1:
            return f"{best_lab}: {best:.1f}"
        return f"best {best_lab}: {best:.1f}, worst {worst_lab}: {worst:.1f}"

    def _shown_fields(self) -> dict[str, str]:
        """The recent value of each figure shown beside the return (the mean over seeds of the
        last rows'), "-" until an episode has ended: the bar's fields shown0, shown1, ..."""
        out = {}
        for i, (_, key, fmt) in enumerate(self.shown):
            v = self.last_shown[key]
            out[f"shown{i}"] = format(v, fmt) if math.isfinite(v) else "-"
        return out

    def update(self, done_iters: int, rows: list[dict], sps: float):
        rets = [r["episode_return_mean"] for r in rows if math.isfinite(r["episode_return_mean"])]
        if rets:
            self.last_return = float(np.mean(rets[-max(1, self.config.num_seeds) * 10:]))
        for key in self.last_shown:
            vals = [r[key] for r in rows if math.isfinite(r.get(key, float("nan")))]
            if vals:
                self.last_shown[key] = float(np.mean(vals[-max(1, self.config.num_seeds) * 10:]))
        if self.member_labels:
            for s in range(len(self.member_labels)):
                own = [r["episode_return_mean"] for r in rows if r.get("seed", 0) == s
                       and math.isfinite(r["episode_return_mean"])]
                if own:
                    self.member_return[s] = float(np.mean(own[-10:]))
        evals = [r for r in rows if math.isfinite(r.get("eval_return_mean", float("nan")))]
        if evals:
            last = evals[-1]["iteration"]
            at_last = [r for r in evals if r["iteration"] == last]
            if self.member_labels:
                value, lab = self._by_setting(
                    {r.get("seed", 0): r["eval_return_mean"] for r in at_last})[0]
                self.last_eval = f"best {lab}: {value:.1f}@{last}"
            else:
                self.last_eval = f"{np.mean([r['eval_return_mean'] for r in at_last]):.1f}@{last}"
        actors = actor_learner_text(rows)
        if self.bar is not None:
            self.bar.update(self.task, completed=done_iters, ret=self.return_text(),
                            sps=f"{sps:,.0f}", eval=self.last_eval, actors=actors,
                            **self._shown_fields())
        elif not self.quiet:
            steps = done_iters * self.config.batch_size
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done_iters - self.start, 1) * (self.n_iter - done_iters)
            ev = f"  eval {self.last_eval}" if self.config.eval_every else ""
            fields = self._shown_fields()
            win = "".join(f"  {name} {fields[f'shown{i}']}"
                          for i, (name, _, _) in enumerate(self.shown))
            print(f"[{self.label}] iter {done_iters}/{self.n_iter}  "
                  f"steps {steps:,}  {self.return_word} {self.return_text()}{win}{ev}  "
                  f"{sps:,.0f} steps/s  "
                  f"{actors + '  ' if actors else ''}ETA {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def actor_learner_text(rows: list[dict]) -> str:
    """An actor-learner chunk's mean policy lag and waits per update, e.g. "lag 1.0, wait:
    actors 0.00 s, learner 0.12 s" (a learner that waits long: the actors are the bottleneck;
    actors that wait long: the learner is); "" for other runs."""
    if not rows or "policy_lag" not in rows[0]:
        return ""
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    return (f"lag {mean('policy_lag'):.1f}, wait: actors {mean('actor_wait_seconds'):.2f} s, "
            f"learner {mean('learner_wait_seconds'):.2f} s")


@contextlib.contextmanager
def compiling(progress: bool | None, what: str = "the training program"):
    """Say that `what` compiles, once every check has passed: on a terminal one line that counts
    the seconds, otherwise a line at the start; then how long it took. Nothing when progress is
    False. Compiling takes from a second to a minute (a CNN, a GRU, many seeds with evaluation
    on 2 cores), and the persistent cache makes a rerun of the same program quick."""
    if progress is False:
        yield
        return
    live, t0, done = sys.stderr.isatty(), time.perf_counter(), threading.Event()

    def tick():
        while not done.wait(1.0):
            print(f"\rcompiling {what} ... {time.perf_counter() - t0:.0f} s", end="",
                  file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, name="jaxppo-compiling", daemon=True)
    print(f"compiling {what} ...", end="" if live else "\n", file=sys.stderr, flush=True)
    if live:
        ticker.start()
    try:
        yield
    except BaseException:  # the error's own message follows on a line of its own
        done.set()
        if live:
            print(file=sys.stderr, flush=True)
        raise
    done.set()
    if live:
        ticker.join()
    start = "\r" if live else ""
    print(f"{start}compiling {what} ... done in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
