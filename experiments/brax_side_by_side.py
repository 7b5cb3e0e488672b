"""jaxppo on `brax:<env>` side by side with Brax's own PPO (`brax.training.agents.ppo.train`)
on the same Brax env and budget, on this machine.

    python experiments/brax_side_by_side.py [--cases inverted_pendulum ...] [--rounds 2]

Each run is a fresh process (no compilation cache on either side), the two sides alternating
(jaxppo, brax, jaxppo, brax, ...) so that both see the same machine load, which is recorded.
Writes experiments/results/brax-side-by-side.json: the CPU model, each side's exact settings,
and per run the final eval return (the mean over 128 full episodes), env steps/s with and
without compiling, and the time to the first evaluation after training started.

Cases (`CASES`):
* `inverted_pendulum`: the same settings on both sides wherever the two libraries have the
  same knob (`matched`): Brax's `unroll_length` is jaxppo's `num_steps`, with
  `batch_size * num_minibatches = num_envs`, so one Brax training step is one unroll of every
  env (one jaxppo iteration) and the minibatches hold the same number of transitions; the
  values are Brax's published inverted_pendulum ones where they apply.
* `inverted_pendulum_brax_published`: Brax exactly at its published inverted_pendulum
  settings (unroll_length 5, 16 unrolls per training step, its default networks), jaxppo at
  the closest settings it has (`CASES` says where they differ).
* `inverted_pendulum_brax_published_64x64`: the same with Brax's networks at jaxppo's size,
  so that the steps/s compare the libraries, not the networks.
No halfcheetah: on this 2-core CPU its env alone steps about 4,000 times a second (256 envs,
generalized backend), so a run of a budget it learns in takes hours, not minutes.

What cannot be matched: Brax's policy is a tanh-squashed Gaussian (jaxppo's a Gaussian clipped
to the bounds); Brax standardises advantages per minibatch (jaxppo over the whole batch);
Brax's network factory takes separate policy and value sizes; Brax treats the time limit as a
termination (its default, bootstrap_on_timeout=False) where jaxppo bootstraps it; and Brax
evaluates once more (at step 0).

Steps/s "excluding compile" is measured from the first evaluation after training started to
the last one, on both sides (the same number of training steps and evaluations, and no
compiling in between); "including compile" is the env steps over the wall time of the whole
run, from building the env to the return of the train call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import cpu_model  # experiments/bench.py: the machine's CPU model

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "experiments" / "results" / "brax-side-by-side.json"

def matched(env: str, *, num_timesteps: int, num_envs: int, unroll_length: int,
            num_minibatches: int, num_epochs: int = 4, learning_rate: float = 3e-4,
            entropy_cost: float = 1e-2, discounting: float = 0.97, gae_lambda: float = 0.95,
            reward_scaling: float = 10.0, normalize_observations: bool = True,
            clipping_epsilon: float = 0.3, hidden_sizes=(64, 64), episode_length: int = 1000,
            num_evals: int = 9, num_eval_envs: int = 128, deterministic_eval: bool = True):
    """(Brax's ppo.train kwargs, jaxppo's PPOConfig fields) of one set of settings, with
    batch_size * num_minibatches = num_envs: one Brax training step is one unroll of every
    env, which is one jaxppo iteration of num_steps = unroll_length."""
    brax = dict(
        num_timesteps=num_timesteps, num_envs=num_envs, episode_length=episode_length,
        unroll_length=unroll_length, batch_size=num_envs // num_minibatches,
        num_minibatches=num_minibatches, num_updates_per_batch=num_epochs,
        learning_rate=learning_rate, entropy_cost=entropy_cost, discounting=discounting,
        gae_lambda=gae_lambda, reward_scaling=reward_scaling,
        normalize_observations=normalize_observations, clipping_epsilon=clipping_epsilon,
        vf_loss_coefficient=0.5, num_evals=num_evals, num_eval_envs=num_eval_envs,
        deterministic_eval=deterministic_eval,
        hidden_sizes=list(hidden_sizes))  # -> network_factory (policy and value), swish
    iterations = num_timesteps // (num_envs * unroll_length)
    every = iterations // (num_evals - 1)  # Brax evaluates after each of num_evals - 1 epochs
    jaxppo = dict(
        env=f"brax:{env}", env_kwargs={"max_steps_in_episode": episode_length},
        num_envs=num_envs, num_steps=unroll_length, total_timesteps=num_timesteps,
        num_epochs=num_epochs, num_minibatches=num_minibatches, gamma=discounting,
        gae_lambda=gae_lambda, lr=learning_rate, lr_schedule="constant",
        adam_eps=1e-8,  # optax.adam's default, which Brax uses
        max_grad_norm=1e9,  # Brax clips no gradients by default (max_grad_norm=None)
        clip_param=clipping_epsilon, vf_clip_param=None, vf_coeff=0.5,
        entropy_coeff=entropy_cost, normalize_observations=normalize_observations,
        reward_scaling=reward_scaling,  # -> a reward hook
        network={"hidden_sizes": list(hidden_sizes), "activation": "silu"},  # silu = swish
        eval_every=every, log_every=every, eval_episodes=num_eval_envs,
        eval_deterministic=deterministic_eval)
    return {"env": env, "brax": brax, "jaxppo": jaxppo}


# Brax's published inverted_pendulum settings (brax's training colab and configs):
# 2048 envs, unroll_length 5, 32 minibatches of batch_size 1024 unrolls (so 16 unrolls of every
# env per training step), 4 updates per batch, reward_scaling 10, normalize_observations,
# discounting 0.97, learning_rate 3e-4, entropy_cost 1e-2, episode_length 1000, its default
# networks and stochastic evaluation; num_timesteps 2M (which its ceil rounds up to whole
# training steps). Here num_evals is 9, not 20: on a CPU 20 evaluations of 128 episodes would
# cost more than the training.
BRAX_PUBLISHED_PENDULUM = dict(
    num_timesteps=16 * 163_840, num_envs=2048, episode_length=1000, unroll_length=5,
    batch_size=1024, num_minibatches=32, num_updates_per_batch=4, learning_rate=3e-4,
    entropy_cost=1e-2, discounting=0.97, reward_scaling=10.0, normalize_observations=True,
    num_evals=9, num_eval_envs=128, deterministic_eval=False)

CASES = {
    # The same settings on both sides (unroll_length = num_steps, one unroll per update).
    "inverted_pendulum": matched(
        "inverted_pendulum", num_timesteps=2_097_152, num_envs=2048, unroll_length=16,
        num_minibatches=8),
    # Brax at its published settings; jaxppo at the closest it can run: the same 2048 envs x
    # 80 steps per update (jaxppo's GAE runs over all 80 steps, Brax's over each unroll of 5),
    # 40 minibatches of 4096 transitions (Brax: 32 of 5120; jaxppo's minibatch count must
    # divide num_steps), stochastic evaluation, and 64-64 silu networks (jaxppo has one size
    # for the policy and the value; Brax's defaults are 32x4 and 256x5).
    "inverted_pendulum_brax_published": {
        "env": "inverted_pendulum",
        "brax": dict(BRAX_PUBLISHED_PENDULUM),
        "jaxppo": {**matched("inverted_pendulum", num_timesteps=16 * 163_840, num_envs=2048,
                             unroll_length=80, num_minibatches=40,
                             deterministic_eval=False)["jaxppo"],
                   "eval_every": 2, "log_every": 2},
    },
    # The same, with Brax's networks at jaxppo's size (64-64 swish for its policy and value):
    # the libraries compared at equal network cost.
    "inverted_pendulum_brax_published_64x64": {
        "env": "inverted_pendulum",
        "brax": {**BRAX_PUBLISHED_PENDULUM, "hidden_sizes": [64, 64]},
        "jaxppo": {**matched("inverted_pendulum", num_timesteps=16 * 163_840, num_envs=2048,
                             unroll_length=80, num_minibatches=40,
                             deterministic_eval=False)["jaxppo"],
                   "eval_every": 2, "log_every": 2},
    },
}


# ---------------------------------------------------------------------- one side, one run
def run_brax(case: dict, seed: int) -> dict:
    import functools

    import flax.linen as nn
    import jax
    from jax._src import api as jax_api

    # Brax 0.14.2's PPO calls jax.device_put_replicated, which jax 0.10 no longer exports;
    # the function itself is still jax's (jax._src.api): put it back where Brax looks.
    if not hasattr(jax_api, "device_put_replicated"):
        raise SystemExit("this jax has no device_put_replicated: Brax's PPO cannot run here")
    jax.device_put_replicated = jax_api.device_put_replicated
    from brax import envs
    from brax.training.agents.ppo import networks as ppo_networks
    from brax.training.agents.ppo import train as ppo

    kwargs = dict(case["brax"])
    hidden = kwargs.pop("hidden_sizes", None)
    if hidden is not None:
        kwargs["network_factory"] = functools.partial(
            ppo_networks.make_ppo_networks, policy_hidden_layer_sizes=tuple(hidden),
            value_hidden_layer_sizes=tuple(hidden), activation=nn.swish)
    evals = []  # (seconds since the start, env steps, eval return)
    t0 = time.perf_counter()

    def progress(step, metrics):
        evals.append((time.perf_counter() - t0, int(step), float(metrics["eval/episode_reward"])))

    env = envs.get_environment(case["env"])
    ppo.train(environment=env, progress_fn=progress, seed=seed, **kwargs)
    total = time.perf_counter() - t0
    trained = [e for e in evals if e[1] > 0]  # Brax evaluates once before training, too
    return _figures(evals, trained, total, evals[-1][1])


def run_jaxppo(case: dict, seed: int) -> dict:
    import jaxppo

    fields = dict(case["jaxppo"])
    scale = fields.pop("reward_scaling", 1.0)

    def scale_rewards(hook_state, traj):
        """Brax's reward_scaling as a jaxppo reward hook: before GAE (the metrics and the
        evaluation keep the env's rewards)."""
        return hook_state, traj.reward * scale

    config = jaxppo.PPOConfig(
        **{**fields, "network": jaxppo.NetworkConfig(**fields["network"])},
        transforms=[scale_rewards] if scale != 1.0 else [], seed=seed,
        compilation_cache_dir=None)  # compile in every run, as Brax does
    evals = []
    t0 = time.perf_counter()

    def callback(rows):
        last = rows[-1]
        evals.append((time.perf_counter() - t0, int(last["env_steps"]),
                      float(last["eval_return_mean"])))

    result = jaxppo.train(config, progress=False, callback=callback)
    total = time.perf_counter() - t0
    out = _figures(evals, evals, total, config.num_iterations * config.batch_size)
    out["compile_s"] = round(result.compile_seconds, 2)
    return out


def _figures(evals, trained, total, env_steps) -> dict:
    """Final return and steps/s from the (time, env steps, eval return) of each evaluation."""
    (t1, s1, _), (tn, sn, final) = trained[0], trained[-1]
    return {
        "final_eval_return": round(final, 2),
        "eval_returns": [[s, round(r, 2)] for _, s, r in evals],
        "env_steps": env_steps,
        "sps_excluding_compile": round((sn - s1) / (tn - t1)),
        "sps_including_compile": round(env_steps / total),
        "first_eval_after_training_s": round(t1, 2),
        "total_s": round(total, 2),
    }


# ---------------------------------------------------------------------- the comparison
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=[
        "inverted_pendulum", "inverted_pendulum_brax_published",
        "inverted_pendulum_brax_published_64x64"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "CASE", "SEED"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.worker:  # one run in this process: print its figures as JSON
        side, case, seed = args.worker
        fn = run_jaxppo if side == "jaxppo" else run_brax
        print("RESULT " + json.dumps(fn(CASES[case], int(seed))), flush=True)
        return

    import importlib.metadata as md

    # Cases not run this time keep their earlier figures.
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report.update({
        "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "versions": {p: md.version(p) for p in ("jax", "brax", "mujoco")},
        "cases": {**report.get("cases", {}), **{c: CASES[c] for c in args.cases}},
        "mapping": {
            "unroll_length": "num_steps", "num_updates_per_batch": "num_epochs",
            "batch_size * num_minibatches = num_envs": "one rollout of every env per update",
            "reward_scaling": "a reward hook (transforms) multiplying rewards before GAE",
            "max_grad_norm=None": "max_grad_norm=1e9", "clipping_epsilon_value=None":
            "vf_clip_param=None", "optax.adam eps 1e-8": "adam_eps=1e-8",
            "network_factory (64, 64) swish": "network.hidden_sizes [64, 64], silu",
            "num_eval_envs, deterministic_eval": "eval_episodes, eval_deterministic",
            "num_evals - 1 evaluations after training steps": "eval_every = log_every",
        },
        "runs": report.get("runs", {}),
    })
    for case in args.cases:
        runs = {"jaxppo": [], "brax": []}
        for r in range(args.rounds):
            for side in ("jaxppo", "brax"):
                t, load = time.time(), os.getloadavg()[0]
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", side, case, str(r)],
                    capture_output=True, text=True, cwd=REPO)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not line:
                    raise SystemExit(f"{side} {case} round {r} failed:\n{proc.stderr[-3000:]}")
                fig = json.loads(line[-1][len("RESULT "):])
                fig.update(seed=r, load_average_before=round(load, 2))  # others share the CPU
                runs[side].append(fig)
                print(f"{case} round {r} {side}: return {fig['final_eval_return']}, "
                      f"{fig['sps_excluding_compile']:,} steps/s excl. compile, "
                      f"{fig['sps_including_compile']:,} incl. ({time.time() - t:.0f} s)",
                      flush=True)
        report["runs"][case] = runs
        report.setdefault("summary", {})[case] = _summary(runs)
        print(json.dumps(report["summary"][case], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


def _summary(runs: dict) -> dict:
    import statistics

    def mean(side, key):
        return round(statistics.mean(r[key] for r in runs[side]), 2)

    out = {}
    for side in runs:
        out[side] = {k: mean(side, k) for k in (
            "final_eval_return", "sps_excluding_compile", "sps_including_compile", "total_s")}
    for k in ("sps_excluding_compile", "sps_including_compile"):
        out[f"{k}_ratio_jaxppo_over_brax"] = round(out["jaxppo"][k] / out["brax"][k], 3)
    out["return_ratio_jaxppo_over_brax"] = round(
        out["jaxppo"]["final_eval_return"] / out["brax"]["final_eval_return"], 3)
    return out


if __name__ == "__main__":
    main()
