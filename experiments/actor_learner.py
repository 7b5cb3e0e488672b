"""The synchronous host loop vs the actor-learner (max_policy_lag 1), side by side.

    .venv/bin/python experiments/actor_learner.py [--rounds 3] [--cases cartpole,halfcheetah]

Each case trains the same config twice per round, once with max_policy_lag 0 (act, then learn,
in one thread) and once with max_policy_lag 1 (actor threads play the next rollout while the
learner learns), each in a fresh process, the two alternating round by round on the same
machine. A run's speed is its env steps per second of training (compiling excluded: the
loop's chunks after the first, log_every=1), and its cores busy the CPU time (user + sys) of
the process over the same wall time; the whole process's wall and CPU time are recorded too.
The ratio is taken round by round (each lag-1 run against the synchronous run just before
it), which a shared machine whose speed drifts keeps steadier than a ratio of medians.
Cases (envs that step in Python, gymnasium 1.x):
  * cartpole: gymnasium:CartPole-v1 with jaxppo's tuned CartPole-v1 config (16 envs x 128
    steps, 8 epochs x 8 minibatches, 64-64), 40 iterations;
  * halfcheetah: gymnasium:HalfCheetah-v5 (MuJoCo), 8 envs x 128 steps, 4 epochs x 4
    minibatches, 64-64, normalised observations, 30 iterations (skipped without mujoco).
The synchronous process then times its two halves apart (a rollout, the update; medians of 5
iterations): the most overlapping them can give is (act + update) / max(act, update).
Writes experiments/results/actor-learner.json with the CPU model, the cores and the load.

    .venv/bin/python experiments/actor_learner.py --learning [--seeds 4]

measures learning per env step instead: envpool:CartPole-v1 with jaxppo's tuned CartPole-v1
config (151,552 steps), seeds 0..N-1, at max_policy_lag 0 and 1 (alternating fresh
processes). Per run: the env steps to the first iteration whose mean episode return is 500
(every episode that ended in it ran the full 500 steps) and to the first whose 10-iteration
mean is >= 475, and the mean return of the last 10 iterations. Writes
experiments/results/actor-learner-learning.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import cpu_model, timed  # experiments/bench.py

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"

CASES = {
    "cartpole": {"tuned": "CartPole-v1", "env": "gymnasium:CartPole-v1", "iterations": 40,
                 "set": {}},
    "halfcheetah": {"tuned": None, "env": "gymnasium:HalfCheetah-v5", "iterations": 30,
                    "set": {"num_envs": 8, "num_steps": 128, "num_epochs": 4,
                            "num_minibatches": 4, "lr": 3e-4, "normalize_observations": True,
                            "network": {"hidden_sizes": [64, 64]}}},
}


# ---------------------------------------------------------------------- the worker
def case_config(case: str, lag: int):
    """The config a case trains at `lag` (one chunk per iteration, no compilation cache)."""
    import jaxppo

    spec = CASES[case]
    base = jaxppo.PPOConfig.tuned(spec["tuned"]) if spec["tuned"] else jaxppo.PPOConfig()
    cfg = jaxppo.PPOConfig.from_dict(spec["set"], base).replace(
        env=spec["env"], max_policy_lag=lag, log_every=1, compilation_cache_dir=None, seed=0)
    return cfg.replace(total_timesteps=spec["iterations"] * cfg.batch_size)


def worker(case: str, lag: int) -> dict:
    """Train one case at `lag` in this process; its speed and cores busy while training."""
    import resource

    import jaxppo

    cfg = case_config(case, lag)
    marks: list[tuple[float, float]] = []  # (wall, CPU seconds) at each chunk's end

    def mark(rows):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        marks.append((time.perf_counter(), usage.ru_utime + usage.ru_stime))

    result = jaxppo.train(cfg, progress=False, callback=mark)
    (w0, c0), (w1, c1) = marks[0], marks[-1]  # the first chunk's end to the last's
    steps = (len(marks) - 1) * cfg.batch_size
    out = {"case": case, "max_policy_lag": lag, "env": cfg.env, "layout": result.layout,
           "env_steps": steps, "train_seconds": w1 - w0, "sps": steps / (w1 - w0),
           "cores_busy_training": (c1 - c0) / (w1 - w0),
           "compile_seconds": result.compile_seconds,
           "return_last": float(result.metrics["episode_return_mean"][0, -1])}
    if lag:
        for key in ("policy_lag", "actor_wait_seconds", "learner_wait_seconds"):
            out[f"{key}_mean"] = float(result.metrics[key][0, 1:].mean())
    else:
        out.update(phases(cfg))
    return out


def phases(cfg, iterations: int = 5) -> dict:
    """The host loop's two halves timed apart (medians over `iterations`): a rollout and the
    update, and the ceiling of the speed-up from overlapping them."""
    import jax

    import jaxppo
    from jaxppo.core.hyperparams import HyperParams
    from jaxppo.run.hostloop import HostLoopRunner

    run = jaxppo.resolve(cfg)
    runner = HostLoopRunner(run, HyperParams.from_config(run.config))
    act, update = [], []
    try:
        for _ in range(iterations):
            s = runner.state
            rng, k_roll = runner._split(s)
            noise = jax.device_get(runner._noise(k_roll, s.env_ids))
            t0 = time.perf_counter()
            traj = runner.rollout.collect(s.params, s.obs_stats, noise, cfg.gamma)
            t1 = time.perf_counter()
            runner.state, _ = runner._update(s.replace(rng=rng), traj, runner.hp, s.env_steps,
                                             s.obs_stats)
            jax.block_until_ready(runner.state.params)
            act.append(t1 - t0)
            update.append(time.perf_counter() - t1)
    finally:
        runner.close()
    a, u = statistics.median(act), statistics.median(update)
    return {"act_seconds": a, "update_seconds": u, "overlap_ceiling": (a + u) / max(a, u)}


def learning_worker(seed: int, lag: int) -> dict:
    """Train envpool:CartPole-v1 (tuned CartPole-v1 config) at `lag`; when it reached 500."""
    import numpy as np

    import jaxppo

    cfg = jaxppo.PPOConfig.tuned("CartPole-v1").replace(
        env="envpool:CartPole-v1", max_policy_lag=lag, seed=seed, compilation_cache_dir=None)
    result = jaxppo.train(cfg, progress=False, plot=False)
    ret = np.asarray(result.metrics["episode_return_mean"][0], np.float64)
    steps = np.asarray(result.metrics["env_steps"][0], np.int64)

    def first(hit):
        idx = np.flatnonzero(hit)
        return int(steps[idx[0]]) if idx.size else None

    rolling = np.array([np.nanmean(ret[max(0, i - 9):i + 1]) if i >= 9 else np.nan
                        for i in range(len(ret))])
    return {"seed": seed, "max_policy_lag": lag, "env_steps": int(steps[-1]),
            "steps_to_500": first(ret >= 500.0), "steps_to_rolling_475": first(rolling >= 475.0),
            "final_return": float(np.nanmean(ret[-10:])), "layout": result.layout}


def learning(seeds: int) -> dict:
    """Steps to 500 at lag 0 and lag 1, seed by seed, alternating fresh processes."""
    runs: dict[str, list] = {"lag0": [], "lag1": []}
    for seed in range(seeds):
        for name, lag in (("lag0", 0), ("lag1", 1)):
            print(f"actor-learner learning: seed {seed}, {name} ...", file=sys.stderr, flush=True)
            done, wall, cpu = timed([sys.executable, __file__, "--learning-worker", str(seed),
                                     str(lag)], cwd=ROOT)
            if done.returncode != 0:
                raise RuntimeError(f"seed {seed} at {name} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append({**row, "process_wall_s": wall, "process_cores_busy": cpu / wall})
    out: dict = {"runs": runs}
    for key in ("steps_to_500", "steps_to_rolling_475"):
        reached = {n: [r[key] for r in rs] for n, rs in runs.items()}
        if all(v is not None for vs in reached.values() for v in vs):
            med = {n: statistics.median(vs) for n, vs in reached.items()}
            out[f"{key}_median"] = med
            out[f"{key}_ratio_lag1_over_lag0"] = med["lag1"] / med["lag0"]
        else:
            out[f"{key}_not_reached"] = {n: sum(v is None for v in vs) for n, vs in reached.items()}
    print(f"actor-learner learning: {json.dumps({k: v for k, v in out.items() if k != 'runs'})}",
          file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------- the driver
def _run(case: str, lag: int) -> dict:
    done, wall, cpu = timed([sys.executable, __file__, "--worker", case, str(lag)], cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{case} at max_policy_lag {lag} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {**row, "process_wall_s": wall, "process_cores_busy": cpu / wall,
            "load_avg_1min_after": os.getloadavg()[0]}


def _available(case: str) -> str | None:
    """Why a case cannot run here, or None."""
    if case == "halfcheetah":
        probe = subprocess.run([sys.executable, "-c", "import gymnasium as g; "
                                "g.make('HalfCheetah-v5').close()"], capture_output=True, text=True)
        if probe.returncode != 0:
            return "gymnasium's HalfCheetah-v5 needs mujoco (pip install 'gymnasium[mujoco]')"
    return None


def side_by_side(rounds: int, cases: list[str]) -> dict:
    """Every case: `rounds` rounds of (synchronous, lag 1), alternating fresh processes."""
    out = {}
    for case in cases:
        why = _available(case)
        if why:
            print(f"actor-learner: {case} skipped: {why}", file=sys.stderr)
            out[case] = {"skipped": why}
            continue
        runs: dict[str, list] = {"sync": [], "lag1": []}
        for r in range(rounds):
            for name, lag in (("sync", 0), ("lag1", 1)):
                print(f"actor-learner: {case} round {r + 1}/{rounds}, {name} ...",
                      file=sys.stderr, flush=True)
                runs[name].append(_run(case, lag))
        paired = [b["sps"] / a["sps"] for a, b in zip(runs["sync"], runs["lag1"])]
        med = {name: {k: statistics.median(x[k] for x in rs)
                      for k in ("sps", "cores_busy_training", "process_cores_busy")}
               for name, rs in runs.items()}
        ceiling = statistics.median(r["overlap_ceiling"] for r in runs["sync"])
        out[case] = {"rounds": runs, "medians": med, "sps_ratio_lag1_over_sync_per_round": paired,
                     "sps_ratio_lag1_over_sync_paired_median": statistics.median(paired),
                     "overlap_ceiling_median": ceiling, "layout_lag1": runs["lag1"][0]["layout"]}
        print(f"actor-learner: {case}: steps/s lag 1 / sync = {statistics.median(paired):.2f} "
              f"(round by round {', '.join(f'{x:.2f}' for x in paired)}); cores busy "
              f"{med['sync']['cores_busy_training']:.2f} -> "
              f"{med['lag1']['cores_busy_training']:.2f}; ceiling from overlap {ceiling:.2f}",
              file=sys.stderr, flush=True)
    return out


def machine() -> dict:
    return {"cpu": cpu_model(), "cpus": os.cpu_count(),
            "cores_allowed": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "python": platform.python_version(), "load_avg_at_start": os.getloadavg()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--learning", action="store_true",
                        help="steps to 500 on envpool:CartPole-v1 at lag 0 and 1 instead")
    parser.add_argument("--seeds", type=int, default=4, help="seeds of --learning")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "LAG"), help=argparse.SUPPRESS)
    parser.add_argument("--learning-worker", nargs=2, type=int, metavar=("SEED", "LAG"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return 0
    if args.learning_worker:
        print(json.dumps(learning_worker(*args.learning_worker)))
        return 0
    if args.learning:
        out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
               "learning": learning(args.seeds)}
        path = RESULTS / "actor-learner-learning.json"
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
           "cases": side_by_side(args.rounds, cases)}
    out["machine"]["load_avg_at_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "actor-learner.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
