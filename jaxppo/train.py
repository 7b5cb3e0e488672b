"""`jaxppo.train`: run the compiled iteration in chunks and report between them.

Python's only jobs here: build the program once, start each chunk (jit(lax.scan) over
`log_every` iterations, vmapped over seeds), then between chunks update the progress bar,
append metrics.jsonl and stop cleanly on NaN/inf.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.algorithm import METRIC_KEYS, Algorithm, HyperParams, TrainState
from jaxppo.config import ConfigError, PPOConfig
from jaxppo.envs import make_env

# Metrics whose non-finite value means training diverged (episode stats are NaN by design
# when no episode ended in an iteration).
_HEALTH_KEYS = ("policy_loss", "value_loss", "entropy", "kl", "grad_norm")


class TrainingDivergedError(RuntimeError):
    """A loss, gradient or parameter became NaN/inf; metrics up to that point are kept."""

    def __init__(self, message: str, iteration: int, last_finite: dict | None):
        super().__init__(message)
        self.iteration = iteration
        self.last_finite = last_finite


def process_uptime() -> float:
    """Seconds since this process started (from /proc where available)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORT_TIME


_IMPORT_TIME = time.perf_counter()


def enable_compilation_cache(path: str | None) -> None:
    """Turn on JAX's persistent compilation cache so a repeated run skips most compiling."""
    if not path:
        return
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclass
class TrainResult:
    """What `train` returns.

    params: the trained network params ([num_seeds, ...] leaves when num_seeds > 1).
    state: the final TrainState, with a leading [num_devices] axis when num_devices > 1
    (params are identical across it) and then [num_seeds] when num_seeds > 1.
    metrics: name -> array [num_iterations] (num_seeds == 1) or [num_seeds, num_iterations];
    also `iteration`, `wall_time` (s since process start, at the end of the chunk that held
    the iteration) and `sps` (env steps per second of that chunk, all seeds).
    `policy(obs, key=None, deterministic=False, seed=0)` and `value(obs, seed=0)` take raw
    observations [..., *obs_shape] and apply the run's observation normalisation.
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

    num_devices: int = 1

    def _seed_slice(self, tree, seed):
        if self.num_devices > 1:  # params are replicated: any device's copy will do
            tree = jax.tree.map(lambda x: x[0], tree)
        if self.config.num_seeds == 1:
            return tree
        return jax.tree.map(lambda x: x[seed], tree)

    def policy(self, obs, key=None, deterministic: bool = False, seed: int = 0):
        if key is None:
            if not deterministic:
                raise ValueError("policy(obs, key): a PRNG key is needed to sample; "
                                 "pass key=jax.random.PRNGKey(0) or deterministic=True")
            key = jax.random.PRNGKey(0)
        st = self._seed_slice(self.state, seed)
        return self._policy_fn(st.params, st.obs_stats, obs, key, deterministic)

    def value(self, obs, seed: int = 0):
        st = self._seed_slice(self.state, seed)
        return self._value_fn(st.params, st.obs_stats, obs)


def _auto_chunk(num_iterations: int) -> int:
    # ~40 progress updates; each chunk is one call into the compiled program.
    return max(1, math.ceil(num_iterations / 40))


def train(
    config: PPOConfig,
    *,
    hparams: HyperParams | None = None,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    callback: Callable[[list[dict]], None] | None = None,
) -> TrainResult:
    """Train PPO as configured; `num_seeds > 1` trains the seeds in one vmapped program.

    run_dir: if given, metrics.jsonl is appended there as training goes.
    progress: show a progress bar (default: when stderr is a terminal, else a line per chunk).
    callback: called with the metric rows of each finished chunk.
    Raises ConfigError for a bad config and TrainingDivergedError on NaN/inf.
    """
    config = config.validate()
    enable_compilation_cache(config.compilation_cache_dir)
    spec = make_env(config)
    num_devices = resolve_num_devices(config)
    hp = hparams if hparams is not None else HyperParams.from_config(config)
    n_iter = config.num_iterations
    chunk_len = min(config.log_every or _auto_chunk(n_iter), n_iter)
    seeds = config.num_seeds
    program = build_program(config, spec, hp, num_devices, chunk_len)
    algo = program.algorithm

    t_compile = time.perf_counter()
    state, compiled = initialise_and_compile(program, jax.random.PRNGKey(config.seed), hp)
    compile_seconds = time.perf_counter() - t_compile

    run_dir = Path(run_dir) if run_dir is not None else None
    metrics_file = open(run_dir / "metrics.jsonl", "a") if run_dir is not None else None
    reporter = _Reporter(config, n_iter, progress)
    history: dict[str, list] = {k: [] for k in METRIC_KEYS + ("iteration", "wall_time", "sps")}
    t_train = time.perf_counter()
    last_finite: dict | None = None
    try:
        for start in range(0, n_iter, chunk_len):
            t0 = time.perf_counter()
            state, m = compiled(state, hp, jnp.asarray(start, jnp.int32))
            m = jax.device_get(m)
            if num_devices > 1:  # metrics are already averaged over devices
                m = jax.tree.map(lambda x: x[0], m)
            dt = time.perf_counter() - t0
            n = min(chunk_len, n_iter - start)
            wall = process_uptime()
            sps = n * config.batch_size * seeds / max(dt, 1e-9)
            rows = []
            for j in range(n):
                for s in range(seeds):
                    row = {k: _scalar(m[k], s, j, seeds) for k in METRIC_KEYS}
                    row.update(iteration=start + j + 1, wall_time=wall, sps=sps)
                    if seeds > 1:
                        row["seed"] = s
                    bad = [k for k in _HEALTH_KEYS if not math.isfinite(row[k])]
                    if bad:
                        _write_rows(metrics_file, rows)
                        raise TrainingDivergedError(
                            f"training diverged at iteration {start + j + 1}"
                            + (f" (seed {s})" if seeds > 1 else "")
                            + f": {', '.join(bad)} became NaN/inf. Last finite metrics: "
                            f"{_short(last_finite)}. Metrics so far are kept"
                            + (f" in {run_dir / 'metrics.jsonl'}" if run_dir else "")
                            + ". Try a lower lr, a smaller max_grad_norm, or "
                            "normalize_observations=true / normalize_rewards=true.",
                            start + j + 1,
                            last_finite,
                        )
                    last_finite = row
                    rows.append(row)
            for k in METRIC_KEYS:
                arr = np.asarray(m[k])
                history[k].append(arr[..., :n])
            for k, v in (("iteration", np.arange(start + 1, start + n + 1)),
                         ("wall_time", np.full(n, wall)), ("sps", np.full(n, sps))):
                history[k].append(np.broadcast_to(v, (seeds, n)) if seeds > 1 else v)
            _write_rows(metrics_file, rows)
            if callback is not None:
                callback(rows)
            reporter.update(start + n, rows, sps)
    finally:
        reporter.close()
        if metrics_file is not None:
            metrics_file.close()
    train_seconds = time.perf_counter() - t_train

    metrics = {k: np.concatenate(v, axis=-1) for k, v in history.items() if v}
    policy_fn = jax.jit(algo.act, static_argnames=("deterministic",))
    value_fn = jax.jit(algo.value)
    params = jax.tree.map(lambda x: x[0], state.params) if num_devices > 1 else state.params
    return TrainResult(
        config=config, params=params, state=state, num_devices=num_devices, metrics=metrics, run_dir=run_dir,
        compile_seconds=compile_seconds, train_seconds=train_seconds, _algorithm=algo,
        _policy_fn=policy_fn, _value_fn=value_fn,
    )


class Program(NamedTuple):
    """The compiled entry points of a run: `init(key, hp)` and `chunk(state, hp, start)`."""

    algorithm: Algorithm
    init: Callable
    chunk: Callable


AXIS = "device"


def resolve_num_devices(config: PPOConfig) -> int:
    """config.num_devices, or every local device; checked against what this host has."""
    available = jax.local_device_count()
    n = config.num_devices if config.num_devices is not None else available
    if n > available:
        raise ConfigError(
            f"num_devices={n} but this host has {available} local device(s) "
            f"({jax.default_backend()}); set num_devices <= {available} or leave it unset"
        )
    if config.num_envs % n:
        hint = "set num_devices explicitly, " if config.num_devices is None else ""
        raise ConfigError(
            f"num_envs={config.num_envs} cannot be split evenly over {n} local devices; "
            f"{hint}use num_envs a multiple of {n}, or num_devices from "
            f"{[d for d in range(1, n + 1) if config.num_envs % d == 0]}"
        )
    return n


def build_program(config: PPOConfig, spec, hp: HyperParams, num_devices: int, chunk_len: int) -> Program:
    """jit (one device) or pmap (several) of init and chunk, vmapped over seeds when asked.

    State layout: [devices?, seeds?, ...]; the devices axis exists only when num_devices > 1.
    """
    seeds = config.num_seeds
    axis = AXIS if num_devices > 1 else None
    algo = Algorithm(config, spec, num_devices=num_devices, axis_name=axis)
    local = algo.local_envs
    hp_axis = (0 if _is_batched(hp, seeds) else None) if seeds > 1 else None

    def init_one(key, hp, device):
        return algo.init(key, hp, env_index_offset=device * local)

    def chunk_one(state, hp, start):
        return algo.chunk(state, hp, start, chunk_len)

    if seeds > 1:
        def init_dev(root, hp, device):
            keys = jax.random.split(root, seeds)
            return jax.vmap(init_one, in_axes=(0, hp_axis, None))(keys, hp, device)

        chunk_dev = jax.vmap(chunk_one, in_axes=(0, hp_axis, None))
    else:
        init_dev, chunk_dev = init_one, chunk_one

    if num_devices == 1:
        init = jax.jit(lambda root, hp: init_dev(root, hp, 0))
        chunk = jax.jit(chunk_dev, donate_argnums=0)
    else:
        devices = jax.local_devices()[:num_devices]
        pinit = jax.pmap(init_dev, axis_name=AXIS, in_axes=(None, None, 0), devices=devices)
        init = lambda root, hp: pinit(root, hp, jnp.arange(num_devices))  # noqa: E731
        chunk = jax.pmap(chunk_dev, axis_name=AXIS, in_axes=(0, None, None), devices=devices,
                         donate_argnums=0)
    return Program(algo, init, chunk)


def initialise_and_compile(program: Program, key: jax.Array, hp: HyperParams):
    """Run `init` and compile `chunk` at the same time; returns (state, compiled chunk).

    The chunk only needs the state's shapes, so its compile (the bulk of start-up) runs in a
    second thread while the main thread compiles and runs init; XLA releases the GIL.
    """
    start0 = jnp.asarray(0, jnp.int32)
    if isinstance(program.chunk, jax.stages.Wrapped) and hasattr(program.chunk, "trace"):
        abstract = jax.eval_shape(program.init, key, hp)
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(lambda: program.chunk.lower(abstract, hp, start0).compile())
            state = jax.block_until_ready(program.init(key, hp))
            return state, future.result()
    state = program.init(key, hp)
    return state, program.chunk.lower(state, hp, start0).compile()


def make_train(config: PPOConfig, hparams: HyperParams | None = None):
    """A pure `train_fn(key, hparams=None) -> (final TrainState, metrics [num_iterations])`.

    Nothing in it touches Python state, so a user can `jax.jit` it and `jax.vmap` it over
    keys (seeds) and over a batched `HyperParams` (a sweep of lr, clip_param, ...).
    """
    config = config.validate()
    algo = Algorithm(config)
    hp = hparams if hparams is not None else HyperParams.from_config(config)
    train_hp = algo.make_train()

    def train_fn(key, hparams: HyperParams | None = None):
        return train_hp(key, hp if hparams is None else hparams)

    return train_fn


def _is_batched(hp: HyperParams, seeds: int) -> bool:
    """True when `hp` carries one set of hyperparameters per seed (a leading axis)."""
    n = np.ndim(hp.clip_param)
    if n == 0:
        return False
    if n == 1 and hp.clip_param.shape[0] == seeds:
        return True
    from jaxppo.config import ConfigError

    raise ConfigError(
        f"hparams has a leading axis of {np.shape(hp.clip_param)}, but num_seeds={seeds}; "
        "a batched HyperParams needs exactly one entry per seed"
    )


def _scalar(arr, seed, j, seeds) -> float:
    a = np.asarray(arr)
    v = a[seed, j] if seeds > 1 else a[j]
    return float(v)


def _short(row: dict | None) -> str:
    if not row:
        return "none (it failed in the first iteration)"
    keys = ("iteration", "episode_return_mean", "policy_loss", "value_loss", "grad_norm", "kl")
    return ", ".join(f"{k}={row[k]:.4g}" for k in keys if k in row)


def _write_rows(f, rows):
    if f is None or not rows:
        return
    import json

    for row in rows:
        f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                            for k, v in row.items()}) + "\n")
    f.flush()


class _Reporter:
    """Progress between chunks: a rich bar on a terminal, a plain line otherwise."""

    def __init__(self, config: PPOConfig, n_iter: int, progress: bool | None):
        self.n_iter = n_iter
        self.config = config
        self.interactive = sys.stderr.isatty() if progress is None else progress
        self.quiet = progress is False
        self.last_return = float("nan")
        self.t0 = time.perf_counter()
        self.bar = None
        if self.interactive and not self.quiet:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bar = Progress(
                TextColumn(f"[bold]{config.env_name}[/]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("return {task.fields[ret]}"), TextColumn("{task.fields[sps]} steps/s"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("train", total=n_iter, ret="   -  ", sps="-")
            self.bar.start()

    def update(self, done_iters: int, rows: list[dict], sps: float):
        rets = [r["episode_return_mean"] for r in rows if math.isfinite(r["episode_return_mean"])]
        if rets:
            self.last_return = float(np.mean(rets[-max(1, self.config.num_seeds) * 10:]))
        if self.bar is not None:
            self.bar.update(self.task, completed=done_iters, ret=f"{self.last_return:7.1f}",
                            sps=f"{sps:,.0f}")
        elif not self.quiet:
            steps = done_iters * self.config.batch_size
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / done_iters * (self.n_iter - done_iters)
            print(f"[{self.config.env_name}] iter {done_iters}/{self.n_iter}  "
                  f"steps {steps:,}  return {self.last_return:.1f}  {sps:,.0f} steps/s  "
                  f"ETA {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()
