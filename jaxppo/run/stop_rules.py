"""The config's stop rules (`stop_at_return`, `stop_after_no_improvement`), decided after each
chunk, and the best evaluation so far, which a run folder's best/ keeps (`StopRules`)."""

from __future__ import annotations

import math

import numpy as np

from jaxppo.config import PPOConfig


class StopRules:
    """The config's stop rules, decided after each chunk on the mean over seeds (members),
    and the best evaluation so far (what best/ keeps): stop_at_return on the latest eval
    return (with eval_every) or the training return (each seed's latest finite
    episode_return_mean; every seed must have one), and stop_after_no_improvement on the
    evaluations since the best one. A resumed run counts its earlier evaluations too."""

    def __init__(self, config: PPOConfig, previous_rows: list[dict]):
        self.config = config
        self.best, self.best_iter, self.best_per_seed = -math.inf, None, []
        self.since = 0  # evaluations since the best one
        self.improved = False
        self._evaluations(previous_rows)

    def _evaluations(self, rows: list[dict]) -> tuple[int, float] | None:
        """Count the evaluations in `rows`; the latest as (iteration, mean over seeds)."""
        by_it: dict[int, list[float]] = {}
        for r in rows:
            v = r.get("eval_return_mean")
            if v is not None and math.isfinite(v):
                by_it.setdefault(r["iteration"], []).append(v)
        latest = None
        for it in sorted(by_it):
            mean = float(np.mean(by_it[it]))
            if mean > self.best:
                self.best, self.best_iter, self.best_per_seed = mean, it, by_it[it]
                self.since, self.improved = 0, True
            else:
                self.since += 1
            latest = (it, mean)
        return latest

    def after_chunk(self, rows: list[dict]) -> str | None:
        """Why the run stops after this chunk's `rows`, or None."""
        cfg = self.config
        self.improved = False
        latest = self._evaluations(rows)
        seeds = f" (mean over {cfg.num_seeds} seeds)" if cfg.num_seeds > 1 else ""
        it = rows[-1]["iteration"]
        if cfg.stop_at_return is not None:
            if cfg.eval_every:
                value, what = (latest[1], "eval") if latest else (None, "eval")
            else:
                value, what = self._training_return(rows), "training"
            if value is not None and value >= cfg.stop_at_return:
                return (f"the {what} return {value:.1f}{seeds} reached "
                        f"stop_at_return={cfg.stop_at_return:g} at iteration {it}")
        n = cfg.stop_after_no_improvement
        if n and latest is not None and self.since >= n:
            return (f"no better eval return{seeds} in {n} evaluations (the best, "
                    f"{self.best:.1f}, was at iteration {self.best_iter})")
        return None

    def _training_return(self, rows: list[dict]) -> float | None:
        last: dict[int, float] = {}
        for r in rows:
            v = r.get("episode_return_mean")
            if v is not None and math.isfinite(v):
                last[r.get("seed", 0)] = v
        return float(np.mean(list(last.values()))) if len(last) == self.config.num_seeds else None

    def best_record(self) -> dict:
        """best/best.json's content: the best evaluation's iteration and returns."""
        return {"iteration": self.best_iter,
                "env_steps": self.best_iter * self.config.batch_size,
                "eval_return_mean": self.best,
                "eval_return_per_seed": [float(v) for v in self.best_per_seed]}
