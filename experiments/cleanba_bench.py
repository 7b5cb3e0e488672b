"""Atari (envpool Breakout-v5) side by side in one sitting: Cleanba's PPO (`cleanba_ppo.py`,
JAX, actor thread + learner, the Sebulba layout) against jaxppo's actor-learner
(`max_policy_lag: 1`) at Cleanba's config, scaled to 2 cores: 1 actor thread x 16 envs x 128
steps, 4 epochs x 4 minibatches, the IMPALA CNN (16-32-32, Dense 256) with one trunk, lr
2.5e-4 annealed, clip 0.1 with no value clipping, and Cleanba's env (Machado et al.'s
protocol: sticky actions 0.25, whole games, full action space, one no-op).

    .venv/bin/python experiments/cleanba_bench.py --cleanba-python /work/peers/cleanba/bin/python
        [--steps 6144] [--num-steps 128] [--rounds 1] [--no-concurrency]

On a loaded 2-core CPU an update of 16 x 16 steps took 7-10 minutes on either side (16 x 128:
about an hour), so `--num-steps 16 --steps 768` (3 updates of 256 steps) is what fits a short
sitting; the steps/s of a conv-bound update hardly depends on the batch size, the returns do.
Add `--only jaxppo` or `--only cleanba` to run one side.

Each measurement is a fresh process; the two alternate round by round. Cleanba runs from a
copy of `../shared/anchors/cleanba/cleanba_ppo.py` (unchanged; `experiments/peers/cleanba.patch`
is applied to the copy where it exists) in a virtualenv of its own (pins:
experiments/peers/cleanba-requirements.txt), which this script does not install. Cleanba
runs with `--concurrency` (its actor one update behind, as jaxppo's lag 1) unless
`--no-concurrency`.

Figures, per run:
  * sps: env steps per second after compiling. Cleanba's actor prints one line per rollout
    (`--log-frequency 1`); this script timestamps them as they arrive, and the figure is the
    steps between the 3rd line and the last over the time between them (with --concurrency
    the 3rd rollout is the first to wait for an update, the learner's first, which compiles;
    the last is the rollout its actor plays past the budget, acting while the last update
    runs). jaxppo's is the same from its metrics.jsonl rows' wall_time (`log_every=1`: one
    row per update; from the 2nd row, its compiling being done before the 1st), beside its
    summary.json `sps` (compiling excluded, the first update included);
  * peak_rss_mb: the process's peak resident memory (wait4's ru_maxrss);
  * cores_busy: (user + sys) CPU time / wall time; load_before / load_after: the 1-minute
    load average around the run (the machine is shared);
  * returns: the mean episode game score by env step. Cleanba's is its printed
    avg_episodic_return: the mean over its envs of each one's last finished game (0 for an env
    that finished none yet); jaxppo's is its rows' episode_return_mean (the games that ended
    in that update). Compared at the run's last update, where both have counted games.
Writes experiments/results/cleanba-bench.json with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from atari_bench import alternate  # experiments/atari_bench.py: fresh runs in turn
from bench import cpu_model  # experiments/bench.py: the machine's CPU model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
# ../shared/anchors: beside the checkout, or beside the folder of its worktrees
ANCHORS = next((d / "shared" / "anchors" for d in ROOT.parents[:2]
                if (d / "shared" / "anchors").is_dir()), ROOT.parent / "shared" / "anchors")
CLEANBA = ANCHORS / "cleanba" / "cleanba_ppo.py"
PATCH = ROOT / "experiments" / "peers" / "cleanba.patch"
ENVS, STEPS = 16, 128  # Cleanba's 128 steps; --num-steps shortens a rollout (and an update)
# Cleanba's make_env: Machado et al. (2017)'s protocol; the frame options are envpool's
# defaults in both (84x84 grey, 4 stacked, frame skip 4, FIRE at reset, 27,000-step limit).
CLEANBA_ENV = ("{episodic_life: false, repeat_action_probability: 0.25, noop_max: 1, "
               "full_action_space: true}")
JAXPPO_SET = [f"num_envs={ENVS}", "num_epochs=4", "num_minibatches=4",
              "lr=2.5e-4", "lr_schedule=linear", "clip_param=0.1", "vf_clip_param=null",
              "entropy_coeff=0.01", "vf_coeff=0.5", "max_grad_norm=0.5", "gamma=0.99",
              "gae_lambda=0.95", "network.torso=impala_cnn", "network.shared_trunk=true",
              "max_policy_lag=1", "actor_threads=1", "log_every=1", f"env_kwargs={CLEANBA_ENV}"]
CLEANBA_LINE = re.compile(r"global_step=(\d+), avg_episodic_return=([-\d.e+naif]+)")


def _run(cmd: list[str], cwd: str, timeout: float) -> dict:
    """Run cmd, timestamping each stdout line as it arrives: {lines: [(seconds, text)],
    stderr, rc, wall_s, cores_busy, peak_rss_mb, load_before, load_after}."""
    load_before = os.getloadavg()[0]
    err = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    killer.cancel()
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(10)
    err.seek(0)
    return {"lines": lines, "stderr": err.read(), "rc": proc.returncode, "wall_s": round(wall, 1),
            "cores_busy": round((usage.ru_utime + usage.ru_stime) / max(wall, 1e-9), 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def _steady_sps(points: list[tuple[float, float]], first: int = 2) -> float | None:
    """(steps_last - steps_first) / (t_last - t_first) over (seconds, env steps) points, from
    the point at index `first` on (the earlier ones include compiling)."""
    if len(points) < first + 2:
        return None
    (t_a, s_a), (t_b, s_b) = points[first], points[-1]
    return round((s_b - s_a) / (t_b - t_a), 1)


def _common(out: dict) -> dict:
    keys = ("wall_s", "cores_busy", "peak_rss_mb", "load_before", "load_after")
    return {k: out[k] for k in keys}


def cleanba_run(python: str, env: str, steps: int, num_steps: int, seed: int,
                concurrency: bool) -> dict:
    with tempfile.TemporaryDirectory() as cwd:
        script = Path(cwd) / "cleanba_ppo.py"
        shutil.copy(CLEANBA, script)
        if PATCH.exists():
            subprocess.run(["patch", "-s", str(script), str(PATCH)], check=True)
        cmd = [python, "-u", str(script), "--env-id", env, "--total-timesteps", str(steps),
               "--seed", str(seed), "--local-num-envs", str(ENVS), "--num-steps", str(num_steps),
               "--num-actor-threads", "1", "--log-frequency", "1"]
        out = _run(cmd + (["--concurrency"] if concurrency else []), cwd, timeout=3600)
    rows = [(t, int(m[1]), float(m[2])) for t, line in out["lines"]
            if (m := CLEANBA_LINE.search(line))]
    if out["rc"] != 0 or not rows:
        return {"error": (out["stderr"] or "")[-2000:], **_common(out)}
    # its actor plays one rollout past the budget: timed, but not a return at the budget
    return {"sps": _steady_sps([(t, s) for t, s, _ in rows]), **_common(out),
            "returns": [[s, round(r, 2)] for _, s, r in rows if s <= steps]}


def jaxppo_run(env: str, steps: int, num_steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "-m", "jaxppo", "train", "--env", f"envpool:{env}", "--runs-dir",
               runs, "--run-name", "run", "--no-plot", "--no-progress", "--set",
               f"total_timesteps={steps}", f"seed={seed}", f"num_steps={num_steps}", *JAXPPO_SET]
        out = _run(cmd, str(ROOT), timeout=3600)
        if out["rc"] != 0:
            return {"error": out["stderr"][-2000:], **_common(out)}
        summary = json.loads((Path(runs) / "run" / "summary.json").read_text())
        metrics = (Path(runs) / "run" / "metrics.jsonl").read_text()
        rows = [json.loads(x) for x in metrics.splitlines()]
    returns = [[r["env_steps"], round(r["episode_return_mean"], 2)] for r in rows
               if r.get("episode_return_mean") is not None]
    return {"sps": _steady_sps([(r["wall_time"], r["env_steps"]) for r in rows], first=1),
            "summary_sps": round(summary["sps"], 1),
            "compile_s": round(summary["compile_seconds"], 1),
            **_common(out), "returns": returns}


def _summarise(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for name, rs in runs.items():
        ok = [x for x in rs if x.get("sps")]
        summary[name] = {
            "sps_median": statistics.median(x["sps"] for x in ok) if ok else None,
            "peak_rss_mb_median": statistics.median(x["peak_rss_mb"] for x in ok) if ok else None,
            "cores_busy_median": statistics.median(x["cores_busy"] for x in ok) if ok else None,
            "final_return": [x["returns"][-1] for x in ok if x.get("returns")],
            "load": [[x["load_before"], x["load_after"]] for x in rs]}
    names = list(summary)
    if len(names) == 2 and all(summary[n]["sps_median"] for n in names):
        summary["jaxppo_vs_cleanba_sps"] = round(summary[names[0]]["sps_median"]
                                                 / summary[names[1]]["sps_median"], 2)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="Breakout-v5")
    p.add_argument("--steps", type=int, default=6144,
                   help="env steps per run: whole updates, at least 3")
    p.add_argument("--num-steps", type=int, default=STEPS,
                   help=f"steps per env per rollout (Cleanba's: {STEPS}); an update: {ENVS} x this")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cleanba-python", help="the python of Cleanba's own virtualenv")
    p.add_argument("--no-concurrency", action="store_true",
                   help="run Cleanba without --concurrency (acting and learning in turn)")
    p.add_argument("--only", choices=("jaxppo", "cleanba"), help="run one side only")
    p.add_argument("--out", default=str(RESULTS / "cleanba-bench.json"))
    args = p.parse_args(argv)
    if not args.cleanba_python:
        p.error("give --cleanba-python (Cleanba's own virtualenv)")
    batch = ENVS * args.num_steps
    if args.steps < 3 * batch or args.steps % batch:
        p.error(f"--steps must be a multiple of one update ({batch} env steps) and at least 3")
    contenders = {
        "jaxppo lag 1 (actor-learner)": lambda s: jaxppo_run(args.env, args.steps,
                                                             args.num_steps, s),
        "Cleanba cleanba_ppo.py": lambda s: cleanba_run(args.cleanba_python, args.env,
                                                         args.steps, args.num_steps, s + 1,
                                                         not args.no_concurrency)}
    if args.only:
        contenders = {k: v for k, v in contenders.items() if k.lower().startswith(args.only)}
    runs = alternate(contenders, args.rounds)
    record = {"cpu": cpu_model(), "cores": os.cpu_count(), "env": args.env,
              "config": {"envs": ENVS, "num_steps": args.num_steps, "actor_threads": 1,
                         "jaxppo_set": JAXPPO_SET,
                         "cleanba_concurrency": not args.no_concurrency},
              "steps_per_run": args.steps, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M"), "summary": _summarise(runs), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
