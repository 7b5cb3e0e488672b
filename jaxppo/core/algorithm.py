"""What a PPO run is built from: the frozen `Algorithm` struct of what `jaxppo.resolve`
derived, the state types the step functions (jaxppo.core.ppo) carry, and acting with the
policy.

One Algorithm for every network. A network is `apply(params, obs, carry, reset) -> (dist,
value, carry)`: feed-forward ones keep an empty carry; a recurrent one (a GRU core) carries
its state from step to step in `TrainState.carry`, zeroed where an episode ended.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxppo.core import networks
from jaxppo.config import PPOConfig, own_critic_lr
from jaxppo.envs.spec import env_action, flatten_obs
from jaxppo.errors import ConfigError
from jaxppo.core.evaluation import eval_max_steps, eval_metric_keys, run_episodes
from jaxppo.core.networks import DistParams
from jaxppo.core.running_stats import RunningStats, normalize


# ---------------------------------------------------------------------- state
class PolicyCarry(NamedTuple):
    """The network's carry for every env ([E, ...]; () for feed-forward; the pair (actor's,
    critic's) for a GRU with a centralised critic) and whether each env's last step ended its
    episode ([E] bool, None for feed-forward): the carry is zeroed before the step that sees
    the new episode's first observation."""

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
    # The env's action mask of s_t ([A] bool per step) when the policy masks (None otherwise).
    action_mask: jax.Array | None = None
    # critic_input "world_state" only (None otherwise): each actor's env's global state of s_t
    # and of its pre-reset successor ([C] per step).
    world_state: jax.Array | None = None
    final_world_state: jax.Array | None = None
    # Envs stepped in Python (jaxppo.run.hostloop): where a reported episode ended, which the
    # episode metrics count (None: where terminated or truncated). An env may report episodes
    # other than the ones learning sees, e.g. a game over all lives with episodic life.
    episode_end: jax.Array | None = None
    # A multi-agent env that reports wins (SMAX, `env.reports_wins`): the episode that ended at
    # t was won (bool, repeated for each agent of the env); None otherwise.
    won: jax.Array | None = None
    # A multi-agent env with episode values (Overcooked's sparse return and dishes,
    # `env.episode_values`): their values [K] of the episode that ended at t, 0 elsewhere
    # (repeated for each agent of the env); None otherwise.
    episode_values: jax.Array | None = None


METRIC_KEYS = (
    "episode_return_mean", "episode_return_min", "episode_return_max",
    "episode_length_mean", "episodes", "policy_loss", "value_loss", "entropy",
    "kl", "approx_kl", "clip_fraction", "explained_variance", "kl_coeff", "lr",
    "entropy_coeff", "grad_norm", "env_steps",
)


def update_metric_keys(config) -> tuple[str, ...]:
    """The metrics `jaxppo.core.ppo.update` gives each iteration: METRIC_KEYS, critic_lr
    when the critic has a learning rate of its own, and gradient_steps with kl_early_stop."""
    return (METRIC_KEYS + (("critic_lr",) if own_critic_lr(config) else ())
            + (("gradient_steps",) if config.kl_early_stop is not None else ()))


@dataclasses.dataclass(frozen=True, eq=False)
class Algorithm:
    """The static setup of PPO for one config, and acting with its policy.

    Built once per resolved config (`Algorithm.create`); everything tunable comes in as
    `HyperParams`. The envs are split into `shards` (devices or hosts; `axis_name` names the
    pmap axis over them), each holding `local_envs = num_envs // shards`. The step functions
    (jaxppo.core.ppo) take it as their first argument.
    """

    config: PPOConfig
    spec: Any  # the env's EnvSpec
    network: Any  # apply(params, obs, carry, reset) -> (dist, value, carry)
    recurrent: bool
    discrete: bool
    local_envs: int
    shards: int = 1
    axis_name: str | None = None
    max_eval_steps: int | None = None  # the resolved evaluation bound (None: none known)
    reward_hooks: tuple = ()  # the config's reward hooks (jaxppo.envs.transforms), in order
    # sync="batch" over several shards: this setup as one shard holding every env, which
    # runs the update on the all-gathered rollouts; None otherwise.
    whole_batch: Algorithm | None = None

    @classmethod
    def create(cls, resolved, axis_name: str | None = None) -> Algorithm:
        """The setup of a resolved config (what `jaxppo.resolve(config)` returns), its envs
        split over the layout's shards along the pmap axis `axis_name`."""
        if isinstance(resolved, PPOConfig):
            raise TypeError("Algorithm.create takes a resolved config: "
                            "Algorithm.create(jaxppo.resolve(config))")
        algo = cls(config=resolved.config, spec=resolved.spec, network=resolved.network,
                   recurrent=resolved.recurrent, discrete=resolved.spec.discrete,
                   local_envs=resolved.local_envs, shards=resolved.layout.shards,
                   axis_name=axis_name, max_eval_steps=resolved.eval_max_steps,
                   reward_hooks=resolved.reward_hooks)
        if algo.config.sync == "batch" and axis_name is not None:
            whole = dataclasses.replace(algo, axis_name=None, shards=1,
                                        local_envs=algo.config.num_envs)
            algo = dataclasses.replace(algo, whole_batch=whole)
        return algo

    @property
    def local_actors(self) -> int:
        """Actors on this shard: its envs times the env's agents (its envs, single-agent)."""
        return self.local_envs * self.spec.num_agents

    def require_compiled_env(self, what: str) -> None:
        """ConfigError when the env steps in Python (no pure function of it to compile)."""
        if self.spec.host_loop:
            raise ConfigError(
                f"Algorithm.{what}: env={self.config.env!r} steps in Python, outside the "
                "compiled program, so there is no pure train function to jit or vmap: train it "
                "with jaxppo.train(config) (its host loop, jaxppo.run.hostloop)")

    # ------------------------------------------------------------------ acting
    def features(self, stats: RunningStats, raw_obs: jax.Array) -> jax.Array:
        """Raw observations [..., *obs_shape] flat [..., obs_dim], normalised with `stats`
        when the config normalises observations."""
        flat = flatten_obs(raw_obs, self.spec.obs_shape)
        return normalize(stats, flat) if self.config.normalize_observations else flat

    def obs_in(self, stats: RunningStats, raw_obs: jax.Array) -> jax.Array:
        """The policy's input for raw observations [..., *obs_shape]: `features`, then with
        `agent_id` a one-hot of each agent's index [..., N] (a multi-agent env's observations
        keep their actor axis second to last: [..., E*N, ...] env-major, or [..., N, ...])."""
        x = self.features(stats, raw_obs)
        if not self.with_agent_id:
            return x
        n = self.spec.num_agents
        if x.ndim < 2 or x.shape[-2] % n:
            raise ValueError(
                f"observations {tuple(raw_obs.shape)}: a policy trained with agent_id=true "
                f"needs every agent's observation, [..., {n}, *obs_shape] (agents in "
                f"{list(self.spec.agents)} order), to know which agent each one is")
        return jnp.concatenate([x, self.spec.agent_one_hot(x.shape[:-1])], axis=-1)

    @property
    def with_agent_id(self) -> bool:
        """True when the policy's input ends with the agent's one-hot index (`agent_id`)."""
        return bool(self.config.agent_id) and bool(self.spec.agents)

    @property
    def per_agent(self) -> bool:
        """True when each agent has a network of its own (`agent_params: per_agent`): params
        with a leading agent axis [N, ...] (`networks.PerAgentNetwork`)."""
        return isinstance(self.network, networks.PerAgentNetwork)

    @property
    def takes_every_agent(self) -> bool:
        """True when the policy needs every agent's observation of an env, in agent order
        ([..., N, *obs_shape]), to know which agent each is (`agent_id`, `per_agent`)."""
        return self.with_agent_id or self.per_agent

    def agent_params(self, params, agent: int):
        """The params agent `agent` (an index into `spec.agents`) acts with: its own slice of
        per-agent params (for `network.inner`), or the shared params themselves."""
        if not self.per_agent:
            return params
        return self.network.agent_params(params, agent)

    @property
    def central_critic(self) -> bool:
        """True when the critic's input is not the policy's (MAPPO: `critic_input` is
        "world_state" or "joint_obs")."""
        return self.config.critic_input != "local"

    def critic_in(self, stats: RunningStats, raw_obs: jax.Array, world_state=None):
        """The centralised critic's input [..., E*N, C] for actors' raw observations
        [..., E*N, *obs_shape] (env-major) and, for "world_state", their env's global state
        [..., E*N, C]; None for a local critic (it reads the policy's input). "joint_obs" is
        every agent's `features` of the same env, concatenated in agent order. With
        `critic_agent_id` either ends with the agent's one-hot index [..., E*N, N]."""
        if self.config.critic_input == "world_state":
            critic = world_state
        elif self.config.critic_input == "joint_obs":
            x = self.features(stats, raw_obs)
            n = self.spec.num_agents
            joint = x.reshape(x.shape[:-2] + (x.shape[-2] // n, 1, n * x.shape[-1]))
            joint = jnp.broadcast_to(joint, joint.shape[:-2] + (n, joint.shape[-1]))
            critic = joint.reshape(x.shape[:-1] + (n * x.shape[-1],))
        else:
            return None
        if critic is None or not self.config.critic_agent_id:
            return critic
        return jnp.concatenate([critic, self.spec.agent_one_hot(critic.shape[:-1])], axis=-1)

    def input_dims(self) -> tuple[int, int | None]:
        """(the policy's input size, the centralised critic's input size or None)."""
        spec = self.spec
        actor = spec.obs_dim + (spec.num_agents if self.with_agent_id else 0)
        ids = spec.num_agents if self.config.critic_agent_id else 0
        if self.config.critic_input == "world_state":
            ws = jax.eval_shape(lambda k: spec.world_state(
                spec.env.reset(k, spec.env_params)[1], spec.env_params), jax.random.PRNGKey(0))
            return actor, int(ws.shape[-1]) + ids
        if self.config.critic_input == "joint_obs":
            return actor, spec.num_agents * spec.obs_dim + ids
        return actor, None

    def init_params(self, key: jax.Array):
        """Fresh network params (a centralised critic's first layer sized to its input)."""
        actor, critic = self.input_dims()
        obs = jnp.zeros((1, actor), jnp.float32)
        if critic is None:
            return self.network.init(key, obs)
        return self.network.init(key, obs, critic_obs=jnp.zeros((1, critic), jnp.float32))

    def initial_carry(self, batch_shape: tuple[int, ...] = ()):
        """The policy's carry at the start of an episode ([*batch_shape, ...]; () for a
        feed-forward network): what acting takes (`policy_step`, evaluation, export), the
        actor's alone where a centralised critic has a carry of its own (`train_carry`)."""
        return networks.initial_carry(self.network, batch_shape)

    def train_carry(self, batch_shape: tuple[int, ...] = ()):
        """The carry training keeps for each actor at an episode's start: `initial_carry`
        (the policy's), paired with the critic's, (actor's, critic's), for a GRU with a
        centralised critic (`networks.training_carry`)."""
        return networks.training_carry(self.network, batch_shape)

    def envs_carry(self, num_envs: int):
        """The carry of `num_envs` envs at an episode's start: [num_envs, ...], or one per
        agent, [num_envs, agents, ...], for a multi-agent env."""
        return self.initial_carry((num_envs,) + ((self.spec.num_agents,) if self.spec.agents
                                                 else ()))

    def policy_step(self, params, obs_stats, raw_obs, carry, key, deterministic: bool = False,
                    action_mask=None):
        """(actions, new carry) for raw observations [..., *obs_shape] and the carry before
        them (`initial_carry` at an episode's start). Actions are env-ready (clipped to the
        bounds); `key` may be None when deterministic (the distribution's mode).
        `action_mask` [..., A] (bool, true = legal) restricts a masked policy's actions."""
        dist, _, carry = self.network.apply(params, self.obs_in(obs_stats, raw_obs), carry)
        dist = networks.mask_logits(dist, action_mask)
        a = networks.mode(self.discrete, dist) if deterministic else networks.sample(self.discrete, dist, key)
        return env_action(self.spec, a), carry

    def act(self, params, obs_stats, raw_obs, key, deterministic: bool = False,
            action_mask=None):
        """Actions for raw observations [..., *obs_shape] of a feed-forward policy (a
        recurrent one needs its carry: `policy_step`); `action_mask` as in `policy_step`."""
        if self.recurrent:
            raise TypeError(
                "a recurrent policy needs its carry from step to step: use "
                "policy_step(params, obs_stats, obs, carry, key) -> (action, carry), starting "
                "each episode from initial_carry(batch_shape); evaluate() handles this itself")
        return self.policy_step(params, obs_stats, raw_obs, (), key, deterministic, action_mask)[0]

    def value(self, params, obs_stats, raw_obs, carry=(), world_state=None):
        """V(obs) given the carry before it (default: the start of an episode; for a GRU with
        a centralised critic the pair `train_carry` gives). A centralised critic reads
        `critic_in(obs_stats, raw_obs, world_state)` (every agent's observations
        [..., N, *obs_shape]; `world_state` [..., N, C] for "world_state")."""
        obs_in = self.obs_in(obs_stats, raw_obs)
        if not self.central_critic:
            return self.network.apply(params, obs_in, carry)[1]
        critic = self.critic_in(obs_stats, raw_obs, world_state)
        if critic is None:
            raise ValueError("critic_input='world_state': the critic's value needs the env's "
                             "global state: value(params, obs_stats, obs, world_state=...)")
        return self.network.apply(params, obs_in, carry, critic_obs=critic)[1]

    def sample_actions(self, dist: DistParams, noise: jax.Array):
        """One action per env from its noise [E, A|D]; returns (actions, log_probs)."""
        action = networks.sample_with_noise(self.discrete, dist, noise)
        return action, networks.log_prob(self.discrete, dist, action)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, params, obs_stats, key, num_episodes: int | None = None,
                 deterministic: bool | None = None, max_steps: int | None = None) -> dict:
        """eval_return_mean/std and eval_length_mean of one episode in each of
        `num_episodes` fresh eval envs (defaults from the config), with the env's
        evaluation params (`EnvSpec.eval_params`: Overcooked unshaped). Pure; jit-able."""
        cfg = self.config
        n = cfg.eval_episodes if num_episodes is None else num_episodes
        det = cfg.eval_deterministic if deterministic is None else deterministic
        bound = self.eval_bound() if max_steps is None else max_steps
        stats = run_episodes(
            lambda obs, k, c, m=None: self.policy_step(params, obs_stats, obs, c, k, det, m),
            self.spec.env, self.spec.eval_params, key, n, bound, self.envs_carry(n),
            action_mask=self.spec.action_mask, num_agents=len(self.spec.agents),
        )
        return stats.metrics(self.spec.agents, self.spec.episode_values)

    @property
    def reports_wins(self) -> bool:
        """The env reports won episodes (SMAX): training and evaluation give a win rate."""
        return bool(self.spec.agents) and bool(getattr(self.spec.env, "reports_wins", False))

    @property
    def agent_metric_keys(self) -> tuple[str, ...]:
        """A multi-agent env's training metrics beside METRIC_KEYS: each agent's
        episode_return_mean/<agent>, win_rate where the env reports wins, and <name>_mean of
        each of its episode values; () otherwise."""
        return (tuple(f"episode_return_mean/{a}" for a in self.spec.agents)
                + (("win_rate",) if self.reports_wins else ())
                + tuple(f"{v}_mean" for v in self.spec.episode_values))

    @property
    def eval_metric_keys(self) -> tuple[str, ...]:
        """The metrics `evaluate` gives (EVAL_METRIC_KEYS, and a multi-agent env's own)."""
        return eval_metric_keys(self.spec.agents, self.reports_wins, self.spec.episode_values)

    def eval_bound(self) -> int:
        """Steps an evaluation episode may last (ConfigError when neither the config nor the
        env gives a bound)."""
        if self.max_eval_steps is None:
            eval_max_steps(self.config, self.spec.env_params)  # raises, naming the fix
        return self.max_eval_steps
