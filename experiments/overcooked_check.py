"""A short learning check of `jaxmarl:overcooked:cramped_room` (IPPO, the tuned config
jaxppo/configs/overcooked_cramped_room.yaml), side by side with JaxMARL's own baseline
(`IPPO/ippo_ff_overcooked.py`'s `make_train` at `config/ippo_ff_overcooked.yaml`, its layout
set to cramped_room) at the same budget, on this machine.

    python experiments/overcooked_check.py --anchors DIR --jaxmarl-python PY [--steps 5e5]
        [--seeds 1] [--rounds 1]

DIR and PY as for experiments/jaxmarl_bench.py (JaxMARL's baseline scripts, and a Python
with what they import). Each run is a fresh process, the sides alternating (jaxppo, jaxmarl,
...), each `jax.jit(train)` compiled ahead of time and run seed after seed. Both anneal the
learning rate over `--steps` and the shaped reward over the baseline's first 2.5e6 env steps
(jaxppo: 156,250 steps of each of the 16 envs).

The number compared is the sparse team return of the final policy: 20 per dish delivered,
which each of the two agents receives, summed over both (40 per dish), the mean over 32
episodes of 400 steps from fresh envs with actions sampled from the policy (jaxppo's
`evaluate`, which plays the game unshaped, and its eval_sparse_return_mean and
eval_dishes_mean; a rollout of the baseline's network by hand). The sparse training return
of the first and last 10 iterations is kept too (jaxppo's sparse_return_mean; JaxMARL's log
wrapper's, before the shaping, times the 2 agents). Writes
experiments/results/overcooked-check.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import cpu_model  # experiments/bench.py: the machine's CPU model
from jaxmarl_bench import (SEED, alternating_runs, ended_log_wrapper, ended_means, final_returns,
                           run_one_side, side_by_side_args, timed)

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "experiments" / "results" / "overcooked-check.json"
LAYOUT = "cramped_room"
CONFIG = REPO / "jaxppo" / "configs" / f"overcooked_{LAYOUT}.yaml"
EVAL_EPISODES = 32


def run_jaxppo(steps: float, seeds: int) -> dict:
    import jax
    import numpy as np

    import jaxppo
    from jaxppo.core.algorithm import Algorithm
    from jaxppo.run.train import make_train

    config = jaxppo.PPOConfig.from_file(str(CONFIG)).replace(total_timesteps=int(steps),
                                                             num_seeds=1)
    keys = jax.random.split(jax.random.PRNGKey(SEED), seeds)
    (states, metrics), t = timed(make_train(config), keys)
    algo = Algorithm.create(jaxppo.resolve(config))  # its evaluation plays unshaped
    evaluate = jax.jit(lambda p, s, k: algo.evaluate(p, s, k, EVAL_EPISODES, False))
    evals = [evaluate(jax.tree.map(lambda x: x[i], states.params),
                     jax.tree.map(lambda x: x[i], states.obs_stats), jax.random.PRNGKey(i))
             for i in range(seeds)]
    env_steps = int(metrics["env_steps"][0, -1]) * seeds
    return {**t, "env_steps": env_steps, "steps_per_s": env_steps / t["train_s"],
            "iterations": int(metrics["env_steps"].shape[1]),
            "sparse_team_return": [float(e["eval_sparse_return_mean"]) for e in evals],
            "dishes": [float(e["eval_dishes_mean"]) for e in evals],
            "training_sparse_team_return": final_returns(np.asarray(metrics["sparse_return_mean"])),
            "shaped_training_return": final_returns(np.asarray(metrics["episode_return_mean"]))}


def run_jaxmarl(steps: float, seeds: int, anchors: Path) -> dict:
    import jax
    import numpy as np
    import yaml

    sys.path.insert(0, str(anchors / "IPPO"))
    import ippo_ff_overcooked as baseline

    baseline.LogWrapper = ended_log_wrapper(baseline.LogWrapper)
    baseline.jax.debug.callback = lambda *args, **kwargs: None  # its wandb.log, left out
    config = yaml.safe_load((anchors / "IPPO" / "config" / "ippo_ff_overcooked.yaml").read_text())
    config["ENV_KWARGS"]["layout"] = baseline.overcooked_layouts[LAYOUT]
    config["TOTAL_TIMESTEPS"] = float(steps)
    config["REW_SHAPING_HORIZON"] = float(config["REW_SHAPING_HORIZON"])
    keys = jax.random.split(jax.random.PRNGKey(SEED), seeds)
    out, t = timed(baseline.make_train(config), keys)
    params = out["runner_state"][0].params
    evals = [_evaluate_baseline(baseline, config, jax.tree.map(lambda x: x[i], params), i)
             for i in range(seeds)]
    per_agent = ended_means(out["metrics"])  # the batch's mean is over agents too
    team = final_returns(2 * per_agent)  # both agents get the shared sparse reward
    iterations = per_agent.shape[1]
    env_steps = iterations * config["NUM_STEPS"] * config["NUM_ENVS"] * seeds
    return {**t, "env_steps": env_steps, "steps_per_s": env_steps / t["train_s"],
            "iterations": iterations, "sparse_team_return": evals,
            "dishes": [r / 40 for r in evals],
            "training_sparse_team_return": team}


def _evaluate_baseline(baseline, config, params, seed: int) -> float:
    """The mean sparse team return of the baseline's policy (sampled, as jaxppo's is) over
    EVAL_EPISODES episodes of 400 steps from fresh envs: the same measure as jaxppo's."""
    import jax
    import jax.numpy as jnp

    env = baseline.jaxmarl.make(config["ENV_NAME"], **config["ENV_KWARGS"])
    network = baseline.ActorCritic(env.action_space(env.agents[0]).n,
                                   activation=config["ACTIVATION"])

    def episode(key):
        key, k_reset = jax.random.split(key)
        obs, state = env.reset(k_reset)

        def step(carry, k):
            obs, state = carry
            k_act, k_step = jax.random.split(k)
            x = jnp.stack([obs[a].flatten() for a in env.agents])
            actions = network.apply(params, x)[0].sample(seed=k_act)
            obs, state, reward, _, _ = env.step(
                k_step, state, {a: actions[i] for i, a in enumerate(env.agents)})
            return (obs, state), sum(reward[a] for a in env.agents)

        return jnp.sum(jax.lax.scan(step, (obs, state), jax.random.split(key, env.max_steps))[1])

    keys = jax.random.split(jax.random.PRNGKey(seed), EVAL_EPISODES)
    return float(jnp.mean(jax.jit(jax.vmap(episode))(keys)))


def main() -> None:
    args = side_by_side_args(__doc__, 5e5, 1, 1)
    if run_one_side(args, lambda: run_jaxppo(args.steps, args.seeds),
                    lambda: run_jaxmarl(args.steps, args.seeds, args.anchors)):
        return
    runs = alternating_runs(args, __file__)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "cpu": cpu_model(), "env": f"jaxmarl:overcooked:{LAYOUT}", "steps_per_seed": args.steps,
        "seeds": args.seeds, "settings": f"{CONFIG.relative_to(REPO)} = JaxMARL's "
        "ippo_ff_overcooked.yaml on cramped_room, total_timesteps as given", "runs": runs},
        indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
