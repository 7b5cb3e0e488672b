"""PPO over several hosts with Ray: one learner actor per node, the driver owns the optimiser.

Protocol (one iteration; see docs in the README, "Multi-host with Ray"):

1. the driver puts the flat params in the object store once; every host rolls out its own
   `num_envs // hosts` envs (global env ids `host * num_envs // hosts + e`) and computes the
   critic values, returning only small statistics (episode sums/min/max, observation and
   discounted-return moments, and, unless rewards are normalised, advantage moments);
2. the driver combines them into global statistics (Chan's parallel merge with equal shard
   sizes, the same numbers `Algorithm._global_moments` computes under pmap) and sends back
   what the hosts need (the new return statistics -> advantage moments; the advantage
   moments -> each host standardises and builds its batch);
3. for each epoch x minibatch every host returns the flat gradient of its shard of the
   minibatch (the minibatch indices come from the same key on every host and each host's
   own global env ids, so the global minibatch is the single-host one); the driver averages
   them (weighted by samples), applies `Algorithm.apply_grads`, and sends the new flat params;
4. the driver adapts kl_coeff, updates the normalisation statistics, logs the metrics.

The key derivation is `Algorithm.iteration`'s, so H hosts x E envs give the same update as
one host with H*E envs (to float tolerance).

A host whose actor dies is replaced (same host index and env ids; its envs are reset) and
the iteration is retried from the driver's last completed state; every host keeps the env
state it had at the start of the iteration until the next one starts, so survivors roll
back too. Nothing before the last completed iteration is lost.

Checkpoints (with a run folder): every `checkpoint_every` iterations and at the end the driver
gathers the hosts' env states and episode trackers and saves them with its own state as one
single-host TrainState (env fields concatenated in global env order) through
`jaxppo.checkpoint.CheckpointStore`, the format `jaxppo train` writes. `resume=RUN_DIR` loads
the newest one, gives each host its slice of the envs back and continues exactly where the
run stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import ray
from jax.flatten_util import ravel_pytree
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxppo.algorithm import METRIC_KEYS, Algorithm, HyperParams, TrainState, schedule_value
from jaxppo.config import ConfigError, PPOConfig
from jaxppo.envs import flatten_obs, make_env
from jaxppo.gae import compute_gae
from jaxppo.losses import update_kl_coeff
from jaxppo.running_stats import RunningStats
from jaxppo.train import (TrainingDivergedError, TrainResult, _history_from_rows, _version,
                          _write_config, enable_compilation_cache, process_uptime)

logger = logging.getLogger("jaxppo.distributed")

# Env parts of TrainState that live on the hosts (the rest lives on the driver).
ENV_FIELDS = ("env_state", "last_obs", "discounted_return", "episode_return",
              "episode_length", "env_ids")
TERM_KEYS = ("policy_loss", "value_loss", "entropy", "kl", "approx_kl", "clip_fraction")
HEALTH_KEYS = ("policy_loss", "value_loss", "entropy", "kl", "grad_norm")
# Arrays up to this size travel inline with the call (Ray's own inline limit is 100 KiB);
# bigger ones are put in the object store once and every host fetches the same object.
INLINE_BYTES = 90 * 1024


# ---------------------------------------------------------------------- errors
class DistributedError(RuntimeError):
    """Multi-host training cannot start or continue; the message names problem and fix."""


class ClusterUnreachableError(DistributedError):
    """No Ray cluster answers at the given address."""


class NotEnoughNodesError(DistributedError):
    """The cluster has fewer suitable nodes than hosts were asked for."""


class HostsConfigError(ConfigError):
    """`hosts` does not fit the config (num_envs not divisible, several seeds, ...)."""


# ---------------------------------------------------------------------- checks
def check_hosts(config: PPOConfig, hosts: int) -> None:
    """Raise HostsConfigError unless `config` can be split over `hosts` learners."""
    if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
        raise HostsConfigError(f"hosts={hosts!r} must be an integer >= 1, e.g. --hosts 2")
    if config.num_seeds != 1:
        raise HostsConfigError(
            f"num_seeds={config.num_seeds}: multi-host training runs one seed per job; "
            "set num_seeds=1 and submit one job per seed (or use single-host `jaxppo train "
            "--seeds N`, which vmaps the seeds)"
        )
    net = config.network
    if getattr(net, "recurrent_size", 0):
        raise HostsConfigError(
            f"network.recurrent_size={net.recurrent_size}: multi-host training supports "
            "feed-forward policies only for now (recurrent minibatches are whole env sequences, "
            "which do not split evenly over hosts); train recurrent policies with `jaxppo train`"
        )
    try:
        from jaxppo.transforms import reward_hooks

        hooks = reward_hooks(config)
    except ImportError:  # pragma: no cover - older layout without transforms
        hooks = []
    if hooks:
        names = ", ".join(getattr(h, "name", type(h).__name__) for h in hooks)
        raise HostsConfigError(
            f"transforms include reward hooks ({names}): multi-host training does not carry "
            "their state across hosts yet; drop them from `transforms` (observation "
            "transforms such as frame_stack are fine) or train with `jaxppo train`"
        )
    if getattr(config, "num_devices", None) not in (None, 1):
        raise HostsConfigError(
            f"num_devices={config.num_devices}: each multi-host learner uses one device for "
            "now; leave num_devices unset (or 1) and add hosts instead"
        )
    if config.num_envs % hosts:
        n = config.num_envs
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        lower = (n // hosts) * hosts
        upper = lower + hosts
        envs_hint = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        raise HostsConfigError(
            f"num_envs={n} (the global env count) is not divisible by hosts={hosts}: every "
            f"host must own the same number of envs. Use hosts from {divisors}, or set "
            f"num_envs to a multiple of {hosts} (e.g. --set num_envs={envs_hint})"
        )


def _split_address(address: str) -> tuple[str, int] | None:
    addr = address
    for scheme in ("ray://", "http://", "https://"):
        if addr.startswith(scheme):
            addr = addr[len(scheme):]
    addr = addr.rstrip("/")
    if ":" not in addr:
        return None
    host, port = addr.rsplit(":", 1)
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def keep_loopback(address: str | None, children: bool = False):
    """Let `ray.init` use a cluster bound to loopback (`--node-ip-address=127.0.0.1`).

    Ray rewrites a 127.0.0.1/localhost address to this machine's outward IP and then looks
    for a raylet with that IP; a loopback-only cluster has neither. For loopback addresses
    only, Ray takes 127.0.0.1 as this machine's IP while `ray.init` runs (its own switch for
    single-machine clusters, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER); with `children` the Ray
    processes started meanwhile inherit the switch. Other addresses are left alone.
    """
    hp = _split_address(address) if address else None
    if hp is None or hp[0] not in _LOOPBACK:
        yield
        return
    try:
        import ray._private.ray_constants as ray_constants

        from jaxppo.distributed.loopback import LOOPBACK_ENV
    except ImportError:  # pragma: no cover - layout of a future Ray
        yield
        return
    old = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    old_env = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    ray_constants.ENABLE_RAY_CLUSTER = False
    if children:
        os.environ.update(LOOPBACK_ENV)
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_fork_warning():
    # Ray starts its daemons with subprocess (fork + exec at once), which JAX's
    # "os.fork() was called" warning cannot tell from a bare fork.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                category=RuntimeWarning)
        yield


def connect(address: str | None = None, timeout_s: float = 5.0) -> bool:
    """Connect to Ray: `address`, else RAY_ADDRESS, else a new local instance.

    Returns True when this call initialised Ray (so the caller should shut it down).
    Raises ClusterUnreachableError within about `timeout_s` when nothing answers there.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address is None or address == "local":
        # A private single-node instance, on loopback only.
        with keep_loopback("127.0.0.1:0", children=True), _quiet_fork_warning():
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
        return True
    if address.startswith(("http://", "https://")):
        raise ClusterUnreachableError(
            f"RAY_ADDRESS={address!r} is a dashboard (job submission) address; the trainer "
            "connects to the cluster's GCS address, e.g. 127.0.0.1:6379. Submit with "
            "`ray job submit --address http://...:8265 -- python -m jaxppo.distributed ...` "
            "(the job gets the right RAY_ADDRESS), or set RAY_ADDRESS=<head-ip>:6379"
        )
    if address != "auto":
        hp = _split_address(address)
        if hp is None:
            raise ClusterUnreachableError(
                f"RAY_ADDRESS={address!r} is not of the form host:port (e.g. 127.0.0.1:6379)")
        try:
            with socket.create_connection(hp, timeout=timeout_s):
                pass
        except OSError as e:
            raise ClusterUnreachableError(
                f"no Ray cluster reachable at RAY_ADDRESS={address} ({e.__class__.__name__}: "
                f"{e.strerror or e} within {timeout_s:g}s). Start one first (`make ray-cluster`, "
                "or `ray start --head --node-ip-address=127.0.0.1` on the head node), fix "
                "RAY_ADDRESS, or unset it to train on a local single-node Ray instance"
            ) from None
    try:
        with keep_loopback(address), _quiet_fork_warning():
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        raise ClusterUnreachableError(
            f"could not connect to a Ray cluster at {address!r}: {e}. Start one with "
            "`make ray-cluster` (or `ray start --head`), or unset RAY_ADDRESS"
        ) from None
    return True


def _node_summary(nodes) -> str:
    return ", ".join(
        f"{n.get('NodeManagerAddress', '?')}:{n.get('NodeManagerPort', '?')} "
        f"(CPU {n['Resources'].get('CPU', 0):g}, GPU {n['Resources'].get('GPU', 0):g})"
        for n in nodes
    ) or "none"


# ---------------------------------------------------------------------- small math
def _combine_moments(means, variances):
    """Global (mean, var) from per-shard moments of equal-size shards (Chan's merge)."""
    means = np.asarray(means, np.float64)
    variances = np.asarray(variances, np.float64)
    mean = means.mean(axis=0)
    var = (variances + np.square(means - mean)).mean(axis=0)
    return mean.astype(np.float32), var.astype(np.float32)


def _moments(x):
    mean = jnp.mean(x, axis=0)
    return mean, jnp.mean(jnp.square(x - mean), axis=0)


def _to_numpy(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


# ---------------------------------------------------------------------- the host actor
class HostLearner:
    """One host's share of the envs: rollout, GAE and the gradients of its minibatch shards.

    Runs as a Ray actor (one per node); plain methods so it can also run in-process.
    Holds the env state across iterations; params, statistics and keys come from the driver.
    """

    def __init__(self, config: PPOConfig, hp: HyperParams, host_index: int, num_hosts: int):
        if ray.is_initialized() and not ray.get_gpu_ids() and not os.environ.get("JAX_PLATFORMS"):
            # No GPU reserved for this learner: stay off any GPU the node has (JAX would
            # otherwise take it, and preallocate most of its memory).
            jax.config.update("jax_platforms", "cpu")
        enable_compilation_cache(config.compilation_cache_dir)
        self.config = config
        self.host_index = host_index
        self.num_hosts = num_hosts
        self.spec = make_env(config)
        self.algo = Algorithm(config, self.spec, num_devices=num_hosts)
        self.local_envs = self.algo.local_envs
        self.offset = host_index * self.local_envs
        self.hp = jax.tree.map(jnp.asarray, hp)
        self.root = jax.random.PRNGKey(config.seed)
        shapes = jax.eval_shape(lambda k: self.algo.init(k, self.hp).params, self.root)
        flat, self._unravel = ravel_pytree(
            jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
        self.num_params = int(flat.size)
        self._init = jax.jit(self.algo.init)
        self._rollout = jax.jit(self._rollout_fn)
        self._gae = jax.jit(self._gae_fn)
        self._batch = jax.jit(self._batch_fn)
        self._grad = jax.jit(self._grad_fn)
        self.snapshots: dict[int, dict] = {}
        self.params = None  # last flat params received from the driver

    # -------------------------------------------------------------- jitted pieces
    def _rollout_fn(self, env, params_flat, obs_stats, return_stats, rng, hp):
        algo, cfg = self.algo, self.config
        params = self._unravel(params_flat)
        state = TrainState(
            params=params, opt_state=None, kl_coeff=jnp.zeros((), jnp.float32),
            obs_stats=obs_stats, return_stats=return_stats, rng=rng,
            env_steps=jnp.zeros((), jnp.int32), iteration=jnp.zeros((), jnp.int32), **env,
        )
        # Same key use as Algorithm.iteration: rollout splits state.rng, then the epochs'
        # key is split from what rollout left.
        state, traj = algo.rollout(state, hp)
        values, next_values = algo.values(params, obs_stats, traj)
        _, k_epochs = jax.random.split(state.rng)
        new_env = {f: getattr(state, f) for f in ENV_FIELDS}

        done = jnp.logical_or(traj.terminated, traj.truncated)
        flat_obs = flatten_obs(traj.obs, self.spec.obs_shape)
        obs_mean, obs_var = _moments(flat_obs.reshape((-1, flat_obs.shape[-1])))
        ret_mean, ret_var = _moments(traj.discounted_return.reshape(-1))
        stats = {
            "episodes": jnp.sum(done),
            "ret_sum": jnp.sum(jnp.where(done, traj.episode_return, 0.0)),
            "len_sum": jnp.sum(jnp.where(done, traj.episode_length, 0)),
            "ret_min": jnp.min(jnp.where(done, traj.episode_return, jnp.inf)),
            "ret_max": jnp.max(jnp.where(done, traj.episode_return, -jnp.inf)),
            "obs_mean": obs_mean, "obs_var": obs_var,
            "disc_ret_mean": ret_mean, "disc_ret_var": ret_var,
        }
        del cfg
        work = {"traj": traj, "values": values, "next_values": next_values,
                "k_epochs": k_epochs, "env_ids": state.env_ids}
        return new_env, work, stats

    def _gae_fn(self, work, return_stats, hp):
        traj, values = work["traj"], work["values"]
        rewards = traj.reward
        if self.config.normalize_rewards:
            rewards = rewards / jnp.sqrt(return_stats.var + 1e-8)
        advantages, targets = compute_gae(
            rewards, values, work["next_values"], traj.terminated, traj.truncated,
            hp.gamma, hp.gae_lambda,
        )
        flat = lambda x: x.reshape(-1)  # noqa: E731
        a_m, a_v = _moments(flat(advantages))
        t_m, t_v = _moments(flat(targets))
        r_m, r_v = _moments(flat(targets - values))
        stats = {"adv_mean": a_m, "adv_var": a_v, "target_mean": t_m, "target_var": t_v,
                 "resid_mean": r_m, "resid_var": r_v}
        return advantages, targets, stats

    def _batch_fn(self, work, obs_stats, advantages, targets, adv_mean, adv_var):
        algo, cfg = self.algo, self.config
        if cfg.normalize_advantages:
            advantages = (advantages - adv_mean) / (jnp.sqrt(adv_var) + 1e-8)
        batch = algo.make_batch(obs_stats, work["traj"], work["values"], advantages, targets)
        keys = jax.random.split(work["k_epochs"], cfg.num_epochs)
        idx = jnp.stack([algo.minibatch_indices(keys[e], work["env_ids"])
                         for e in range(cfg.num_epochs)])  # [epochs, M, T/M, E_local]
        return batch, idx

    def _grad_fn(self, params_flat, batch, idx, epoch, step, hp, ent_coeff, kl_coeff):
        params = self._unravel(params_flat)
        mb = self.algo.gather_minibatch(batch, idx[epoch, step])
        grads, terms = self.algo.loss_and_grads(params, mb, hp, ent_coeff, kl_coeff)
        flat, _ = ravel_pytree(grads)
        t = jnp.stack([getattr(terms, k) for k in TERM_KEYS]).astype(flat.dtype)
        return jnp.concatenate([flat, t])

    # -------------------------------------------------------------- remote methods
    def info(self) -> dict:
        ctx = ray.get_runtime_context() if ray.is_initialized() else None
        return {
            "host_index": self.host_index,
            "node_id": ctx.get_node_id() if ctx else None,
            "node_ip": ray.util.get_node_ip_address() if ctx else None,
            "pid": os.getpid(),
            "devices": [str(d) for d in jax.devices()],
            "local_envs": self.local_envs,
            "env_offset": self.offset,
            "num_params": self.num_params,
        }

    def reset_envs(self, completed: int) -> dict:
        """Fresh envs for the start of iteration `completed` (0 = the run's first).

        At 0 the envs are seeded exactly as single-host `Algorithm.init` seeds them; a
        replacement host later on gets new resets (a key folded with `completed`).
        Returns the moments of the initial observations.
        """
        key = self.root if completed == 0 else jax.random.fold_in(self.root, completed)
        st = self._init(key, self.hp, self.offset)
        self.snapshots = {completed: {f: getattr(st, f) for f in ENV_FIELDS}}
        flat = flatten_obs(st.last_obs, self.spec.obs_shape).reshape((self.local_envs, -1))
        mean, var = _moments(flat)
        return {"obs_mean": np.asarray(mean), "obs_var": np.asarray(var)}

    def env_state(self, completed: int) -> dict:
        """The env state and episode trackers at the start of iteration `completed` (numpy),
        for a checkpoint."""
        if completed not in self.snapshots:
            raise RuntimeError(
                f"host {self.host_index} has no env state for the start of iteration "
                f"{completed + 1} (it has {sorted(self.snapshots)})")
        return _to_numpy(self.snapshots[completed])

    def load_envs(self, completed: int, env: dict) -> None:
        """Continue from a checkpoint: `env` (this host's slice) is the env state at the start
        of iteration `completed`."""
        env = jax.tree.map(jnp.asarray, env)
        ids = np.asarray(env["env_ids"])
        want = np.arange(self.offset, self.offset + self.local_envs)
        if ids.shape != want.shape or not np.array_equal(ids, want):
            raise RuntimeError(f"host {self.host_index} was given env ids {ids.tolist()}, "
                               f"expected {want.tolist()}")
        self.snapshots = {completed: env}

    def warmup(self) -> float:
        """Compile every per-iteration function (no state changes). Returns seconds."""
        t0 = time.perf_counter()
        env = next(iter(self.snapshots.values()))
        p = np.zeros((self.num_params,), np.float32)
        os_ = _to_numpy(RunningStats.create((self.spec.obs_dim,)))
        rs = _to_numpy(RunningStats.create(()))
        rng = np.asarray(self.root)
        _, work, _ = self._rollout(env, p, os_, rs, rng, self.hp)
        adv, targets, _ = self._gae(work, rs, self.hp)
        batch, idx = self._batch(work, os_, adv, targets, np.float32(0), np.float32(1))
        out = self._grad(p, batch, idx, 0, 0, self.hp, np.float32(0), np.float32(0))
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    def rollout(self, completed: int, params_flat, obs_stats, return_stats, rng) -> dict:
        """Roll out iteration `completed` (0-based) from the env state at its start."""
        if completed not in self.snapshots:
            raise RuntimeError(
                f"host {self.host_index} has no env state for the start of iteration "
                f"{completed + 1} (it has {sorted(self.snapshots)}); call reset_envs first")
        env = self.snapshots[completed]
        self.params = params_flat
        new_env, work, stats = self._rollout(env, params_flat, obs_stats, return_stats,
                                             np.asarray(rng), self.hp)
        # Keep the start state until the next iteration starts, so a retry can roll back.
        self.snapshots = {completed: env, completed + 1: new_env}
        self.work, self.obs_stats = work, obs_stats
        self.adv = self.targets = self.batch = self.idx = None
        if not self.config.normalize_rewards:
            stats.update(self._advantages(return_stats))
        return _to_numpy(stats)

    def _advantages(self, return_stats):
        self.adv, self.targets, stats = self._gae(self.work, return_stats, self.hp)
        return stats

    def gae(self, return_stats) -> dict:
        """GAE with the driver's (global) return statistics; returns advantage moments."""
        return _to_numpy(self._advantages(return_stats))

    def begin_learn(self, adv_mean, adv_var, ent_coeff, kl_coeff) -> int:
        """Standardise advantages with the global moments and build the local batch."""
        self.batch, self.idx = self._batch(self.work, self.obs_stats, self.adv, self.targets,
                                           np.float32(adv_mean), np.float32(adv_var))
        self.ent_coeff, self.kl_coeff = np.float32(ent_coeff), np.float32(kl_coeff)
        return self.config.minibatch_size // self.num_hosts  # samples per local minibatch

    def grad(self, params_flat, epoch: int, step: int) -> np.ndarray:
        """[num_params + 6]: flat grads of this host's shard of minibatch (epoch, step),
        then the loss terms (TERM_KEYS), both means over the local shard."""
        self.params = params_flat
        out = self._grad(params_flat, self.batch, self.idx, epoch, step, self.hp,
                         self.ent_coeff, self.kl_coeff)
        return np.asarray(out)

    def echo(self, x):
        """Return the argument: measures the transport alone (experiments/ray_bench.py)."""
        return x

    def compile_counts(self) -> dict:
        """Programs compiled per jitted function (1 each when nothing recompiles)."""
        return {k: getattr(self, k)._cache_size() for k in ("_rollout", "_gae", "_batch", "_grad")}

    def set_params(self, params_flat) -> None:
        self.params = params_flat

    def get_params(self):
        return None if self.params is None else np.asarray(self.params)


# ---------------------------------------------------------------------- the driver
class RayTrainer:
    """Driver side: owns params, optimiser state, kl_coeff, statistics, rng and counters.

    `start()` reserves one bundle per host (placement group, STRICT_SPREAD by default: one
    learner per node), starts the learners and compiles; `run_iteration()` runs (and on a
    host failure retries) one iteration and returns its metric row; `shutdown()` frees all.
    Ray must already be initialised (see `connect`).

    `fault_hook(trainer, iteration, phase, step)` is called before each phase
    ("rollout", "learn") and each gradient step; tests use it to kill a host mid-run.
    """

    def __init__(self, config: PPOConfig, hosts: int, *, hparams: HyperParams | None = None,
                 strategy: str = "STRICT_SPREAD", cpus_per_host: float = 1,
                 gpus_per_host: float = 0, placement_timeout_s: float = 120.0,
                 max_host_failures: int = 8,
                 fault_hook: Callable[["RayTrainer", int, str, int], None] | None = None):
        config = config.validate()
        check_hosts(config, hosts)
        if strategy not in ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"):
            raise HostsConfigError(
                f"strategy={strategy!r} must be one of STRICT_SPREAD (one host per node, the "
                "default), SPREAD, PACK, STRICT_PACK")
        self.config = config
        self.hosts_n = hosts
        self.strategy = strategy
        self.bundle = {"CPU": cpus_per_host}
        if gpus_per_host:
            self.bundle["GPU"] = gpus_per_host
        self.placement_timeout_s = placement_timeout_s
        self.max_host_failures = max_host_failures
        self.fault_hook = fault_hook
        self.spec = make_env(config)
        self.algo = Algorithm(config, self.spec, num_devices=hosts)
        self.hp = hparams if hparams is not None else HyperParams.from_config(config)
        self.hp_np = _to_numpy(self.hp)
        self.hosts: list[Any] = []
        self.pg = None
        self.state: TrainState | None = None
        self.failures = 0
        self.host_failures: list[dict] = []
        self.timing: dict[str, float] = {}
        self.setup_seconds = 0.0

    # -------------------------------------------------------------- setup
    def check_cluster(self) -> list[dict]:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        fits = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in self.bundle.items())]
        if self.strategy == "STRICT_SPREAD" and self.hosts_n > len(fits):
            need = ", ".join(f"{v:g} {k}" for k, v in self.bundle.items())
            raise NotEnoughNodesError(
                f"hosts={self.hosts_n} but the Ray cluster has only {len(fits)} alive node(s) "
                f"with {need} (one learner per node, placement STRICT_SPREAD); nodes: "
                f"{_node_summary(nodes)}. Use --hosts {max(len(fits), 1)} or fewer, or add "
                "nodes (`ray start --address=<head>:6379` on each; `make ray-cluster` "
                "starts 3 on this machine)"
            )
        return nodes

    def start(self, restored: TrainState | None = None) -> "RayTrainer":
        """Reserve the bundles, start and compile the learners; cleans up if it fails.

        restored: a checkpointed single-host TrainState (env fields over all `num_envs` envs,
        in global order) to continue from instead of a fresh start.
        """
        try:
            return self._start(restored)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, restored: TrainState | None = None) -> "RayTrainer":
        t0 = time.perf_counter()
        nodes = self.check_cluster()
        self.pg = placement_group([dict(self.bundle) for _ in range(self.hosts_n)],
                                  strategy=self.strategy, name="")
        try:
            ray.get(self.pg.ready(), timeout=self.placement_timeout_s)
        except GetTimeoutError:
            self._remove_pg()
            raise NotEnoughNodesError(
                f"could not reserve {self.hosts_n} x {self.bundle} ({self.strategy}) within "
                f"{self.placement_timeout_s:g}s; other jobs may hold the resources. "
                f"Nodes: {_node_summary(nodes)}"
            ) from None
        self.hosts = [self._make_host(k) for k in range(self.hosts_n)]
        self.host_info = ray.get([h.info.remote() for h in self.hosts])
        if restored is None:
            init = ray.get([h.reset_envs.remote(0) for h in self.hosts])
        else:
            completed = int(restored.iteration)
            ray.get([h.load_envs.remote(completed, self._env_slice(restored, k))
                     for k, h in enumerate(self.hosts)])
            init = None
        compile_futs = [h.warmup.remote() for h in self.hosts]
        self._init_driver(init)
        if restored is not None:
            self._restore_driver(restored)
        self.host_compile_seconds = ray.get(compile_futs)
        self.setup_seconds = time.perf_counter() - t0
        return self

    def _make_host(self, k: int):
        remote_cls = ray.remote(HostLearner)
        opts = dict(
            num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0),
            max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=k),
        )
        return remote_cls.options(**opts).remote(self.config, self.hp_np, k, self.hosts_n)

    def _env_slice(self, full: TrainState, k: int) -> dict:
        local = self.config.num_envs // self.hosts_n
        return {f: jax.tree.map(lambda x: np.asarray(x)[k * local:(k + 1) * local],
                                getattr(full, f)) for f in ENV_FIELDS}

    def _restore_driver(self, restored: TrainState):
        driver_part = restored.replace(**{f: None for f in ENV_FIELDS})
        self.state = jax.tree.map(lambda new, old: jnp.asarray(new, dtype=old.dtype),
                                  driver_part, self.state)
        self.flat_params = np.asarray(ravel_pytree(self.state.params)[0])

    def full_state(self) -> TrainState:
        """The driver's state with every host's env state and episode trackers (numpy,
        concatenated over hosts in global env order): a single-host TrainState, as saved in
        checkpoints. A host that died meanwhile is replaced (its envs restart from reset)."""
        completed = int(self.state.iteration)
        while True:
            try:
                envs = ray.get([h.env_state.remote(completed) for h in self.hosts])
                break
            except RayActorError as e:
                self._handle_failure(e)
        env = {f: jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *[e[f] for e in envs])
               for f in ENV_FIELDS}
        return _to_numpy(self.state).replace(**env)

    def _init_driver(self, init_stats):
        cfg, algo = self.config, self.algo
        state = jax.jit(algo.init)(jax.random.PRNGKey(cfg.seed), self.hp)
        obs_stats = RunningStats.create((self.spec.obs_dim,))
        if cfg.normalize_observations and init_stats is not None:
            m, v = _combine_moments([s["obs_mean"] for s in init_stats],
                                    [s["obs_var"] for s in init_stats])
            obs_stats = obs_stats.merge(jnp.asarray(m), jnp.asarray(v), cfg.num_envs)
        self.state = state.replace(
            obs_stats=obs_stats, return_stats=RunningStats.create(()),
            **{f: None for f in ENV_FIELDS})
        flat, self._unravel = ravel_pytree(self.state.params)
        self.flat_params = np.asarray(flat)
        self.num_params = int(flat.size)

        def apply(params, opt_state, flat_grads, hp, lr):
            params, opt_state, gn = algo.apply_grads(params, opt_state, self._unravel(flat_grads),
                                                     hp, lr)
            return params, opt_state, gn, ravel_pytree(params)[0]

        def schedules(hp, steps):
            return schedule_value(hp.lr_points, steps), schedule_value(hp.entropy_points, steps)

        def next_rng(rng):  # Algorithm.iteration: rollout splits once, the epochs once more
            rng, _ = jax.random.split(rng)
            rng, _ = jax.random.split(rng)
            return rng

        lr0, _ = schedules(self.hp, self.state.env_steps)
        zeros = np.zeros_like(self.flat_params)
        self._apply = jax.jit(apply).lower(self.state.params, self.state.opt_state, zeros,
                                           self.hp, lr0).compile()
        self._schedules = jax.jit(schedules)
        self._next_rng = jax.jit(next_rng)
        self._update_kl = jax.jit(update_kl_coeff)
        # Compile the driver's small programs now, not inside the first iteration.
        st = self.state
        jax.block_until_ready((self._schedules(self.hp, st.env_steps), self._next_rng(st.rng),
                               self._update_kl(st.kl_coeff, jnp.float32(0), self.hp.kl_target)))
        self._evaluate = None
        if getattr(cfg, "eval_every", 0):
            from jaxppo.evaluation import EVAL_KEY_TAG

            def evaluate(params, obs_stats, rng):
                return algo.evaluate(params, obs_stats, jax.random.fold_in(rng, EVAL_KEY_TAG))

            self._evaluate = jax.jit(evaluate)
            jax.block_until_ready(self._evaluate(st.params, st.obs_stats, st.rng))

    # -------------------------------------------------------------- one iteration
    def _gather(self, futures):
        return ray.get(futures)

    def _hook(self, phase: str, step: int = 0):
        if self.fault_hook is not None:
            self.fault_hook(self, int(self.state.iteration) + 1, phase, step)

    def _share(self, arr: np.ndarray):
        return arr if arr.nbytes <= INLINE_BYTES else ray.put(arr)

    def _iteration_once(self):
        cfg, st = self.config, self.state
        completed = int(st.iteration)
        t0 = time.perf_counter()
        start_steps = st.env_steps
        lr, ent_coeff = self._schedules(self.hp, start_steps)
        obs_stats_np, return_stats_np = _to_numpy(st.obs_stats), _to_numpy(st.return_stats)
        rng_np = np.asarray(st.rng)

        # 1. rollout + values on every host; params go to the object store once.
        self._hook("rollout")
        params_ref = ray.put(self.flat_params)
        stats = self._gather([h.rollout.remote(completed, params_ref, obs_stats_np,
                                               return_stats_np, rng_np) for h in self.hosts])
        n_global = cfg.num_steps * cfg.num_envs

        # 2. global statistics: discounted-return moments -> advantages -> their moments.
        return_stats = st.return_stats
        if cfg.normalize_rewards:
            m, v = _combine_moments([s["disc_ret_mean"] for s in stats],
                                    [s["disc_ret_var"] for s in stats])
            return_stats = return_stats.merge(jnp.asarray(m), jnp.asarray(v), n_global)
            rs_np = _to_numpy(return_stats)
            more = self._gather([h.gae.remote(rs_np) for h in self.hosts])
            for s, extra in zip(stats, more):
                s.update(extra)
        adv_mean, adv_var = _combine_moments([s["adv_mean"] for s in stats],
                                             [s["adv_var"] for s in stats])
        kl_coeff_np = np.float32(st.kl_coeff)
        weights = np.asarray(self._gather([
            h.begin_learn.remote(adv_mean, adv_var, np.float32(ent_coeff), kl_coeff_np)
            for h in self.hosts]), np.float64)
        weights = weights / weights.sum()
        t_rollout = time.perf_counter() - t0

        # 3. epochs x minibatches: hosts send grads of their shard; driver averages + applies.
        self._hook("learn")
        params, opt_state, flat = st.params, st.opt_state, self.flat_params
        P = self.num_params
        terms, grad_norms = [], []
        t1 = time.perf_counter()
        step = 0
        for epoch in range(cfg.num_epochs):
            for j in range(cfg.num_minibatches):
                self._hook("grad", step)
                arg = self._share(flat)
                outs = self._gather([h.grad.remote(arg, epoch, j) for h in self.hosts])
                avg = np.tensordot(weights, np.stack(outs).astype(np.float64), axes=1)
                avg = avg.astype(np.float32)
                params, opt_state, gn, flat_j = self._apply(params, opt_state, avg[:P],
                                                            self.hp, lr)
                flat = np.asarray(flat_j)
                terms.append(avg[P:])
                grad_norms.append(gn)
                step += 1
        t_learn = time.perf_counter() - t1

        # 4. adapt kl_coeff, update observation statistics, metrics.
        terms = np.stack(terms)  # [epochs * M, 6]
        mean_terms = {k: float(np.mean(terms[:, i], dtype=np.float32))
                      for i, k in enumerate(TERM_KEYS)}
        mean_kl = np.float32(mean_terms["kl"])
        kl_coeff = (self._update_kl(st.kl_coeff, jnp.float32(mean_kl), self.hp.kl_target)
                    if cfg.use_kl_loss else st.kl_coeff)
        obs_stats = st.obs_stats
        if cfg.normalize_observations:
            m, v = _combine_moments([s["obs_mean"] for s in stats],
                                    [s["obs_var"] for s in stats])
            obs_stats = obs_stats.merge(jnp.asarray(m), jnp.asarray(v), n_global)
        env_steps = start_steps + n_global

        n_done = int(sum(int(s["episodes"]) for s in stats))
        nan = float("nan")
        _, target_var = _combine_moments([s["target_mean"] for s in stats],
                                         [s["target_var"] for s in stats])
        _, resid_var = _combine_moments([s["resid_mean"] for s in stats],
                                        [s["resid_var"] for s in stats])
        f32 = lambda x: float(np.float32(x))  # noqa: E731  (metric values as float32, like train)
        row = {
            "episode_return_mean": f32(sum(float(s["ret_sum"]) for s in stats) / n_done) if n_done else nan,
            "episode_return_min": f32(min(float(s["ret_min"]) for s in stats)) if n_done else nan,
            "episode_return_max": f32(max(float(s["ret_max"]) for s in stats)) if n_done else nan,
            "episode_length_mean": f32(sum(float(s["len_sum"]) for s in stats) / n_done) if n_done else nan,
            "episodes": n_done,
            **mean_terms,
            "explained_variance": f32(1.0 - resid_var / max(float(target_var), 1e-8)),
            "kl_coeff": f32(kl_coeff),
            "lr": f32(lr),
            "entropy_coeff": f32(ent_coeff),
            "grad_norm": f32(np.mean(np.asarray(jax.device_get(grad_norms)))),
            "env_steps": int(env_steps),
        }
        new_state = st.replace(
            params=params, opt_state=opt_state, rng=self._next_rng(st.rng), kl_coeff=kl_coeff,
            obs_stats=obs_stats, return_stats=return_stats, env_steps=env_steps,
            iteration=st.iteration + 1,
        )
        if self._evaluate is not None:
            from jaxppo.evaluation import EVAL_METRIC_KEYS

            done = completed + 1
            if done % cfg.eval_every == 0 or done == cfg.num_iterations:
                # As in Algorithm.chunk: the eval key is folded from the new training key.
                ev = jax.device_get(self._evaluate(new_state.params, new_state.obs_stats,
                                                   new_state.rng))
                row.update({k: float(ev[k]) for k in EVAL_METRIC_KEYS})
            else:
                row.update({k: float("nan") for k in EVAL_METRIC_KEYS})
        timing = {"iteration_s": time.perf_counter() - t0, "rollout_s": t_rollout,
                  "learn_s": t_learn, "sync_steps": step,
                  "sync_step_ms": 1e3 * t_learn / max(step, 1)}
        return new_state, flat, row, timing

    def run_iteration(self) -> dict:
        """One iteration (retried after replacing any host that died). Returns its metrics."""
        while True:
            try:
                state, flat, row, timing = self._iteration_once()
            except RayActorError as e:
                self._handle_failure(e)
                continue
            self.state, self.flat_params, self.timing = state, flat, timing
            row.update(iteration=int(state.iteration))
            return row

    # -------------------------------------------------------------- failures
    def _dead_hosts(self) -> list[tuple[int, str]]:
        dead = []
        for k, h in enumerate(self.hosts):
            reason = None
            for _ in range(3):
                try:
                    ray.get(h.info.remote(), timeout=60)
                    reason = None
                    break
                except ActorUnavailableError as e:
                    reason = _short_reason(e)
                    time.sleep(1.0)
                except (ActorDiedError, RayActorError) as e:
                    reason = _short_reason(e)
                    break
                except GetTimeoutError:
                    reason = "no answer within 60s"
                    break
            if reason is not None:
                dead.append((k, reason))
        return dead

    def _handle_failure(self, error: Exception):
        iteration = int(self.state.iteration) + 1
        dead = self._dead_hosts()
        if not dead:  # an actor error, but every host answers: retry once more anyway
            dead_msg = _short_reason(error)
            logger.warning("a host call failed (%s) but every host answers; retrying "
                           "iteration %d", dead_msg, iteration)
            self.failures += 1
        for k, reason in dead:
            self.failures += 1
            self.host_failures.append({"host": k, "iteration": iteration, "reason": reason})
            msg = f"host {k} died ({reason}); replacing it and retrying iteration {iteration}"
            logger.warning(msg)
            if self.failures > self.max_host_failures:
                raise DistributedError(
                    f"{msg}: but that is host failure {self.failures}, more than "
                    f"max_host_failures={self.max_host_failures}; giving up. Check the nodes "
                    "(ray status) and the actor logs (ray logs / the dashboard)"
                ) from error
            self._replace_host(k, int(self.state.iteration))

    def _replace_host(self, k: int, completed: int):
        try:
            ray.kill(self.hosts[k], no_restart=True)
        except Exception:  # already gone
            pass
        new = self._make_host(k)
        try:
            ray.get(new.info.remote(), timeout=self.placement_timeout_s)
        except GetTimeoutError:
            ray.kill(new, no_restart=True)
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            raise DistributedError(
                f"could not place a replacement for host {k} within "
                f"{self.placement_timeout_s:g}s ({self.strategy} needs a free node with "
                f"{self.bundle}); alive nodes: {_node_summary(nodes)}. Add a node "
                "(`ray start --address=<head>:6379`) or restart with fewer --hosts"
            ) from None
        self.hosts[k] = new
        ray.get(new.reset_envs.remote(completed))

    # -------------------------------------------------------------- access and cleanup
    def broadcast_params(self):
        """Send the driver's current params to every host (they then all hold them)."""
        ref = ray.put(self.flat_params)
        ray.get([h.set_params.remote(ref) for h in self.hosts])

    def host_params(self) -> list[np.ndarray]:
        return ray.get([h.get_params.remote() for h in self.hosts])

    def _remove_pg(self):
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None

    def shutdown(self):
        for h in self.hosts:
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        self.hosts = []
        self._remove_pg()

    def result(self, metrics: dict, run_dir=None, compile_seconds=0.0, train_seconds=0.0):
        """A TrainResult (state: the driver's TrainState; its env fields are None, the envs
        live on the hosts)."""
        algo = self.algo
        result = TrainResult(
            config=self.config, params=self.state.params, state=self.state, metrics=metrics,
            run_dir=run_dir, compile_seconds=compile_seconds, train_seconds=train_seconds,
            _algorithm=algo, _policy_fn=jax.jit(algo.act, static_argnames=("deterministic",)),
            _value_fn=jax.jit(algo.value),
        )
        if hasattr(result, "iterations_done"):
            result.iterations_done = int(self.state.iteration)
        return result


def _short_reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    first = next((line.strip() for line in text if line.strip()), "")
    if len(first) > 160:
        first = first[:157] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


# ---------------------------------------------------------------------- public entry point
def train_distributed(
    config: PPOConfig | None,
    hosts: int = 2,
    run_dir: str | Path | None = None,
    progress: bool | None = None,
    *,
    hparams: HyperParams | None = None,
    callback: Callable[[list[dict]], None] | None = None,
    address: str | None = None,
    strategy: str = "STRICT_SPREAD",
    gpus_per_host: float = 0,
    placement_timeout_s: float = 120.0,
    connect_timeout_s: float = 5.0,
    fault_hook: Callable | None = None,
    resume: str | Path | None = None,
    stop_after_iterations: int | None = None,
) -> TrainResult:
    """Train PPO with `hosts` learner actors (one per Ray node); returns a TrainResult.

    `config.num_envs` is the global env count: each host owns num_envs // hosts envs.
    Ray: uses the current connection if `ray.init` was called, else `address`, else
    RAY_ADDRESS, else starts a local instance (one node: hosts=1 unless strategy="PACK").
    run_dir: metrics.jsonl is appended there, one row per iteration; checkpoints/ gets the
    whole state (the driver's and every host's envs) every `checkpoint_every` iterations and
    at the end, as `jaxppo.train` writes it.
    resume: a run folder to continue from its newest checkpoint (config may be None: the
    folder's config.yaml is used); metrics.jsonl is cut back to the checkpoint and appended
    to. `hosts` may differ from the saved run's as long as it divides num_envs.
    stop_after_iterations: run at most this many iterations in this call, then checkpoint and
    return (`TrainResult.completed` is False).
    progress: None/True print a line about 40 times per run to stderr; False is quiet.
    callback: called with the metric rows of each finished iteration.
    Raises HostsConfigError/ConfigError for a bad config, CheckpointError for a run folder
    that cannot be resumed (nothing in it is changed), ClusterUnreachableError,
    NotEnoughNodesError, DistributedError (a host could not be replaced), and
    TrainingDivergedError on NaN/inf, always before starting work where it can be known.
    """
    from jaxppo import checkpoint as ckpt

    restored = None
    start_iter, wall_offset = 0, 0.0
    config, run_dir, resume_store, resume_step, meta = ckpt.begin_resume(
        "train_distributed", config, run_dir, resume)
    try:
        config = config.validate()
        check_hosts(config, hosts)
        if stop_after_iterations is not None and (
                not isinstance(stop_after_iterations, int) or stop_after_iterations < 1):
            raise ConfigError(f"stop_after_iterations={stop_after_iterations!r} must be an "
                              "integer >= 1 (or None to run to the end)")
        n_iter = config.num_iterations
        if meta is not None:
            ckpt.check_resumable(meta.get("config") or {}, config, run_dir)
            saved_devices = meta.get("num_devices") or 1
            if saved_devices != 1:
                raise ConfigError(
                    f"cannot resume {run_dir} on hosts: it was trained with "
                    f"num_devices={saved_devices} (its state is split over them); resume it "
                    "with `jaxppo train --resume` instead. Nothing was changed.")
            hp = hparams if hparams is not None else HyperParams.from_config(config)
            single = Algorithm(config, make_env(config))
            abstract = jax.eval_shape(single.init, jax.random.PRNGKey(config.seed), hp)
            restored, start_iter, wall_offset = ckpt.restore_for_resume(
                resume_store, resume_step, abstract, config, run_dir)
        else:
            ckpt.refuse_checkpointed_run_dir(run_dir, "python -m jaxppo.distributed")
    finally:
        if resume_store is not None:
            resume_store.close()

    started = connect(address, timeout_s=connect_timeout_s)
    trainer = None
    log = store = None
    try:
        trainer = RayTrainer(config, hosts, hparams=hparams, strategy=strategy,
                             gpus_per_host=gpus_per_host,
                             placement_timeout_s=placement_timeout_s, fault_hook=fault_hook)
        keys = METRIC_KEYS
        if getattr(config, "eval_every", 0):
            from jaxppo.evaluation import EVAL_METRIC_KEYS

            keys = keys + EVAL_METRIC_KEYS
        history: dict[str, list] = {k: [] for k in keys + ("iteration", "wall_time", "sps")}
        run_dir = Path(run_dir) if run_dir is not None else None
        trainer.start(restored)
        restored = None
        compile_seconds = trainer.setup_seconds
        if progress is not False:
            for h in trainer.host_info:
                lo = h["env_offset"]
                print(f"host {h['host_index']}: node {h['node_ip']} ({h['node_id'][:8]}), pid "
                      f"{h['pid']}, devices {', '.join(h['devices'])}, envs {lo}-"
                      f"{lo + h['local_envs'] - 1}", file=sys.stderr, flush=True)
            print(f"learners ready in {compile_seconds:.1f}s (start + compile)"
                  + (f"; resumed at iteration {start_iter}" if resume is not None else ""),
                  file=sys.stderr, flush=True)
        previous: list[dict] = []
        if run_dir is not None:
            from jaxppo.runlog import RunLog

            # Every check has passed: from here on the run folder may be written to.
            run_dir.mkdir(parents=True, exist_ok=True)
            _write_config(run_dir, config, overwrite=resume is not None)
            log = RunLog(run_dir, tensorboard=bool(getattr(config, "tensorboard", False)),
                         resume_iteration=start_iter if resume is not None else None,
                         resume_env_steps=(start_iter * config.batch_size
                                           if resume is not None else None))
            previous = log.previous_rows
            store = ckpt.CheckpointStore(run_dir, keep=config.keep_checkpoints)
        end_iter = n_iter if stop_after_iterations is None else min(
            n_iter, start_iter + stop_after_iterations)
        every = max(1, math.ceil(n_iter / 40))
        t_train = time.perf_counter()
        last_finite = None
        returns: list[float] = [r["episode_return_mean"] for r in previous[-10:]
                                if r.get("episode_return_mean") is not None]
        it = start_iter
        saved_at = start_iter if resume is not None else None
        wall = wall_offset

        def save(iteration):
            store.save(iteration, trainer.full_state(), {
                "env_steps": iteration * config.batch_size, "num_devices": 1, "num_seeds": 1,
                "hosts": hosts, "wall_time": wall, "config": config.to_dict(),
                "env": config.env_name, "jaxppo_version": _version(),
            })

        while it < end_iter:
            row = trainer.run_iteration()
            it = row["iteration"]
            wall = wall_offset + process_uptime()
            row.update(wall_time=wall,
                       sps=config.batch_size / max(trainer.timing["iteration_s"], 1e-9))
            bad = [k for k in HEALTH_KEYS if not math.isfinite(row[k])]
            if bad:
                if log is not None:
                    log.write([row])
                raise TrainingDivergedError(
                    f"training diverged at iteration {row['iteration']}: {', '.join(bad)} "
                    f"became NaN/inf. Last finite metrics: {_short(last_finite)}. Metrics so "
                    "far are kept" + (f" in {run_dir / 'metrics.jsonl'}" if run_dir else "")
                    + ". Try a lower lr, a smaller max_grad_norm, or normalize_observations=true",
                    row["iteration"], last_finite)
            last_finite = row
            if log is not None:
                log.write([row])
            for k in history:
                history[k].append(row[k])
            if store is not None and config.checkpoint_every and it % config.checkpoint_every == 0:
                save(it)
                saved_at = it
            if callback is not None:
                callback([row])
            if math.isfinite(row["episode_return_mean"]):
                returns.append(row["episode_return_mean"])
            if progress is not False and (it % every == 0 or it == end_iter):
                elapsed = time.perf_counter() - t_train
                done_now = it - start_iter
                ret = float(np.mean(returns[-10:])) if returns else float("nan")
                print(f"[{config.env_name} x{hosts} hosts] iter {it}/{n_iter}  steps "
                      f"{row['env_steps']:,}  return {ret:.1f}  {row['sps']:,.0f} steps/s  "
                      f"ETA {elapsed / done_now * (end_iter - it):.0f}s",
                      file=sys.stderr, flush=True)
        if store is not None and saved_at != it:
            save(it)
        train_seconds = time.perf_counter() - t_train
        trainer.broadcast_params()
        past = _history_from_rows(previous, keys, 1)
        metrics = {k: np.concatenate([*(np.asarray(p) for p in past[k]), np.asarray(v)])
                   if past[k] else np.asarray(v) for k, v in history.items()}
        result = trainer.result(metrics, run_dir, compile_seconds, train_seconds)
        result.iterations_done = it
        result.completed = it >= n_iter
        result.resumed_from = start_iter if resume is not None else None
        result.host_failures = list(trainer.host_failures)
        result.hosts = hosts
        return result
    finally:
        if log is not None:
            log.close()
        if store is not None:
            store.close()  # waits for a save still being written
        if trainer is not None:
            trainer.shutdown()
        if started:
            ray.shutdown()


def _short(row: dict | None) -> str:
    if not row:
        return "none (it failed in the first iteration)"
    keys = ("iteration", "episode_return_mean", "policy_loss", "value_loss", "grad_norm", "kl")
    return ", ".join(f"{k}={row[k]:.4g}" for k in keys if k in row)
