"""Atari (envpool Breakout-v5) steps per second, side by side in one sitting: CleanRL's
`ppo_atari_envpool.py` (PyTorch, synchronous) against jaxppo's synchronous host loop
(`max_policy_lag: 0`) and its actor-learner (`max_policy_lag: 1`), at CleanRL's config (8 envs
x 128 steps, 4 epochs x 4 minibatches, Nature CNN, lr 2.5e-4 annealed, clip 0.1).

    .venv/bin/python experiments/atari_bench.py [--steps 20480] [--rounds 3]
        [--cleanrl-python PATH | --skip-cleanrl] [--env Breakout-v5] [--baseline-tree DIR]

Each measurement is a fresh process; the contenders alternate round by round. The figure is
each one's own steady-state env steps per second: CleanRL's last printed `SPS:` (steps over
the time since its start, after its imports), jaxppo's summary.json `sps` (env steps over the
training time, compiling excluded; the host loop's first iteration included). CleanRL runs
from a copy of its script in `../shared/anchors/cleanrl/` in a virtualenv of its own
(torch, envpool 0.8.4, gym 0.23.1, numpy < 2, tyro, tensorboard: see
experiments/peers/cleanrl-requirements.txt), which this script does not install: pass its
python with --cleanrl-python. Writes experiments/results/atari-bench.json with the CPU model
and, per run, the cores it kept busy ((user + sys) CPU time / wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import cpu_model  # experiments/bench.py: the machine's CPU model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
CLEANRL = ROOT.parent / "shared" / "anchors" / "cleanrl" / "ppo_atari_envpool.py"


def _timed(cmd: list[str], cwd: str, timeout: float,
           env: dict | None = None) -> tuple[subprocess.CompletedProcess, float, float]:
    """(the finished process, its wall seconds, its cores busy)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out, wall, cpu / max(wall, 1e-9)


def cleanrl_run(python: str, env: str, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as cwd:
        cmd = [python, str(CLEANRL), "--env-id", env, "--total-timesteps", str(steps),
               "--seed", str(seed), "--no-cuda"]
        out, wall, busy = _timed(cmd, cwd, timeout=3600)
    sps = [int(m) for m in re.findall(r"SPS: (\d+)", out.stdout)]
    if out.returncode != 0 or not sps:
        return {"error": (out.stderr or out.stdout)[-2000:], "wall_s": wall}
    return {"sps": sps[-1], "wall_s": round(wall, 1), "cores_busy": round(busy, 2)}


def jaxppo_run(env: str, steps: int, seed: int, lag: int, tree: str | None = None) -> dict:
    """A run of this checkout's jaxppo, or of the one in `tree` (another checkout, e.g. a git
    worktree of an earlier commit, imported first through PYTHONPATH)."""
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "-m", "jaxppo", "train", "--env", f"envpool:{env}", "--runs-dir",
               runs, "--run-name", "run", "--no-plot", "--no-progress", "--set",
               f"total_timesteps={steps}", f"seed={seed}", f"max_policy_lag={lag}"]
        out, wall, busy = _timed(cmd, tree or str(ROOT), timeout=3600,
                                 env={**os.environ, "PYTHONPATH": tree} if tree else None)
        if out.returncode != 0:
            return {"error": out.stderr[-2000:], "wall_s": wall}
        summary = json.loads((Path(runs) / "run" / "summary.json").read_text())
    return {"sps": round(summary["sps"], 1), "compile_s": round(summary["compile_seconds"], 1),
            "wall_s": round(wall, 1), "cores_busy": round(busy, 2),
            "final_return": summary.get("final_return_mean")}


def alternate(contenders: dict, rounds: int) -> dict[str, list[dict]]:
    """Each contender's runs (run(round) -> dict), fresh in turn round by round, each printed."""
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name, run in contenders.items():
            result = run(r)
            runs[name].append(result)
            print(f"round {r + 1}: {name}: {result}", file=sys.stderr, flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="Breakout-v5")
    p.add_argument("--steps", type=int, default=20480, help="env steps per run (CleanRL's batch: 1024)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cleanrl-python", help="the python of CleanRL's own virtualenv")
    p.add_argument("--skip-cleanrl", action="store_true")
    p.add_argument("--baseline-tree", help="another checkout of jaxppo (e.g. a git worktree of an "
                   "earlier commit): its synchronous loop joins the contenders")
    p.add_argument("--out", default=str(RESULTS / "atari-bench.json"))
    args = p.parse_args(argv)
    if not args.skip_cleanrl and not args.cleanrl_python:
        p.error("give --cleanrl-python (CleanRL's own virtualenv) or --skip-cleanrl")
    contenders = {"jaxppo lag 0 (synchronous)": lambda s: jaxppo_run(args.env, args.steps, s, 0),
                  "jaxppo lag 1 (actor-learner)": lambda s: jaxppo_run(args.env, args.steps, s, 1)}
    if args.baseline_tree:
        tree = str(Path(args.baseline_tree).resolve())
        commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip() or tree
        contenders[f"jaxppo lag 0 at {commit}"] = lambda s: jaxppo_run(args.env, args.steps, s,
                                                                        0, tree)
    if not args.skip_cleanrl:
        contenders["CleanRL ppo_atari_envpool.py"] = lambda s: cleanrl_run(
            args.cleanrl_python, args.env, args.steps, s + 1)
    runs = alternate(contenders, args.rounds)
    summary = {}
    for name, rs in runs.items():
        sps = [x["sps"] for x in rs if "sps" in x]
        summary[name] = {"sps_median": statistics.median(sps) if sps else None, "sps": sps}
    base = summary.get("CleanRL ppo_atari_envpool.py", {}).get("sps_median")
    sync = summary["jaxppo lag 0 (synchronous)"]["sps_median"]
    for name, s in summary.items():
        if s["sps_median"] and base:
            s["vs_cleanrl"] = round(s["sps_median"] / base, 2)
        if s["sps_median"] and sync:
            s["vs_jaxppo_sync"] = round(s["sps_median"] / sync, 2)
    record = {"cpu": cpu_model(), "cores": os.cpu_count(), "env": args.env,
              "steps_per_run": args.steps, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M"), "summary": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
