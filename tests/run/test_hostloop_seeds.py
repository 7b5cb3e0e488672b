"""Several seeds in one run of an env that steps in Python (num_seeds > 1): one vector env per
seed, the learner state vmapped over seeds. Seed k is the one-seed run with seed k's key (the
compiled path's), in the host loop and the actor-learner; the run folder, metrics and resume are
those of a compiled several-seed run."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxppo
from jaxppo.core.hyperparams import HyperParams
from jaxppo.errors import ConfigError
from jaxppo.program.build import build_program
from jaxppo.run.actorlearner import ActorLearnerRunner
from jaxppo.run.hostloop import HostLoopRunner, seed_keys
from jaxppo.run.logs import read_metrics

SEEDS = 3
CART = jaxppo.PPOConfig(env="gymnasium:CartPole-v1", num_envs=4, num_steps=16, num_epochs=2,
                        num_minibatches=2, total_timesteps=4 * 16 * 3, compilation_cache_dir=None,
                        normalize_observations=True, num_seeds=SEEDS, eval_every=2,
                        eval_episodes=2, network=jaxppo.NetworkConfig(hidden_sizes=(16,)))
# Exactly equal in both: what the envs and episodes did (the same actions were sampled).
ENV_SIDE = ("episode_return_mean", "episode_return_min", "episode_return_max",
            "episode_length_mean", "episodes", "env_steps", "eval_return_mean",
            "eval_return_std", "eval_length_mean", "lr", "entropy_coeff", "kl_coeff")


def _train(runner_cls, cfg, iterations: int, keys=None):
    run = jaxppo.resolve(cfg)
    runner = runner_cls(run, HyperParams.from_config(run.config), keys=keys)
    try:
        return runner.train_chunk(0, iterations), runner.snapshot()
    finally:
        runner.close()


@pytest.mark.parametrize("lag", [0, 1])
def test_each_seed_is_the_one_seed_run_with_its_key(lag):
    """Seed k of a 3-seed run against a one-seed run started from seed k's key: the envs see
    the same actions (episode metrics equal exactly); the learner's numbers agree to float
    tolerance (vmapping the update over seeds may change how XLA orders its reductions)."""
    cfg = CART.replace(max_policy_lag=lag, **({"actor_threads": 2} if lag else {}))
    cls = ActorLearnerRunner if lag else HostLoopRunner
    metrics, state = _train(cls, cfg, 3)
    assert metrics["episode_return_mean"].shape == (SEEDS, 3)
    assert state.last_obs.shape == (SEEDS, 4, 4) and state.iteration.tolist() == [3] * SEEDS
    keys = seed_keys(cfg)
    returns = []
    for k in range(SEEDS):
        one_m, one_state = _train(cls, cfg.replace(num_seeds=1), 3, keys=keys[k][None])
        for name, column in one_m.items():
            if name.endswith("_seconds"):
                continue
            if name in ENV_SIDE or name == "policy_lag":
                np.testing.assert_array_equal(metrics[name][k], column, err_msg=name)
            else:
                np.testing.assert_allclose(metrics[name][k], column, rtol=2e-4, atol=1e-6,
                                           err_msg=name)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(one_state.params)):
            np.testing.assert_allclose(a[k], b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.obs_stats.mean[k], one_state.obs_stats.mean, rtol=1e-5,
                                   atol=1e-7)
        np.testing.assert_array_equal(state.last_obs[k], one_state.last_obs)
        returns.append(one_m["episode_return_mean"])
    assert not np.array_equal(returns[0], returns[1])  # the seeds differ


def test_seeds_start_from_the_compiled_paths_keys():
    """A host run's seed k starts from the params a compiled 3-seed run's seed k starts from
    (gymnax's CartPole-v1 has the same spaces as gymnasium's)."""
    host_cfg = CART.replace(num_seeds=SEEDS, eval_every=0)
    run = jaxppo.resolve(host_cfg)
    hp = HyperParams.from_config(run.config)
    runner = HostLoopRunner(run, hp)
    try:
        host = jax.device_get(runner.state.params)
    finally:
        runner.close()
    compiled_run = jaxppo.resolve(host_cfg.replace(env="CartPole-v1"))
    program = build_program(compiled_run, hp, 1)
    compiled = jax.device_get(program.init(jax.random.PRNGKey(host_cfg.seed), hp).params)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(compiled)):
        assert a.shape[0] == SEEDS
        np.testing.assert_array_equal(a, b)


def test_run_folder_resume_and_policy(tmp_path):
    """The run folder of a several-seed run: a row per seed and iteration, a [seeds, ...]
    checkpoint that a resume restores, and each seed's policy."""
    cfg = CART.replace(num_seeds=2, total_timesteps=4 * 16 * 4, eval_every=0,
                       max_policy_lag=1, actor_threads=2)
    run_dir = tmp_path / "run"
    first = jaxppo.train(cfg, run_dir=run_dir, progress=False, stop_after_iterations=2)
    assert not first.completed and first.metrics["env_steps"].shape == (2, 2)
    done = jaxppo.train(None, resume=run_dir, progress=False)
    rows = read_metrics(run_dir)
    assert done.completed
    assert [(r["iteration"], r["seed"]) for r in rows] == [(i, s) for i in range(1, 5)
                                                          for s in range(2)]
    assert done.metrics["env_steps"].tolist() == [[64, 128, 192, 256]] * 2
    assert all(x.shape[0] == 2 for x in jax.tree.leaves(done.params))
    p0, p1 = (jaxppo.load_policy(run_dir, seed_index=s) for s in (0, 1))
    assert p0.evaluate(episodes=2, seed=0) != p1.evaluate(episodes=2, seed=0)


def _params_after_one(cfg, hp):
    runner = HostLoopRunner(jaxppo.resolve(cfg), hp)
    try:
        runner.train_chunk(0, 1)
        return jax.device_get(runner.state.params)
    finally:
        runner.close()


def test_sweep_hyperparameters_per_seed():
    """One set of hyperparameters per seed (as a sweep gives them): seed k trains with its
    own, as in a run where every seed has seed k's; a stack that does not match num_seeds is
    refused."""
    cfg = CART.replace(num_seeds=2, eval_every=0)
    fast, slow = (HyperParams.from_config(cfg.replace(lr=lr)) for lr in (1e-2, 1e-5))
    swept = _params_after_one(cfg, HyperParams.stack([fast, slow]))
    for k, hp in enumerate((fast, slow)):
        alone = _params_after_one(cfg, hp)
        for a, b in zip(jax.tree.leaves(swept), jax.tree.leaves(alone)):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match="num_seeds=2"):
        HostLoopRunner(jaxppo.resolve(cfg), HyperParams.stack([fast] * 3))


def test_population_based_training_is_refused():
    cfg = CART.replace(num_seeds=4, pbt={"interval": 2},
                       search={"lr": {"loguniform": [1e-4, 1e-2]}})
    with pytest.raises(ConfigError, match=r"pbt=\{'interval': 2\}: env='gymnasium:CartPole-v1' "
                                          r"steps in Python .* runs only in the compiled program"):
        jaxppo.resolve(cfg)
