"""jaxppo's IPPO on `jaxmarl:MPE_simple_spread_v3` side by side with JaxMARL's own baseline
(`IPPO/ippo_ff_mpe.py`'s `make_train`, at `config/ippo_ff_mpe.yaml`) on this machine; with
`--smax MAP`, jaxppo's IPPO with a GRU on `jaxmarl:smax:MAP` against JaxMARL's
`IPPO/ippo_rnn_smax.py` at `config/ippo_rnn_smax.yaml` (its map replaced by MAP).

    python experiments/jaxmarl_bench.py --anchors DIR --jaxmarl-python PY [--steps 2e6]
        [--seeds 2] [--rounds 2] [--vmap] [--jaxppo-api train]
        [--smax 3m [--together] [--alone] [--jaxmarl-network]]

DIR holds JaxMARL's baseline scripts (IPPO/ippo_ff_mpe.py, IPPO/config/ippo_ff_mpe.yaml); PY
is a Python whose environment has what they import (jaxmarl, distrax, hydra-core, omegaconf,
wandb, matplotlib) at jaxppo's jax and flax versions; jaxppo's side runs with this Python.
Each run is a fresh process, the two sides alternating (jaxppo, jaxmarl, jaxppo, ...), each
`jax.jit(train)` run seed after seed over `--seeds` keys (`--vmap`: `jax.jit(jax.vmap(train))`
over them at once), compiled ahead of time so that compiling and training are timed apart.
`--jaxppo-api train` runs jaxppo's side as a user calls it instead: `jaxppo.train` with
`num_seeds` (its own layout of the seeds over the machine's CPU devices), timed by the compile
and training seconds it reports.
Writes experiments/results/jaxmarl-bench.json: the CPU model, the settings, and per run the
final return (per seed the mean over the last 10 iterations of the mean team return of the
episodes that ended in the iteration), env steps/s (env transitions of every seed, each
holding every agent's step) and the cores busy (the process's user+sys CPU time over the
wall time of training).

`--smax MAP --together` compares learning, not speed: one run a side, both sides at once
(each a fresh process on the shared cores), written to
experiments/results/jaxmarl-smax-MAP-learning.json. `--alone` runs jaxppo's side alone and
adds its record to that file's runs (after a change to jaxppo; JaxMARL's side is the same
program at the same seeds). `--jaxmarl-network` gives jaxppo's side JaxMARL's own network
(`jaxmarl_network()`, a module of one's own) instead of jaxppo's built-in one, and runs it
alone in the same way.

Both report the team return as JaxMARL's MPE baselines log it: the sum over the agents of
each agent's episode return (MPELogWrapper scales each agent's return by the agent count,
then the batch mean averages over agents). For JaxMARL the mean over the episodes that
ended is taken from its per-step info (the script itself logs the mean over every step of
the last ended episode's return).

What differs at the same settings: JaxMARL treats MPE's 25-step time limit as a terminal
state, jaxppo bootstraps it; JaxMARL standardises advantages per minibatch, jaxppo over the
iteration's batch; JaxMARL's minibatches are a permutation of all samples, jaxppo's cut each
env's shuffled steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench import cpu_model  # experiments/bench.py: the machine's CPU model

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "experiments" / "results" / "jaxmarl-bench.json"
ENV = "MPE_simple_spread_v3"
SEED = 30  # ippo_ff_mpe.yaml's
# Seeds as one vmapped program (--vmap), else one program run seed after seed. On this
# machine JaxMARL's vmapped ippo_ff_mpe stalled (no CPU used) beyond about 10 iterations.
VMAP = "--vmap" in sys.argv
SMAX_OUT = REPO / "experiments" / "results" / "jaxmarl-smax-bench.json"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def final_returns(per_iteration) -> dict:
    """Per seed, the mean over the first and the last 10 iterations of the per-iteration
    return ([seeds, iterations], NaN where no episode ended)."""
    import numpy as np

    r = np.asarray(per_iteration, np.float64)
    return {"final_return": [float(np.nanmean(s[-10:])) for s in r],
            "first_return": [float(np.nanmean(s[:10])) for s in r]}


def seed_keys(seeds: int, first: int = 0):
    """The keys of seeds first .. first + seeds - 1: jax.random.split's keys do not depend on
    how many are asked for, so seed i has the same key in every run (seeds 4-7 of a later run
    continue seeds 0-3 of an earlier one)."""
    import jax

    return jax.random.split(jax.random.PRNGKey(SEED), first + seeds)[first:]


def timed(train, keys) -> tuple[object, dict]:
    """Compile `train` ahead of time (`jit(vmap(train))` with VMAP, else `jit(train)` of one
    key), then run it over `keys` (one program, or one seed after another): (output with a
    leading seed axis, timings)."""
    import jax

    t0, c0 = time.perf_counter(), cpu_seconds()
    program = jax.jit(jax.vmap(train)) if VMAP else jax.jit(train)
    compiled = program.lower(keys if VMAP else keys[0]).compile()
    t1, c1 = time.perf_counter(), cpu_seconds()
    if VMAP:
        out = jax.block_until_ready(compiled(keys))
    else:
        outs = [jax.block_until_ready(compiled(k)) for k in keys]
        out = jax.tree.map(lambda *x: jax.numpy.stack(x), *outs)
    t2, c2 = time.perf_counter(), cpu_seconds()
    return out, {"compile_s": t1 - t0, "train_s": t2 - t1, "cores_busy": (c2 - c1) / (t2 - t1)}


def run_jaxppo(steps: float, seeds: int, config_file: Path, api: str = "make_train") -> dict:
    """jaxppo's side: `make_train`'s function timed as the baseline's is (`timed`), or with
    api="train" `jaxppo.train(config with num_seeds=seeds)` as a user calls it (its own
    layout of the seeds over this machine's CPU devices; its compile and training times as it
    reports them; cores busy over the whole call)."""
    import jax
    import numpy as np

    import jaxppo
    from jaxppo.run.train import make_train

    config = jaxppo.PPOConfig.from_file(str(config_file)).replace(
        total_timesteps=int(steps), num_seeds=1)
    if api == "train":
        t0, c0 = time.perf_counter(), cpu_seconds()
        result = jaxppo.train(config.replace(num_seeds=seeds, seed=SEED), progress=False,
                              plot=False)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        metrics = {k: np.reshape(result.metrics[k], (seeds, -1))  # [seeds, iterations]
                   for k in ("env_steps", "episode_return_mean")}
        t = {"compile_s": result.compile_seconds, "train_s": result.train_seconds,
             "cores_busy": cpu / wall, "cores_busy_over": "the whole jaxppo.train call",
             "api": "jaxppo.train", "layout": result.layout}
    else:
        keys = jax.random.split(jax.random.PRNGKey(SEED), seeds)
        (_, metrics), t = timed(make_train(config), keys)
    env_steps = int(metrics["env_steps"][0, -1]) * seeds
    return {**t, **final_returns(metrics["episode_return_mean"]), "env_steps": env_steps,
            "steps_per_s": env_steps / t["train_s"],
            "iterations": int(metrics["env_steps"].shape[1])}


def ended_log_wrapper(log_wrapper: type) -> type:
    """A baseline's log wrapper class, with the returns of the episodes that ended in the step
    (zero elsewhere) in info["ended_return"]: the batch means of it and of `returned_episode`
    give the mean return of the episodes that ended (`ended_means`)."""

    class EndedLogWrapper(log_wrapper):
        def step(self, key, state, action):
            obs, state, reward, done, info = super().step(key, state, action)
            info["ended_return"] = info["returned_episode_returns"] * info["returned_episode"]
            return obs, state, reward, done, info

    return EndedLogWrapper


def ended_means(metrics) -> "np.ndarray":
    """The mean return of the episodes that ended, per seed and iteration [seeds,
    iterations] (NaN where none did), from the batch means per iteration of the
    `ended_log_wrapper`'s info."""
    import numpy as np

    ended = np.asarray(metrics["returned_episode"], np.float64)
    ret = np.asarray(metrics["ended_return"])
    return np.where(ended > 0, ret / np.maximum(ended, 1e-12), np.nan)


def run_jaxmarl(steps: float, seeds: int, anchors: Path) -> dict:
    import jax
    import numpy as np
    import yaml

    sys.path.insert(0, str(anchors / "IPPO"))
    import ippo_ff_mpe

    ippo_ff_mpe.LogWrapper = ended_log_wrapper(ippo_ff_mpe.LogWrapper)
    # The baseline logs each iteration through an io_callback to wandb.log (which fails
    # before a wandb.init); jaxppo's program has no host callback inside: it is left out.
    ippo_ff_mpe.jax.experimental.io_callback = lambda *args, **kwargs: None
    config = yaml.safe_load((anchors / "IPPO" / "config" / "ippo_ff_mpe.yaml").read_text())
    config["TOTAL_TIMESTEPS"] = float(steps)
    keys = jax.random.split(jax.random.PRNGKey(SEED), seeds)
    out, t = timed(ippo_ff_mpe.make_train(config), keys)
    m = out["metrics"]
    per_iteration = ended_means(m)
    iterations = per_iteration.shape[1]
    env_steps = iterations * config["NUM_STEPS"] * config["NUM_ENVS"] * seeds
    return {**t, **final_returns(per_iteration), "env_steps": env_steps,
            "steps_per_s": env_steps / t["train_s"], "iterations": iterations,
            "baseline_logged_final": [float(np.mean(s[-10:]))
                                      for s in np.asarray(m["returned_episode_returns"])]}


def yaml_config(anchors: Path) -> dict:
    import yaml

    return yaml.safe_load((anchors / "IPPO" / "config" / "ippo_rnn_smax.yaml").read_text())


def smax_config(anchors: Path, smax_map: str, steps: float):
    """jaxppo's config of JaxMARL's ippo_rnn_smax.yaml on `smax_map`: the same envs, steps,
    epochs, minibatches, learning rate (annealed linearly to 0), clip (policy and value, as
    its loss clips both with CLIP_EPS), entropy and value coefficients, gradient clip and
    env options; its FC_DIM_SIZE Dense layer before a GRU of GRU_HIDDEN_DIM, and after the
    GRU a relu layer of its own in each head (network.head_sizes: the actor's is
    GRU_HIDDEN_DIM wide, the critic's FC_DIM_SIZE, which jaxppo's one field needs equal, as
    they are in the yaml). What differs: those layers' init (jaxppo's sqrt 2, JaxMARL's 2)."""
    import yaml

    import jaxppo

    c = yaml_config(anchors)
    if c["FC_DIM_SIZE"] != c["GRU_HIDDEN_DIM"]:
        raise SystemExit("jaxppo's heads have layers of one width (network.head_sizes); "
                         f"the yaml's are {c['GRU_HIDDEN_DIM']} and {c['FC_DIM_SIZE']}")
    return jaxppo.PPOConfig(
        env=f"jaxmarl:smax:{smax_map}", env_kwargs=dict(c["ENV_KWARGS"]),
        num_envs=c["NUM_ENVS"], num_steps=c["NUM_STEPS"], num_epochs=c["UPDATE_EPOCHS"],
        num_minibatches=c["NUM_MINIBATCHES"], total_timesteps=int(steps), lr=c["LR"],
        lr_schedule="linear" if c["ANNEAL_LR"] else "constant", gamma=c["GAMMA"],
        gae_lambda=c["GAE_LAMBDA"], clip_param=c["CLIP_EPS"], vf_clip_param=c["CLIP_EPS"],
        entropy_coeff=c["ENT_COEF"], vf_coeff=c["VF_COEF"], max_grad_norm=c["MAX_GRAD_NORM"],
        adam_eps=1e-5, network=jaxppo.NetworkConfig(
            (c["FC_DIM_SIZE"],), activation=c["ACTIVATION"], recurrent_size=c["GRU_HIDDEN_DIM"],
            head_sizes=(c["FC_DIM_SIZE"],)))


def jaxmarl_network():
    """ippo_rnn_smax.py's ActorCriticRNN as a jaxppo module of one's own (docs/configuration.md,
    "Your own network"): a Dense of FC_DIM_SIZE and a ReLU, one GRU shared by actor and critic
    (reset where an episode starts), then per head a Dense of GRU_HIDDEN_DIM (actor) or
    FC_DIM_SIZE (critic) and a ReLU before the output; its initialisers (orthogonal sqrt 2,
    2, 0.01 and 1; flax's GRUCell, its recurrent kernel orthogonal through jaxppo's own)."""
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np

    from jaxppo.core.networks import orthogonal

    def dense(features, scale):
        return nn.Dense(features, kernel_init=orthogonal(scale), bias_init=nn.initializers.zeros)

    class JaxMARLActorCriticRNN(nn.Module):
        fc: int = 128
        gru: int = 128
        action_dim: int | None = None  # filled from the env
        discrete: bool | None = None

        def initial_carry(self, batch_shape):
            return jnp.zeros(tuple(batch_shape) + (self.gru,), jnp.float32)

        @nn.compact
        def __call__(self, obs, carry, reset):
            carry = jnp.where(reset[..., None], 0.0, carry)
            x = nn.relu(dense(self.fc, float(np.sqrt(2.0)))(obs))
            carry, y = nn.GRUCell(self.gru, recurrent_kernel_init=orthogonal(1.0))(carry, x)
            logits = dense(self.action_dim, 0.01)(nn.relu(dense(self.gru, 2.0)(y)))
            value = dense(1, 1.0)(nn.relu(dense(self.fc, 2.0)(y)))[..., 0]
            return logits, value, carry

    return JaxMARLActorCriticRNN


def smax_results(returns, wins, steps_per_iteration: int, seeds: int, t: dict) -> dict:
    """Per seed the mean over the last 10 iterations of the return (one agent's: SMAX's
    reward is the team's, the same for every agent) and of the win rate."""
    import numpy as np

    r, w = np.asarray(returns, np.float64), np.asarray(wins, np.float64)
    env_steps = r.shape[1] * steps_per_iteration * seeds
    return {**t, "final_return": [float(np.nanmean(x[-10:])) for x in r],
            "final_win_rate": [float(np.nanmean(x[-10:])) for x in w],
            "first_win_rate": [float(np.nanmean(x[:10])) for x in w],
            "env_steps": env_steps, "steps_per_s": env_steps / t["train_s"],
            "iterations": int(r.shape[1])}


def run_jaxppo_smax(steps: float, seeds: int, anchors: Path, smax_map: str,
                    own_network: bool = False) -> dict:
    import jax

    import jaxppo
    from jaxppo.run.train import make_train

    config = smax_config(anchors, smax_map, steps)
    if own_network:  # JaxMARL's network, at the yaml's sizes
        c = yaml_config(anchors)
        config = config.replace(network=jaxppo.NetworkConfig(
            module=jaxmarl_network()(fc=c["FC_DIM_SIZE"], gru=c["GRU_HIDDEN_DIM"])))
    keys = jax.random.split(jax.random.PRNGKey(SEED), seeds)
    (_, m), t = timed(make_train(config), keys)
    return smax_results(m["episode_return_mean/ally_0"], m["win_rate"], config.batch_size,
                        seeds, t)


def run_jaxmarl_smax(steps: float, seeds: int, anchors: Path, smax_map: str) -> dict:
    """JaxMARL's script as it is, its per-iteration wandb.log (through its io_callback)
    recorded instead of sent: the mean return and win rate of the episodes that ended."""
    import yaml

    sys.path.insert(0, str(anchors / "IPPO"))
    import ippo_rnn_smax

    config = yaml.safe_load((anchors / "IPPO" / "config" / "ippo_rnn_smax.yaml").read_text())
    config.update(TOTAL_TIMESTEPS=float(steps), MAP_NAME=smax_map)
    return run_smax_baseline(ippo_rnn_smax, config, seeds)


def run_smax_baseline(script, config: dict, seeds: int, first_seed: int = 0) -> dict:
    """A JaxMARL SMAX baseline script's `make_train(config)` run seed after seed, its
    per-iteration wandb.log (through its io_callback) recorded instead of sent:
    `smax_results` of the logged mean return and win rate of the episodes that ended."""
    import jax

    logged = []
    script.wandb.log = lambda row, *a, **k: logged.append(
        {key: float(row[key]) for key in ("returns", "win_rate", "env_step")})
    keys = seed_keys(seeds, first_seed)
    _, t = timed(script.make_train(config), keys)
    per_seed = len(logged) // seeds  # seed after seed; each seed's rows in step order
    rows = [sorted(logged[i * per_seed:(i + 1) * per_seed], key=lambda r: r["env_step"])
            for i in range(seeds)]
    return smax_results([[r["returns"] for r in s] for s in rows],
                        [[r["win_rate"] for r in s] for s in rows],
                        config["NUM_ENVS"] * config["NUM_STEPS"], seeds, t)


def one_run(side: str, args, script: str = __file__) -> dict:
    """A fresh process of one side of `script`; its last stdout line is the result."""
    return finish_run(side, start_run(side, args, script))


def start_run(side: str, args, script: str = __file__):
    """Start a fresh process of one side of `script` (finish_run waits for it)."""
    python = sys.executable if side == "jaxppo" else args.jaxmarl_python
    options = (["--vmap"] if getattr(args, "vmap", False) else []) + (
        ["--smax", args.smax] if getattr(args, "smax", None) else []) + (
        ["--jaxmarl-network"] if getattr(args, "jaxmarl_network", False) else []) + (
        ["--first-seed", str(args.first_seed)] if getattr(args, "first_seed", 0) else []) + (
        ["--set", *args.set] if getattr(args, "set", None) else []) + (
        ["--jaxppo-api", args.jaxppo_api] if getattr(args, "jaxppo_api", None) == "train" else [])
    cmd = [python, script, "--side", side, "--steps", str(args.steps), "--seeds",
           str(args.seeds), "--anchors", str(args.anchors)] + options
    env = {**os.environ, "PYTHONPATH": str(REPO)} if side == "jaxppo" else dict(os.environ)
    started = time.perf_counter(), os.getloadavg()[0]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO), started


def finish_run(side: str, run) -> dict:
    """Wait for a process `start_run` started: its record."""
    proc, (t, load) = run
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return {"side": side, "process_wall_s": time.perf_counter() - t, "load_before": load,
            **result}


def side_by_side_args(doc: str, steps: float, seeds: int, rounds: int,
                      jaxppo_api: bool = False) -> argparse.Namespace:
    """The command line of a side-by-side script (these defaults); `jaxppo_api`: its jaxppo
    side can run through jaxppo.train (`--jaxppo-api train`)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=float, default=steps, help="env steps per seed")
    p.add_argument("--seeds", type=int, default=seeds)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--anchors", type=Path, required=True)
    p.add_argument("--jaxmarl-python", default=None)
    p.add_argument("--side", choices=("jaxppo", "jaxmarl"), default=None)
    p.add_argument("--vmap", action="store_true", help="the seeds as one vmapped program")
    if jaxppo_api:
        p.add_argument("--jaxppo-api", choices=("make_train", "train"), default="make_train",
                       help="jaxppo's side of the MPE comparison: make_train's function timed "
                            "as the baseline's (default), or jaxppo.train(num_seeds=SEEDS) as "
                            "a user calls it")
    p.add_argument("--smax", default=None, help="a SMAX map: IPPO with a GRU (ippo_rnn_smax)")
    p.add_argument("--together", action="store_true",
                   help="with --smax: both sides at once, a learning comparison (not speed)")
    p.add_argument("--alone", action="store_true",
                   help="with --smax --together: jaxppo alone, its record added to the file's")
    p.add_argument("--jaxmarl-network", action="store_true",
                   help="with --smax --together: jaxppo alone, with JaxMARL's own network")
    return p.parse_args()


def run_one_side(args, jaxppo_side, jaxmarl_side) -> bool:
    """With --side, run that side here (`jaxppo_side()` or `jaxmarl_side()`, each giving its
    record) and print its record as one JSON line, as `one_run` reads it; False without."""
    if args.side is None:
        return False
    print(json.dumps(jaxppo_side() if args.side == "jaxppo" else jaxmarl_side()))
    return True


def alternating_runs(args, script: str = __file__) -> list[dict]:
    """`args.rounds` rounds of a jaxppo run then a JaxMARL run, each a fresh process."""
    runs = []
    for r in range(args.rounds):
        for side in ("jaxppo", "jaxmarl"):
            runs.append({"round": r, **one_run(side, args, script)})
            print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> None:
    args = side_by_side_args(__doc__, 2e6, 2, 2, jaxppo_api=True)
    if args.smax:
        smax_main(args)
        return
    if run_one_side(args, lambda: run_jaxppo(args.steps, args.seeds,
                                             REPO / "jaxppo" / "configs" / f"{ENV}.yaml",
                                             args.jaxppo_api),
                    lambda: run_jaxmarl(args.steps, args.seeds, args.anchors)):
        return
    runs = alternating_runs(args)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "cpu": cpu_model(), "env": ENV, "steps_per_seed": args.steps, "seeds": args.seeds,
        "seeds_vmapped": args.vmap, "jaxppo_api": args.jaxppo_api,
        "settings": f"jaxppo/configs/{ENV}.yaml = JaxMARL's ippo_ff_mpe.yaml, total_timesteps "
                    "as given", "runs": runs}, indent=1) + "\n")
    print(f"wrote {OUT}")


def _network_label(config) -> str:
    net = config.network
    return (f"network.hidden_sizes={list(net.hidden_sizes)}, recurrent_size="
            f"{net.recurrent_size}, head_sizes={list(net.head_sizes)}")


def smax_main(args) -> None:
    """--smax: one side in this process (--side), or both alternating in fresh processes."""
    if args.jaxppo_api != "make_train":  # SMAX's jaxppo side times make_train's function only
        raise SystemExit("--jaxppo-api train is the MPE comparison's (without --smax)")
    if run_one_side(args, lambda: run_jaxppo_smax(args.steps, args.seeds, args.anchors, args.smax,
                                                  args.jaxmarl_network),
                    lambda: run_jaxmarl_smax(args.steps, args.seeds, args.anchors, args.smax)):
        return
    if args.together:  # a learning comparison: both sides at once
        out = SMAX_OUT.with_name(f"jaxmarl-smax-{args.smax}-learning.json")
        if args.jaxmarl_network or args.alone:  # jaxppo alone, its record added to the others
            if not out.exists():
                raise SystemExit(f"{out} does not exist: run --smax {args.smax} --together "
                                 "first, then add jaxppo's side alone to it")
            record = json.loads(out.read_text())
            run = finish_run("jaxppo", start_run("jaxppo", args))
            built_in = smax_config(args.anchors, args.smax, args.steps)
            label = ("jaxppo, JaxMARL's network" if args.jaxmarl_network else
                     f"jaxppo alone, {_network_label(built_in)}")
            record["runs"].append({**run, "side": label, "date": time.strftime("%Y-%m-%d")})
            out.write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {out}")
            return
        started = {side: start_run(side, args) for side in ("jaxppo", "jaxmarl")}
        runs = [finish_run(side, run) for side, run in started.items()]
        note = {"together": "both sides ran at once on the shared cores: a comparison of "
                            "learning; the steps/s are not a speed comparison"}
    else:
        runs, out, note = alternating_runs(args), SMAX_OUT, {}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "cpu": cpu_model(), "cores": os.cpu_count(), "env": f"jaxmarl:smax:{args.smax}",
        "steps_per_seed": args.steps, "seeds": args.seeds, "seeds_vmapped": args.vmap,
        "settings": "JaxMARL's ippo_rnn_smax.yaml on this map (smax_config), total_timesteps "
                    "as given", **note, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
