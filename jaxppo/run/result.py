"""`TrainResult`: what `jaxppo.train` (and `train_distributed`) return.

The trained params and final state, every iteration's metrics, how far the run got and why
it stopped, and the trained policy to act with and evaluate (`policy`, `value`, `evaluate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxppo.core.algorithm import Algorithm, TrainState
from jaxppo.config import PPOConfig
from jaxppo.run.policy import check_action_mask, check_key, check_obs, evaluate_policy


@dataclass
class TrainResult:
    """What `train` returns.

    params: the trained network params ([num_seeds, ...] leaves when num_seeds > 1).
    state: the final TrainState, with a leading [num_devices] axis when `device_axis` (the
    envs split over devices: params are identical across it) and then [num_seeds] when
    num_seeds > 1. Seeds or PBT members split over devices come back as one
    [num_seeds, ...] state, as from one device. `layout`: where the run trained, in words
    (e.g. "16 seeds over 2 CPU devices (8 each, no collectives)").
    metrics: name -> array [num_seeds, num_iterations], for one seed too (`[0]` is its row);
    also `iteration`, `wall_time` (s since process start, at the end of the chunk that held
    the iteration; a resumed run adds the time of the processes before it) and `sps` (env
    steps per second of that chunk, all seeds); with eval_every, eval_return_mean/std and
    eval_length_mean (NaN on iterations without evaluation). A resumed run's metrics start
    at iteration 1 (the earlier ones are read back from metrics.jsonl).
    `policy(obs, key=None, deterministic=False, seed=0)` and `value(obs, seed=0)` take raw
    observations [..., *obs_shape] and apply the run's observation normalisation (a
    recurrent run acts through `jaxppo.load_policy(run_dir).step`; `evaluate` works for both);
    a run trained with the env's action mask also takes `action_mask=` [..., num_actions], the
    legal actions (as `jaxppo.Policy.step` does).
    iterations_done / completed: how far the run got (completed is False after
    stop_after_iterations); resumed_from: the checkpoint iteration it started from, if any.
    hosts: processes the run was spread over (1 unless jaxppo.distributed); host_failures:
    the hosts lost and replaced during the run; summary: summary.json's content (run folder);
    interrupted: the signal (SIGINT, SIGTERM) that stopped the run early, if one did;
    stopped: why the run stopped before its end, if a stop rule (stop_at_return,
    stop_after_no_improvement) or the callback (False, StopTraining) stopped it.
    """

    config: PPOConfig
    params: Any
    state: TrainState
    metrics: dict[str, np.ndarray]
    run_dir: Path | None = None
    compile_seconds: float = 0.0
    train_seconds: float = 0.0
    _algorithm: Algorithm | None = field(default=None, repr=False)
    _policy_fn: Callable | None = field(default=None, repr=False)
    _value_fn: Callable | None = field(default=None, repr=False)
    _save: Callable | None = field(default=None, repr=False)

    num_devices: int = 1
    iterations_done: int = 0
    completed: bool = True
    resumed_from: int | None = None
    hosts: int = 1
    host_failures: list = field(default_factory=list)
    summary: dict | None = None
    interrupted: str | None = None
    stopped: str | None = None
    layout: str = ""
    device_axis: bool | None = None  # None: num_devices > 1

    def __post_init__(self):
        if self.device_axis is None:
            self.device_axis = self.num_devices > 1

    @property
    def env(self):
        """The env the run trained on (a gymnax env, wrapped by the config's transforms)."""
        return self._algorithm.spec.env

    @property
    def env_params(self):
        return self._algorithm.spec.env_params

    def _seed_slice(self, tree, seed):
        seeds = self.config.num_seeds
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < seeds:
            raise ValueError(f"seed={seed!r}, but the run trained {seeds} seed(s): use a seed "
                             f"index from 0 to {seeds - 1}")
        if self.device_axis:  # params are replicated: any device's copy will do
            tree = jax.tree.map(lambda x: x[0], tree)
        if seeds == 1:
            return tree
        return jax.tree.map(lambda x: x[seed], tree)

    def policy(self, obs, key=None, deterministic: bool = False, seed: int = 0,
               action_mask=None):
        if key is None:
            if not deterministic:
                raise ValueError("policy(obs, key): a PRNG key is needed to sample; "
                                 "pass key=jax.random.PRNGKey(0) or deterministic=True")
            key = jax.random.PRNGKey(0)
        check_key(key)
        obs = check_obs(obs, self._algorithm)
        mask = None if self._algorithm.recurrent else check_action_mask(action_mask, obs,
                                                                         self._algorithm)
        st = self._seed_slice(self.state, seed)
        return self._policy_fn(st.params, st.obs_stats, obs, key, deterministic, mask)

    def value(self, obs, seed: int = 0):
        obs = check_obs(obs, self._algorithm)
        st = self._seed_slice(self.state, seed)
        return self._value_fn(st.params, st.obs_stats, obs)

    def save(self, run_dir: str | Path, *, plot: bool = True) -> Path:
        """Write the run's folder at `run_dir` (a new or empty folder), as `train(config,
        run_dir=...)` would have: config.yaml, metrics.jsonl, the checkpoint of the last
        iteration (`jaxppo train --resume RUN_DIR` continues the run), params.msgpack,
        summary.json, curve.png (with `plot`), and sweep.json for a sweep. Not written: best/
        (the best evaluation's params are kept only while a run folder is open). Returns the
        folder's path; `jaxppo.load_policy(path)` then loads the policy.

        Raises:
            ConfigError: run_dir exists and holds files.
        """
        if self._save is None:
            raise ValueError("this TrainResult was not returned by jaxppo.train (or "
                             "train_distributed), so it has no run to save")
        return self._save(self, run_dir, plot)

    def evaluate(self, episodes: int = 10, seed: int = 0, deterministic: bool = True,
                 max_steps: int | None = None, policy_seed: int = 0) -> dict:
        """One episode in each of `episodes` fresh envs reset from PRNGKey(seed), with the
        policy of seed `policy_seed`: return/length mean and std, and the per-episode arrays.
        `jaxppo.load_policy(run_dir).evaluate(...)` gives the same numbers."""
        st = self._seed_slice(self.state, policy_seed)
        return evaluate_policy(self._algorithm, st.params, st.obs_stats, episodes=episodes,
                               seed=seed, deterministic=deterministic, max_steps=max_steps)
