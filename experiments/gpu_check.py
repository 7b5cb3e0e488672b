"""GPU figures in a few minutes: env-only and training steps/s at thousands of envs.

Run on a machine with a GPU through experiments/gpu_check.sh. Prints one JSON object and
writes experiments/results/gpu-<date>.json. `--quick` shrinks everything for a CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxppo
from jaxppo.envs.make import make_env
from jaxppo.core.hyperparams import HyperParams
from jaxppo.program.build import build_program

RESULTS = Path(__file__).resolve().parent / "results"


def env_only_sps(env: str, num_envs: int, steps: int) -> float:
    cfg = jaxppo.PPOConfig(env=env, num_envs=num_envs, num_steps=steps, compilation_cache_dir=None)
    spec = make_env(cfg)

    def run(key):
        keys = jax.random.split(key, num_envs)
        obs, st = jax.vmap(spec.env.reset, in_axes=(0, None))(keys, spec.env_params)

        def step(carry, _):
            st, key = carry
            key, ka, ks = jax.random.split(key, 3)
            a = jax.vmap(spec.env.action_space(spec.env_params).sample)(jax.random.split(ka, num_envs))
            _, st, r, _, _, _ = jax.vmap(spec.env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(ks, num_envs), st, a, spec.env_params)
            return (st, key), r.sum()

        return jax.lax.scan(step, (st, key), None, length=steps)[1].sum()

    f = jax.jit(run).lower(jax.random.PRNGKey(0)).compile()
    jax.block_until_ready(f(jax.random.PRNGKey(1)))
    t = time.perf_counter()
    jax.block_until_ready(f(jax.random.PRNGKey(2)))
    return num_envs * steps / (time.perf_counter() - t)


def train_sps(env: str, num_envs: int, num_steps: int, iters: int, num_devices: int,
              **overrides) -> dict:
    cfg = jaxppo.PPOConfig(env=env, num_envs=num_envs, num_steps=num_steps, num_epochs=4,
                           num_minibatches=4, total_timesteps=num_envs * num_steps * iters * 2,
                           num_devices=num_devices, compilation_cache_dir=None, **overrides)
    hp = HyperParams.from_config(cfg)
    prog = build_program(jaxppo.resolve(cfg, "local"), hp, iters)
    t0 = time.perf_counter()
    state = prog.init(jax.random.PRNGKey(0), hp)
    z, n = jnp.asarray(0, jnp.int32), jnp.asarray(cfg.num_iterations, jnp.int32)
    chunk = prog.chunk.lower(state, hp, z, n).compile() if num_devices == 1 else prog.chunk
    state, m = chunk(state, hp, z, n)  # first chunk (compiles under pmap)
    jax.block_until_ready(m)
    compile_and_first = time.perf_counter() - t0
    t = time.perf_counter()
    state, m = chunk(state, hp, jnp.asarray(iters, jnp.int32), n)
    jax.block_until_ready(m)
    dt = time.perf_counter() - t
    ret = m["episode_return_mean"]
    return {"env": env, "num_envs": num_envs, "num_steps": num_steps, "num_devices": num_devices,
            "sps": num_envs * num_steps * iters / dt, "seconds_per_iteration": dt / iters,
            "compile_plus_first_chunk_s": compile_and_first,
            "last_return": float(jnp.nanmean(jnp.asarray(ret)))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    args = p.parse_args()
    big = [64] if args.quick else [2048, 8192]
    iters = 2 if args.quick else 10
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__,
           "backend": jax.default_backend(),
           "devices": [str(d) for d in jax.local_devices()], "env_only": [], "train": []}
    for env in ("CartPole-v1", "Breakout-MinAtar"):
        for n in big:
            out["env_only"].append({"env": env, "num_envs": n,
                                    "sps": env_only_sps(env, n, 32 if args.quick else 256)})
            print(json.dumps(out["env_only"][-1]), flush=True)
    for env, steps in (("CartPole-v1", 16 if args.quick else 64), ("Breakout-MinAtar", 16 if args.quick else 64)):
        for n in big[:1]:
            out["train"].append(train_sps(env, n, steps, iters, 1))
            print(json.dumps(out["train"][-1]), flush=True)
    ndev = jax.local_device_count()
    if ndev > 1:  # one process over every local GPU, both ways of combining the shards
        for sync in ("gradients", "batch"):
            out["train"].append({**train_sps("CartPole-v1", big[0] * ndev, 16 if args.quick else 64,
                                             iters, ndev, sync=sync), "sync": sync})
            print(json.dumps(out["train"][-1]), flush=True)
    else:
        out["pmap_note"] = "one local device: pmap over all local GPUs is the single-device run"
    RESULTS.mkdir(parents=True, exist_ok=True)
    kind = "gpu" if jax.default_backend() == "gpu" else jax.default_backend()
    path = RESULTS / f"{kind}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
