"""Run the tuned configs with several seeds and regenerate the results table (docs/results.md).

    .venv/bin/python experiments/run_experiments.py                 # every config, 4 seeds
    .venv/bin/python experiments/run_experiments.py --env CartPole-v1 Acrobot-v1
    .venv/bin/python experiments/run_experiments.py --max-steps 2e6  # cap budgets (CPU)
    .venv/bin/python experiments/run_experiments.py --table-only     # rebuild the results table

Each env trains all its seeds in one vmapped program (`--seeds`, default 4) through the
CLI and ends with one evaluation scored as gymnax-blines scores its agents (164 episodes,
sampled actions). experiments/results/<env>.json (that eval return and the training return of
the last 10 iterations, mean ± std over seeds, env steps, wall time, steps/s, machine) and experiments/results/<env>.png are written, and the table
between the results markers in docs/results.md is rebuilt from every results/*.json present.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "jaxppo" / "configs"  # the tuned configs the package ships
RESULTS = ROOT / "experiments" / "results"
RUNS = ROOT / "experiments" / "runs"
RESULTS_PAGE = ROOT / "docs" / "results.md"  # the site's Results page holds the table
START, END = "<!-- results:start -->", "<!-- results:end -->"

# Published anchors. gymnax: the PPO results table of the gymnax README (agents from
# gymnax-blines, configs agents/<env>/ppo.yaml), final return and env-step budget.
GYMNAX_PPO = {
    "CartPole-v1": (500.0, 1.5e5),
    "Acrobot-v1": (-80.0, 5e5),
    "Pendulum-v1": (-130.0, 1e6),
    "MountainCar-v0": (-118.0, 5e5),
    "Catch-bsuite": (1.0, 1e5),
    "Asterix-MinAtar": (15.0, 1e7),
    "Breakout-MinAtar": (28.0, 1e7),
    "Freeway-MinAtar": (58.0, 1e7),
    "SpaceInvaders-MinAtar": (131.0, 1e7),
}
# gymnax-blines scores an agent by the mean return of 164 test episodes, actions sampled.
EVAL_EPISODES = 164
# Other published PPO figures, each with its source and budget. MinAtar: Pgx's PPO example
# (a small CNN, 2e7 steps, on Pgx's own MinAtar port) and gymnax-blines' training curves (1e7),
# both read off the published plots, so approximate.
OTHER_PPO = {
    "CartPole-v1": "PureJaxRL ≈500 (5e5; README curve)",
    "Asterix-MinAtar": "Pgx ≈22–25 (2e7); gymnax-blines curve peak ≈18 (1e7)",
    "Breakout-MinAtar": "Pgx ≈50 (2e7); gymnax-blines curve peak ≈43 (1e7)",
    "Freeway-MinAtar": "Pgx ≈63 (2e7); gymnax-blines curve peak ≈57 (1e7)",
    "SpaceInvaders-MinAtar": "Pgx ≈145–150 (2e7); gymnax-blines curve peak ≈130 (1e7)",
}


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def run_env(env: str, seeds: int, max_steps: float | None) -> dict:
    config = CONFIGS / f"{env}.yaml"
    import yaml

    total = int(yaml.safe_load(config.read_text())["total_timesteps"])
    budget_note = "config"
    if env in GYMNAX_PPO and total > GYMNAX_PPO[env][1]:
        # Compare at a budget no larger than gymnax's own PPO baseline.
        total = int(GYMNAX_PPO[env][1])
        budget_note = "gymnax baseline budget"
    if max_steps is not None and total > max_steps:
        total = int(max_steps)
        budget_note = "capped for this CPU"
    # One evaluation after the last iteration, scored as gymnax-blines scores its agents:
    # EVAL_EPISODES episodes with actions sampled from the policy, mean return per seed.
    overrides = [f"eval_every={10**9}", f"eval_episodes={EVAL_EPISODES}", "eval_deterministic=false"]
    if total != int(yaml.safe_load(config.read_text())["total_timesteps"]):
        overrides.append(f"total_timesteps={total}")
    run_dir = RUNS / env
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "jaxppo", "train", "--config", str(config), "--seeds", str(seeds),
           "--runs-dir", str(RUNS), "--run-name", env, "--no-progress", "--set", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {
        "env": env,
        "config": str(config.relative_to(ROOT)),
        "seeds": seeds,
        "env_steps_per_seed": summary["env_steps"],
        "budget_capped": budget_note == "capped for this CPU",
        "budget": budget_note,
        "final_return_mean": summary["final_return_mean"],
        "final_return_std": summary["final_return_std"],
        "final_return_per_seed": summary["final_return_per_seed"],
        "final_return_definition": "mean episode return over the last 10 iterations, per seed",
        "eval_return_mean": summary["final_eval_return_mean"],
        "eval_return_std": summary["final_eval_return_std"],
        "eval_return_per_seed": summary["final_eval_return_per_seed"],
        "eval_return_definition": (
            f"after the last iteration, mean return of {EVAL_EPISODES} episodes with sampled "
            "actions, per seed (as gymnax-blines evaluates)"),
        "wall_seconds": wall,
        "compile_seconds": summary["compile_seconds"],
        "train_seconds": summary["train_seconds"],
        "sps_all_seeds": summary["sps"],
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if env == "Pendulum-v1":
        result.update(pendulum_deterministic(run_dir))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{env}.json").write_text(json.dumps(result, indent=2))
    if (run_dir / "curve.png").exists():
        shutil.copy(run_dir / "curve.png", RESULTS / f"{env}.png")
    return result


def pendulum_deterministic(run_dir: Path) -> dict:
    """Each seed's deterministic policy against the optimum, on the same 2000 random start
    states (experiments/pendulum_optimum.py --policy, which also writes the gap analysis)."""
    subprocess.run([sys.executable, str(ROOT / "experiments" / "pendulum_optimum.py"),
                    "--policy", str(run_dir)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    gap = json.loads((RESULTS / "pendulum-policy-gap.json").read_text())["policy_comparison"]
    per_seed = [s["return_mean"] for s in gap["seeds"]]
    return {
        "deterministic_return_mean": sum(per_seed) / len(per_seed),
        "deterministic_return_per_seed": per_seed,
        "deterministic_return_definition": (
            f"after the last iteration, mean return of {gap['episodes']} episodes with the "
            "deterministic (most likely) action from random start states, per seed "
            "(experiments/pendulum_optimum.py --policy)"),
        "optimum_return_mean_same_starts": gap["greedy_return_mean"],
    }


def _fmt_steps(x: float) -> str:
    return f"{x:.2g}".replace("e+0", "e").replace("e+", "e")


def _eval_cell(r: dict) -> str:
    if "eval_return_mean" not in r:
        return f"— ({r['seeds']})"
    return f"{r['eval_return_mean']:.1f} ± {r['eval_return_std']:.1f} ({r['seeds']})"


def build_table() -> str:
    rows = [
        "| env | jaxppo eval return (mean ± std, seeds) | training return | env steps / seed "
        "| wall s | steps/s | gymnax PPO (budget) | other published PPO (budget) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        r = json.loads(path.read_text())
        if "final_return_mean" not in r or "env" not in r:
            continue
        env = r["env"]
        anchor = GYMNAX_PPO.get(env)
        anchor_s = f"{anchor[0]:g} ({_fmt_steps(anchor[1])})" if anchor else "—"
        capped = " (capped)" if r.get("budget_capped") else ""
        rows.append(
            f"| {env} | {_eval_cell(r)} | {r['final_return_mean']:.1f} ± {r['final_return_std']:.1f} "
            f"| {_fmt_steps(r['env_steps_per_seed'])}{capped} | {r['wall_seconds']:.0f} "
            f"| {r['sps_all_seeds']:,.0f} | {anchor_s} | {OTHER_PPO.get(env, '—')} |"
        )
    return "\n".join(rows)


def update_readme() -> None:
    text = RESULTS_PAGE.read_text()
    if START not in text or END not in text:
        print(f"{RESULTS_PAGE} has no {START} ... {END} markers; table not written", file=sys.stderr)
        return
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    RESULTS_PAGE.write_text(f"{head}{START}\n{build_table()}\n{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", nargs="*", help="envs to run (default: every config)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--max-steps", type=float, help="cap total_timesteps per seed")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    if not args.table_only:
        envs = args.env or sorted(p.stem for p in CONFIGS.glob("*.yaml"))
        for env in envs:
            if not (CONFIGS / f"{env}.yaml").exists():
                print(f"error: no tuned config jaxppo/configs/{env}.yaml", file=sys.stderr)
                return 2
            r = run_env(env, args.seeds, args.max_steps)
            print(f"{env}: {r['final_return_mean']:.1f} ± {r['final_return_std']:.1f} "
                  f"({r['env_steps_per_seed']:,} steps/seed, {r['wall_seconds']:.0f}s)", flush=True)
    update_readme()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
