"""One PPO iteration as pure, jit-able functions: rollout -> GAE -> epochs x minibatches.

Each function takes the frozen `Algorithm` (what `resolve` derived) first. What a recurrent
network changes is small and local: the rollout records each env's carry at its start and
the resets; values and the loss replay the network over whole sequences; and a minibatch is
whole env sequences [T, E/M] instead of num_steps/M steps of every env. Whatever crosses
shards (devices or hosts) is in jaxppo.core.collectives: the same global batch gives the
same update on 1 device, N devices or H hosts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from jaxppo.core import collectives, networks
from jaxppo.core.algorithm import Algorithm, PolicyCarry, PopulationRecord, TrainState, Transition
from jaxppo.core.gae import compute_gae
from jaxppo.config import own_critic_lr
from jaxppo.core.hyperparams import HyperParams, schedule_value
from jaxppo.core.losses import (Batch, map_dist, map_samples, ppo_loss_terms,
                                unstack_shared_log_std, update_kl_coeff)
from jaxppo.core.networks import DistParams
from jaxppo.core.running_stats import RunningStats
from jaxppo.envs.spec import (apply_reward_hooks, env_action, flatten_obs, init_reward_hooks,
                              step_batch)


# ---------------------------------------------------------------------- init
def optimizer(algo: Algorithm, hp: HyperParams, params) -> optax.GradientTransformation:
    """Clip by global norm (over all of `params`, or with `max_grad_norm_over: each_network`
    the actor's and the critic's apart), then Adam; the learning rate is applied by hand so
    it can follow env steps (not optimiser steps) and be vmapped. It works on `params`
    flattened to one vector."""
    if algo.config.max_grad_norm_over == "each_network":
        clip = clip_each_network(networks.critic_param_mask(params), hp.max_grad_norm)
    else:
        clip = optax.clip_by_global_norm(hp.max_grad_norm)
    return optax.chain(clip, optax.scale_by_adam(eps=algo.config.adam_eps))


def clip_each_network(critic, max_norm) -> optax.GradientTransformation:
    """optax.clip_by_global_norm applied to the actor's part and the critic's part of a flat
    gradient apart (`critic` bool [P] marks the critic's entries; the other part is zeros
    in each call, so it adds nothing to the norm). Adam being elementwise, this and one Adam
    step is what an optimiser each for actor and critic gives. Its state is
    clip_by_global_norm's (empty), so a checkpoint loads under either setting."""
    clip = optax.clip_by_global_norm(max_norm)

    def update(grads, state, params=None):
        parts = (clip.update(jnp.where(mine, grads, 0.0), state)[0] for mine in (critic, ~critic))
        return sum(parts), state

    return optax.GradientTransformation(clip.init, update)


def init(algo: Algorithm, key: jax.Array, hp: HyperParams,
         env_index_offset: int | jax.Array = 0) -> TrainState:
    """Fresh state. Env e (global index `env_index_offset + e`) is seeded from `key` and e
    alone, so splitting envs across devices or hosts leaves each env's stream unchanged."""
    spec = algo.spec
    algo.require_compiled_env("init")
    key, k_params, k_env = jax.random.split(key, 3)
    env_ids = env_index_offset + jnp.arange(algo.local_envs)
    env_keys = jax.vmap(lambda i: jax.random.fold_in(k_env, i))(env_ids)
    obs, env_state = jax.vmap(spec.env.reset, in_axes=(0, None))(env_keys, spec.env_params)
    return init_state(algo, key, k_params, hp, spec.to_actors(obs), env_state, env_ids)


def init_state(algo: Algorithm, key: jax.Array, k_params: jax.Array, hp: HyperParams,
               obs: jax.Array, env_state: Any, env_ids: jax.Array) -> TrainState:
    """A fresh TrainState around envs just reset to `obs` [E, *obs_shape] (`env_state`;
    () for envs stepped outside the program, jaxppo.run.hostloop): params from `k_params`,
    `key` the training stream. A multi-agent env's E is its actors (envs x agents)."""
    spec, cfg, E = algo.spec, algo.config, algo.local_actors
    params = algo.init_params(k_params)
    opt_state = optimizer(algo, hp, params).init(ravel_pytree(params)[0])
    obs_stats = RunningStats.create((spec.obs_dim,))
    if cfg.normalize_observations:
        obs_stats = collectives.merge_stats(obs_stats, flatten_obs(obs, spec.obs_shape),
                                            algo.axis_name, algo.shards)
    carry = PolicyCarry(algo.train_carry((E,)), jnp.ones((E,), bool) if algo.recurrent else None)
    return TrainState(
        params=params,
        opt_state=opt_state,
        kl_coeff=hp.kl_coeff,
        obs_stats=obs_stats,
        return_stats=RunningStats.create(()),
        env_state=env_state,
        last_obs=obs,
        discounted_return=jnp.zeros((E,), jnp.float32),
        episode_return=jnp.zeros((E,), jnp.float32),
        episode_length=jnp.zeros((E,), jnp.int32),
        env_ids=env_ids.astype(jnp.int32),
        rng=key,
        env_steps=jnp.asarray(0, jnp.int32),
        iteration=jnp.asarray(0, jnp.int32),
        carry=carry,
        hook_state=init_reward_hooks(algo.reward_hooks, spec),
        hparams=hp if cfg.pbt is not None else None,
        population=PopulationRecord.create() if cfg.pbt is not None else None,
    )


# ---------------------------------------------------------------------- rollout
def rollout_noise(algo: Algorithm, key: jax.Array, env_ids: jax.Array):
    """Every random number a rollout needs, drawn before it in one go: for each env and
    step, the noise that samples its action ([T, E, A] Gumbel for logits, [T, E, D]
    normal for a Gaussian) and the key of its env step ([T, E] keys). Env e's draws come
    from its global index alone, so it sees the same randomness whether it lives on 1
    device, N devices or H hosts. A multi-agent env's noise is per actor: [T, E*N, A]."""
    spec, T = algo.spec, algo.config.num_steps
    shape = (T, spec.num_agents, spec.action_dim) if spec.agents else (T, spec.action_dim)

    def one_env(i):
        k_act, k_env = jax.random.split(jax.random.fold_in(key, i))
        return networks.sampling_noise(algo.discrete, k_act, shape), jax.random.split(k_env, T)

    noise, env_keys = jax.vmap(one_env)(env_ids)
    noise = jnp.swapaxes(noise, 0, 1)  # [T, E, (N,) A]
    return jax.vmap(spec.to_actors)(noise), jnp.swapaxes(env_keys, 0, 1)


def step_envs(algo: Algorithm, st: TrainState, dist: DistParams, action, logp, env_keys,
              hp: HyperParams):
    """Step every env once with `action` [E, ...] (one per actor); returns (state with
    env/episode trackers advanced, the Transition of this step, done flags [E]). A
    multi-agent env's agents share their env's done."""
    spec = algo.spec
    obs, env_state, reward, term, trunc, info = step_batch(
        spec.env, env_keys, st.env_state, spec.to_agents(env_action(spec, action)),
        spec.env_params)
    obs, final_obs = spec.to_actors(obs), spec.to_actors(info["final_observation"])
    reward = spec.to_actors(reward.astype(jnp.float32))
    term = spec.to_actors(term.astype(bool))
    trunc = jnp.logical_and(spec.to_actors(trunc.astype(bool)), ~term)
    done = jnp.logical_or(term, trunc)
    ep_ret = st.episode_return + reward
    ep_len = st.episode_length + 1
    disc_ret = st.discounted_return * hp.gamma + reward
    tr = Transition(
        obs=st.last_obs, final_obs=final_obs, action=action,
        log_prob=logp, dist=dist, reward=reward, discounted_return=disc_ret,
        terminated=term, truncated=trunc, episode_return=ep_ret, episode_length=ep_len,
        won=spec.to_actors(info["won"]) if "won" in info else None,
        episode_values=(jnp.repeat(info["episode_values"], spec.num_agents, axis=0)
                        if "episode_values" in info else None),
    )
    if algo.config.critic_input == "world_state":
        final_ws = info["final_world_state"]  # [E, C]: every agent of an env gets its env's
        final_ws = jnp.repeat(final_ws[:, None], spec.num_agents, axis=1)
        tr = tr._replace(final_world_state=spec.to_actors(final_ws))
    st = st.replace(
        env_state=env_state,
        last_obs=obs,
        discounted_return=jnp.where(done, 0.0, disc_ret),
        episode_return=jnp.where(done, 0.0, ep_ret),
        episode_length=jnp.where(done, 0, ep_len),
    )
    return st, tr, done


def rollout(algo: Algorithm, state: TrainState, hp: HyperParams):
    """num_steps steps of every local env. Returns (state after them, Transition [T, E])."""

    def step(st, xs):
        noise, env_keys = xs
        obs_in = algo.obs_in(st.obs_stats, st.last_obs)
        world_state = (algo.spec.world_states(st.env_state)
                       if algo.config.critic_input == "world_state" else None)
        # A GRU critic of its own steps its carry along with the actor's.
        critic_in = (algo.critic_in(st.obs_stats, st.last_obs, world_state)
                     if algo.recurrent else None)
        dist, _, carry = apply_network(algo, st.params, obs_in, st.carry.state, st.carry.reset,
                                       critic_in)
        mask = algo.spec.masks(st.env_state)  # the legal actions of the observed states
        dist = networks.mask_logits(dist, mask)
        action, logp = algo.sample_actions(dist, noise)
        reset = st.carry.reset
        st, tr, done = step_envs(algo, st, dist, action, logp, env_keys, hp)
        st = st.replace(carry=PolicyCarry(carry, done if algo.recurrent else None))
        return st, tr._replace(reset=reset, action_mask=mask, world_state=world_state)

    carry0 = state.carry.state
    rng, k_roll = jax.random.split(state.rng)
    state, traj = jax.lax.scan(step, state, rollout_noise(algo, k_roll, state.env_ids))
    return state.replace(rng=rng), traj._replace(carry0=carry0)


# ---------------------------------------------------------------------- values and GAE
def apply_network(algo: Algorithm, params, obs_in, carry, reset, critic_in=None):
    """The network on one step: (dist, value, carry); a centralised critic's input
    `critic_in` goes to the critic when given (None: the network's own contract)."""
    if critic_in is None:
        return algo.network.apply(params, obs_in, carry, reset)
    return algo.network.apply(params, obs_in, carry, reset, critic_obs=critic_in)


def unroll(algo: Algorithm, params, carry0, obs_in, reset, critic_in=None):
    """Replay the network over sequences: obs_in [T, B, obs_dim] (normalised), reset
    [T, B], carry0 [B, ...], and a centralised critic's input critic_in [T, B, C] (None: a
    local critic). Returns (dist [T, B, ...] with a shared log_std kept as one vector,
    values [T, B], the carries after each step [T, B, ...])."""

    def step(carry, xs):
        obs, r, c = xs
        dist, value, carry = apply_network(algo, params, obs, carry, r, c)
        return carry, (dist, value, carry)

    _, (dist, values, carries) = jax.lax.scan(step, carry0, (obs_in, reset, critic_in))
    return unstack_shared_log_std(dist), values, carries


def rollout_values(algo: Algorithm, params, obs_stats: RunningStats, traj: Transition):
    """V(s_t) and V(s'_t) of the pre-reset successor, [T, E]. Feed-forward: a pass over
    both, in blocks of at most a minibatch's states (`_value_rows`). Recurrent: V(s_t) by
    replaying the network over the rollout, and V(s'_t) from the carry after step t (before
    any reset), in one batched pass."""
    if algo.recurrent:
        obs_in = algo.obs_in(obs_stats, traj.obs)
        final_in = algo.obs_in(obs_stats, traj.final_obs)
        critic_in = algo.critic_in(obs_stats, traj.obs, traj.world_state)
        _, values, carries = unroll(algo, params, traj.carry0, obs_in, traj.reset, critic_in)
        final_critic_in = algo.critic_in(obs_stats, traj.final_obs, traj.final_world_state)
        return values, apply_network(algo, params, final_in, carries, None, final_critic_in)[1]
    T = traj.reward.shape[0]
    # The raw observations go in (uint8 frames stay uint8), each block made the network's
    # input on its own: no float copy of all 2T x E states at once.
    both_raw = jnp.concatenate([traj.obs, traj.final_obs], axis=0)
    rows = _value_rows(T, algo.config.num_minibatches)
    if not algo.central_critic:
        both = _in_blocks(lambda x: algo.network.apply(params, algo.obs_in(obs_stats, x))[1],
                          rows, both_raw)
        return both[:T], both[T:]
    critic_in = jnp.concatenate([algo.critic_in(obs_stats, traj.obs, traj.world_state),
                                 algo.critic_in(obs_stats, traj.final_obs, traj.final_world_state)])
    both = _in_blocks(lambda x, c: algo.network.apply(params, algo.obs_in(obs_stats, x),
                                                      critic_obs=c)[1], rows, both_raw, critic_in)
    return both[:T], both[T:]


def _value_rows(num_steps: int, num_minibatches: int) -> int:
    """The rows (steps of every env) of a block of the value pass over [2T, E]: the most that
    divide 2T and hold no more states than a minibatch (T/M rows), so that pass never holds
    more activations than a minibatch's forward pass does (an Atari CNN's over all 2T x E
    states at once took several times the memory of the whole update)."""
    most = max(1, num_steps // num_minibatches)
    return max(r for r in range(1, most + 1) if (2 * num_steps) % r == 0)


def _in_blocks(fn, rows: int, *xs):
    """fn over arrays [R, ...] given in blocks of `rows` (a lax.map when there are several);
    the same values as one call, row for row."""
    n = xs[0].shape[0]
    if rows >= n:
        return fn(*xs)
    out = jax.lax.map(lambda b: fn(*b), tuple(x.reshape((n // rows, rows) + x.shape[1:])
                                              for x in xs))
    return out.reshape((n,) + out.shape[2:])


def gather_rollout_stats(algo: Algorithm, traj: Transition) -> dict:
    """Every shard's statistics of its rollout [T, E], in one collective: episodes
    ([S, 5]) and, when normalised, the moments of observations and discounted returns."""
    cfg, spec = algo.config, algo.spec
    local = {"episodes": collectives.local_episode_stats(team_episodes(spec, traj))}
    if spec.agents:
        local["agents"] = collectives.local_agent_stats(traj, spec.num_agents)
    if cfg.normalize_observations:
        flat_obs = flatten_obs(traj.obs, spec.obs_shape).reshape((-1, spec.obs_dim))
        local["obs"] = collectives.local_moments(flat_obs, axis=0)
    if cfg.normalize_rewards:
        local["returns"] = collectives.local_moments(traj.discounted_return)
    return collectives.all_gather(local, algo.axis_name)


def team_episodes(spec, traj: Transition) -> Transition:
    """The episodes of a rollout [T, E] as the metrics count them: a multi-agent env's
    actors [T, E*N] as its envs [T, E], an episode's return the sum of its agents' returns
    (the team return; JaxMARL's MPE baselines log the same) and its end and length its
    agents' shared ones. A single-agent rollout is returned as it is."""
    if not spec.agents:
        return traj
    per_env = lambda x: x.reshape(x.shape[:1] + (-1, spec.num_agents))  # noqa: E731
    first = lambda x: None if x is None else per_env(x)[..., 0]  # noqa: E731
    return traj._replace(episode_return=jnp.sum(per_env(traj.episode_return), axis=-1),
                         episode_length=first(traj.episode_length),
                         terminated=first(traj.terminated), truncated=first(traj.truncated),
                         episode_end=first(traj.episode_end))


def agent_metrics(algo: Algorithm, rollout_stats: dict) -> dict:
    """A multi-agent env's metrics beside the team return: each agent's mean episode return
    (`episode_return_mean/<agent>`), where the env reports wins (SMAX) the fraction of ended
    episodes won (`win_rate`), and the mean of each of its episode values (`<name>_mean`,
    Overcooked's sparse return and dishes); NaN when no episode ended. {} for a single-agent
    env."""
    spec = algo.spec
    if not spec.agents:
        return {}
    sums = jnp.sum(rollout_stats["agents"], axis=0)  # [agents + 1 (+ values)] over shards
    episodes = jnp.sum(rollout_stats["episodes"][:, 0])
    mean = jnp.where(episodes > 0, sums / jnp.maximum(episodes, 1.0), jnp.nan)
    if not algo.reports_wins:  # the wins' slot, after the agents', is 0: not a metric
        mean = jnp.concatenate([mean[:spec.num_agents], mean[spec.num_agents + 1:]])
    return dict(zip(algo.agent_metric_keys, mean))  # agents, win_rate?, episode values


def gae(algo: Algorithm, state: TrainState, traj: Transition, values, next_values,
        rollout_stats: dict, hp: HyperParams):
    """Reward hooks, reward scaling, GAE and advantage normalisation over the rollout [T, E]
    (`normalize_advantages_over: minibatch` leaves that to `learn`).

    Returns (state with the hooks' and the return statistics' new values, advantages [T, E],
    value targets [T, E], the global moments of targets, residuals and advantages).
    """
    cfg = algo.config
    rewards, hook_state = apply_reward_hooks(
        algo.reward_hooks, state.hook_state, traj, traj.reward, algo.axis_name)
    return_stats = state.return_stats
    if cfg.normalize_rewards:
        return_stats = collectives.merge_gathered(return_stats, rollout_stats["returns"],
                                                  traj.discounted_return.size, algo.shards)
        rewards = rewards / jnp.sqrt(return_stats.var + 1e-8)
    # bootstrap_truncation=false: a time limit's cut ends the episode as a termination does.
    terminated = (traj.terminated if cfg.bootstrap_truncation
                  else jnp.logical_or(traj.terminated, traj.truncated))
    advantages, targets = compute_gae(
        rewards, values, next_values, terminated, traj.truncated, hp.gamma, hp.gae_lambda)
    # The GAE statistics of every shard in one collective.
    local = {"targets": collectives.local_moments(targets),
             "residuals": collectives.local_moments(targets - values)}
    over_batch = cfg.normalize_advantages and cfg.normalize_advantages_over == "batch"
    if over_batch:
        local["advantages"] = collectives.local_moments(advantages)
    gae_stats = jax.tree.map(lambda x: collectives.combine_moments(*x),
                             collectives.all_gather(local, algo.axis_name),
                             is_leaf=lambda x: isinstance(x, tuple))
    if over_batch:
        adv_mean, adv_var = gae_stats["advantages"]
        advantages = (advantages - adv_mean) / (jnp.sqrt(adv_var) + 1e-8)
    state = state.replace(hook_state=hook_state, return_stats=return_stats)
    return state, advantages, targets, gae_stats


def make_batch(algo: Algorithm, obs_stats, traj: Transition, values, advantages, targets,
               raw_obs: bool = False) -> Batch:
    """The iteration's batch, time-major [T, E, ...]; a state-independent old log_std
    is kept as one vector [D]. With `raw_obs`, `obs` holds the raw observations [T, E,
    *obs_shape] in the env's dtype (uint8 frames a quarter of their float32 size), which
    `learn` makes the network's input one minibatch at a time."""
    return Batch(
        obs=traj.obs if raw_obs else algo.obs_in(obs_stats, traj.obs), actions=traj.action,
        old_log_probs=traj.log_prob, old_dist=unstack_shared_log_std(traj.dist),
        old_values=values, advantages=advantages, value_targets=targets,
        reset=traj.reset, carry0=traj.carry0, action_mask=traj.action_mask,
        critic_obs=algo.critic_in(obs_stats, traj.obs, traj.world_state),
    )


# ---------------------------------------------------------------------- epochs x minibatches
class LearnStats(NamedTuple):
    """What each minibatch step reports ([epochs, minibatches] after the scans)."""

    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    kl: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array
    grad_norm: jax.Array
    # With kl_early_stop: whether the minibatch was evaluated (before the stop, or the one
    # that stopped the updates) and whether its gradient step was taken; else None.
    evaluated: jax.Array | None = None
    stepped: jax.Array | None = None


def gather_minibatch(algo: Algorithm, batch: Batch, idx: jax.Array) -> Batch:
    """One minibatch from the time-major batch: [T/M * E, ...] samples for time indices
    idx [T/M, E], or the whole sequences [T, E/M, ...] of env columns idx [E/M]."""
    if algo.recurrent:
        sub = map_samples(lambda x: x[:, idx], batch)
        return sub._replace(carry0=jax.tree.map(lambda c: c[idx], batch.carry0))
    cols = jnp.arange(idx.shape[1])[None, :]
    return map_samples(lambda x: x[idx, cols].reshape((-1,) + x.shape[2:]), batch)


def forward(algo: Algorithm, params, mb: Batch):
    """(dist, values [B], samples [B]) of the network on a minibatch; whole sequences are
    replayed from their carries and resets, then flattened to samples."""
    if not algo.recurrent:
        if mb.critic_obs is None:
            dist, values, _ = algo.network.apply(params, mb.obs)
        else:
            dist, values, _ = algo.network.apply(params, mb.obs, critic_obs=mb.critic_obs)
        return networks.mask_logits(dist, mb.action_mask), values, mb
    dist, values, _ = unroll(algo, params, mb.carry0, mb.obs, mb.reset, mb.critic_obs)
    merge = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731  [T, B, ...] -> [T*B, ...]
    mb = map_samples(merge, mb)
    return networks.mask_logits(map_dist(merge, dist), mb.action_mask), values.reshape(-1), mb


def loss_and_grads(algo: Algorithm, params, mb: Batch, hp: HyperParams, ent_coeff, kl_coeff):
    """(grads, LossTerms) of the PPO loss on one (local) minibatch."""
    cfg = algo.config

    def loss_fn(p):
        dist, values, samples = forward(algo, p, mb)
        terms = ppo_loss_terms(
            algo.discrete, dist, values, samples,
            clip_param=hp.clip_param, vf_clip_param=hp.vf_clip_param, vf_coeff=hp.vf_coeff,
            entropy_coeff=ent_coeff, kl_coeff=kl_coeff, use_kl_loss=cfg.use_kl_loss,
            use_vf_clip=cfg.vf_clip_param is not None,
        )
        return terms.total, terms

    return jax.grad(loss_fn, has_aux=True)(params)


def apply_grads(algo: Algorithm, params, opt_state, flat_grads, hp: HyperParams, lr):
    """Clip by global norm, Adam, step by -lr (a scalar, or one per entry of the flat
    parameters: `step_sizes`). Returns (params, opt_state, grad_norm), the
    norm before clipping, over every parameter.

    The optimiser works on one flat vector (its state too): one fused update instead of
    one per parameter array.
    """
    flat_params, unravel = ravel_pytree(params)
    grad_norm = optax.tree.norm(flat_grads)
    updates, opt_state = optimizer(algo, hp, params).update(flat_grads, opt_state, flat_params)
    return unravel(flat_params - lr * updates), opt_state, grad_norm


def learn(algo: Algorithm, params, opt_state, batch: Batch, env_ids, key, hp, lr, ent_coeff,
          kl_coeff, obs_stats: RunningStats | None = None):
    """num_epochs x num_minibatches gradient steps on the batch [T, E, ...]; grads averaged
    over shards. With `obs_stats`, the batch's obs are raw (`make_batch(raw_obs=True)`) and
    each minibatch's are made the network's input with those statistics. With kl_early_stop,
    the steps end at the first minibatch whose approx KL exceeds it (`until_the_kl_stop`).
    Returns ((params, opt_state), LearnStats [epochs, minibatches])."""

    per_minibatch = (algo.config.normalize_advantages
                     and algo.config.normalize_advantages_over == "minibatch")
    stop_at = algo.config.kl_early_stop

    def minibatch_step(carry, mb):
        params, opt_state = carry
        if obs_stats is not None:
            mb = mb._replace(obs=algo.obs_in(obs_stats, mb.obs))
        if per_minibatch:  # the minibatch's moments over every shard's part of it
            mean, var = collectives.combine_moments(*collectives.all_gather(
                collectives.local_moments(mb.advantages), algo.axis_name))
            mb = mb._replace(advantages=(mb.advantages - mean) / (jnp.sqrt(var) + 1e-8))
        grads, terms = loss_and_grads(algo, params, mb, hp, ent_coeff, kl_coeff)
        # One all-reduce per minibatch: the flat gradient and the loss terms together.
        flat_grads = ravel_pytree(grads)[0]
        n = flat_grads.shape[0]
        fused = jnp.concatenate([flat_grads, jnp.stack(terms).astype(flat_grads.dtype)])
        fused = collectives.pmean(fused, algo.axis_name)
        terms = type(terms)(*fused[n:])
        after = apply_grads(algo, params, opt_state, fused[:n], hp, lr)
        stats = LearnStats(
            policy_loss=terms.policy_loss, value_loss=terms.value_loss, entropy=terms.entropy,
            kl=terms.kl, approx_kl=terms.approx_kl, clip_fraction=terms.clip_fraction,
            grad_norm=after[2],
        )
        if stop_at is None:
            return after[:2], stats
        # The KL of the params about to step (every shard's mean, so every shard agrees).
        over = terms.approx_kl > stop_at
        kept = jax.tree.map(lambda old, new: jnp.where(over, old, new), carry, after[:2])
        return kept, stats._replace(evaluated=jnp.array(True), stepped=~over)

    def until_the_kl_stop(carry, mb):
        """minibatch_step until a minibatch's approx KL exceeds kl_early_stop: that one's
        step and every later one of the iteration are skipped (not computed: all shards
        agree on the stop; vmapped over seeds, both sides are computed and one is kept)."""
        params, opt_state, stopped = carry

        def skip():
            zero = jnp.zeros((), jnp.float32)
            return (params, opt_state), LearnStats(
                *(zero,) * 7, evaluated=jnp.array(False), stepped=jnp.array(False))

        (params, opt_state), stats = jax.lax.cond(
            stopped, skip, lambda: minibatch_step((params, opt_state), mb))
        return (params, opt_state, stopped | (stats.evaluated & ~stats.stepped)), stats

    def epoch(carry, k):
        # Every minibatch of the epoch in one gather (the minibatches stacked [M, ...]),
        # rather than one gather per field in every minibatch step.
        idx = collectives.minibatch_indices(
            k, env_ids, algo.config.num_steps, algo.config.num_minibatches, algo.recurrent,
            algo.spec.num_agents if algo.per_agent else 1)
        minibatches = jax.vmap(lambda i: gather_minibatch(algo, batch, i))(idx)
        return jax.lax.scan(minibatch_step if stop_at is None else until_the_kl_stop, carry,
                            minibatches)

    keys = jax.random.split(key, algo.config.num_epochs)
    if stop_at is None:
        return jax.lax.scan(epoch, (params, opt_state), keys)
    (params, opt_state, _), stats = jax.lax.scan(epoch, (params, opt_state, jnp.array(False)),
                                                 keys)
    return (params, opt_state), stats


# ---------------------------------------------------------------------- one iteration
def iteration(algo: Algorithm, state: TrainState, hp: HyperParams):
    """Rollout, GAE, learn, adapt. Returns (new_state, metrics dict of scalars).

    Split over shards (devices or hosts), `config.sync` says how they combine: with
    "gradients" each shard keeps its part of the batch and every minibatch's gradient is
    all-reduced; with "batch" the rollouts are all-gathered once and every shard runs the
    whole update on the whole batch (`algo.whole_batch`; params stay identical).
    """
    start_steps = state.env_steps
    obs_stats_acting = state.obs_stats
    state, traj = rollout(algo, state, hp)
    env_ids = algo.spec.actor_ids(state.env_ids)
    if algo.whole_batch is not None:
        traj, env_ids = collectives.gather_envs(traj, env_ids, algo.axis_name)
        algo = algo.whole_batch
    return update(algo, state, traj, env_ids, hp, start_steps, obs_stats_acting)


def critic_lr_at(hp: HyperParams, lr: jax.Array, env_steps: jax.Array) -> jax.Array:
    """The critic's learning rate at `env_steps`: its schedule's value, or `lr` where that is
    below 0 (critic_lr null, hyperparams.FOLLOWS_LR)."""
    own = schedule_value(hp.critic_lr_points, env_steps)
    return jnp.where(own < 0, lr, own)


def step_sizes(params, lr: jax.Array, critic_lr: jax.Array | None) -> jax.Array:
    """What the optimiser's update is scaled by: `lr`, or with a critic learning rate of its
    own, `critic_lr` on the critic's entries of the flat parameter vector and `lr` on the
    actor's (Adam being elementwise, this is an optimiser each for actor and critic)."""
    if critic_lr is None:
        return lr
    return jnp.where(networks.critic_param_mask(params), critic_lr, lr)


def update(algo: Algorithm, state: TrainState, traj: Transition, env_ids: jax.Array,
           hp: HyperParams, start_steps: jax.Array, obs_stats_acting: RunningStats):
    """GAE, learn and adapt on a rollout [T, E] (this shard's envs, or actors of a
    multi-agent env: `env_ids` [E] their global ids), acted with `obs_stats_acting`.
    Returns (new_state, metrics)."""
    cfg = algo.config
    lr = schedule_value(hp.lr_points, start_steps)
    ent_coeff = schedule_value(hp.entropy_points, start_steps)
    values, next_values = rollout_values(algo, state.params, obs_stats_acting, traj)
    rollout_stats = gather_rollout_stats(algo, traj)
    state, advantages, targets, gae_stats = gae(algo, state, traj, values, next_values,
                                                rollout_stats, hp)
    # Observations stay raw until a minibatch is cut, unless the input carries agent ids,
    # which come from each actor's place in the rollout's actor axis.
    raw = not algo.with_agent_id
    batch = make_batch(algo, obs_stats_acting, traj, values, advantages, targets, raw_obs=raw)

    rng, k_epochs = jax.random.split(state.rng)
    critic_lr = critic_lr_at(hp, lr, start_steps) if own_critic_lr(cfg) else None
    (params, opt_state), learned = learn(
        algo, state.params, state.opt_state, batch, env_ids, k_epochs, hp,
        step_sizes(state.params, lr, critic_lr), ent_coeff, state.kl_coeff,
        obs_stats_acting if raw else None,
    )
    mean = jnp.mean
    if learned.evaluated is not None:  # kl_early_stop: over the minibatches evaluated
        mean = lambda x: (jnp.sum(jnp.where(learned.evaluated, x, 0.0))  # noqa: E731
                          / jnp.maximum(jnp.sum(learned.evaluated), 1))
    mean_kl = mean(learned.kl)
    kl_coeff = state.kl_coeff
    if cfg.use_kl_loss:
        kl_coeff = update_kl_coeff(kl_coeff, mean_kl, hp.kl_target)
    obs_stats = state.obs_stats
    if cfg.normalize_observations:
        obs_stats = collectives.merge_gathered(obs_stats, rollout_stats["obs"], traj.reward.size,
                                               algo.shards)
    env_steps = start_steps + cfg.num_steps * cfg.num_envs
    _, target_var = gae_stats["targets"]
    _, resid_var = gae_stats["residuals"]
    metrics = {
        **collectives.episode_metrics(rollout_stats["episodes"]),
        **agent_metrics(algo, rollout_stats),
        "policy_loss": mean(learned.policy_loss),
        "value_loss": mean(learned.value_loss),
        "entropy": mean(learned.entropy),
        "kl": mean_kl,
        "approx_kl": mean(learned.approx_kl),
        "clip_fraction": mean(learned.clip_fraction),
        "explained_variance": 1.0 - resid_var / jnp.maximum(target_var, 1e-8),
        "kl_coeff": kl_coeff,
        "lr": lr,
        "entropy_coeff": ent_coeff,
        "grad_norm": mean(learned.grad_norm),
        "env_steps": env_steps,
    }
    if critic_lr is not None:
        metrics["critic_lr"] = critic_lr
    if learned.stepped is not None:  # kl_early_stop: the gradient steps taken, of epochs x M
        metrics["gradient_steps"] = jnp.sum(learned.stepped).astype(jnp.float32)
    if traj.action_mask is not None:  # states where the env left no legal action (an env bug)
        count = jnp.sum(~jnp.any(traj.action_mask, axis=-1)).astype(jnp.float32)
        metrics["masked_out_states"] = collectives.pmean(count, algo.axis_name) * algo.shards
    state = state.replace(
        params=params, opt_state=opt_state, rng=rng, kl_coeff=kl_coeff, obs_stats=obs_stats,
        env_steps=env_steps, iteration=state.iteration + 1,
    )
    return state, metrics
