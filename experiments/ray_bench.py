"""Multi-host training on a loopback Ray cluster against one plain process, side by side.

    .venv/bin/python experiments/ray_bench.py [--rounds 3] [--skip-minatar]

Starts a Ray cluster of 2 nodes x 1 CPU on 127.0.0.1 (ray.cluster_utils.Cluster) and, in
alternating runs (a plain `jaxppo.train` in a fresh process, then `train_distributed` on the
cluster), measures env steps/s of the compiled training (compile excluded):

  same_batch      PureJaxRL's CartPole config (4 envs x 128 steps, 4 epochs x 4 minibatches,
                  64-64 tanh), 3e5 steps: one unpinned process vs 2 hosts, same global batch;
                  the hosts unpinned, and pinned to a core each (as on `make ray-cluster`)
  weak_cartpole   the same config per host, each process pinned to its own core (taskset /
                  sched_setaffinity): 1 process on core 0 with 4 envs vs 2 hosts with 8 envs;
                  efficiency = sps(2 hosts) / (2 x sps(1 process))
  one_host        1 Ray host pinned to core 0 vs 1 process pinned to core 0 (4 envs)
  weak_minatar    the tuned Breakout-MinAtar config per host (64 envs, 256-256 MLP), pinned
                  as above, 12 iterations per run

each for both `sync` modes where it matters ("gradients": one all-reduce per minibatch;
"batch": one all-gather of the rollout per iteration), and the collectives themselves: how
many per iteration and their bytes (counted from the config and from the compiled HLO), and
the time of one all-reduce of the gradient across the 2 hosts with gloo's polling thread at
normal priority and at SCHED_IDLE. Writes experiments/results/ray-bench.json with the CPU
model; on one machine the hosts share its 2 cores and its loopback, so this measures what the
design costs, not what a cluster gains.
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"

CARTPOLE = dict(env="CartPole-v1", num_envs=4, num_steps=128, num_epochs=4, num_minibatches=4,
                total_timesteps=300_000, lr=2.5e-4)

SINGLE = r'''
import json, sys, numpy as np, jaxppo
cfg = jaxppo.PPOConfig.from_dict(json.loads(sys.argv[1]))
r = jaxppo.train(cfg, progress=False)
steps = r.iterations_done * cfg.batch_size * cfg.num_seeds
print("RESULT " + json.dumps({"sps": steps / r.train_seconds,
      "ms_per_iteration": 1e3 * r.train_seconds / r.iterations_done,
      "compile_s": r.compile_seconds,
      "final_return": float(np.nanmean(r.metrics["episode_return_mean"][0, -10:]))}))
'''


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def final_return(metrics) -> float:
    import numpy as np

    r = np.asarray(metrics["episode_return_mean"], float)[..., -10:]  # every seed's last 10
    r = r[np.isfinite(r)]
    return float(r.mean()) if len(r) else float("nan")


def run_single(cfg: dict, cpu: int | None) -> dict:
    cmd = [sys.executable, "-c", SINGLE, json.dumps(cfg)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def run_hosts(cfg: dict, hosts: int, pin: bool) -> dict:
    from jaxppo import PPOConfig
    from jaxppo.distributed import train_distributed

    config = PPOConfig.from_dict(cfg)
    r = train_distributed(config, hosts=hosts, progress=False, plot=False,
                          pin_cpus=[[k] for k in range(hosts)] if pin else None)
    steps = (r.iterations_done) * config.batch_size
    return {"sps": steps / r.train_seconds,
            "ms_per_iteration": 1e3 * r.train_seconds / r.iterations_done,
            "compile_s": r.compile_seconds, "final_return": final_return(r.metrics)}


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def compare(name: str, single_cfg: dict, hosts_cfg: dict, hosts: int, pin: bool, rounds: int,
            weak: bool, single_cpu: int | None = 0) -> dict:
    """Alternating rounds of one plain process (pinned to `single_cpu` when the hosts are
    pinned) and `hosts` Ray hosts (each pinned to its own core with `pin`)."""
    singles, multis = [], []
    for k in range(rounds):
        singles.append(run_single(single_cfg, single_cpu if pin else None))
        multis.append(run_hosts(hosts_cfg, hosts, pin))
        print(f"  {name} round {k + 1}: 1 process {singles[-1]['sps']:,.0f} steps/s, "
              f"{hosts} host(s) {multis[-1]['sps']:,.0f} steps/s", flush=True)
    s, m = median(singles, "sps"), median(multis, "sps")
    out = {"hosts": hosts, "hosts_pinned": pin, "single_pinned": pin and single_cpu is not None,
           "single_config": single_cfg, "hosts_config": hosts_cfg,
           "single": singles, "multi": multis, "single_sps_median": s, "hosts_sps_median": m,
           "single_ms_per_iteration_median": median(singles, "ms_per_iteration"),
           "hosts_ms_per_iteration_median": median(multis, "ms_per_iteration")}
    if weak:
        out["weak_scaling_efficiency"] = m / (hosts * s)
    else:
        out["sps_ratio_hosts_over_single"] = m / s
        out["iteration_time_ratio_hosts_over_single"] = (
            out["hosts_ms_per_iteration_median"] / out["single_ms_per_iteration_median"])
    print(f"{name}: " + ", ".join(f"{k}={v:.3f}" for k, v in out.items()
                                  if k.endswith(("efficiency", "ratio_hosts_over_single"))),
          flush=True)
    return out


def collectives(cfg: dict, sync: str, shards: int = 2) -> dict:
    """Collectives per iteration and their payloads, from the config, checked against the
    static counts in the compiled chunk (2 forced CPU devices in a subprocess)."""
    code = r'''
import json, os, re, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import jaxppo
from jaxppo.core.hyperparams import HyperParams
from jaxppo.program.build import build_program
cfg = jaxppo.PPOConfig.from_dict(json.loads(sys.argv[1])).replace(num_devices=2, compilation_cache_dir=None)
hp = HyperParams.from_config(cfg)
prog = build_program(jaxppo.resolve(cfg, "local"), hp, 1)
state = prog.init(jax.random.PRNGKey(0), hp)
z = jnp.asarray(0, jnp.int32)
text = prog.chunk.lower(state, hp, z, z).compile().as_text()
params = int(ravel_pytree(jax.tree.map(lambda x: x[0], state.params))[0].size)
print("RESULT " + json.dumps({"all_reduce_ops": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)),
      "all_gather_ops": len(re.findall(r"= \S+ all-gather(?:-start)?\(", text)), "num_params": params}))
'''
    out = subprocess.run([sys.executable, "-c", code, json.dumps({**cfg, "sync": sync})],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    hlo = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    steps = cfg["num_epochs"] * cfg["num_minibatches"]
    grad_bytes = 4 * (hlo["num_params"] + 7)  # flat gradient + 7 loss terms, float32
    if sync == "gradients":
        per_iter = {"all_reduce": steps, "all_gather": 2}
        payload = {"all_reduce_bytes_each": grad_bytes,
                   "bytes_per_iteration_sent_per_host": steps * grad_bytes}
    else:
        per_iter = {"all_reduce": 0, "all_gather": 1}
        payload = {"note": "all-gather of the rollout: T x E_local x (obs, final obs, action, "
                           "log-prob, dist, reward, flags, episode trackers) floats per host"}
    return {"sync": sync, "per_iteration": per_iter, "static_ops_in_compiled_chunk": hlo,
            **payload}


def all_reduce_times(sizes: list[int]) -> dict:
    """ms per all-reduce across 2 pinned hosts, for each payload size (floats), measured by
    the learners after start-up; plus the start-up measurement before/after SCHED_IDLE."""
    import ray

    from jaxppo import PPOConfig, resolve
    from jaxppo.core.hyperparams import HyperParams
    from jaxppo.distributed.group import HostGroup

    cfg = PPOConfig(**{**CARTPOLE, "num_envs": 8}, compilation_cache_dir=None)
    group = HostGroup(resolve(cfg), HyperParams.from_config(cfg), 2, chunk_len=1,
                      pin_cpus=[[0], [1]]).start()
    try:
        stats = ray.get([a.stats.remote() for a in group.learners])
        times = {}
        for n in sizes:
            ms = ray.get([a.time_all_reduce.remote(n, 50) for a in group.learners])
            times[str(n)] = max(ms)
    finally:
        group.close()
    return {"startup_16_floats": stats, "ms_by_floats": times}


def num_params(cfg: dict) -> int:
    import jax

    from jaxppo import PPOConfig, resolve
    from jaxppo.core import ppo
    from jaxppo.core.algorithm import Algorithm
    from jaxppo.core.hyperparams import HyperParams

    config = PPOConfig.from_dict(cfg)
    algo = Algorithm.create(resolve(config))
    state = jax.eval_shape(lambda k, h: ppo.init(algo, k, h), jax.random.PRNGKey(0),
                           HyperParams.from_config(config))
    return int(sum(x.size for x in jax.tree.leaves(state.params)))


def network_model(num_params: int, minibatch_steps: int) -> dict:
    """Per-iteration all-reduce time on real networks (2 hosts, ring all-reduce: each host
    sends and receives about the payload once per all-reduce, in 2 latency-bound steps)."""
    payload = 4 * (num_params + 7)
    out = {"num_params": num_params, "all_reduces_per_iteration": minibatch_steps}
    for gbit in (10, 100):
        for latency_us in (50,):
            per = 2 * latency_us * 1e-6 + payload / (gbit * 1e9 / 8)
            out[f"{gbit}Gbit_{latency_us}us"] = {"ms_per_all_reduce": per * 1e3,
                                                 "ms_per_iteration": minibatch_steps * per * 1e3}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per comparison")
    ap.add_argument("--skip-minatar", action="store_true", help="skip the MinAtar weak scaling")
    ap.add_argument("--out", default=str(RESULTS / "ray-bench.json"))
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="run only these comparisons (e.g. one_host weak_minatar_gradients); "
                         "the other results of --out are kept")
    args = ap.parse_args()

    from jaxppo.distributed.loopback import LOOPBACK_ENV

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.update(LOOPBACK_ENV)

    import ray
    from ray.cluster_utils import Cluster

    from jaxppo import PPOConfig
    from jaxppo.distributed.cluster import _quiet_fork_warning, connect

    os.environ.setdefault("RAY_worker_niceness", "0")
    cache = str(ROOT / ".cache" / "ray-bench-xla")
    cart = {**CARTPOLE, "compilation_cache_dir": cache}
    minatar = PPOConfig.tuned("Breakout-MinAtar").to_dict()
    minatar.update(total_timesteps=64 * 128 * 12, log_every=6, compilation_cache_dir=cache)

    previous = json.loads(Path(args.out).read_text()) if args.only and Path(args.out).exists() else {}
    result = {**previous, "cpu": cpu_model(), "cores": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds}
    rounds = args.rounds
    jobs = {"collectives": lambda: {s: collectives(CARTPOLE, s) for s in ("gradients", "batch")},
            "all_reduce": lambda: all_reduce_times([16, num_params(CARTPOLE) + 7, 100_000, 350_000]),
            "network_model_cartpole": lambda: network_model(num_params(CARTPOLE), 16),
            "network_model_minatar": lambda: network_model(num_params(minatar), 32)}
    for sync in ("gradients", "batch"):
        c = {**cart, "sync": sync}
        jobs[f"same_batch_{sync}"] = lambda c=c, sync=sync: compare(
            f"same batch, sync={sync}", c, c, 2, False, rounds, weak=False)
        # As on `make ray-cluster`, where each worker node owns one core.
        jobs[f"same_batch_pinned_{sync}"] = lambda c=c, sync=sync: compare(
            f"same batch, hosts pinned, sync={sync}", c, c, 2, True, rounds, weak=False,
            single_cpu=None)
        jobs[f"weak_cartpole_{sync}"] = lambda c=c, sync=sync: compare(
            f"weak scaling CartPole, sync={sync}", c, {**c, "num_envs": 8}, 2, True, rounds,
            weak=True)
    jobs["one_host"] = lambda: compare("1 host vs 1 process", cart, cart, 1, True, rounds,
                                       weak=False)
    if not args.skip_minatar:
        for sync in ("gradients", "batch"):
            c = {**minatar, "sync": sync}
            jobs[f"weak_minatar_{sync}"] = lambda c=c, sync=sync: compare(
                f"weak scaling Breakout-MinAtar, sync={sync}", c, {**c, "num_envs": 128}, 2,
                True, max(2, rounds - 1), weak=True)
    unknown = set(args.only or ()) - set(jobs)
    if unknown:
        ap.error(f"unknown --only {sorted(unknown)}; choose from {sorted(jobs)}")
    with _quiet_fork_warning():
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False,
            object_store_memory=200 * 1024 * 1024))
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1",
                         object_store_memory=200 * 1024 * 1024)
    cluster.wait_for_nodes()
    connect(cluster.address)
    try:
        for name, job in jobs.items():
            if not args.only or name in args.only:
                print(f"{name} ...", flush=True)
                result[name] = job()
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
