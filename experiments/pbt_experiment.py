"""Population-based training against the tuned config, at the same per-member budget.

    .venv/bin/python experiments/pbt_experiment.py                      # Pendulum-v1, Acrobot-v1
    .venv/bin/python experiments/pbt_experiment.py --env Acrobot-v1 --repeats 2
    .venv/bin/python experiments/pbt_experiment.py --env Breakout-MinAtar --max-steps 2e6

For each env, `--repeats` pairs (default 4) of fresh processes, alternating:
  * tuned: `jaxppo train --config <tuned> --seeds 16` (16 seeds of the tuned config, one
    vmapped program), seed 1000 r;
  * PBT: `jaxppo search --config <tuned>` with a population of 16 drawn around the tuned
    values (SEARCH below) and `pbt: {interval: INTERVAL}`, seed r.
Both end with the evaluation of the README results table (164 episodes per member, sampled
actions). Reported per env: the tuned config's eval return over all its seeds; each PBT run's
population mean, the eval of the member that ranks first by training return (what PBT would
hand you without an extra evaluation) and the best member's; and the wall time of each PBT
process against the tuned process before it (the cost of 16 different settings and the
exploit/explore steps, over 16 seeds of one setting). Results: experiments/results/pbt.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_experiments import CONFIGS, EVAL_EPISODES, RESULTS, ROOT, machine  # noqa: E402

RUNS = ROOT / "experiments" / "runs" / "pbt"
POPULATION = 16
# Distributions around each tuned config's values (lr over x/4 .. x*4).
SEARCH = {
    "Pendulum-v1": {"lr": {"loguniform": [2.5e-4, 4e-3]}, "clip_param": {"uniform": [0.1, 0.3]},
                    "gae_lambda": {"uniform": [0.9, 0.99]}},
    "Acrobot-v1": {"lr": {"loguniform": [7.5e-4, 1.2e-2]},
                   "entropy_coeff": {"loguniform": [1e-3, 3e-2]},
                   "clip_param": {"uniform": [0.1, 0.3]}, "gae_lambda": {"uniform": [0.9, 0.99]}},
    "Breakout-MinAtar": {"lr": {"loguniform": [1.25e-4, 2e-3]},
                         "entropy_coeff": {"loguniform": [3e-3, 3e-2]},
                         "clip_param": {"uniform": [0.1, 0.3]}},
}
INTERVAL = 20  # iterations between exploit/explore steps (about 12 over each run here)


def _run(cmd: list[str], run_dir: Path) -> tuple[float, dict]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return wall, json.loads((run_dir / "summary.json").read_text())


def _constant_lr(values: dict, total: int) -> list[str]:
    """A search scales a number, not a points schedule: a tuned lr given as points that is
    constant over the (capped) budget becomes that constant, the same for both runs."""
    lr = values.get("lr")
    if not isinstance(lr, list):
        return []
    upto = [(step, v) for step, v in lr if step <= total]
    after = [v for step, v in lr if step > total][:1] if upto[-1][0] < total else []
    held = [v for _, v in upto] + after  # the values the lr takes (or moves toward) in budget
    if len(set(held)) != 1:
        raise SystemExit(f"the tuned lr {lr} changes within {total} steps: searching it needs "
                         "a constant or linear lr; cap the budget with --max-steps")
    return [f"lr={held[0]}", "lr_schedule=constant"]


def run_env(env: str, repeats: int, max_steps: float | None) -> dict:
    config = CONFIGS / f"{env}.yaml"
    values = yaml.safe_load(config.read_text())
    total = int(values["total_timesteps"])
    if max_steps is not None:
        total = min(total, int(max_steps))
    common = ["--config", str(config), "--runs-dir", str(RUNS), "--no-progress", "--no-plot",
              "--set", f"eval_every={10**9}", f"eval_episodes={EVAL_EPISODES}",
              "eval_deterministic=false", f"total_timesteps={total}", *_constant_lr(values, total)]
    search = {"population": POPULATION, **SEARCH[env]}
    tuned, pbt = [], []
    for r in range(repeats):
        name = f"{env}-tuned-{r}"
        wall, s = _run([sys.executable, "-m", "jaxppo", "train", "--run-name", name, *common,
                        f"seed={1000 * r}", f"num_seeds={POPULATION}"], RUNS / name)
        tuned.append({"seed": 1000 * r, "wall_seconds": wall, "compile_seconds": s["compile_seconds"],
                      "train_seconds": s["train_seconds"],
                      "eval_return_per_seed": s["final_eval_return_per_seed"],
                      "final_return_per_seed": s["final_return_per_seed"]})
        name = f"{env}-pbt-{r}"
        wall, s = _run([sys.executable, "-m", "jaxppo", "search", "--run-name", name, *common,
                        f"seed={r}", f"search={json.dumps(search)}",
                        f"pbt={json.dumps({'interval': INTERVAL})}"], RUNS / name)
        rec = json.loads((RUNS / name / "search.json").read_text())
        members = rec["members"]
        by_training = max(members, key=lambda m: -np.inf if m["final_return"] is None
                          else m["final_return"])
        evals = [m["final_eval_return"] for m in members]
        pbt.append({"seed": r, "wall_seconds": wall, "compile_seconds": s["compile_seconds"],
                    "train_seconds": s["train_seconds"],
                    "population_eval_return_mean": float(np.mean(evals)),
                    "top_by_training_return_eval": by_training["final_eval_return"],
                    "best_member_eval": float(np.max(evals)),
                    "final_return_mean": float(np.mean(s["final_return_per_seed"])),
                    "winner_hparams": rec["best"]["hparams"],
                    "exploit_steps": len(rec["pbt"]["lineage"]["exploits"])})
        print(f"{env} repeat {r}: tuned {np.mean(tuned[-1]['eval_return_per_seed']):.1f} "
              f"({tuned[-1]['wall_seconds']:.0f} s), PBT population "
              f"{pbt[-1]['population_eval_return_mean']:.1f}, top-by-training "
              f"{pbt[-1]['top_by_training_return_eval']:.1f} ({wall:.0f} s)", flush=True)
    tuned_evals = [np.mean(t["eval_return_per_seed"]) for t in tuned]
    ratios = [p["wall_seconds"] / t["wall_seconds"] for p, t in zip(pbt, tuned)]
    train_ratios = [p["train_seconds"] / t["train_seconds"] for p, t in zip(pbt, tuned)]
    return {
        "env": env, "env_steps_per_member": total, "population": POPULATION,
        "search": SEARCH[env], "pbt": {"interval": INTERVAL},
        "tuned_eval_return_mean": float(np.mean(tuned_evals)),
        "tuned_eval_return_std_over_runs": float(np.std(tuned_evals)),
        "tuned_eval_return_std_over_seeds": float(np.std(
            [x for t in tuned for x in t["eval_return_per_seed"]])),
        "pbt_population_eval_return_mean": float(np.mean(
            [p["population_eval_return_mean"] for p in pbt])),
        "pbt_population_eval_return_std_over_runs": float(np.std(
            [p["population_eval_return_mean"] for p in pbt])),
        "pbt_top_by_training_return_eval_mean": float(np.mean(
            [p["top_by_training_return_eval"] for p in pbt])),
        "pbt_best_member_eval_mean": float(np.mean([p["best_member_eval"] for p in pbt])),
        "wall_ratio_pbt_over_tuned": float(np.mean(ratios)),
        "wall_ratios": ratios,
        "train_seconds_ratio_pbt_over_tuned": float(np.mean(train_ratios)),
        "tuned_runs": tuned, "pbt_runs": pbt,
        "evaluation": (f"after the last iteration, {EVAL_EPISODES} episodes per member with "
                       "sampled actions (the README results table's evaluation)"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", nargs="+", default=["Pendulum-v1", "Acrobot-v1"], choices=list(SEARCH))
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--max-steps", type=float, default=None,
                   help="cap the per-member budget (recorded in the results)")
    args = p.parse_args()
    out_file = RESULTS / "pbt.json"
    results = json.loads(out_file.read_text()) if out_file.exists() else {}
    for env in args.env:
        rec = run_env(env, args.repeats, args.max_steps)
        rec.update(machine=machine(), date=time.strftime("%Y-%m-%d"), repeats=args.repeats)
        results[env] = rec
        out_file.write_text(json.dumps(results, indent=2))
        print(json.dumps({k: v for k, v in rec.items() if not k.endswith("_runs")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
