"""Multi-host (Ray) overhead on loopback: 2 local hosts vs 1, same global batch.

    .venv/bin/python experiments/ray_bench.py [--iterations 20]

Starts a local Ray cluster of 2 nodes x 1 CPU on 127.0.0.1 (ray.cluster_utils.Cluster),
then with PureJaxRL's CartPole config (4 envs x 128 steps, 4 epochs x 4 minibatches, 64-64
tanh) measures, after two warm-up iterations:

  * seconds per iteration with 1 host and with 2 hosts (each host = one Ray actor on its own
    node), the split into rollout (+GAE and statistics) and learning, and the same iteration
    fused in one process (`Algorithm.iteration` under jit) for reference;
  * milliseconds per gradient sync step: hosts' grads -> driver average -> optax -> new
    params to every host (the learning phase divided by epochs x minibatches), and the
    bare transport round trip of a params-sized array to every host and back;
  * bytes moved per iteration: params (once for the rollout and once per step) down and
    grads (+6 loss terms) up, float32, times hosts.

Writes experiments/results/ray-bench.json and prints it. On one machine both "hosts" share its
cores, so this measures the protocol's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20, help="measured iterations per setup")
    ap.add_argument("--out", default=str(RESULTS / "ray-bench.json"))
    args = ap.parse_args()

    from jaxppo.distributed.loopback import LOOPBACK_ENV

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.update(LOOPBACK_ENV)

    import jax
    import numpy as np
    import ray
    from ray.cluster_utils import Cluster

    from jaxppo import PPOConfig
    from jaxppo.algorithm import Algorithm, HyperParams
    from jaxppo.distributed.ray_trainer import RayTrainer, connect

    cfg = PPOConfig(env="CartPole-v1", num_envs=4, num_steps=128, num_epochs=4, num_minibatches=4,
                    total_timesteps=500_000, lr=2.5e-4)
    n_iter = args.iterations
    steps = cfg.num_epochs * cfg.num_minibatches

    # Reference: the whole iteration fused in one XLA program in this process.
    algo = Algorithm(cfg)
    hp = HyperParams.from_config(cfg)
    state = jax.jit(algo.init)(jax.random.PRNGKey(0), hp)
    it = jax.jit(algo.iteration)
    for _ in range(2):
        state, m = it(state, hp)
    jax.block_until_ready(state)
    fused = []
    for _ in range(n_iter):
        t0 = time.perf_counter()
        state, m = it(state, hp)
        jax.block_until_ready(state)
        fused.append(time.perf_counter() - t0)

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False))
    results = {}
    try:
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        connect(cluster.address)
        for hosts in (1, 2):
            trainer = RayTrainer(cfg, hosts).start()
            try:
                for _ in range(2):
                    trainer.run_iteration()
                timings = []
                for _ in range(n_iter):
                    trainer.run_iteration()
                    timings.append(dict(trainer.timing))
                P = trainer.num_params
                x = np.zeros(P, np.float32)
                rtt = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    ray.get([h.echo.remote(x) for h in trainer.hosts])
                    rtt.append(time.perf_counter() - t0)
                compiles = ray.get([h.compile_counts.remote() for h in trainer.hosts])
            finally:
                trainer.shutdown()
            med = lambda k: statistics.median(t[k] for t in timings)  # noqa: E731
            bytes_down = hosts * 4 * P * (1 + steps)
            bytes_up = hosts * 4 * (P + 6) * steps
            results[f"{hosts}_host{'s' if hosts > 1 else ''}"] = {
                "hosts": hosts,
                "envs_per_host": cfg.num_envs // hosts,
                "iteration_ms_median": 1e3 * med("iteration_s"),
                "rollout_phase_ms_median": 1e3 * med("rollout_s"),
                "learn_phase_ms_median": 1e3 * med("learn_s"),
                "sync_step_ms_median": med("sync_step_ms"),
                "sync_step_ms_min": min(t["sync_step_ms"] for t in timings),
                "sync_step_ms_max": max(t["sync_step_ms"] for t in timings),
                "transport_roundtrip_ms_median": 1e3 * statistics.median(rtt),
                "steps_per_second": cfg.batch_size / med("iteration_s"),
                "bytes_per_iteration": {"params_down": bytes_down, "grads_up": bytes_up,
                                        "total": bytes_down + bytes_up},
                "compiled_programs_per_host": compiles,
            }
    finally:
        ray.shutdown()
        cluster.shutdown()

    out = {
        "what": "PPO over Ray on loopback: per-iteration time with 2 local hosts vs 1 (same "
                "global batch) and the cost of each gradient sync step",
        "config": {"env": cfg.env_name, "num_envs": cfg.num_envs, "num_steps": cfg.num_steps,
                   "num_epochs": cfg.num_epochs, "num_minibatches": cfg.num_minibatches,
                   "hidden_sizes": list(cfg.network.hidden_sizes),
                   "num_params": results["1_host"]["bytes_per_iteration"]["params_down"]
                   // (4 * (1 + steps)),
                   "sync_steps_per_iteration": steps},
        "measured_iterations": n_iter,
        "fused_single_process_iteration_ms_median": 1e3 * statistics.median(fused),
        **results,
        "target_sync_step_ms": 5.0,
        "meets_target": results["2_hosts"]["sync_step_ms_median"] <= 5.0,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "jax": jax.__version__,
                    "ray": ray.__version__,
                    "note": "2 Ray nodes x 1 CPU on one machine shared with other work; "
                            "both hosts, the driver and Ray's daemons share its cores"},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
