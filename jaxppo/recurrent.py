"""Recurrent (GRU) PPO for partially observed envs: `network.recurrent_size > 0`.

The actor and critic share one GRU core: torso MLP (or CNN) -> GRUCell -> policy head and
value head. The carry is zeroed where an episode ended, by multiplying it by (1 - reset)
before the step that sees the new episode's first observation.

What changes against the feed-forward `Algorithm`:
* the train state carries the GRU state of every env (`TrainState.hidden`, a
  `RecurrentCarry`) from step to step and from one iteration to the next;
* the rollout stores the carry at its start (`hidden0` [E, H]) and the reset flag applied
  before every step (`reset` [T, E]), which is all the learner needs to replay the GRU;
* V(s_t) is recomputed by replaying the GRU over the rollout; V(s'_t) of the pre-reset
  successor uses the carry after step t, before any reset;
* minibatches are whole env sequences [T, E/M] (not time-stratified samples), and the loss
  replays the GRU over each from its stored initial carry with the stored resets
  (truncated backpropagation through time over the rollout). At the start of learning this
  reproduces the rollout's log-probs, so the first ratio is 1.

Minibatch j takes one env from every group of M consecutive global env ids (a permutation
per group, keyed by the group id), so the global minibatch is the same set of sequences
however envs are spread over devices; this needs M to divide the local number of envs.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxppo import networks
from jaxppo.algorithm import Algorithm, HyperParams, TrainState
from jaxppo.config import ConfigError
from jaxppo.envs import env_action
from jaxppo.evaluation import EpisodeStats, eval_max_steps, run_episodes
from jaxppo.losses import Minibatch, map_dist, map_samples, ppo_loss_terms, unstack_shared_log_std
from jaxppo.networks import DistParams, _dense, orthogonal


# ---------------------------------------------------------------------- network
class RecurrentActorCritic(nn.Module):
    """One step of the recurrent actor-critic.

    `__call__(obs [..., obs_dim], hidden [..., H] = zeros, reset [...] = False)` returns
    (DistParams, value [...], new_hidden [..., H]); `reset` marks observations that start
    an episode, whose carry is zeroed first.
    """

    action_dim: int
    discrete: bool
    recurrent_size: int
    hidden_sizes: Sequence[int] = (64,)
    activation: str = "tanh"
    torso: str = "mlp"
    obs_shape: Sequence[int] = ()
    conv_channels: Sequence[int] = (16,)
    conv_kernel: int = 3
    log_std_init: float = 0.0
    state_dependent_std: bool = False

    def setup(self):
        self.encoder = networks.make_torso(self)
        # flax's default recurrent init, made safe to vmap over seeds (see networks.orthogonal).
        self.core = nn.GRUCell(features=self.recurrent_size, recurrent_kernel_init=orthogonal(1.0))
        networks.setup_policy_heads(self)
        self.value_head = _dense(1, 1.0)

    def __call__(self, obs, hidden=None, reset=None):
        if hidden is None:
            hidden = jnp.zeros(obs.shape[:-1] + (self.recurrent_size,), jnp.float32)
        if reset is not None:
            hidden = hidden * (1.0 - reset.astype(hidden.dtype))[..., None]
        hidden, y = self.core(hidden, self.encoder(obs))
        return networks.policy_dist(self, y), self.value_head(y)[..., 0], hidden


def make_recurrent_network(config, spec) -> RecurrentActorCritic:
    net = config.network
    return RecurrentActorCritic(
        action_dim=spec.action_dim,
        discrete=spec.discrete,
        recurrent_size=net.recurrent_size,
        hidden_sizes=tuple(net.hidden_sizes),
        activation=net.activation,
        torso=networks.resolve_torso(config, spec),
        obs_shape=tuple(spec.obs_shape),
        conv_channels=tuple(net.conv_channels),
        conv_kernel=net.conv_kernel,
        log_std_init=float(net.log_std_init),
        state_dependent_std=bool(net.state_dependent_std),
    )


# ---------------------------------------------------------------------- data
class RecurrentCarry(NamedTuple):
    """`TrainState.hidden` of a recurrent run: the GRU state after each env's last step, and
    whether that step ended its episode (then the carry is zeroed before the next step)."""

    hidden: jax.Array  # [E, H]
    reset: jax.Array  # [E] bool


class RecurrentTransition(NamedTuple):
    """`algorithm.Transition` plus what replaying the GRU needs; [T, E] unless noted."""

    obs: jax.Array
    final_obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    dist: DistParams
    reward: jax.Array
    discounted_return: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    episode_return: jax.Array
    episode_length: jax.Array
    reset: jax.Array  # the carry was zeroed before step t (obs[t] starts an episode)
    hidden0: jax.Array  # [E, H] carry at the rollout's start (before reset[0] is applied)


class RecurrentBatch(NamedTuple):
    """The iteration's batch: a time-major Minibatch [T, E, ...] and the GRU's replay inputs."""

    minibatch: Minibatch
    reset: jax.Array  # [T, E]
    hidden0: jax.Array  # [E, H]


# ---------------------------------------------------------------------- algorithm
class RecurrentAlgorithm(Algorithm):
    """PPO with a GRU actor-critic; see the module docstring for what differs."""

    def __init__(self, config, spec=None, num_devices: int = 1, axis_name: str | None = None):
        super().__init__(config, spec, num_devices, axis_name)
        if config.network.recurrent_size < 1:
            raise ConfigError(
                f"RecurrentAlgorithm needs network.recurrent_size >= 1, got "
                f"{config.network.recurrent_size}; use Algorithm for feed-forward policies"
            )
        # The update splits the envs it sees into minibatches: this shard's, or with
        # sync="batch" all of them.
        update_envs = config.num_envs if config.sync == "batch" else self.local_envs
        if update_envs % config.num_minibatches:
            where = ("the envs" if update_envs == config.num_envs else
                     f"the envs on each device (num_envs={config.num_envs} / {num_devices} "
                     f"device(s) = {update_envs})")
            raise ConfigError(
                f"num_minibatches={config.num_minibatches} must divide {where}: recurrent "
                "minibatches are whole env sequences; choose num_minibatches from "
                f"{[d for d in range(1, update_envs + 1) if update_envs % d == 0]}"
                + ("" if update_envs == config.num_envs else ", or sync='batch'")
            )
        self.network = make_recurrent_network(config, self.spec)
        self.recurrent_size = config.network.recurrent_size

    # ------------------------------------------------------------------ state
    def initial_hidden(self, batch_shape: tuple[int, ...] = ()) -> jax.Array:
        """A zero GRU state [*batch_shape, H]: the carry at the start of an episode."""
        return jnp.zeros(tuple(batch_shape) + (self.recurrent_size,), jnp.float32)

    def init(self, key, hp: HyperParams, env_index_offset=0) -> TrainState:
        state = super().init(key, hp, env_index_offset)
        carry = RecurrentCarry(self.initial_hidden((self.local_envs,)),
                               jnp.ones((self.local_envs,), bool))
        return state.replace(hidden=carry)

    # ------------------------------------------------------------------ acting
    def act(self, params, obs_stats, raw_obs, hidden, key, deterministic: bool = False):
        """(env actions, new hidden) for raw observations [B, *obs_shape] and the GRU state
        hidden [B, H] (zeros, `initial_hidden((B,))`, at the start of an episode)."""
        if key is None or jnp.result_type(key) == jnp.bool_:
            raise TypeError(
                "a recurrent policy needs its hidden state: call "
                "RecurrentAlgorithm.act(params, obs_stats, obs, hidden, key) -> (action, new_hidden), "
                "starting each episode from initial_hidden(batch_shape); the feed-forward form "
                "policy(obs, key) (TrainResult.policy, TrainResult.evaluate) cannot carry it"
            )
        dist, _, hidden = self.network.apply(params, self._obs_in(obs_stats, raw_obs), hidden)
        a = networks.mode(self.discrete, dist) if deterministic else networks.sample(self.discrete, dist, key)
        return env_action(self.spec, a), hidden

    def value(self, params, obs_stats, raw_obs, hidden=None):
        """V(obs) given the GRU state before it (hidden [B, H])."""
        if hidden is None:
            raise TypeError("a recurrent critic needs the hidden state: value(params, obs_stats, "
                            "obs, hidden) with hidden from RecurrentAlgorithm.act")
        return self.network.apply(params, self._obs_in(obs_stats, raw_obs), hidden)[1]

    def unroll(self, params, hidden0, obs_in, reset):
        """Replay the GRU over sequences: obs_in [T, B, obs_dim] (normalised), reset [T, B],
        hidden0 [B, H]. Returns (DistParams loc [T, B, A] with log_std [T, B, D] when
        state-dependent, else one vector; values [T, B]; hiddens [T, B, H] after each step)."""

        def step(h, xs):
            obs, r = xs
            dist, value, h = self.network.apply(params, obs, h, r)
            return h, (dist, value, h)

        _, (dist, values, hiddens) = jax.lax.scan(step, hidden0, (obs_in, reset))
        return unstack_shared_log_std(dist), values, hiddens

    # ------------------------------------------------------------------ rollout
    def rollout(self, state: TrainState, hp: HyperParams):
        def step(carry, _):
            st, rng = carry
            rng, k_step = jax.random.split(rng)
            act_keys, env_keys = self.step_keys(k_step, st.env_ids)
            obs_in = self._obs_in(st.obs_stats, st.last_obs)
            dist, _, hidden = self.network.apply(st.params, obs_in, st.hidden.hidden, st.hidden.reset)
            action, logp = self.sample_actions(dist, act_keys)
            reset = st.hidden.reset
            st, tr, done = self.step_envs(st, dist, action, logp, env_keys, hp)
            return (st.replace(hidden=RecurrentCarry(hidden, done)), rng), (tr, reset)

        hidden0 = state.hidden.hidden
        rng, k_roll = jax.random.split(state.rng)
        (state, _), (traj, reset) = jax.lax.scan(step, (state, k_roll), None,
                                                 length=self.config.num_steps)
        traj = RecurrentTransition(*traj, reset=reset, hidden0=hidden0)
        return state.replace(rng=rng), traj

    # ------------------------------------------------------------------ pieces of an iteration
    def env_axes(self, traj: RecurrentTransition) -> RecurrentTransition:
        return super().env_axes(traj)._replace(hidden0=0)

    def values(self, params, obs_stats, traj: RecurrentTransition):
        """V(s_t) [T, E] by replaying the GRU; V(s'_t) [T, E] of the pre-reset successor from
        the carry after step t (before any reset), in one batched pass."""
        obs_in = self._obs_in(obs_stats, traj.obs)
        final_in = self._obs_in(obs_stats, traj.final_obs)
        _, values, hiddens = self.unroll(params, traj.hidden0, obs_in, traj.reset)
        next_values = self.network.apply(params, final_in, hiddens)[1]
        return values, next_values

    def make_batch(self, obs_stats, traj: RecurrentTransition, values, advantages, targets):
        mb = super().make_batch(obs_stats, traj, values, advantages, targets)
        return RecurrentBatch(mb, traj.reset, traj.hidden0)

    def minibatch_indices(self, key: jax.Array, env_ids: jax.Array) -> jax.Array:
        """[M, E/M] local env columns: minibatch j holds one env of each group of M
        consecutive global env ids, chosen by a permutation keyed by the group id."""
        M = self.config.num_minibatches
        groups = env_ids.reshape(-1, M)[:, 0] // M  # [E/M] global group ids
        perms = jax.vmap(lambda g: jax.random.permutation(jax.random.fold_in(key, g), M))(groups)
        cols = jnp.arange(env_ids.shape[0]).reshape(-1, M)
        return jnp.take_along_axis(cols, perms, axis=1).T

    def gather_minibatch(self, batch: RecurrentBatch, idx: jax.Array) -> RecurrentBatch:
        """The sequences of env columns idx [E/M]: every field [T, E/M, ...]."""
        sub = map_samples(lambda x: x[:, idx], batch.minibatch)
        return RecurrentBatch(sub, batch.reset[:, idx], batch.hidden0[idx])

    def loss_and_grads(self, params, batch: RecurrentBatch, hp: HyperParams, ent_coeff, kl_coeff):
        """(grads, LossTerms) of the PPO loss with the GRU replayed over the minibatch's
        sequences from their stored initial carries and resets."""
        cfg = self.config
        mb = batch.minibatch
        merge_tb = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731  [T, B, ...] -> [T*B, ...]
        flat = map_samples(merge_tb, mb)

        def loss_fn(p):
            dist, values, _ = self.unroll(p, batch.hidden0, mb.obs, batch.reset)
            dist = map_dist(merge_tb, dist)
            terms = ppo_loss_terms(
                self.discrete, dist, values.reshape(-1), flat,
                clip_param=hp.clip_param, vf_clip_param=hp.vf_clip_param, vf_coeff=hp.vf_coeff,
                entropy_coeff=ent_coeff, kl_coeff=kl_coeff, use_kl_loss=cfg.use_kl_loss,
                use_vf_clip=cfg.vf_clip_param is not None,
            )
            return terms.total, terms

        return jax.grad(loss_fn, has_aux=True)(params)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, params, obs_stats, key, num_episodes: int | None = None,
                 deterministic: bool | None = None, max_steps: int | None = None) -> dict:
        """As `Algorithm.evaluate`, with each eval env's GRU state carried through its episode."""
        cfg = self.config
        n = cfg.eval_episodes if num_episodes is None else num_episodes
        det = cfg.eval_deterministic if deterministic is None else deterministic
        bound = eval_max_steps(cfg, self.spec.env_params) if max_steps is None else max_steps
        return run_recurrent_episodes(self, params, obs_stats, key, n, bound, det).metrics()


def run_recurrent_episodes(algo: RecurrentAlgorithm, params, obs_stats, key, num_episodes: int,
                           max_steps: int, deterministic: bool = True) -> EpisodeStats:
    """`evaluation.run_episodes` with the GRU state carried through each eval episode."""
    def act(obs, k, hidden):
        return algo.act(params, obs_stats, obs, hidden, k, deterministic=deterministic)

    return run_episodes(act, algo.spec.env, algo.spec.env_params, key, num_episodes, max_steps,
                        policy_state=algo.initial_hidden((num_episodes,)))


def algorithm_class(config) -> type[Algorithm]:
    """RecurrentAlgorithm when `network.recurrent_size > 0`, else the feed-forward Algorithm."""
    return RecurrentAlgorithm if config.network.recurrent_size > 0 else Algorithm
