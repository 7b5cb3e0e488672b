"""envpool Atari on this machine: the env's speed, the Atari torsos' cost, and a short run.

    .venv/bin/python experiments/envpool_atari.py [--steps 2000] [--reps 6] [--run-steps 102400]

* env: envpool Breakout-v5 with 8 envs (CleanRL's preprocessing), random actions, synchronous
  `step`: raw envpool, then jaxppo's SAME_STEP vector env (`EnvpoolVectorEnv`), alternated;
* torsos: forward + backward (the gradient of a scalar of the actor-critic's outputs) of a
  1024 batch of 84x84x4 frames and the 8-env policy forward, for the Nature and IMPALA CNNs,
  each with its convolutions computed both ways `jaxppo.core.networks.Conv` can (one matmul
  over windows; XLA's convolution), alternated rep by rep; min and median;
* with --run-steps N: jaxppo.train on envpool:Breakout-v5 with the tuned config for N env
  steps through the host loop: its env steps/s, and the game scores of the whole games played
  (recorded from the vector env's episode_reward / episode_end).
Writes experiments/results/envpool-atari.json with the CPU model and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import cpu_model  # experiments/bench.py: the machine's CPU model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def env_speed(steps: int, rounds: int = 6) -> dict:
    """Env steps/s of 8 Breakout-v5 envs: raw envpool and jaxppo's vector env, alternated."""
    import envpool

    from jaxppo.envs.envpool_suite import ATARI_DEFAULTS, EnvpoolEnv

    raw = envpool.make("Breakout-v5", env_type="gymnasium", num_envs=8, batch_size=8, seed=0,
                       **ATARI_DEFAULTS)
    raw.reset()
    ours = EnvpoolEnv("Breakout-v5").make_vec(8)
    ours.reset(seed=list(range(8)))
    rng = np.random.default_rng(0)
    rates = {"raw_envpool": [], "jaxppo_vector_env": []}
    for _ in range(rounds):
        for name, envs in (("raw_envpool", raw), ("jaxppo_vector_env", ours)):
            actions = rng.integers(0, 4, (steps, 8)).astype(np.int32)
            t = time.perf_counter()
            for a in actions:
                envs.step(a)
            rates[name].append(8 * steps / (time.perf_counter() - t))
    raw.close()
    ours.close()
    return {k: {"env_steps_per_s_median": statistics.median(v), "env_steps_per_s_max": max(v),
                "rounds": v} for k, v in rates.items()}


def torso_cost(reps: int, batch: int = 1024, torsos=("nature_cnn", "impala_cnn")) -> dict:
    """ms of forward+backward [batch] and of the policy forward [8] per torso and conv."""
    import jax
    import jax.numpy as jnp

    import jaxppo
    from jaxppo.core import networks

    frames = np.random.default_rng(0).integers(0, 256, (batch, 84 * 84 * 4)).astype(np.float32)
    x, x8 = jnp.asarray(frames), jnp.asarray(frames[:8])
    fns, chosen = {}, (networks.NATURE_CONV_VIA, networks.IMPALA_CONV_VIA)
    for torso in torsos:
        for conv in ("windows", "xla"):
            # the torsos read these when they are traced
            networks.NATURE_CONV_VIA = networks.IMPALA_CONV_VIA = conv
            try:
                cfg = jaxppo.PPOConfig(env="envpool:Breakout-v5", network=jaxppo.NetworkConfig(
                    torso=torso, shared_trunk=True), compilation_cache_dir=None)
                net = jaxppo.resolve(cfg).network
                params = net.init(jax.random.PRNGKey(0), x8)

                def loss(p, obs, net=net):
                    dist, value, _ = net.apply(p, obs)
                    return jnp.sum(dist.loc ** 2) + jnp.sum(value ** 2)

                grad, fwd = jax.jit(jax.grad(loss)), jax.jit(net.apply)
                jax.block_until_ready(grad(params, x))
                jax.block_until_ready(fwd(params, x8))
            finally:
                networks.NATURE_CONV_VIA, networks.IMPALA_CONV_VIA = chosen
            count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
            fns[(torso, conv)] = (grad, fwd, params, count)
    times = {k: ([], []) for k in fns}
    for _ in range(reps):
        for key, (grad, fwd, params, _) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(grad(params, x))
            times[key][0].append(time.perf_counter() - t)
            for _ in range(5):
                t = time.perf_counter()
                jax.block_until_ready(fwd(params, x8))
                times[key][1].append(time.perf_counter() - t)
    out = {}
    for (torso, conv), (fb, f8) in times.items():
        out.setdefault(torso, {"params": fns[(torso, conv)][3]})[conv] = {
            f"fwd_bwd_{batch}_ms_min": 1e3 * min(fb),
            f"fwd_bwd_{batch}_ms_median": 1e3 * statistics.median(fb),
            "fwd_8_ms_min": 1e3 * min(f8), "fwd_8_ms_median": 1e3 * statistics.median(f8)}
    return out


def short_run(env_steps: int) -> dict:
    """jaxppo.train on envpool:Breakout-v5 with the tuned config for env_steps, in this
    process: its env steps/s, the host loop's reported episode return, and the game scores of
    the whole games played, recorded from the vector env's episode_reward / episode_end (the
    host loop of this commit reports the learning episode: one life, clipped rewards)."""
    import jaxppo
    from jaxppo.envs import envpool_suite

    games: list[tuple[int, float]] = []  # (env steps so far, the game's score)
    step, counter = envpool_suite.EnvpoolVectorEnv.step, {"steps": 0}

    def recording_step(self, actions):
        out = step(self, actions)
        info = out[4]
        score = self.__dict__.setdefault("_score", np.zeros(self.num_envs))
        score += info["episode_reward"]
        counter["steps"] += self.num_envs
        for i in np.flatnonzero(info["episode_end"]):
            games.append((counter["steps"], float(score[i])))
            score[i] = 0.0
        return out

    envpool_suite.EnvpoolVectorEnv.step = recording_step
    try:
        cfg = jaxppo.PPOConfig.tuned("envpool:Breakout-v5", total_timesteps=env_steps,
                                     checkpoint_minutes=0.0)
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            result = jaxppo.train(cfg, run_dir=Path(tmp) / "run", progress=False)
            wall = time.perf_counter() - t
    finally:
        envpool_suite.EnvpoolVectorEnv.step = step
    learning = [float(v) for v in result.metrics["episode_return_mean"][0]]
    return {"env_steps": int(cfg.num_iterations * cfg.batch_size), "wall_seconds": wall,
            "train_seconds": result.train_seconds, "compile_seconds": result.compile_seconds,
            "sps": int(cfg.num_iterations * cfg.batch_size) / result.train_seconds,
            "games": len(games),
            "game_score_mean_first_20_games": _mean([s for _, s in games[:20]]),
            "game_score_mean_last_20_games": _mean([s for _, s in games[-20:]]),
            "learning_episode_return_mean_last_10_iterations": float(np.nanmean(learning[-10:])),
            "game_scores": games, "learning_episode_return_mean_by_iteration": learning}


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="vector-env steps per timing round")
    ap.add_argument("--reps", type=int, default=6, help="timed reps per torso and conv")
    ap.add_argument("--run-steps", type=int, default=0,
                    help="env steps of the training run (0: none)")
    ap.add_argument("--batch", type=int, default=1024, help="the forward+backward batch")
    ap.add_argument("--torsos", nargs="+", default=["nature_cnn", "impala_cnn"])
    ap.add_argument("--skip", nargs="*", default=[], choices=["env", "torsos"])
    args = ap.parse_args()
    out = {"cpu": cpu_model(), "load_avg_before": os.getloadavg()}
    if "env" not in args.skip:
        out["breakout_8_envs"] = env_speed(args.steps)
        print(json.dumps(out["breakout_8_envs"], indent=1), flush=True)
    if "torsos" not in args.skip:
        out[f"torsos_batch_{args.batch}"] = torso_cost(args.reps, args.batch, args.torsos)
        print(json.dumps(out[f"torsos_batch_{args.batch}"], indent=1), flush=True)
    if args.run_steps:
        out["breakout_run"] = short_run(args.run_steps)
        print(json.dumps({k: v for k, v in out["breakout_run"].items()
                          if k not in ("game_scores", "learning_episode_return_mean_by_iteration")},
                         indent=1), flush=True)
    out["load_avg_after"] = os.getloadavg()
    path = RESULTS / "envpool-atari.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(out)
    path.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
