"""Run in a subprocess with 4 forced host devices (XLA_FLAGS must be set before jax loads).

Prints one JSON object with the checks `test_pmap.py` asserts on.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxppo  # noqa: E402
from jaxppo.core.hyperparams import HyperParams  # noqa: E402
from jaxppo.program.build import build_program  # noqa: E402
from jaxppo.program.layout import Layout  # noqa: E402
from jaxppo.program.resolved import resolve  # noqa: E402


EQUIVALENCE = jaxppo.PPOConfig(
    num_envs=8, num_steps=16, total_timesteps=8 * 16, num_minibatches=4,
    network=jaxppo.NetworkConfig((16, 16)), normalize_observations=True,
    normalize_rewards=True, compilation_cache_dir=None,
)
# Continuous actions with a per-sample std: the old log std is batched with its samples.
# Advantages standardised per minibatch: each minibatch's moments from every device's part.
EQUIVALENCE_STATE_STD = EQUIVALENCE.replace(
    env="Pendulum-v1", env_kwargs={"max_steps_in_episode": 10},  # episodes end in the batch
    network=jaxppo.NetworkConfig((16, 16), state_dependent_std=True, log_std_init=-0.5),
    normalize_advantages_over="minibatch")


# sync="batch": the rollouts are all-gathered once and every device runs the whole update.
# A state-independent std (one log std for every env, not gathered) and a GRU with a reward
# hook (the GRU's start carry has its env axis first).
EQUIVALENCE_BATCH = EQUIVALENCE.replace(
    env="Pendulum-v1", env_kwargs={"max_steps_in_episode": 10}, sync="batch")
EQUIVALENCE_BATCH_GRU = EQUIVALENCE.replace(
    env="MemoryChain-bsuite", network=jaxppo.NetworkConfig((16,), recurrent_size=8),
    transforms=[{"count_bonus": {"scale": 0.1}}], sync="batch")

# kl_early_stop: every device stops at the same minibatch (the KL is every device's mean).
EQUIVALENCE_KL_STOP = EQUIVALENCE.replace(kl_early_stop=3e-6)


def one_iteration_equivalence(cfg=EQUIVALENCE):
    hp = HyperParams.from_config(cfg)
    out = {}
    for nd in (1, 4):
        prog = build_program(resolve(cfg.replace(num_devices=nd), Layout(nd)), hp, 1)
        st = prog.init(jax.random.PRNGKey(3), hp)
        st, m = prog.chunk(st, hp, jax.numpy.int32(0), jax.numpy.int32(1))
        if nd > 1:
            leaves = jax.tree.leaves(st.params)
            out["replicated_after_iteration"] = all(
                np.array_equal(leaf[0], leaf[i]) for leaf in leaves for i in range(nd))
            st = jax.tree.map(lambda x: x[0], st)
            m = jax.tree.map(lambda x: x[0], m)
        out[nd] = (st, m)
    (s1, m1), (s4, m4) = out[1], out[4]
    return {
        "replicated_after_iteration": out["replicated_after_iteration"],
        "max_param_diff": max(float(np.abs(a - b).max())
                              for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params))),
        "max_obs_mean_diff": float(np.abs(s1.obs_stats.mean - s4.obs_stats.mean).max()),
        "max_obs_var_diff": float(np.abs(s1.obs_stats.var - s4.obs_stats.var).max()),
        "metrics_1": {k: float(v[0]) for k, v in m1.items()},
        "metrics_4": {k: float(v[0]) for k, v in m4.items()},
    }


def learns_on_two_devices():
    cfg = jaxppo.PPOConfig(
        num_envs=16, num_steps=128, num_epochs=8, num_minibatches=8, lr=5e-4,
        total_timesteps=300_000, num_devices=2,
    )
    result = jaxppo.train(cfg, progress=False)
    leaves = jax.tree.leaves(result.state.params)
    ret = result.metrics["episode_return_mean"][0]
    tail = ret[-10:]
    return {
        "devices": int(result.num_devices),
        "replicated_after_training": all(np.array_equal(leaf[0], leaf[1]) for leaf in leaves),
        "first_return": float(np.nanmean(ret[:5])),
        "final_return": float(np.nanmean(tail)),
    }


def stops_on_two_devices():
    """stop_at_return and best/ on two devices: the rule reads the evaluation the program
    made over both devices' envs, and best/ holds params that load_policy(best=True) takes."""
    import tempfile

    cfg = jaxppo.PPOConfig(
        num_envs=16, num_steps=128, num_epochs=8, num_minibatches=8, lr=5e-4,
        total_timesteps=300_000, num_devices=2, eval_every=5, eval_episodes=8,
        stop_at_return=150.0, compilation_cache_dir=None,
    )
    with tempfile.TemporaryDirectory() as tmp:
        result = jaxppo.train(cfg, run_dir=f"{tmp}/run", progress=False, plot=False)
        best = json.loads(open(f"{tmp}/run/best/best.json").read())
        policy = jaxppo.load_policy(f"{tmp}/run", best=True)
        evals = result.metrics["eval_return_mean"][0]
        return {
            "devices": int(result.num_devices), "completed": bool(result.completed),
            "stopped": result.stopped, "iterations": int(result.iterations_done),
            "num_iterations": int(cfg.num_iterations),
            "last_eval": float(evals[np.isfinite(evals)][-1]),
            "best_eval": float(best["eval_return_mean"]),
            "best_iteration": int(best["iteration"]), "policy_iteration": policy.iteration,
            "best_return_of_policy": float(policy.evaluate(episodes=8)["return_mean"]),
        }


# A multi-agent env (3 agents an env, actors split with their env); 32 steps end episodes.
EQUIVALENCE_MARL = EQUIVALENCE.replace(env="jaxmarl:MPE_simple_spread_v3", num_steps=32,
                                       total_timesteps=8 * 32)

CHECKS = {"equivalence": one_iteration_equivalence,
          "equivalence-marl": lambda: one_iteration_equivalence(EQUIVALENCE_MARL),
          "equivalence-state-std": lambda: one_iteration_equivalence(EQUIVALENCE_STATE_STD),
          "equivalence-batch": lambda: one_iteration_equivalence(EQUIVALENCE_BATCH),
          "equivalence-batch-gru": lambda: one_iteration_equivalence(EQUIVALENCE_BATCH_GRU),
          "equivalence-kl-stop": lambda: one_iteration_equivalence(EQUIVALENCE_KL_STOP),
          "learn": learns_on_two_devices,
          "stop": stops_on_two_devices}


if __name__ == "__main__":
    # One process for several checks (one jax start): {name: result} for each name given.
    print("RESULT " + json.dumps({which: CHECKS[which]() for which in sys.argv[1:]}))
