"""Where one training iteration's time goes: rollout, update (values, GAE, epochs x
minibatches) and the whole iteration, per layout, with the cores each keeps busy.

    .venv/bin/python experiments/phases.py                          # Breakout-MinAtar, 64 envs
    .venv/bin/python experiments/phases.py --env CartPole-v1 --num-envs 4 --iterations 100

Each layout runs in a fresh process (one CPU device per core is fixed when JAX starts):
`one core, one device` pinned with taskset to the first allowed core; `all cores, one
device`; `all cores, envs split over N devices` (gradients all-reduced every minibatch, as
`num_devices: auto` does at 8 or more envs per device). Each phase is compiled as a loop of
`--iterations` iterations in one program, run `--repeats` times; the fastest counts (the
machine's other load only ever slows a run down). Cores busy = (user + sys CPU seconds) /
wall seconds of the timed runs. Results go to experiments/results/phases-<env>-<envs>.json.

The ratios to read: all cores / one core on one device is the intra-op parallelism XLA
already finds in one program (its matmuls fan out over the cores); the split over N
devices can only add to the phases that one device leaves serial.
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
RESULTS = ROOT / "experiments" / "results"

WORKER = r"""
import json, resource, sys, time
spec = json.loads(sys.argv[1])
import jax
import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.run.runner import ChunkRunner
from jaxppo.program.build import build_program
from jaxppo.program.resolved import resolve

n_dev, N = spec["devices"], spec["iterations"]
cfg = jaxppo.PPOConfig(
    env=spec["env"], num_envs=spec["num_envs"], num_steps=128, num_epochs=4, num_minibatches=4,
    total_timesteps=10**9, lr=2.5e-4, lr_schedule="constant", entropy_coeff=0.01,
    max_grad_norm=0.5, num_devices=n_dev, compilation_cache_dir=None,
    network=jaxppo.NetworkConfig(hidden_sizes=(64, 64), activation="tanh", torso="mlp"))
AX = "device"
algo = Algorithm.create(resolve(cfg), axis_name=AX if n_dev > 1 else None)
hp = HyperParams.from_config(algo.config)


def loops(state, traj):
    # Each loop returns the whole state it carried, so nothing it computes is left out.
    def rollouts(s):
        return jax.lax.scan(lambda s, _: (ppo.rollout(algo, s, hp)[0], None), s, None,
                            length=N)[0]

    def updates(s):  # the same rollout N times: values, GAE and learning only
        def body(s, _):
            s2, _ = ppo.update(algo, s, traj, algo.spec.actor_ids(s.env_ids), hp, s.env_steps,
                               s.obs_stats)
            return s2.replace(env_state=s.env_state), None
        return jax.lax.scan(body, s, None, length=N)[0]

    def iterations(s):
        return jax.lax.scan(lambda s, _: ppo.iteration(algo, s, hp), s, None,
                            length=N)[0]
    return {"rollout": rollouts, "update": updates, "iteration": iterations}


key = jax.random.PRNGKey(0)
fns = {}
if n_dev == 1:  # the phases, each a loop of N iterations in one program
    state = jax.jit(lambda k: ppo.init(algo, k, hp))(key)
    traj = jax.jit(lambda s: ppo.rollout(algo, s, hp)[1])(state)
    fns = {k: (lambda f: (lambda: f(state, traj)))(jax.jit(lambda s, t, f=k: loops(s, t)[f](s)))
           for k in ("rollout", "update", "iteration")}
# Training as jaxppo.train runs it: the program of this layout, N iterations per chunk.
runner = ChunkRunner(build_program(resolve(cfg), hp, N), hp, key)
fns["training"] = lambda: runner.train_chunk(0, N)
out = {}
for name, fn in fns.items():
    jax.block_until_ready(fn())  # compile and warm up
    best, cpu, wall = float("inf"), 0.0, 0.0
    for _ in range(spec["repeats"]):
        r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
        jax.block_until_ready(fn())
        dt = time.perf_counter() - t; r1 = resource.getrusage(resource.RUSAGE_SELF)
        best = min(best, dt); wall += dt
        cpu += (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    out[name] = {"ms_per_iteration": best / N * 1e3, "cores_busy": cpu / wall}
print(json.dumps({"devices": len(jax.devices()), "local_envs": algo.local_envs, **out}))
"""


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def run(spec: dict, pin: list[str], cpu_devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAXPPO_CPU_DEVICES"] = str(cpu_devices)
    p = subprocess.run([*pin, sys.executable, "-c", WORKER, json.dumps(spec)], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"phase worker failed ({spec}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="Breakout-MinAtar")
    ap.add_argument("--num-envs", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="JSON path (default experiments/results/phases-<env>-<envs>.json)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    base = {"env": args.env, "num_envs": args.num_envs, "iterations": args.iterations,
            "repeats": args.repeats}
    layouts = []
    if len(cores) > 1 and shutil.which("taskset"):
        layouts.append(("one core, one device", ["taskset", "-c", str(cores[0])], 1, 1))
    layouts.append(("all cores, one device", [], len(cores), 1))
    if len(cores) > 1 and args.num_envs % len(cores) == 0:
        layouts.append((f"all cores, envs split over {len(cores)} devices", [], len(cores),
                        len(cores)))
    rows = {}
    for name, pin, cpu_devices, devices in layouts:
        rows[name] = run({**base, "devices": devices}, pin, cpu_devices)
        r = rows[name]
        print(f"{name:40s} " + "  ".join(
            f"{k} {r[k]['ms_per_iteration']:7.2f} ms ({r[k]['cores_busy']:.2f} cores)"
            for k in ("rollout", "update", "iteration", "training") if k in r), flush=True)
    out = {"cpu": cpu_model(), "cores": len(cores), "config": base,
           "time": time.strftime("%Y-%m-%d %H:%M"), "layouts": rows}
    path = Path(args.out) if args.out else RESULTS / f"phases-{args.env}-{args.num_envs}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
