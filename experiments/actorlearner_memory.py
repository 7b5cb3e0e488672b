"""Peak memory of jaxppo's actor-learner at Cleanba's config, two checkouts side by side: the
jaxppo side of `cleanba_bench.py` (Breakout-v5 via envpool, 16 envs x 16 steps, 3 updates, the
IMPALA CNN, `max_policy_lag: 1`, one actor thread), run from each checkout in fresh processes,
with the compile cache off (`compilation_cache_dir=null`, JAX_COMPILATION_CACHE_DIR unset:
every program compiled) and warm (the default cache, filled by one discarded run of each
checkout first), the checkouts alternating within each round.

    .venv/bin/python experiments/actorlearner_memory.py --before ../main --after . [--rounds 2]

Figures per run are cleanba_bench's (`peak_rss_mb`: the process's peak resident memory,
wait4's ru_maxrss; `sps`, `compile_s`, `cores_busy`, the load around it); the summary gives
each checkout's and mode's median. Writes experiments/results/actorlearner-memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import cpu_model  # experiments/bench.py: the machine's CPU model

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ("peak_rss_mb", "sps", "summary_sps", "compile_s", "wall_s", "cores_busy",
          "load_before", "load_after")
# One run of cleanba_bench's jaxppo side, imported from the checkout under test.
RUN = """
import json, sys
sys.path.insert(0, "experiments")
import cleanba_bench as cb
if COLD:
    cb.JAXPPO_SET.append("compilation_cache_dir=null")
out = cb.jaxppo_run("Breakout-v5", 768, 16, 0)
out.pop("returns", None)
print("RESULT " + json.dumps(out))
"""


def run_once(root: str, cold: bool) -> dict:
    """One fresh process of the jaxppo side of cleanba_bench from checkout `root`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", f"COLD = {cold}\n" + RUN], cwd=root, env=env,
                          capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {"error": proc.stderr[-2000:]}


def summarise(runs: dict) -> dict:
    """Each checkout's and mode's median of every figure over its runs."""
    return {side: {mode: {k: round(statistics.median(r[k] for r in rs if k in r), 2)
                          for k in FIELDS if any(k in r for r in rs)}
                   for mode, rs in modes.items()}
            for side, modes in runs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the checkout to compare against")
    p.add_argument("--after", required=True, help="the checkout under test")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "actorlearner-memory.json"))
    args = p.parse_args(argv)
    sides = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    for root in sides.values():  # fills the compile cache for the warm runs
        run_once(root, cold=False)
    runs = {side: {"cold": [], "warm": []} for side in sides}
    for r in range(args.rounds):
        for mode in ("cold", "warm"):
            for side, root in sides.items():
                out = run_once(root, cold=mode == "cold")
                runs[side][mode].append(out)
                print(r, mode, side, {k: out.get(k) for k in FIELDS + ("error",)}, flush=True)
    record = {"cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "sides": sides, "rounds": args.rounds, "summary": summarise(runs), "runs": runs}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
