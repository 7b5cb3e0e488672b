"""The host loop's learner on 1 device vs split over 2 (num_devices 1 vs 2), side by side.

    .venv/bin/python experiments/host_devices.py [--rounds 3] [--iterations 20]

gymnasium:CartPole-v1 with jaxppo's tuned CartPole-v1 config (16 envs x 128 steps, 8 epochs x
8 minibatches, 64-64), max_policy_lag 0, trained once per round on each device count, each in
a fresh process (on a CPU, jaxppo's one device per core), the two alternating round by round.
A run's speed is its env steps per second of training (compiling excluded: the loop's chunks
after the first, log_every=1) and its cores busy the process's CPU time over the same wall
time. After training, the worker times the update alone on the last rollout (median of 5,
`update_seconds`). Ratios are taken round by round. Writes
experiments/results/host-devices.json with the CPU model, the cores and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from actor_learner import machine  # experiments/actor_learner.py
from bench import timed  # experiments/bench.py

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def worker(devices: int, iterations: int) -> dict:
    """Train at `devices` in this process; its speed, cores busy and the update's time."""
    import jax

    import jaxppo
    from jaxppo.core.hyperparams import HyperParams
    from jaxppo.run.hostloop import HostLoopRunner

    cfg = jaxppo.PPOConfig.tuned("CartPole-v1").replace(
        env="gymnasium:CartPole-v1", num_devices=devices, log_every=1, seed=0,
        compilation_cache_dir=None)
    cfg = cfg.replace(total_timesteps=iterations * cfg.batch_size)
    marks: list[tuple[float, float]] = []

    def mark(rows):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        marks.append((time.perf_counter(), usage.ru_utime + usage.ru_stime))

    result = jaxppo.train(cfg, progress=False, callback=mark)
    (w0, c0), (w1, c1) = marks[0], marks[-1]
    steps = (len(marks) - 1) * cfg.batch_size
    run = jaxppo.resolve(cfg, "local")
    runner = HostLoopRunner(run, HyperParams.from_config(run.config))
    try:
        _, traj = runner.iterate()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(runner.learner.update(runner.state, traj))
            times.append(time.perf_counter() - t0)
    finally:
        runner.close()
    return {"num_devices": devices, "layout": result.layout, "env_steps": steps,
            "train_seconds": w1 - w0, "sps": steps / (w1 - w0),
            "cores_busy_training": (c1 - c0) / (w1 - w0),
            "update_seconds": statistics.median(times),
            "return_last": float(result.metrics["episode_return_mean"][0, -1])}


def side_by_side(rounds: int, iterations: int) -> dict:
    runs: dict[int, list] = {1: [], 2: []}
    for r in range(rounds):
        for devices in (1, 2):
            print(f"host-devices: round {r + 1}/{rounds}, {devices} device(s) ...",
                  file=sys.stderr, flush=True)
            done, wall, cpu = timed([sys.executable, __file__, "--worker", str(devices),
                                     str(iterations)], cwd=ROOT)
            if done.returncode != 0:
                raise RuntimeError(f"num_devices {devices} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            runs[devices].append({**row, "process_wall_s": wall, "process_cores_busy": cpu / wall,
                                  "load_avg_1min_after": os.getloadavg()[0]})
    paired = [b["sps"] / a["sps"] for a, b in zip(runs[1], runs[2])]
    update = [b["update_seconds"] / a["update_seconds"] for a, b in zip(runs[1], runs[2])]
    out = {"rounds": runs, "sps_ratio_2_over_1_per_round": paired,
           "sps_ratio_2_over_1_median": statistics.median(paired),
           "update_time_ratio_2_over_1_per_round": update,
           "medians": {d: {k: statistics.median(x[k] for x in rs) for k in
                           ("sps", "cores_busy_training", "update_seconds")}
                       for d, rs in runs.items()}}
    print(f"host-devices: steps/s 2 / 1 devices = {out['sps_ratio_2_over_1_median']:.2f} "
          f"(round by round {', '.join(f'{x:.2f}' for x in paired)}); update time 2 / 1 = "
          f"{', '.join(f'{x:.2f}' for x in update)}", file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    started = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine()}
    result = side_by_side(args.rounds, args.iterations)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "host-devices.json"
    path.write_text(json.dumps({**started, "load_avg_at_end": os.getloadavg(), "result": result},
                               indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
