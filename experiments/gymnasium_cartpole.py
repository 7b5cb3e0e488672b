"""Time to a return of 475 on gymnasium's CartPole-v1: jaxppo's host loop vs Stable-Baselines3.

    .venv/bin/python experiments/gymnasium_cartpole.py [--seeds 3] [--sb3-python /tmp/sb3venv/bin/python]

Each run is a fresh process, timed from its first line (imports, env construction and, for
jaxppo, compiling count); runs alternate between the contenders, seed by seed. Both train on
`gymnasium.make("CartPole-v1")` stepped in Python. The criterion is the same for both: the
mean return of the last 20 finished training episodes reaches 475 (jaxppo reports episodes per
iteration, so its window is the trailing iterations holding at least 20 episodes); a run stops
there. Contenders:
  * jaxppo, env="gymnasium:CartPole-v1" with the shipped tuned CartPole-v1 config (16 envs x
    128 steps, 8 epochs x 8 minibatches, lr 1e-3 annealed over 1.5e5 steps), with the
    persistent compilation cache warm (the default after a first run) and cold (off);
  * jaxppo with its defaults (PureJaxRL's CartPole settings: 4 envs, lr 2.5e-4 over 5e5 steps);
  * SB3's PPO("MlpPolicy", "CartPole-v1") with every default (1 env, 2048 steps, 10 epochs of
    64-sample minibatches, lr 3e-4), device="cpu", in its own virtualenv (torch CPU), which
    this script does not install: pass its python with --sb3-python, or --skip-sb3.
Writes experiments/results/gymnasium-cartpole.json with the CPU model and the machine's load.
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

from bench import cpu_model  # experiments/bench.py: the machine's CPU model

T0 = time.perf_counter()  # the worker's clock starts before any import

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
THRESHOLD, WINDOW = 475.0, 20


# ---------------------------------------------------------------------- workers
class _Reached(Exception):
    pass


def jaxppo_worker(seed: int, tuned: bool, cold: bool = False) -> dict:
    import jaxppo

    base = jaxppo.PPOConfig.tuned("CartPole-v1") if tuned else jaxppo.PPOConfig()
    cfg = base.replace(env="gymnasium:CartPole-v1", seed=seed, log_every=1)
    if cold:  # no persistent compilation cache: every function compiles in this process
        cfg = cfg.replace(compilation_cache_dir=None)
    out = {"env_steps_budget": cfg.num_iterations * cfg.batch_size, "times": []}
    recent: list[tuple[int, float]] = []  # (episodes, mean return) per iteration

    def callback(rows):
        row = rows[-1]
        now = time.perf_counter() - T0
        out["times"].append(now)
        if row["episodes"]:
            recent.append((row["episodes"], row["episode_return_mean"]))
        n, total = 0, 0.0
        for k, r in reversed(recent):
            n, total = n + k, total + k * r
            if n >= WINDOW:
                break
        if n >= WINDOW and total / n >= THRESHOLD:
            out.update(seconds=now, env_steps=int(row["env_steps"]), window_return=total / n)
            raise _Reached

    try:
        jaxppo.train(cfg, progress=False, callback=callback, plot=False)
    except _Reached:
        pass
    times = out.pop("times")
    # Startup (imports, env, compile): the first iteration's end less one iteration's time.
    if len(times) >= 2:
        out["startup_seconds"] = times[0] - (times[1] - times[0])
    return out


def sb3_worker(seed: int, budget: int, threads: int = 0) -> dict:
    if threads:  # torch's intra-op threads (its default: one per core)
        import torch

        torch.set_num_threads(threads)
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    out: dict = {"env_steps_budget": budget}
    returns: list[float] = []

    class Stop(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:  # Monitor's record of a finished episode
                    returns.append(float(info["episode"]["r"]))
            tail = returns[-WINDOW:]
            if len(tail) == WINDOW and sum(tail) / WINDOW >= THRESHOLD:
                out.update(seconds=time.perf_counter() - T0, env_steps=int(self.num_timesteps),
                           window_return=sum(tail) / WINDOW)
                return False
            return True

    model = PPO("MlpPolicy", "CartPole-v1", seed=seed, device="cpu", verbose=0)
    out["startup_seconds"] = time.perf_counter() - T0
    model.learn(total_timesteps=budget, callback=Stop())
    import stable_baselines3
    import torch

    out.update(sb3=stable_baselines3.__version__, torch=torch.__version__,
               torch_threads=torch.get_num_threads())
    return out


# ---------------------------------------------------------------------- driver
def _run(python: str, *args: str) -> dict:
    proc = subprocess.run([python, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{args}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    hit = [r for r in runs if "seconds" in r]
    out = {"runs": runs, "reached": f"{len(hit)}/{len(runs)}"}
    if hit:
        out["median_seconds"] = statistics.median(r["seconds"] for r in hit)
        out["median_env_steps"] = statistics.median(r["env_steps"] for r in hit)
        out["median_startup_seconds"] = statistics.median(r["startup_seconds"] for r in hit
                                                          if "startup_seconds" in r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sb3-python", default="/tmp/sb3venv/bin/python")
    p.add_argument("--sb3-budget", type=int, default=300_000)
    p.add_argument("--skip-sb3", action="store_true")
    p.add_argument("--skip-defaults", action="store_true", help="skip jaxppo with its defaults")
    p.add_argument("--sb3-threads", type=int, default=0,
                   help="also run SB3 with torch.set_num_threads(N) (0: only torch's default)")
    p.add_argument("--only", nargs="+", help="run only these contenders")
    p.add_argument("--merge", action="store_true",
                   help="add these contenders' results to the existing results file")
    p.add_argument("--worker", choices=("jaxppo-tuned", "jaxppo-tuned-cold", "jaxppo-defaults",
                                        "sb3", "sb3-threads"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.worker in ("sb3", "sb3-threads"):
        threads = args.sb3_threads if args.worker == "sb3-threads" else 0
        print(json.dumps(sb3_worker(args.seed, args.sb3_budget, threads)))
        return
    if args.worker:
        print(json.dumps(jaxppo_worker(args.seed, tuned=args.worker.startswith("jaxppo-tuned"),
                                       cold=args.worker.endswith("-cold"))))
        return

    contenders = {"jaxppo-tuned": sys.executable, "jaxppo-tuned-cold": sys.executable}
    if not args.skip_defaults:
        contenders["jaxppo-defaults"] = sys.executable
    if not args.skip_sb3:
        contenders["sb3"] = args.sb3_python
        if args.sb3_threads:
            contenders["sb3-threads"] = args.sb3_python
    if args.only:
        contenders = {k: v for k, v in contenders.items() if k in args.only}
    runs: dict[str, list] = {k: [] for k in contenders}
    load = [os.getloadavg()]
    for seed in range(args.seeds):
        for name, python in contenders.items():
            extra = (["--sb3-budget", str(args.sb3_budget), "--sb3-threads", str(args.sb3_threads)]
                     if name.startswith("sb3") else [])
            r = _run(python, "--worker", name, "--seed", str(seed), *extra)
            r["seed"] = seed
            runs[name].append(r)
            print(name, seed, r, file=sys.stderr, flush=True)
        load.append(os.getloadavg())
    import gymnasium
    import jax

    import jaxppo

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "task": "gymnasium CartPole-v1: wall seconds from process start until the mean return "
                f"of the last {WINDOW} finished training episodes reaches {THRESHOLD:g}",
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "jax": jax.__version__, "jaxppo": jaxppo.__version__,
                    "gymnasium": gymnasium.__version__,
                    "load_avg_1_5_15_before_and_after_each_round": load},
        "contenders": {
            "jaxppo-tuned": "jaxppo host loop, env=gymnasium:CartPole-v1, the shipped tuned "
                            "CartPole-v1 config (16 envs x 128 steps, 8x8 minibatches, lr 1e-3 "
                            "linear over 1.5e5 steps), log_every=1; the persistent compilation "
                            "cache on (the default) and warm",
            "jaxppo-tuned-cold": "the same with compilation_cache_dir=null: everything compiles "
                                 "in the process",
            "jaxppo-defaults": "jaxppo host loop, library defaults (PureJaxRL's CartPole "
                               "settings: 4 envs x 128 steps, 4x4, lr 2.5e-4 linear over 5e5)",
            "sb3": "Stable-Baselines3 PPO('MlpPolicy', 'CartPole-v1') with its defaults, "
                   f"device=cpu, budget {args.sb3_budget} steps, torch's default threads",
            "sb3-threads": f"the same with torch.set_num_threads({args.sb3_threads})",
        },
        "results": {k: _summary(v) for k, v in runs.items()},
    }
    result["contenders"] = {k: v for k, v in result["contenders"].items() if k in runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "gymnasium-cartpole.json"
    if args.merge and path.exists():  # earlier contenders stay; the added ones say when
        merged = json.loads(path.read_text())
        for name in runs:
            merged["results"][name] = {**result["results"][name], "date": result["date"],
                                       "load_avg": load}
            merged["contenders"][name] = result["contenders"][name]
        result = merged
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"}
                      for k, v in result["results"].items()}, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
