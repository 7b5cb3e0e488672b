"""summary.json and the last line of `jaxppo train`: steps per seed and in all, this call's
speed apart from a resumed run's totals, and strict JSON when no episode ended (no compile:
the results are made by hand)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from jaxppo.config import NetworkConfig, PPOConfig
from jaxppo.run.command import report
from jaxppo.run.folder import strict_json, summary


def _result(num_seeds: int, returns, iterations: int, resumed_from=None, seconds=41.5):
    """A TrainResult's fields that summary() and report() read."""
    cfg = PPOConfig(env="CartPole-v1", num_envs=4, num_steps=32, num_seeds=num_seeds,
                    total_timesteps=4 * 32 * iterations, network=NetworkConfig((16, 16)))
    r = np.asarray(returns, np.float64).reshape(num_seeds, -1)
    return SimpleNamespace(config=cfg, metrics={"episode_return_mean": r if num_seeds > 1 else r[0]},
                           iterations_done=iterations, resumed_from=resumed_from, completed=True,
                           hosts=1, num_devices=1, host_failures=[], compile_seconds=3.0,
                           train_seconds=seconds, run_dir="runs/x")


def _done_line(result, capsys) -> str:
    result.summary = summary(result)
    assert report(result, resume_command="jaxppo train --resume runs/x") == 0
    (line,) = capsys.readouterr().err.splitlines()
    return line


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_population_states_steps_per_seed_and_in_all(capsys):
    res = _result(16, np.full((16, 12), 20.0), iterations=12)
    s = summary(res)
    per_seed = 12 * 128
    assert s["env_steps"] == per_seed and s["env_steps_all_seeds"] == 16 * per_seed
    assert s["env_steps_this_call"] == 16 * per_seed and s["resumed_from"] is None
    assert s["sps"] == pytest.approx(16 * per_seed / 41.5)
    line = _done_line(res, capsys)
    assert (f"16 seeds × {per_seed:,} env steps = {16 * per_seed:,} in 41.5s "
            f"({16 * per_seed / 41.5:,.0f} steps/s in all) + 3.0s compile") in line, line
    assert "final return 20.0 ± 0.0 (last 10 iterations, 16 seeds)" in line

    one = _done_line(_result(1, np.full(12, 20.0), iterations=12), capsys)
    assert f"{per_seed:,} env steps in 41.5s ({per_seed / 41.5:,.0f} steps/s) + 3.0s" in one
    # One seed: its return, no spread over seeds
    assert "final return 20.0 (last 10 iterations);" in one and "±" not in one, one


def test_a_resumed_run_gives_this_calls_steps_and_speed_and_the_runs_totals(capsys):
    res = _result(4, np.full((4, 73), 30.0), iterations=73, resumed_from=50, seconds=12.0)
    s = summary(res)
    assert s["env_steps"] == 73 * 128 and s["env_steps_all_seeds"] == 4 * 73 * 128
    assert s["env_steps_this_call"] == 4 * 23 * 128 and s["resumed_from"] == 50
    assert s["sps"] == pytest.approx(4 * 23 * 128 / 12.0)
    line = _done_line(res, capsys)
    assert (f"this call: iterations 51-73, 4 seeds × {23 * 128:,} env steps = {4 * 23 * 128:,} "
            f"in 12.0s ({4 * 23 * 128 / 12.0:,.0f} steps/s in all) + 3.0s compile; the run: "
            f"4 seeds × {73 * 128:,} env steps = {4 * 73 * 128:,} in 73 iterations; run folder "
            "runs/x") in line, line


def test_no_episode_ended_is_null_in_strict_json_and_n_a_in_the_line(capsys):
    res = _result(2, np.full((2, 12), np.nan), iterations=12)
    s = summary(res)
    assert math.isnan(s["final_return_mean"])  # in memory a float, as before
    written = _strict(strict_json(s))
    assert written["final_return_mean"] is None and written["final_return_std"] is None
    assert written["final_return_per_seed"] == [None, None]
    assert written["env_steps"] == 12 * 128  # the rest as it was
    line = _done_line(res, capsys)
    assert "final return n/a (no episode ended in the last 10 iterations)" in line, line
    assert "nan" not in line


def test_seeds_without_an_ended_episode_are_left_out_of_the_mean(capsys):
    returns = np.stack([np.full(12, 10.0), np.full(12, np.nan), np.full(12, 30.0)])
    s = summary(_result(3, returns, iterations=12))
    assert s["final_return_mean"] == pytest.approx(20.0)
    assert s["final_return_std"] == pytest.approx(10.0)
    assert _strict(strict_json(s))["final_return_per_seed"] == [10.0, None, 30.0]
    line = _done_line(_result(3, returns, iterations=12), capsys)
    assert "final return 20.0 ± 10.0 (last 10 iterations, 2 of 3 seeds; no episode ended" in line
    alone = np.stack([np.full(12, 10.0), np.full(12, np.nan)])
    line = _done_line(_result(2, alone, iterations=12), capsys)
    assert "final return 10.0 (last 10 iterations, 1 of 2 seeds; no episode ended" in line, line


def test_strict_json_writes_numpy_numbers_and_infinities():
    text = strict_json({"a": np.float32(1.5), "b": [np.inf, -np.inf], "c": np.int64(3),
                        "d": np.array([1.0, np.nan]), "e": (np.bool_(True), "x")})
    assert _strict(text) == {"a": 1.5, "b": [None, None], "c": 3, "d": [1.0, None],
                             "e": [True, "x"]}
