"""jaxppo's MAPPO with GRUs (an actor GRU on each agent's observation, a critic GRU of its own
on the world state with the agent's id) on `jaxmarl:smax:2s3z` side by side with JaxMARL's own
`MAPPO/mappo_rnn_smax.py` at `config/mappo_homogenous_rnn_smax.yaml`, at a shortened budget:
a learning check, not a tuned comparison.

    python experiments/mappo_smax.py --anchors DIR --jaxmarl-python PY [--steps 1e6]
        [--seeds 2] [--first-seed 0] [--sides jaxmarl jaxppo] [--together]
        [--set KEY=VALUE ...]

DIR holds JaxMARL's baseline scripts (MAPPO/mappo_rnn_smax.py, MAPPO/config/...); PY is a
Python whose environment has what they import. Each side is a fresh process, run seed after
seed over the same keys, compiled ahead of time (jaxmarl_bench's `timed`); the sides run one
after the other in the order given (`--together`: both at once, a comparison of learning
only), and each run's result replaces that side's entry in
experiments/results/mappo-smax.json (so the sides may run in separate sittings): the CPU
model, the load, the settings, and per side and seed the mean over the last 10 iterations of
the mean return and win rate of the episodes that ended in each iteration (JaxMARL's own
logged `returns` and `win_rate`; jaxppo's `episode_return_mean/ally_0` and `win_rate`).

jaxppo's side is jaxppo/configs/smax_2s3z.yaml (the yaml's settings) with total_timesteps as
given, and `--set`'s config fields on top (as `jaxppo train --set`; the run's record names
them, and replaces only a record with the same ones). What differs at the same settings: jaxppo
standardises advantages over the iteration's batch (JaxMARL per minibatch), optimises actor and
critic with one Adam on the summed loss with each network's gradient clipped by its own norm
(JaxMARL: one Adam each, each with its own clip: the same step, Adam being elementwise), and
zeroes the GRU carries at an episode's end only (JaxMARL also a dead agent's at every step). A
time-out is terminal on both sides (the yaml's bootstrap_truncation: false).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench import cpu_model  # experiments/bench.py: the machine's CPU model
from jaxmarl_bench import (SEED, finish_run, run_one_side, run_smax_baseline, seed_keys,
                           smax_results, start_run, timed)

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "experiments" / "results" / "mappo-smax.json"
CONFIG = REPO / "jaxppo" / "configs" / "smax_2s3z.yaml"


def run_jaxppo(steps: float, seeds: int, first_seed: int = 0, settings=None) -> dict:
    import jaxppo
    from jaxppo.run.train import make_train

    config = jaxppo.PPOConfig.from_file(str(CONFIG)).with_overrides(settings or []).replace(
        total_timesteps=int(steps), num_seeds=1)
    (_, m), t = timed(make_train(config), seed_keys(seeds, first_seed))
    return smax_results(m["episode_return_mean/ally_0"], m["win_rate"], config.batch_size,
                        seeds, t)


def run_jaxmarl(steps: float, seeds: int, anchors: Path, first_seed: int = 0) -> dict:
    """JaxMARL's script as it is, its per-iteration wandb.log (through its io_callback)
    recorded instead of sent."""
    import yaml

    sys.path.insert(0, str(anchors / "MAPPO"))
    import mappo_rnn_smax

    config = yaml.safe_load(
        (anchors / "MAPPO" / "config" / "mappo_homogenous_rnn_smax.yaml").read_text())
    config.update(TOTAL_TIMESTEPS=float(steps))
    return run_smax_baseline(mappo_rnn_smax, config, seeds, first_seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=float, default=1e6, help="env steps per seed")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=0,
                   help="run seeds FIRST .. FIRST + SEEDS - 1 (their keys as in a run from 0)")
    p.add_argument("--anchors", type=Path, required=True)
    p.add_argument("--jaxmarl-python", default=None)
    p.add_argument("--sides", nargs="+", choices=("jaxppo", "jaxmarl"),
                   default=["jaxppo", "jaxmarl"])
    p.add_argument("--side", choices=("jaxppo", "jaxmarl"), default=None)
    p.add_argument("--together", action="store_true",
                   help="both sides at once: a learning comparison (the steps/s are not one)")
    p.add_argument("--set", nargs="+", default=None, metavar="KEY=VALUE",
                   help="config fields on jaxppo's side, over the yaml's (values as YAML)")
    args = p.parse_args()
    if run_one_side(args, lambda: run_jaxppo(args.steps, args.seeds, args.first_seed,
                                             args.set),
                    lambda: run_jaxmarl(args.steps, args.seeds, args.anchors, args.first_seed)):
        return
    started = {side: start_run(side, args, __file__) for side in args.sides} if args.together \
        else {}
    for side in args.sides:
        run = {**finish_run(side, started.get(side) or start_run(side, args, __file__)),
               "load_after": os.getloadavg()[0], "steps_per_seed": args.steps,
               "seeds": args.seeds, "first_seed": args.first_seed, "cpu": cpu_model(),
               "date": time.strftime("%Y-%m-%d"),
               "cores": os.cpu_count(),
               **({"set": args.set} if side == "jaxppo" and args.set else {}),
               **({"together": True, "placement": (
                   "both sides at once, each a fresh process on the 2 shared cores: a "
                   "comparison of learning; the env steps/s are not a speed comparison")}
                  if args.together else {})}
        print(json.dumps(run), flush=True)
        # read late: the other side may have run meanwhile
        out = json.loads(OUT.read_text()) if OUT.exists() else {"runs": []}
        out["runs"] = [r for r in out["runs"]
                       if (r["side"], r.get("first_seed", 0), r.get("set"))
                       != (run["side"], args.first_seed, run.get("set"))] + [run]
        out.update(env="jaxmarl:smax:2s3z", key=SEED, settings=(
            "JaxMARL's mappo_homogenous_rnn_smax.yaml; jaxppo/configs/smax_2s3z.yaml; "
            "total_timesteps as given"), shared_machine=(
            "2 cores shared with other work: the load before and after each run is recorded; "
            "timings are noisy, the learning figures are not"))
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
