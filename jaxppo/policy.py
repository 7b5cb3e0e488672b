"""`load_policy(RUN_DIR)`: the trained policy of a run folder as a jitted function.

    act = jaxppo.load_policy("runs/CartPole-v1-20250101-120000")
    action = act(obs)                     # deterministic (the distribution's mode)
    action = act(obs, jax.random.PRNGKey(0))  # sampled

The run folder's config.yaml gives the env and network; the newest checkpoint gives the
params and the observation-normalisation statistics (params.msgpack when there is no
checkpoint). Observations are raw env observations [*obs_shape] or [B, *obs_shape];
actions come back ready for `env.step` (continuous ones clipped to the action bounds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.checkpoint import (CHECKPOINT_DIR, CheckpointError, CheckpointStore, checkpoint_dir,
                               saved_shards,
                               load_params_dict, load_run_config)
from jaxppo.running_stats import RunningStats


class Policy:
    """A trained policy: `policy(obs, key=None)` -> actions. Deterministic when key is None.

    Attributes: config (PPOConfig of the run), spec (EnvSpec), params, obs_stats,
    iteration (of the checkpoint it came from; None for params.msgpack).
    """

    def __init__(self, config, spec, params, obs_stats: RunningStats, iteration: int | None = None):
        from jaxppo.algorithm import Algorithm

        self.config = config
        self.spec = spec
        self.params = params
        self.obs_stats = obs_stats
        self.iteration = iteration
        algo = Algorithm(config, spec)
        self._mode = jax.jit(lambda p, s, o: algo.act(p, s, o, jax.random.PRNGKey(0), deterministic=True))
        self._sample = jax.jit(lambda p, s, o, k: algo.act(p, s, o, k, deterministic=False))

    def __call__(self, obs, key: jax.Array | None = None):
        obs = jnp.asarray(obs)
        if key is None:
            return self._mode(self.params, self.obs_stats, obs)
        return self._sample(self.params, self.obs_stats, obs, key)

    act = __call__

    def evaluate(self, episodes: int = 10, seed: int = 0, deterministic: bool = True,
                 max_steps: int | None = None) -> dict:
        """Mean/std return and length of one episode in each of `episodes` envs."""
        return evaluate_act(self, self.config, self.spec, episodes=episodes, seed=seed,
                            deterministic=deterministic, max_steps=max_steps)

    def __repr__(self):
        return (f"Policy({self.config.env_name}, obs_shape={self.spec.obs_shape}, "
                f"iteration={self.iteration})")


def evaluate_act(act, config, spec, *, episodes: int, seed: int, deterministic: bool,
                 max_steps: int | None = None) -> dict:
    """Host-side evaluation of `act(obs, key=None)`: one episode in each of `episodes` envs,
    reset from PRNGKey(seed). Returns return/length mean and std (floats) and the arrays."""
    from jaxppo.evaluation import eval_max_steps, run_episodes, summarize

    bound = max_steps if max_steps is not None else eval_max_steps(config, spec.env_params)
    step_act = (lambda obs, k: act(obs)) if deterministic else (lambda obs, k: act(obs, k))
    stats = jax.jit(lambda key: run_episodes(step_act, spec.env, spec.env_params, key,
                                             episodes, bound))(jax.random.PRNGKey(seed))
    out = summarize(stats)
    out["returns"] = np.asarray(stats.returns).tolist()
    out["lengths"] = np.asarray(stats.lengths).tolist()
    return out


def load_policy(run_dir: str | Path, *, seed_index: int = 0, step: int | None = None,
                env: Any = None) -> Policy:
    """The trained policy of RUN_DIR as a callable `act(obs, key=None)`.

    seed_index: which seed of a multi-seed run. step: a checkpoint iteration (default: the
    newest). env: the env object, for runs of a custom (unregistered) env that config.yaml
    can only name.
    Raises CheckpointError for a missing or unreadable run folder or checkpoint.
    """
    from jaxppo.envs import make_env

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run folder {run_dir} does not exist; check the path")
    meta = None
    state = None
    if checkpoint_dir(run_dir).is_dir():
        with CheckpointStore(run_dir, read_only=True) as store:
            steps = store.steps()
            if steps:
                if step is None:
                    step = steps[-1]
                elif step not in steps:
                    raise CheckpointError(
                        f"no checkpoint for iteration {step} in {store.directory}; "
                        f"available: {', '.join(map(str, steps))}")
                state, meta = store.restore(step)
    config = load_run_config(run_dir, meta)
    if env is not None:
        config = config.replace(env=env)
    if getattr(config.network, "recurrent_size", 0):
        raise CheckpointError(
            f"{run_dir} holds a recurrent policy (network.recurrent_size="
            f"{config.network.recurrent_size}); load_policy returns stateless policies only, so "
            "restore it with jaxppo.checkpoint.CheckpointStore and act with the run's algorithm")
    spec = make_env(config)
    if state is not None:
        params, obs_stats = state["params"], state["obs_stats"]
        lead = saved_shards(meta) > 1, int(meta.get("num_seeds", 1)) > 1
    else:
        path = run_dir / "params.msgpack"
        if not path.exists():
            raise CheckpointError(
                f"run folder {run_dir} has neither a checkpoint in {CHECKPOINT_DIR}/ nor "
                "params.msgpack; it holds no trained policy (did the run finish?)")
        saved = load_params_dict(path)
        params, obs_stats = saved["params"], saved["obs_stats"]
        lead = False, config.num_seeds > 1
    if lead[0]:  # replicated over devices: any copy
        params, obs_stats = jax.tree.map(lambda x: x[0], (params, obs_stats))
    if lead[1]:
        if not 0 <= seed_index < config.num_seeds:
            raise ValueError(f"seed_index={seed_index} but the run has num_seeds={config.num_seeds}")
        params, obs_stats = jax.tree.map(lambda x: x[seed_index], (params, obs_stats))
    obs_stats = RunningStats(jnp.asarray(obs_stats["mean"]), jnp.asarray(obs_stats["var"]),
                             jnp.asarray(obs_stats["count"]))
    params = jax.tree.map(jnp.asarray, params)
    return Policy(config, spec, params, obs_stats, iteration=None if meta is None else int(meta["iteration"]))

