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

import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.algorithm import Algorithm
from jaxppo.checkpoint import (CHECKPOINT_DIR, CheckpointStore, checkpoint_dir, load_params_dict,
                               load_run_config)
from jaxppo.envs import check_recorded_env
from jaxppo.errors import CheckpointError, ConfigError
from jaxppo.evaluation import run_episodes, summarize
from jaxppo.resolve import resolve
from jaxppo.running_stats import RunningStats


class Policy:
    """A trained policy: `policy(obs, key=None)` -> actions. Deterministic when key is None.

    A recurrent policy keeps a carry from step to step: `policy.step(obs, carry, key=None)`
    -> (actions, carry), starting each episode from `policy.initial_carry(batch_shape)`
    (`step` works for feed-forward policies too, with an empty carry).
    Attributes: config (PPOConfig of the run), spec (EnvSpec), env and env_params (the env it
    trained on), params, obs_stats,
    iteration (of the checkpoint it came from; None for params.msgpack), recurrent.
    """

    def __init__(self, algorithm: Algorithm, params, obs_stats: RunningStats,
                 iteration: int | None = None):
        self.algorithm = algorithm
        self.config = algorithm.config
        self.spec = algorithm.spec
        self.recurrent = algorithm.recurrent
        self.params = params
        self.obs_stats = obs_stats
        self.iteration = iteration
        self._step = jax.jit(algorithm.policy_step, static_argnames=("deterministic",))

    @property
    def env(self):
        """The env the run trained on (with its observation transforms)."""
        return self.spec.env

    @property
    def env_params(self):
        return self.spec.env_params

    def __call__(self, obs, key: jax.Array | None = None):
        if self.recurrent:
            raise TypeError(
                "this policy is recurrent: it needs its carry from step to step. Use "
                "policy.step(obs, carry, key=None) -> (action, carry), starting each episode "
                "from policy.initial_carry(batch_shape); policy.evaluate() does this for you")
        return self.step(obs, (), key)[0]

    act = __call__

    def step(self, obs, carry, key: jax.Array | None = None):
        """(actions, new carry) for observations [*obs_shape] or [B, *obs_shape] and the
        carry before them. Deterministic (the distribution's mode) when key is None."""
        return self._step(self.params, self.obs_stats, jnp.asarray(obs), carry, key,
                          deterministic=key is None)

    def initial_carry(self, batch_shape: tuple[int, ...] = ()):
        """The carry at the start of an episode (() for a feed-forward policy)."""
        return self.algorithm.initial_carry(batch_shape)

    def evaluate(self, episodes: int = 10, seed: int = 0, deterministic: bool = True,
                 max_steps: int | None = None) -> dict:
        """Mean/std return and length of one episode in each of `episodes` envs."""
        return evaluate_policy(self.algorithm, self.params, self.obs_stats, episodes=episodes,
                               seed=seed, deterministic=deterministic, max_steps=max_steps)

    def __repr__(self):
        return (f"Policy({self.config.env_name}, obs_shape={self.spec.obs_shape}, "
                f"iteration={self.iteration}{', recurrent' if self.recurrent else ''})")


def evaluate_policy(algorithm: Algorithm, params, obs_stats, *, episodes: int, seed: int,
                    deterministic: bool, max_steps: int | None = None) -> dict:
    """Host-side evaluation: one episode in each of `episodes` envs reset from
    PRNGKey(seed), each carrying its policy's carry. Returns return/length mean and std
    (floats) and the per-episode arrays."""
    if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
        raise ValueError(f"episodes={episodes!r} must be an integer >= 1")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool)
                                  or max_steps < 1):
        raise ValueError(f"max_steps={max_steps!r} must be an integer >= 1 (or None for the "
                         "env's time limit)")
    bound = max_steps if max_steps is not None else algorithm.eval_bound()

    def play(params, obs_stats, key):
        def step(obs, k, carry):
            return algorithm.policy_step(params, obs_stats, obs, carry, k, deterministic)

        return run_episodes(step, algorithm.spec.env, algorithm.spec.env_params, key, episodes,
                            bound, algorithm.initial_carry((episodes,)))

    stats = jax.jit(play)(params, obs_stats, jax.random.PRNGKey(seed))
    out = summarize(stats)
    out["returns"] = np.asarray(stats.returns).tolist()
    out["lengths"] = np.asarray(stats.lengths).tolist()
    return out


def load_policy(run_dir: str | Path, *, seed_index: int = 0, step: int | None = None,
                env: Any = None) -> Policy:
    """The trained policy of RUN_DIR as a callable `act(obs, key=None)`.

    seed_index: which seed of a multi-seed run. step: a checkpoint iteration (default: the
    newest). env: the env (an object or "module:Class"), for runs of a custom env that
    config.yaml can only name (one whose class is not importable; importable ones are
    recorded as "module:Class" and rebuilt).
    Raises CheckpointError for a missing or unreadable run folder or checkpoint, ConfigError
    for an env that cannot be rebuilt.
    """
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
    else:
        check_recorded_env(config, run_dir, (
            f"Pass the env: jaxppo.load_policy({str(run_dir)!r}, env=YourEnv()) (or "
            f"`jaxppo eval {run_dir} --env module:Class`)"))
    try:
        with warnings.catch_warnings():  # notes about the training budget mean nothing here
            warnings.filterwarnings("ignore", message="total_timesteps=")
            resolved = resolve(config)
    except ConfigError as e:
        if env is None and str(e).startswith(f"env={config.env!r}"):  # "module:Class" failed
            raise ConfigError(f"{e}. (This is the env {run_dir}/config.yaml records; or pass "
                              "it: load_policy(run_dir, env=YourEnv()))") from e
        raise
    algorithm = Algorithm(resolved)
    if state is not None:
        params, obs_stats = state["params"], state["obs_stats"]
        seeds = int(meta.get("num_seeds", 1))
    else:
        path = run_dir / "params.msgpack"
        if not path.exists():
            raise CheckpointError(
                f"run folder {run_dir} has neither a checkpoint in {CHECKPOINT_DIR}/ nor "
                "params.msgpack; it holds no trained policy (did the run finish?)")
        saved = load_params_dict(path)
        params, obs_stats = saved["params"], saved["obs_stats"]
        seeds = config.num_seeds
    if not isinstance(seed_index, int) or isinstance(seed_index, bool) or not 0 <= seed_index < seeds:
        raise ValueError(f"seed_index={seed_index!r}, but {run_dir} holds {seeds} seed(s): use "
                         f"a seed index from 0 to {seeds - 1}")
    if seeds > 1:
        params, obs_stats = jax.tree.map(lambda x: x[seed_index], (params, obs_stats))
    obs_stats = RunningStats(jnp.asarray(obs_stats["mean"]), jnp.asarray(obs_stats["var"]),
                             jnp.asarray(obs_stats["count"]))
    params = jax.tree.map(jnp.asarray, params)
    return Policy(algorithm, params, obs_stats,
                  iteration=None if meta is None else int(meta["iteration"]))

