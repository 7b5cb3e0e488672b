"""MAPPO (a centralised critic on the world state) against IPPO (each agent's critic on its
own observation) on `jaxmarl:MPE_simple_spread_v3`, at the tuned config's settings and a
short budget: a learning check of `critic_input`, not a tuned comparison.

    python experiments/mappo_mpe.py [--steps 1e6] [--seeds 2] [--critic-inputs local world_state]

Each variant is one compiled `make_train` program run seed after seed (the same keys for
every variant), the variants alternating in one process. Writes
experiments/results/mappo-mpe.json: the CPU model, the settings, and per variant the final
team return (per seed the mean over the last 10 iterations of the mean team return of the
episodes that ended in each), the first 10 iterations' likewise, env steps/s and the cores
busy (jaxmarl_bench's `timed`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench import cpu_model  # experiments/bench.py: the machine's CPU model
from jaxmarl_bench import SEED, final_returns, timed

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "experiments" / "results" / "mappo-mpe.json"
ENV = "jaxmarl:MPE_simple_spread_v3"


def run(critic_input: str, steps: float, seeds: int) -> dict:
    import jax

    import jaxppo
    from jaxppo.run.train import make_train

    config = jaxppo.PPOConfig.tuned(ENV, total_timesteps=int(steps), num_seeds=1,
                                    critic_input=critic_input)
    keys = jax.random.split(jax.random.PRNGKey(SEED), seeds)
    (_, metrics), t = timed(make_train(config), keys)
    env_steps = int(metrics["env_steps"][0, -1]) * seeds
    return {"critic_input": critic_input, **t, **final_returns(metrics["episode_return_mean"]),
            "env_steps": env_steps, "steps_per_s": env_steps / t["train_s"],
            "iterations": int(metrics["env_steps"].shape[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=float, default=1e6, help="env steps per seed")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--critic-inputs", nargs="+", default=["local", "world_state"])
    args = ap.parse_args()
    runs = []
    for ci in args.critic_inputs:
        runs.append(run(ci, args.steps, args.seeds))
        print(json.dumps(runs[-1]), flush=True)
    out = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_at_end": os.getloadavg(),
           "env": ENV, "steps_per_seed": args.steps, "seeds": args.seeds, "key": SEED,
           "config": "jaxppo/configs/MPE_simple_spread_v3.yaml", "runs": runs}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
