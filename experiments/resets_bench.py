"""Env steps/s of this tree against another tree of jaxppo (e.g. a git worktree of the commit
before a change), in alternating fresh processes on this machine, for envs given by name:

    python experiments/resets_bench.py --baseline-tree DIR [--rounds 2]
        [--run ENV,SEEDS,ITERATIONS[,DEVICES] ...]

Each run trains the env's tuned config (or the defaults; Craftax with 64 envs x 64 steps and
8 minibatches) for ITERATIONS iterations with SEEDS seeds (DEVICES: the CPU
devices, JAXPPO_CPU_DEVICES; default one per core) and reports the median of its chunks'
env steps/s (compiling excluded) and the cores busy (user+sys CPU over the process's wall
time). Written to experiments/results/resets-bench.json with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from atari_bench import _timed  # a fresh process timed: (result, wall s, cores busy)
from bench import cpu_model  # experiments/bench.py: the machine's CPU model

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "experiments" / "results" / "resets-bench.json"
DEFAULT_RUNS = ("craftax:Craftax-Classic-Symbolic-v1,1,4,1", "jaxmarl:MPE_simple_spread_v3,1,300,1")
CRAFTAX = dict(num_envs=64, num_steps=64, num_minibatches=8)


def child(env: str, seeds: int, iterations: int) -> None:
    """One run in this process: prints its record as one JSON line."""
    import numpy as np

    import jaxppo
    from jaxppo import PPOConfig

    path = jaxppo.config.tuned_config_path(env)
    cfg = PPOConfig.from_file(path) if path else PPOConfig(env=env)
    if env.startswith("craftax:"):
        cfg = cfg.replace(**CRAFTAX)
    cfg = cfg.replace(env=env, num_seeds=seeds, compilation_cache_dir=None,
                      total_timesteps=cfg.num_envs * cfg.num_steps * iterations)
    r = jaxppo.train(cfg, progress=False)
    print(json.dumps({"steps_per_s": float(np.median(np.asarray(r.metrics["sps"]).ravel())),
                      "layout": r.layout, "jaxppo": str(Path(jaxppo.__file__).parent.parent)}))


def one_run(tree: Path, run: str) -> dict:
    env_name, seeds, iterations, *devices = run.split(",")
    env = dict(os.environ, PYTHONPATH=str(tree))
    if devices:
        env["JAXPPO_CPU_DEVICES"] = devices[0]
    out, wall, busy = _timed([sys.executable, __file__, "--child", env_name, seeds, iterations],
                             str(tree), timeout=3600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{run} in {tree} failed:\n{out.stderr[-3000:]}")
    return {"tree": str(tree), "run": run, "process_wall_s": wall, "cores_busy": busy,
            **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-tree", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--run", nargs="+", default=list(DEFAULT_RUNS),
                   help="ENV,SEEDS,ITERATIONS[,DEVICES] (default: %(default)s)")
    args = p.parse_args()
    records = []
    for run in args.run:
        for r in range(args.rounds):
            for tree in (REPO, args.baseline_tree.resolve()):
                records.append({"round": r, "load_before": os.getloadavg()[0],
                                **one_run(tree, run)})
                print(json.dumps(records[-1]), flush=True)
    OUT.write_text(json.dumps({"cpu": cpu_model(), "this_tree": str(REPO),
                               "baseline_tree": str(args.baseline_tree), "runs": records},
                              indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
