"""`jaxppo.train`: run the compiled iteration in chunks and report between them.

Python's only jobs here: build the program once, start each chunk (jit(lax.scan) over
`log_every` iterations, vmapped over seeds), then between chunks update the progress bar,
append metrics.jsonl and stop cleanly on NaN/inf.
"""

from __future__ import annotations

import math
import os
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
from jaxppo.evaluation import EVAL_METRIC_KEYS
from jaxppo.recurrent import algorithm_class
from jaxppo.runlog import RunLog

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
    the iteration; a resumed run adds the time of the processes before it) and `sps` (env
    steps per second of that chunk, all seeds); with eval_every, eval_return_mean/std and
    eval_length_mean (NaN on iterations without evaluation). A resumed run's metrics start
    at iteration 1 (the earlier ones are read back from metrics.jsonl).
    `policy(obs, key=None, deterministic=False, seed=0)` and `value(obs, seed=0)` take raw
    observations [..., *obs_shape] and apply the run's observation normalisation.
    iterations_done / completed: how far the run got (completed is False after
    stop_after_iterations); resumed_from: the checkpoint iteration it started from, if any.
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
    iterations_done: int = 0
    completed: bool = True
    resumed_from: int | None = None

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

    def evaluate(self, episodes: int = 10, seed: int = 0, deterministic: bool = True,
                 max_steps: int | None = None, policy_seed: int = 0) -> dict:
        """One episode in each of `episodes` fresh envs reset from PRNGKey(seed), with the
        policy of seed `policy_seed`: return/length mean and std, and the per-episode arrays.
        `jaxppo.load_policy(run_dir).evaluate(...)` gives the same numbers."""
        from jaxppo.policy import evaluate_act

        def act(obs, key=None):
            return self.policy(obs, key, deterministic=key is None, seed=policy_seed)

        return evaluate_act(act, self.config, self._algorithm.spec, episodes=episodes, seed=seed,
                            deterministic=deterministic, max_steps=max_steps)


def _auto_chunk(num_iterations: int) -> int:
    # ~40 progress updates; each chunk is one call into the compiled program.
    return max(1, math.ceil(num_iterations / 40))


def train(
    config: PPOConfig | None,
    *,
    hparams: HyperParams | None = None,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    callback: Callable[[list[dict]], None] | None = None,
    resume: str | Path | None = None,
    stop_after_iterations: int | None = None,
) -> TrainResult:
    """Train PPO as configured; `num_seeds > 1` trains the seeds in one vmapped program.

    run_dir: if given, the run folder: config.yaml (written if missing), metrics.jsonl
    (appended as training goes), checkpoints/ (every `checkpoint_every` iterations and at the
    end) and, with `tensorboard`, tensorboard/.
    resume: a run folder to continue from its newest checkpoint; metrics.jsonl is cut back to
    the checkpoint and appended to. `config` may be None (the folder's config.yaml is used);
    a given config may change fields like total_timesteps, but not shapes (ConfigError).
    stop_after_iterations: run at most this many iterations in this call, then checkpoint and
    return (`TrainResult.completed` is False); resume later with `resume=run_dir`.
    progress: show a progress bar (default: when stderr is a terminal, else a line per chunk).
    callback: called with the metric rows of each finished chunk.
    Raises ConfigError for a bad config, CheckpointError for a run folder that cannot be
    resumed (nothing in it is changed then) and TrainingDivergedError on NaN/inf.
    """
    from jaxppo import checkpoint as ckpt

    config, run_dir, resume_store, resume_step, resume_meta = ckpt.begin_resume(
        "train", config, run_dir, resume)
    try:
        config = config.validate()
        if stop_after_iterations is not None and (
                not isinstance(stop_after_iterations, int) or stop_after_iterations < 1):
            raise ConfigError(f"stop_after_iterations={stop_after_iterations!r} must be an "
                              "integer >= 1 (or None to run to the end)")
        enable_compilation_cache(config.compilation_cache_dir)
        spec = make_env(config)
        num_devices = resolve_num_devices(config)
        if resume_meta is not None:
            ckpt.check_resumable(resume_meta.get("config") or {}, config, run_dir,
                                 resume_meta.get("num_devices"), num_devices)
        else:
            ckpt.refuse_checkpointed_run_dir(run_dir, "jaxppo train")
        if config.eval_every:
            from jaxppo.evaluation import eval_max_steps

            eval_max_steps(config, spec.env_params)  # ConfigError now rather than mid-trace
        hp = hparams if hparams is not None else HyperParams.from_config(config)
        n_iter = config.num_iterations
        chunk_len = min(config.log_every or _auto_chunk(n_iter), n_iter)
        if config.checkpoint_every:  # chunks end on checkpoint iterations anyway; no longer
            chunk_len = min(chunk_len, config.checkpoint_every)
        seeds = config.num_seeds
        program = build_program(config, spec, hp, num_devices, chunk_len)
        algo = program.algorithm

        key = jax.random.PRNGKey(config.seed)
        start_iter, wall_offset, restored = 0, 0.0, None
        if resume_store is not None:  # read and check the checkpoint before compiling
            abstract = jax.eval_shape(program.init, key, hp)
            restored, start_iter, wall_offset = ckpt.restore_for_resume(
                resume_store, resume_step, abstract, config, run_dir)
        t_compile = time.perf_counter()
        state, compiled = initialise_and_compile(program, key, hp)
        compile_seconds = time.perf_counter() - t_compile
        if restored is not None:  # onto the devices (and shardings) the program expects
            state = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), restored, state)
    finally:
        if resume_store is not None:
            resume_store.close()

    # Every check has passed: from here on the run folder may be written to.
    run_dir = Path(run_dir) if run_dir is not None else None
    runlog = store = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, config, overwrite=resume is not None)
        runlog = RunLog(run_dir, tensorboard=config.tensorboard, num_seeds=seeds,
                        resume_iteration=start_iter if resume is not None else None,
                        resume_env_steps=start_iter * config.batch_size if resume is not None else None)
        store = ckpt.CheckpointStore(run_dir, keep=config.keep_checkpoints)
    keys = METRIC_KEYS + (EVAL_METRIC_KEYS if config.eval_every else ())
    history = _history_from_rows(runlog.previous_rows if runlog else [], keys, seeds)
    end_iter = n_iter if stop_after_iterations is None else min(n_iter, start_iter + stop_after_iterations)
    reporter = _Reporter(config, n_iter, progress, start=start_iter)
    t_train = time.perf_counter()
    last_finite: dict | None = None
    it, saved_at, wall = start_iter, start_iter if resume is not None else None, wall_offset

    def save(iteration):
        store.save(iteration, state, {
            "env_steps": iteration * config.batch_size, "num_devices": num_devices,
            "num_seeds": seeds, "wall_time": wall, "config": config.to_dict(),
            "env": config.env_name, "jaxppo_version": _version(),
        })

    try:
        while it < end_iter:
            stop = min(end_iter, it + chunk_len)
            if config.checkpoint_every:
                stop = min(stop, (it // config.checkpoint_every + 1) * config.checkpoint_every)
            t0 = time.perf_counter()
            state, m = compiled(state, hp, jnp.asarray(it, jnp.int32), jnp.asarray(stop, jnp.int32))
            m = jax.device_get(m)
            if num_devices > 1:  # metrics are already averaged over devices
                m = jax.tree.map(lambda x: x[0], m)
            dt = time.perf_counter() - t0
            n = stop - it
            wall = wall_offset + process_uptime()
            sps = n * config.batch_size * seeds / max(dt, 1e-9)
            rows = []
            for j in range(n):
                for s in range(seeds):
                    row = {k: _scalar(m[k], s, j, seeds) for k in keys}
                    row.update(iteration=it + j + 1, wall_time=wall, sps=sps)
                    if seeds > 1:
                        row["seed"] = s
                    bad = [k for k in _HEALTH_KEYS if not math.isfinite(row[k])]
                    if bad:
                        if runlog is not None:
                            runlog.write(rows)
                        raise TrainingDivergedError(
                            f"training diverged at iteration {it + j + 1}"
                            + (f" (seed {s})" if seeds > 1 else "")
                            + f": {', '.join(bad)} became NaN/inf. Last finite metrics: "
                            f"{_short(last_finite)}. Metrics so far are kept"
                            + (f" in {run_dir / 'metrics.jsonl'}" if run_dir else "")
                            + ". Try a lower lr, a smaller max_grad_norm, or "
                            "normalize_observations=true / normalize_rewards=true.",
                            it + j + 1,
                            last_finite,
                        )
                    last_finite = row
                    rows.append(row)
            for k in keys:
                history[k].append(np.asarray(m[k])[..., :n])
            for k, v in (("iteration", np.arange(it + 1, stop + 1)),
                         ("wall_time", np.full(n, wall)), ("sps", np.full(n, sps))):
                history[k].append(np.broadcast_to(v, (seeds, n)) if seeds > 1 else v)
            if runlog is not None:
                runlog.write(rows)
            it = stop
            if store is not None and config.checkpoint_every and it % config.checkpoint_every == 0:
                save(it)
                saved_at = it
            if callback is not None:
                callback(rows)
            reporter.update(it, rows, sps)
        if store is not None and saved_at != it:
            save(it)
    finally:
        reporter.close()
        if runlog is not None:
            runlog.close()
        if store is not None:
            store.close()  # waits for a save still being written
    train_seconds = time.perf_counter() - t_train

    metrics = {k: np.concatenate(v, axis=-1) for k, v in history.items() if v}
    policy_fn = jax.jit(algo.act, static_argnames=("deterministic",))
    value_fn = jax.jit(algo.value)
    params = jax.tree.map(lambda x: x[0], state.params) if num_devices > 1 else state.params
    return TrainResult(
        config=config, params=params, state=state, num_devices=num_devices, metrics=metrics, run_dir=run_dir,
        compile_seconds=compile_seconds, train_seconds=train_seconds, _algorithm=algo,
        _policy_fn=policy_fn, _value_fn=value_fn, iterations_done=it, completed=it >= n_iter,
        resumed_from=start_iter if resume is not None else None,
    )


def _write_config(run_dir: Path, config: PPOConfig, overwrite: bool) -> None:
    """RUN_DIR/config.yaml: written when missing (the CLI writes it first) or, on resume, when
    the config changed (e.g. a larger total_timesteps), through a temporary file."""
    import yaml

    from jaxppo.checkpoint import write_text_atomic

    path = run_dir / "config.yaml"
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    if not path.exists() or (overwrite and path.read_text() != text):
        write_text_atomic(path, text)


def _history_from_rows(rows: list[dict], keys, seeds: int) -> dict[str, list]:
    """Metric arrays of earlier rows (a resumed run's past), as the first entry of each list."""
    history: dict[str, list] = {k: [] for k in keys + ("iteration", "wall_time", "sps")}
    if not rows:
        return history
    by_seed = [[r for r in rows if r.get("seed", 0) == s] for s in range(seeds)]
    n = min(len(b) for b in by_seed)
    for k in history:
        arr = np.asarray([[np.nan if r.get(k) is None else r[k] for r in b[:n]] for b in by_seed],
                         np.float64)
        if k == "iteration":
            arr = arr.astype(np.int64)
        elif k in ("env_steps", "episodes"):  # the dtypes the compiled program returns
            arr = arr.astype(np.int32)
        elif k in METRIC_KEYS or k in EVAL_METRIC_KEYS:
            arr = arr.astype(np.float32)
        history[k].append(arr if seeds > 1 else arr[0])
    return history


def _version() -> str:
    from jaxppo import __version__

    return __version__


class Program(NamedTuple):
    """The compiled entry points of a run: `init(key, hp)` and `chunk(state, hp, start, stop)`
    (iterations start..min(start + chunk_len, stop) - 1; the rest of the chunk is skipped)."""

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
    algo = algorithm_class(config)(config, spec, num_devices=num_devices, axis_name=axis)
    local = algo.local_envs
    hp_axis = (0 if _is_batched(hp, seeds) else None) if seeds > 1 else None

    def init_one(key, hp, device):
        return algo.init(key, hp, env_index_offset=device * local)

    def chunk_one(state, hp, start, stop):
        return algo.chunk(state, hp, start, chunk_len, stop)

    if seeds > 1:
        def init_dev(root, hp, device):
            keys = jax.random.split(root, seeds)
            return jax.vmap(init_one, in_axes=(0, hp_axis, None))(keys, hp, device)

        chunk_dev = jax.vmap(chunk_one, in_axes=(0, hp_axis, None, None))
    else:
        init_dev, chunk_dev = init_one, chunk_one

    if num_devices == 1:
        init = jax.jit(lambda root, hp: init_dev(root, hp, 0))
        chunk = jax.jit(chunk_dev, donate_argnums=0)
    else:
        devices = jax.local_devices()[:num_devices]
        pinit = jax.pmap(init_dev, axis_name=AXIS, in_axes=(None, None, 0), devices=devices)
        init = lambda root, hp: pinit(root, hp, jnp.arange(num_devices))  # noqa: E731
        chunk = jax.pmap(chunk_dev, axis_name=AXIS, in_axes=(0, None, None, None), devices=devices,
                         donate_argnums=0)
    return Program(algo, init, chunk)


def initialise_and_compile(program: Program, key: jax.Array, hp: HyperParams):
    """Run `init`, then compile `chunk` for the resulting state; returns (state, compiled).

    (Compiling the chunk in a second thread while init runs was measured: no faster on two
    cores, and about 170 MB more peak memory, so the two run one after the other.)
    """
    start0 = jnp.asarray(0, jnp.int32)
    state = program.init(key, hp)
    return state, program.chunk.lower(state, hp, start0, start0).compile()


def make_train(config: PPOConfig, hparams: HyperParams | None = None):
    """A pure `train_fn(key, hparams=None) -> (final TrainState, metrics [num_iterations])`.

    Nothing in it touches Python state, so a user can `jax.jit` it and `jax.vmap` it over
    keys (seeds) and over a batched `HyperParams` (a sweep of lr, clip_param, ...).
    """
    config = config.validate()
    algo = algorithm_class(config)(config)
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


class _Reporter:
    """Progress between chunks: a rich bar on a terminal, a plain line otherwise; both show
    the recent return, steps/s, the ETA and the last evaluation."""

    def __init__(self, config: PPOConfig, n_iter: int, progress: bool | None, start: int = 0):
        self.n_iter = n_iter
        self.start = start
        self.config = config
        self.interactive = sys.stderr.isatty() if progress is None else progress
        self.quiet = progress is False
        self.last_return = float("nan")
        self.last_eval = "-"
        self.t0 = time.perf_counter()
        self.bar = None
        if self.interactive and not self.quiet:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            columns = [
                TextColumn(f"[bold]{config.env_name}[/]"), BarColumn(bar_width=16),
                MofNCompleteColumn(), TextColumn("return {task.fields[ret]}"),
                TextColumn("{task.fields[sps]} steps/s"),
            ]
            if config.eval_every:
                columns.append(TextColumn("eval {task.fields[eval]}"))
            columns += [TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
            self.bar = Progress(*columns)
            self.task = self.bar.add_task("train", total=n_iter, completed=start, ret="   -  ",
                                          sps="-", eval="-")
            self.bar.start()

    def update(self, done_iters: int, rows: list[dict], sps: float):
        rets = [r["episode_return_mean"] for r in rows if math.isfinite(r["episode_return_mean"])]
        if rets:
            self.last_return = float(np.mean(rets[-max(1, self.config.num_seeds) * 10:]))
        evals = [r for r in rows if math.isfinite(r.get("eval_return_mean", float("nan")))]
        if evals:
            last = evals[-1]["iteration"]
            vals = [r["eval_return_mean"] for r in evals if r["iteration"] == last]
            self.last_eval = f"{np.mean(vals):.1f}@{last}"
        if self.bar is not None:
            self.bar.update(self.task, completed=done_iters, ret=f"{self.last_return:.1f}",
                            sps=f"{sps:,.0f}", eval=self.last_eval)
        elif not self.quiet:
            steps = done_iters * self.config.batch_size
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done_iters - self.start, 1) * (self.n_iter - done_iters)
            ev = f"  eval {self.last_eval}" if self.config.eval_every else ""
            print(f"[{self.config.env_name}] iter {done_iters}/{self.n_iter}  "
                  f"steps {steps:,}  return {self.last_return:.1f}{ev}  {sps:,.0f} steps/s  "
                  f"ETA {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()
