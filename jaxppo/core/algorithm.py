"""One PPO iteration as a pure, jit-able function: rollout -> GAE -> epochs x minibatches.

One Algorithm for every network. A network is `apply(params, obs, carry, reset) -> (dist,
value, carry)`: feed-forward ones keep an empty carry; a recurrent one (a GRU core) carries
its state from step to step in `TrainState.carry`, zeroed where an episode ended. What a
recurrent network changes is small and local: the rollout records each env's carry at its
start and the resets; values and the loss replay the network over whole sequences; and a
minibatch is whole env sequences [T, E/M] instead of num_steps/M steps of every env.

Nothing here touches files, Ray or the CLI. `axis_name` names a pmap axis when the iteration
runs on several devices (of one host or of many): gradients and every batch statistic are
reduced over it, so the same global batch gives the same update on 1 device, N devices or H
hosts. Each collective costs a network latency across hosts, so an iteration makes few and
fuses what it sends: one all-gather of the rollout's statistics, one of the GAE statistics,
and one all-reduce per minibatch carrying the flat gradient and the loss terms together.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from flax import struct

from jaxppo.core import networks
from jaxppo.envs import transforms
from jaxppo.config import PPOConfig
from jaxppo.envs.make import env_action, flatten_obs
from jaxppo.errors import ConfigError
from jaxppo.core.evaluation import EVAL_KEY_TAG, EVAL_METRIC_KEYS, eval_max_steps, run_episodes
from jaxppo.core.gae import compute_gae
from jaxppo.core.hyperparams import HyperParams, schedule_value
from jaxppo.core.losses import (Batch, map_dist, map_samples, ppo_loss_terms, shares_log_std,
                           unstack_shared_log_std, update_kl_coeff)
from jaxppo.core.networks import DistParams
from jaxppo.resolve import Resolved, resolve
from jaxppo.core.running_stats import RunningStats, normalize


# ---------------------------------------------------------------------- state
class PolicyCarry(NamedTuple):
    """The network's carry for every env ([E, ...]; () for feed-forward) and whether each
    env's last step ended its episode ([E] bool, None for feed-forward): the carry is zeroed
    before the step that sees the new episode's first observation."""

    state: Any = ()
    reset: jax.Array | None = None


@struct.dataclass
class TrainState:
    """Everything that evolves during training (one seed, one device)."""

    params: Any
    opt_state: Any
    kl_coeff: jax.Array
    obs_stats: RunningStats
    return_stats: RunningStats  # of the discounted return, for reward scaling
    env_state: Any
    last_obs: jax.Array  # [E, *obs_shape] raw observations
    discounted_return: jax.Array  # [E] running discounted return for reward scaling
    episode_return: jax.Array  # [E] undiscounted return of the episode in progress
    episode_length: jax.Array  # [E]
    env_ids: jax.Array  # [E] global index of each local env (keys and shuffles derive from it)
    rng: jax.Array  # identical on every device/host; per-env streams fold in env_ids
    env_steps: jax.Array  # int, global transitions so far (all devices)
    iteration: jax.Array  # int
    carry: PolicyCarry = PolicyCarry()  # the network's carry; holds no arrays for feed-forward
    hook_state: Any = ()  # states of the config's reward hooks (jaxppo.envs.transforms), one each
    # Population-based training only (None otherwise, holding no arrays): this member's live
    # hyperparameters, which exploit/explore steps change (jaxppo.search.pbt), and its fitness record.
    hparams: Any = None
    population: Any = None


class PopulationRecord(NamedTuple):
    """A PBT member's fitness since its last exploit/explore step (jaxppo.search.pbt)."""

    return_sum: jax.Array  # sum of the returns of episodes that ended since the last step
    episodes: jax.Array  # how many ended
    fitness: jax.Array  # the fitness at the last step (-inf before the first)
    last_eval: jax.Array  # the most recent in-loop evaluation's mean return (NaN before one)

    @classmethod
    def create(cls) -> "PopulationRecord":
        z = jnp.float32(0.0)
        return cls(z, z, jnp.float32(-jnp.inf), jnp.float32(jnp.nan))


class Transition(NamedTuple):
    """One rollout step; every field gets leading axes [T, E] from the scan."""

    obs: jax.Array  # raw observation s_t
    final_obs: jax.Array  # raw pre-reset successor of s_t
    action: jax.Array
    log_prob: jax.Array
    dist: DistParams
    reward: jax.Array
    discounted_return: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    episode_return: jax.Array  # return of the episode that ended at t (valid where done)
    episode_length: jax.Array
    # Recurrent networks only (None / () otherwise): the carry was zeroed before step t, and
    # every env's carry at the rollout's start ([E, ...], no time axis).
    reset: jax.Array | None = None
    carry0: Any = ()


METRIC_KEYS = (
    "episode_return_mean", "episode_return_min", "episode_return_max",
    "episode_length_mean", "episodes", "policy_loss", "value_loss", "entropy",
    "kl", "approx_kl", "clip_fraction", "explained_variance", "kl_coeff", "lr",
    "entropy_coeff", "grad_norm", "env_steps",
)


def _pmean(x, axis_name):
    return x if axis_name is None else jax.lax.pmean(x, axis_name)


def local_moments(x: jax.Array, axis=None):
    """(mean, variance) of one shard's samples, over `axis` (default: all elements)."""
    mean = jnp.mean(x, axis=axis)
    return mean, jnp.mean(jnp.square(x - mean), axis=axis)


def combine_moments(means: jax.Array, variances: jax.Array):
    """Global (mean, variance) from per-shard moments [S, ...] of equal-size shards (Chan's
    merge). With one shard it returns that shard's moments unchanged, bit for bit."""
    mean = jnp.mean(means, axis=0)
    return mean, jnp.mean(variances + jnp.square(means - mean), axis=0)


class Algorithm:
    """The compiled pieces of PPO for one config: `init`, `iteration`, `chunk`, `make_train`.

    Built once per resolved config (`jaxppo.resolve`; a PPOConfig is resolved here);
    everything tunable comes in as `HyperParams`. The envs are split into the layout's
    `shards` (devices or hosts; `axis_name` names the pmap axis over them), each holding
    `local_envs = num_envs // shards`.
    """

    def __init__(self, run: Resolved | PPOConfig, axis_name: str | None = None):
        if isinstance(run, PPOConfig):
            run = resolve(run)
        self.run = run
        self.config = run.config
        self.spec = run.spec
        self.network = run.network
        self.recurrent = run.recurrent
        self.shards = run.layout.shards
        self.local_envs = run.local_envs
        self.axis_name = axis_name
        self.discrete = self.spec.discrete

    # ------------------------------------------------------------------ optimiser
    def _optimizer(self, hp: HyperParams) -> optax.GradientTransformation:
        # lr is applied by hand so it can follow env steps (not optimiser steps) and be vmapped.
        return optax.chain(
            optax.clip_by_global_norm(hp.max_grad_norm),
            optax.scale_by_adam(eps=self.config.adam_eps),
        )

    # ------------------------------------------------------------------ init
    def init(self, key: jax.Array, hp: HyperParams, env_index_offset: int | jax.Array = 0) -> TrainState:
        """Fresh state. Env e (global index `env_index_offset + e`) is seeded from `key` and e
        alone, so splitting envs across devices or hosts leaves each env's stream unchanged."""
        spec = self.spec
        self._require_compiled_env("init")
        key, k_params, k_env = jax.random.split(key, 3)
        env_ids = env_index_offset + jnp.arange(self.local_envs)
        env_keys = jax.vmap(lambda i: jax.random.fold_in(k_env, i))(env_ids)
        obs, env_state = jax.vmap(spec.env.reset, in_axes=(0, None))(env_keys, spec.env_params)
        return self.init_state(key, k_params, hp, obs, env_state, env_ids)

    def init_state(self, key: jax.Array, k_params: jax.Array, hp: HyperParams, obs: jax.Array,
                   env_state: Any, env_ids: jax.Array) -> TrainState:
        """A fresh TrainState around envs just reset to `obs` [E, *obs_shape] (`env_state`;
        () for envs stepped outside the program, jaxppo.run.hostloop): params from `k_params`,
        `key` the training stream."""
        spec = self.spec
        dummy = jnp.zeros((1, spec.obs_dim), jnp.float32)
        params = self.network.init(k_params, dummy)
        opt_state = self._optimizer(hp).init(ravel_pytree(params)[0])
        flat = flatten_obs(obs, spec.obs_shape)
        obs_stats = RunningStats.create((spec.obs_dim,))
        if self.config.normalize_observations:
            obs_stats = self._merge_stats(obs_stats, flat)
        E = self.local_envs
        carry = PolicyCarry(self.initial_carry((E,)), jnp.ones((E,), bool) if self.recurrent else None)
        return TrainState(
            params=params,
            opt_state=opt_state,
            kl_coeff=hp.kl_coeff,
            obs_stats=obs_stats,
            return_stats=RunningStats.create(()),
            env_state=env_state,
            last_obs=obs,
            discounted_return=jnp.zeros((self.local_envs,), jnp.float32),
            episode_return=jnp.zeros((self.local_envs,), jnp.float32),
            episode_length=jnp.zeros((self.local_envs,), jnp.int32),
            env_ids=env_ids.astype(jnp.int32),
            rng=key,
            env_steps=jnp.asarray(0, jnp.int32),
            iteration=jnp.asarray(0, jnp.int32),
            carry=carry,
            hook_state=self.init_reward_hooks(),
            hparams=hp if self.config.pbt is not None else None,
            population=PopulationRecord.create() if self.config.pbt is not None else None,
        )

    def _require_compiled_env(self, what: str) -> None:
        if self.spec.host_loop:
            raise ConfigError(
                f"Algorithm.{what}: env={self.config.env!r} steps in Python, outside the "
                "compiled program, so there is no pure train function to jit or vmap: train it "
                "with jaxppo.train(config) (its host loop, jaxppo.run.hostloop)")

    def _merge_stats(self, stats: RunningStats, x: jax.Array) -> RunningStats:
        """Merge a batch [N, ...] (this shard's part) into stats, with the moments of all shards."""
        gathered = self.all_gather(local_moments(x, axis=0))
        return self._merge_gathered(stats, gathered, x.shape[0])

    def _merge_gathered(self, stats: RunningStats, gathered, n_local: int) -> RunningStats:
        """Merge the all-gathered shard moments ([S, ...] mean and variance) into stats."""
        return stats.merge(*combine_moments(*gathered), n_local * self.shards)

    def all_gather(self, tree):
        """Every shard's value of `tree`, with a leading [shards] axis, in one collective:
        the leaves travel together as one flat vector. Without an axis: [1, ...]."""
        if self.axis_name is None:
            return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
        flat, unravel = ravel_pytree(tree)
        return jax.vmap(unravel)(jax.lax.all_gather(flat, self.axis_name))

    # ------------------------------------------------------------------ acting
    def _obs_in(self, stats: RunningStats, raw_obs: jax.Array) -> jax.Array:
        flat = flatten_obs(raw_obs, self.spec.obs_shape)
        return normalize(stats, flat) if self.config.normalize_observations else flat

    def initial_carry(self, batch_shape: tuple[int, ...] = ()):
        """The network's carry at the start of an episode ([*batch_shape, ...]; () for a
        feed-forward network)."""
        return networks.initial_carry(self.network, batch_shape)

    def policy_step(self, params, obs_stats, raw_obs, carry, key, deterministic: bool = False):
        """(actions, new carry) for raw observations [..., *obs_shape] and the carry before
        them (`initial_carry` at an episode's start). Actions are env-ready (clipped to the
        bounds); `key` may be None when deterministic (the distribution's mode)."""
        dist, _, carry = self.network.apply(params, self._obs_in(obs_stats, raw_obs), carry)
        a = networks.mode(self.discrete, dist) if deterministic else networks.sample(self.discrete, dist, key)
        return env_action(self.spec, a), carry

    def act(self, params, obs_stats, raw_obs, key, deterministic: bool = False):
        """Actions for raw observations [..., *obs_shape] of a feed-forward policy (a
        recurrent one needs its carry: `policy_step`)."""
        if self.recurrent:
            raise TypeError(
                "a recurrent policy needs its carry from step to step: use "
                "policy_step(params, obs_stats, obs, carry, key) -> (action, carry), starting "
                "each episode from initial_carry(batch_shape); evaluate() handles this itself")
        return self.policy_step(params, obs_stats, raw_obs, (), key, deterministic)[0]

    def value(self, params, obs_stats, raw_obs, carry=()):
        """V(obs) given the carry before it (default: the start of an episode)."""
        return self.network.apply(params, self._obs_in(obs_stats, raw_obs), carry)[1]

    # ------------------------------------------------------------------ rollout
    def rollout_noise(self, key: jax.Array, env_ids: jax.Array):
        """Every random number a rollout needs, drawn before it in one go: for each env and
        step, the noise that samples its action ([T, E, A] Gumbel for logits, [T, E, D]
        normal for a Gaussian) and the key of its env step ([T, E] keys). Env e's draws come
        from its global index alone, so it sees the same randomness whether it lives on 1
        device, N devices or H hosts."""
        T, A = self.config.num_steps, self.spec.action_dim

        def one_env(i):
            k_act, k_env = jax.random.split(jax.random.fold_in(key, i))
            return (networks.sampling_noise(self.discrete, k_act, (T, A)),
                    jax.random.split(k_env, T))

        noise, env_keys = jax.vmap(one_env)(env_ids)
        return jnp.swapaxes(noise, 0, 1), jnp.swapaxes(env_keys, 0, 1)

    def sample_actions(self, dist: DistParams, noise: jax.Array):
        """One action per env from its noise [E, A|D]; returns (actions, log_probs)."""
        action = networks.sample_with_noise(self.discrete, dist, noise)
        return action, networks.log_prob(self.discrete, dist, action)

    def step_envs(self, st: TrainState, dist: DistParams, action, logp, env_keys, hp: HyperParams):
        """Step every env once; returns (state with env/episode trackers advanced, the
        Transition of this step, done flags [E])."""
        spec = self.spec
        obs, env_state, reward, term, trunc, info = jax.vmap(
            spec.env.step, in_axes=(0, 0, 0, None)
        )(env_keys, st.env_state, env_action(spec, action), spec.env_params)
        reward = reward.astype(jnp.float32)
        term = term.astype(bool)
        trunc = jnp.logical_and(trunc.astype(bool), ~term)
        done = jnp.logical_or(term, trunc)
        ep_ret = st.episode_return + reward
        ep_len = st.episode_length + 1
        disc_ret = st.discounted_return * hp.gamma + reward
        tr = Transition(
            obs=st.last_obs, final_obs=info["final_observation"], action=action,
            log_prob=logp, dist=dist, reward=reward, discounted_return=disc_ret,
            terminated=term, truncated=trunc, episode_return=ep_ret, episode_length=ep_len,
        )
        st = st.replace(
            env_state=env_state,
            last_obs=obs,
            discounted_return=jnp.where(done, 0.0, disc_ret),
            episode_return=jnp.where(done, 0.0, ep_ret),
            episode_length=jnp.where(done, 0, ep_len),
        )
        return st, tr, done

    def rollout(self, state: TrainState, hp: HyperParams):
        def step(st, xs):
            noise, env_keys = xs
            obs_in = self._obs_in(st.obs_stats, st.last_obs)
            dist, _, carry = self.network.apply(st.params, obs_in, st.carry.state, st.carry.reset)
            action, logp = self.sample_actions(dist, noise)
            reset = st.carry.reset
            st, tr, done = self.step_envs(st, dist, action, logp, env_keys, hp)
            st = st.replace(carry=PolicyCarry(carry, done if self.recurrent else None))
            return st, tr._replace(reset=reset)

        carry0 = state.carry.state
        rng, k_roll = jax.random.split(state.rng)
        state, traj = jax.lax.scan(step, state, self.rollout_noise(k_roll, state.env_ids))
        return state.replace(rng=rng), traj._replace(carry0=carry0)

    # ------------------------------------------------------------------ one iteration
    def iteration(self, state: TrainState, hp: HyperParams):
        """Rollout, GAE, learn, adapt. Returns (new_state, metrics dict of scalars).

        Split over shards (devices or hosts), `config.sync` says how they combine: with
        "gradients" each shard keeps its part of the batch and every minibatch's gradient is
        all-reduced; with "batch" the rollouts are all-gathered once and every shard runs the
        whole update on the whole batch (the same update, so params stay identical).
        """
        start_steps = state.env_steps
        obs_stats_acting = state.obs_stats
        state, traj = self.rollout(state, hp)
        if self.config.sync == "batch" and self.axis_name is not None:
            traj, env_ids = self.gather_envs(traj, state.env_ids)
            return self._whole_batch().update(state, traj, env_ids, hp, start_steps, obs_stats_acting)
        return self.update(state, traj, state.env_ids, hp, start_steps, obs_stats_acting)

    def _whole_batch(self) -> "Algorithm":
        """This algorithm seen as one shard holding every env (for sync="batch")."""
        import copy

        whole = copy.copy(self)
        whole.axis_name, whole.shards, whole.local_envs = None, 1, self.config.num_envs
        return whole

    def env_axes(self, traj: Transition) -> Transition:
        """The env axis of every leaf of a rollout (-1: the same for every env, e.g. a
        state-independent log std)."""
        axes = jax.tree.map(lambda _: 1, traj)._replace(carry0=jax.tree.map(lambda _: 0, traj.carry0))
        if shares_log_std(traj.dist):
            axes = axes._replace(dist=axes.dist._replace(log_std=-1))
        return axes

    def gather_envs(self, traj: Transition, env_ids: jax.Array):
        """(rollout [T, num_envs, ...], env ids [num_envs]) of every shard, in global env order,
        through one all-gather: every leaf travels as float32 columns of one array [E, F]
        (exact for the bools, small ints and floats a rollout holds)."""
        tree = (traj, env_ids)
        leaves, treedef = jax.tree.flatten(tree)
        axes = jax.tree.leaves((self.env_axes(traj), 0))
        cols, layout = [], []
        for x, ax in zip(leaves, axes):
            if ax < 0:
                layout.append(None)
                continue
            y = jnp.moveaxis(x, ax, 0)
            cols.append(y.reshape((y.shape[0], -1)).astype(jnp.float32))
            layout.append((ax, y.shape[1:], x.dtype))
        gathered = jax.lax.all_gather(jnp.concatenate(cols, axis=1), self.axis_name, tiled=True)
        out, i = [], 0
        for x, lay in zip(leaves, layout):
            if lay is None:
                out.append(x)
                continue
            ax, shape, dtype = lay
            n = int(np.prod(shape))
            y = gathered[:, i:i + n].reshape((gathered.shape[0],) + shape).astype(dtype)
            out.append(jnp.moveaxis(y, 0, ax))
            i += n
        return jax.tree.unflatten(treedef, out)

    def update(self, state: TrainState, traj: Transition, env_ids: jax.Array, hp: HyperParams,
               start_steps: jax.Array, obs_stats_acting: RunningStats):
        """GAE, learn and adapt on a rollout [T, E] (this shard's envs, `env_ids`), acted
        with `obs_stats_acting`. Returns (new_state, metrics)."""
        cfg = self.config
        lr = schedule_value(hp.lr_points, start_steps)
        ent_coeff = schedule_value(hp.entropy_points, start_steps)
        values, next_values = self.rollout_values(state.params, obs_stats_acting, traj)
        # One collective for everything the rollout alone determines.
        flat_obs = flatten_obs(traj.obs, self.spec.obs_shape).reshape((-1, self.spec.obs_dim))
        local = {"episodes": self._local_episode_stats(traj)}
        if cfg.normalize_observations:
            local["obs"] = local_moments(flat_obs, axis=0)
        if cfg.normalize_rewards:
            local["returns"] = local_moments(traj.discounted_return)
        rollout_stats = self.all_gather(local)

        rewards = traj.reward
        rewards, state = self.apply_reward_hooks(state, traj, rewards)
        return_stats = state.return_stats
        if cfg.normalize_rewards:
            return_stats = self._merge_gathered(return_stats, rollout_stats["returns"],
                                                traj.discounted_return.size)
            rewards = rewards / jnp.sqrt(return_stats.var + 1e-8)
        advantages, targets = compute_gae(
            rewards, values, next_values, traj.terminated, traj.truncated, hp.gamma, hp.gae_lambda
        )
        # And one for the GAE statistics.
        local = {"targets": local_moments(targets), "residuals": local_moments(targets - values)}
        if cfg.normalize_advantages:
            local["advantages"] = local_moments(advantages)
        gae_stats = jax.tree.map(lambda x: combine_moments(*x), self.all_gather(local),
                                 is_leaf=lambda x: isinstance(x, tuple))
        if cfg.normalize_advantages:
            adv_mean, adv_var = gae_stats["advantages"]
            advantages = (advantages - adv_mean) / (jnp.sqrt(adv_var) + 1e-8)
        batch = self.make_batch(obs_stats_acting, traj, values, advantages, targets)

        rng, k_epochs = jax.random.split(state.rng)
        (params, opt_state), learn = self.learn(
            state.params, state.opt_state, batch, env_ids, k_epochs, hp, lr, ent_coeff,
            state.kl_coeff,
        )
        mean_kl = jnp.mean(learn.kl)
        kl_coeff = update_kl_coeff(state.kl_coeff, mean_kl, hp.kl_target) if cfg.use_kl_loss else state.kl_coeff
        obs_stats = state.obs_stats
        if cfg.normalize_observations:
            obs_stats = self._merge_gathered(obs_stats, rollout_stats["obs"], flat_obs.shape[0])

        env_steps = start_steps + cfg.num_steps * cfg.num_envs
        metrics = self._episode_metrics(rollout_stats["episodes"])
        _, target_var = gae_stats["targets"]
        _, resid_var = gae_stats["residuals"]
        metrics.update({
            "policy_loss": jnp.mean(learn.policy_loss),
            "value_loss": jnp.mean(learn.value_loss),
            "entropy": jnp.mean(learn.entropy),
            "kl": mean_kl,
            "approx_kl": jnp.mean(learn.approx_kl),
            "clip_fraction": jnp.mean(learn.clip_fraction),
            "explained_variance": 1.0 - resid_var / jnp.maximum(target_var, 1e-8),
            "kl_coeff": kl_coeff,
            "lr": lr,
            "entropy_coeff": ent_coeff,
            "grad_norm": jnp.mean(learn.grad_norm),
            "env_steps": env_steps,
        })
        state = state.replace(
            params=params, opt_state=opt_state, rng=rng, kl_coeff=kl_coeff, obs_stats=obs_stats,
            return_stats=return_stats, env_steps=env_steps, iteration=state.iteration + 1,
        )
        return state, metrics

    # ------------------------------------------------------------------ user reward hooks
    def init_reward_hooks(self) -> tuple:
        """Initial states of the config's reward hooks (jaxppo.envs.transforms); () for none."""
        return transforms.init_reward_hooks(self.config, self.spec)

    def apply_reward_hooks(self, state: TrainState, traj: Transition, rewards):
        """The config's reward hooks over the rollout batch [T, E], before GAE.
        Returns (rewards, state) with the hooks' new states in state.hook_state."""
        rewards, hook_state = transforms.apply_reward_hooks(
            self.config, state.hook_state, traj, rewards, self.axis_name)
        return rewards, state.replace(hook_state=hook_state)

    # ------------------------------------------------------------------ pieces of an iteration
    def rollout_values(self, params, obs_stats: RunningStats, traj: Transition):
        """V(s_t) and V(s'_t) of the pre-reset successor, [T, E]. Feed-forward: one batched
        pass over both. Recurrent: V(s_t) by replaying the network over the rollout, and
        V(s'_t) from the carry after step t (before any reset), in one batched pass."""
        obs_in = self._obs_in(obs_stats, traj.obs)
        final_in = self._obs_in(obs_stats, traj.final_obs)
        if self.recurrent:
            _, values, carries = self.unroll(params, traj.carry0, obs_in, traj.reset)
            return values, self.network.apply(params, final_in, carries)[1]
        T = traj.reward.shape[0]
        both = self.network.apply(params, jnp.concatenate([obs_in, final_in], axis=0))[1]
        return both[:T], both[T:]

    def unroll(self, params, carry0, obs_in, reset):
        """Replay the network over sequences: obs_in [T, B, obs_dim] (normalised), reset
        [T, B], carry0 [B, ...]. Returns (dist [T, B, ...] with a shared log_std kept as one
        vector, values [T, B], the carries after each step [T, B, ...])."""

        def step(carry, xs):
            obs, r = xs
            dist, value, carry = self.network.apply(params, obs, carry, r)
            return carry, (dist, value, carry)

        _, (dist, values, carries) = jax.lax.scan(step, carry0, (obs_in, reset))
        return unstack_shared_log_std(dist), values, carries

    def make_batch(self, obs_stats, traj: Transition, values, advantages, targets) -> Batch:
        """The iteration's batch, time-major [T, E, ...]; a state-independent old log_std
        is kept as one vector [D]."""
        return Batch(
            obs=self._obs_in(obs_stats, traj.obs), actions=traj.action,
            old_log_probs=traj.log_prob, old_dist=unstack_shared_log_std(traj.dist),
            old_values=values, advantages=advantages, value_targets=targets,
            reset=traj.reset, carry0=traj.carry0,
        )

    def _local_episode_stats(self, traj: Transition) -> jax.Array:
        """[5] float32: episodes that ended in this shard's rollout, the sums of their returns
        and lengths, and their min and max return (+inf/-inf when none ended)."""
        done = jnp.logical_or(traj.terminated, traj.truncated)
        return jnp.stack([
            jnp.sum(done).astype(jnp.float32),
            jnp.sum(jnp.where(done, traj.episode_return, 0.0)),
            jnp.sum(jnp.where(done, traj.episode_length, 0)).astype(jnp.float32),
            jnp.min(jnp.where(done, traj.episode_return, jnp.inf)),
            jnp.max(jnp.where(done, traj.episode_return, -jnp.inf)),
        ])

    @staticmethod
    def _episode_metrics(gathered: jax.Array) -> dict:
        """Metrics from every shard's `_local_episode_stats` ([S, 5])."""
        n_done = jnp.sum(gathered[:, 0])
        has = n_done > 0
        denom = jnp.maximum(n_done, 1.0)
        nan = jnp.float32(jnp.nan)
        return {
            "episode_return_mean": jnp.where(has, jnp.sum(gathered[:, 1]) / denom, nan),
            "episode_return_min": jnp.where(has, jnp.min(gathered[:, 3]), nan),
            "episode_return_max": jnp.where(has, jnp.max(gathered[:, 4]), nan),
            "episode_length_mean": jnp.where(has, jnp.sum(gathered[:, 2]) / denom, nan),
            "episodes": n_done.astype(jnp.int32),
        }

    def minibatch_indices(self, key: jax.Array, env_ids: jax.Array) -> jax.Array:
        """Each epoch's minibatches, cut so that the global minibatch is the same set of
        transitions however the envs are spread over devices or hosts.

        Feed-forward: [M, T/M, E] time indices; each env's T steps are shuffled by a key
        from its global index, and minibatch j takes T/M steps of every env.
        Recurrent: [M, E/M] env columns (whole sequences); minibatch j holds one env of each
        group of M consecutive global env ids, chosen by a permutation keyed by the group.
        """
        T, M = self.config.num_steps, self.config.num_minibatches
        if self.recurrent:
            groups = env_ids.reshape(-1, M)[:, 0] // M  # [E/M] global group ids
            perms = jax.vmap(lambda g: jax.random.permutation(jax.random.fold_in(key, g), M))(groups)
            cols = jnp.arange(env_ids.shape[0]).reshape(-1, M)
            return jnp.take_along_axis(cols, perms, axis=1).T
        perms = jax.vmap(lambda i: jax.random.permutation(jax.random.fold_in(key, i), T))(env_ids)
        return perms.T.reshape(M, T // M, -1)

    def gather_minibatch(self, batch: Batch, idx: jax.Array) -> Batch:
        """One minibatch from the time-major batch: [T/M * E, ...] samples for time indices
        idx [T/M, E], or the whole sequences [T, E/M, ...] of env columns idx [E/M]."""
        if self.recurrent:
            sub = map_samples(lambda x: x[:, idx], batch)
            return sub._replace(carry0=jax.tree.map(lambda c: c[idx], batch.carry0))
        cols = jnp.arange(idx.shape[1])[None, :]
        return map_samples(lambda x: x[idx, cols].reshape((-1,) + x.shape[2:]), batch)

    def forward(self, params, mb: Batch):
        """(dist, values [B], samples [B]) of the network on a minibatch; whole sequences are
        replayed from their carries and resets, then flattened to samples."""
        if not self.recurrent:
            dist, values, _ = self.network.apply(params, mb.obs)
            return dist, values, mb
        dist, values, _ = self.unroll(params, mb.carry0, mb.obs, mb.reset)
        merge = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731  [T, B, ...] -> [T*B, ...]
        return map_dist(merge, dist), values.reshape(-1), map_samples(merge, mb)

    def loss_and_grads(self, params, mb: Batch, hp: HyperParams, ent_coeff, kl_coeff):
        """(grads, LossTerms) of the PPO loss on one (local) minibatch."""
        cfg = self.config

        def loss_fn(p):
            dist, values, samples = self.forward(p, mb)
            terms = ppo_loss_terms(
                self.discrete, dist, values, samples,
                clip_param=hp.clip_param, vf_clip_param=hp.vf_clip_param, vf_coeff=hp.vf_coeff,
                entropy_coeff=ent_coeff, kl_coeff=kl_coeff, use_kl_loss=cfg.use_kl_loss,
                use_vf_clip=cfg.vf_clip_param is not None,
            )
            return terms.total, terms

        grads, terms = jax.grad(loss_fn, has_aux=True)(params)
        return grads, terms

    def apply_grads(self, params, opt_state, flat_grads, hp: HyperParams, lr):
        """Clip by global norm, Adam, step by -lr. Returns (params, opt_state, grad_norm).

        The optimiser works on one flat vector (its state too): one fused update instead of
        one per parameter array, which compiles and runs faster for small networks.
        """
        flat_params, unravel = ravel_pytree(params)
        grad_norm = optax.tree.norm(flat_grads)
        updates, opt_state = self._optimizer(hp).update(flat_grads, opt_state, flat_params)
        return unravel(flat_params - lr * updates), opt_state, grad_norm

    def learn(self, params, opt_state, batch: Batch, env_ids, key, hp, lr, ent_coeff, kl_coeff):
        """num_epochs x num_minibatches gradient steps; grads averaged over devices."""
        ax = self.axis_name

        def minibatch_step(carry, mb):
            params, opt_state = carry
            grads, terms = self.loss_and_grads(params, mb, hp, ent_coeff, kl_coeff)
            # One all-reduce per minibatch: the flat gradient and the loss terms together.
            flat_grads = ravel_pytree(grads)[0]
            n = flat_grads.shape[0]
            fused = _pmean(jnp.concatenate([flat_grads, jnp.stack(terms).astype(flat_grads.dtype)]), ax)
            terms = type(terms)(*fused[n:])
            params, opt_state, grad_norm = self.apply_grads(params, opt_state, fused[:n], hp, lr)
            return (params, opt_state), _LearnStats(
                policy_loss=terms.policy_loss, value_loss=terms.value_loss, entropy=terms.entropy,
                kl=terms.kl, approx_kl=terms.approx_kl, clip_fraction=terms.clip_fraction,
                grad_norm=grad_norm,
            )

        def epoch(carry, k):
            # Every minibatch of the epoch in one gather (the minibatches stacked [M, ...]),
            # rather than one gather per field in every minibatch step.
            minibatches = jax.vmap(lambda idx: self.gather_minibatch(batch, idx))(
                self.minibatch_indices(k, env_ids))
            return jax.lax.scan(minibatch_step, carry, minibatches)

        keys = jax.random.split(key, self.config.num_epochs)
        return jax.lax.scan(epoch, (params, opt_state), keys)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, params, obs_stats, key, num_episodes: int | None = None,
                 deterministic: bool | None = None, max_steps: int | None = None) -> dict:
        """eval_return_mean/std and eval_length_mean of one episode in each of
        `num_episodes` fresh eval envs (defaults from the config). Pure; jit-able."""
        cfg = self.config
        n = cfg.eval_episodes if num_episodes is None else num_episodes
        det = cfg.eval_deterministic if deterministic is None else deterministic
        bound = self.eval_bound() if max_steps is None else max_steps
        stats = run_episodes(
            lambda obs, k, c: self.policy_step(params, obs_stats, obs, c, k, deterministic=det),
            self.spec.env, self.spec.env_params, key, n, bound, self.initial_carry((n,)),
        )
        return stats.metrics()

    def eval_bound(self) -> int:
        """Steps an evaluation episode may last (ConfigError when neither the config nor the
        env gives a bound)."""
        if self.run.eval_max_steps is None:
            eval_max_steps(self.config, self.spec.env_params)  # raises, naming the fix
        return self.run.eval_max_steps

    # ------------------------------------------------------------------ whole runs
    def make_train(self):
        """A pure `train_fn(key, hp) -> (final TrainState, metrics [num_iterations])`."""
        self._require_compiled_env("make_train")
        n_iter = self.config.num_iterations

        def train_fn(key, hp):
            state = self.init(key, hp)
            return jax.lax.scan(lambda s, _: self.iteration(s, hp), state, None, length=n_iter)

        return train_fn

    def chunk(self, state: TrainState, hp: HyperParams, start: jax.Array, length: int,
              stop: jax.Array | None = None):
        """`length` iterations from `start`; iterations from `stop` (default: the run's end)
        on are skipped (cond on an unbatched index, so under vmap it stays a real branch).

        With `eval_every > 0`, iteration k (1-based) is followed by an evaluation when k is a
        multiple of eval_every or the last iteration; its eval_* metrics are NaN otherwise.
        """
        n_iter = self.config.num_iterations
        stop = n_iter if stop is None else jnp.minimum(stop, n_iter)
        return jax.lax.scan(lambda s, i: self.chunk_step(s, hp, start + i, stop), state,
                            jnp.arange(length))

    def chunk_step(self, s: TrainState, hp: HyperParams, index: jax.Array, stop: jax.Array):
        """Iteration `index` (0-based) of a chunk: run when index < stop, else skipped (zero
        metrics, state unchanged); then the evaluation when due. A PBT member trains with the
        hyperparameters in its state (`hp` only gives their shapes)."""
        cfg = self.config
        n_iter = cfg.num_iterations
        if s.hparams is not None:
            hp = s.hparams

        def run(s):
            return self.iteration(s, hp)

        def skip(s):
            _, m = jax.eval_shape(self.iteration, s, hp)
            return s, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), m)

        live = index < stop
        s, m = jax.lax.cond(live, run, skip, s)
        if cfg.eval_every:
            done = index + 1
            due = jnp.logical_and(live, jnp.logical_or(done % cfg.eval_every == 0, done == n_iter))
            m = {**m, **self._maybe_evaluate(s, due)}
        return s, m

    def _maybe_evaluate(self, state: TrainState, due: jax.Array) -> dict:
        """Eval metrics when `due` (unbatched), NaN otherwise. The key is folded from the
        training key without consuming it, so training randomness does not change."""

        def evaluate(st):
            key = jax.random.fold_in(st.rng, EVAL_KEY_TAG)
            return self.evaluate(st.params, st.obs_stats, key)

        def skip(st):
            return {k: jnp.float32(jnp.nan) for k in EVAL_METRIC_KEYS}

        return jax.lax.cond(due, evaluate, skip, state)


class _LearnStats(NamedTuple):
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    kl: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array
    grad_norm: jax.Array
