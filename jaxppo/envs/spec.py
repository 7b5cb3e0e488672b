"""What the policy and the PPO step know of an env: its `EnvSpec` (the env with its params,
observation shape, action space and action mask), observations flattened for the network, and
the policy's actions as the env takes them; and the config's reward hooks (built by
jaxppo.envs.transforms) run over a rollout. `jaxppo.envs.make` builds the spec; jaxppo.core
reads it and imports nothing else of envs/.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The most combinations one Discrete action is made of: a MultiDiscrete action space (Jumanji's,
# gymnasium's) or Box actions discretised on a grid (`discretize_actions`).
MAX_JOINT_ACTIONS = 4096


# Where an env that steps in Python gives the legal actions of an observation (the wording
# of every message that asks for them).
HOST_MASK_SOURCES = ("info['action_mask'] of the reset or step that gave the observation, the "
                     "env's action_masks() after it, or the 'action_mask' entry of its Dict "
                     "observation")


def mask_in_info(state, params):
    """The `action_mask` of an env that steps in Python (its `gives_action_mask`): its legal
    actions come with each observation (HOST_MASK_SOURCES), where the host loop reads them;
    there is no state to compute them from."""
    raise TypeError(f"this env steps in Python: its legal actions are {HOST_MASK_SOURCES}; "
                    "pass them as action_mask")


class EnvSpec(NamedTuple):
    """An environment and what the networks need to know about it.

    Attributes:
      env: the env (gymnax API), transforms included.
      env_params: the params its reset and step take.
      obs_shape: one observation's shape.
      discrete: Discrete actions (else a Box).
      action_dim: the number of actions (discrete) or the action vector's size.
      action_low, action_high: a Box's bounds [action_dim] (None for discrete actions).
      action_mask: `action_mask(state, params) -> bool [action_dim]` (true = legal) of one
        env's state ([num_agents, action_dim] for a multi-agent env), when the policy masks
        illegal actions (`env_action_mask`); else None.
      agents: a multi-agent env's agent names (its observation, action and reward have an
        agent axis of that length, `num_agents`); () for a single-agent env.
      world_state: `world_state(state, params) -> float32 [C]`, a multi-agent env's global
        state of one env's state (MAPPO's critic input, `critic_input: world_state`), whose
        step puts the pre-reset state's in info["final_world_state"]; else None.

    Each agent of each env is one actor: the rollout and the update see a batch of
    `num_agents` actors per env, env-major (actor e * num_agents + i is agent i of env e),
    and reshape at the env's step (`to_actors`, `to_agents`).
    """

    env: Any
    env_params: Any
    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int  # number of actions (discrete) or action vector size (continuous)
    action_low: np.ndarray | None  # continuous bounds, broadcast to [action_dim]
    action_high: np.ndarray | None
    action_mask: Any = None
    agents: tuple[str, ...] = ()
    world_state: Any = None

    @property
    def masked(self) -> bool:
        """True when the policy's illegal actions are masked (the env gives a mask)."""
        return self.action_mask is not None

    @property
    def eval_params(self) -> Any:
        """The params evaluation plays with: the env's `evaluation_params(env_params)` where
        it has one (Overcooked: its game unshaped), else env_params."""
        own = getattr(self.env, "evaluation_params", None)
        return own(self.env_params) if callable(own) else self.env_params

    @property
    def episode_values(self) -> tuple[str, ...]:
        """The names of a multi-agent env's episode values (its `episode_values`, e.g.
        Overcooked's sparse return and dishes: info["episode_values"] [K] on the step that
        ends an episode); () for other envs."""
        return tuple(getattr(self.env, "episode_values", ())) if self.agents else ()

    def masks(self, env_state) -> jax.Array | None:
        """The action masks [E, action_dim] of a batch of env states [E, ...] (None when
        unmasked)."""
        if self.action_mask is None:
            return None
        return self.to_actors(jax.vmap(self.action_mask, in_axes=(0, None))(env_state,
                                                                            self.env_params))

    def world_states(self, env_state) -> jax.Array:
        """The global states of a batch of env states [E, ...] as each actor's critic input
        [E*N, C] (every agent of an env gets its env's)."""
        ws = jax.vmap(self.world_state, in_axes=(0, None))(env_state, self.env_params)
        return self.to_actors(jnp.repeat(ws[:, None], self.num_agents, axis=1))

    def agent_one_hot(self, batch_shape: tuple[int, ...]) -> jax.Array:
        """One-hot agent indices [*batch_shape, N] of actors laid out as the batch folds them
        (the last axis of batch_shape is envs x agents, env-major: actor k is agent k % N)."""
        n = self.num_agents
        ids = jnp.eye(n, dtype=jnp.float32)[jnp.arange(batch_shape[-1]) % n]
        return jnp.broadcast_to(ids, tuple(batch_shape) + (n,))

    @property
    def num_agents(self) -> int:
        """Actors per env: the agents of a multi-agent env, else 1."""
        return max(1, len(self.agents))

    def to_actors(self, x: jax.Array) -> jax.Array:
        """A multi-agent env's per-agent values [E, N, ...] as the actors' [E*N, ...], or its
        per-env values [E] (a shared done) repeated for each agent; unchanged for a
        single-agent env."""
        if not self.agents:
            return x
        if x.ndim == 1:
            return jnp.repeat(x, self.num_agents)
        return x.reshape((-1,) + x.shape[2:])

    def to_agents(self, x: jax.Array) -> jax.Array:
        """The actors' values [E*N, ...] as [E, N, ...] (the env's step takes one action per
        agent); unchanged for a single-agent env."""
        return x.reshape((-1, self.num_agents) + x.shape[1:]) if self.agents else x

    def actor_ids(self, env_ids: jax.Array) -> jax.Array:
        """Global actor ids [E*N] of envs with global ids env_ids [E]: agent i of env e is
        e * N + i, so ids stay global however envs are split; env_ids for single-agent."""
        if not self.agents:
            return env_ids
        return (env_ids[:, None] * self.num_agents + jnp.arange(self.num_agents)).reshape(-1)

    @property
    def obs_dim(self) -> int:
        return int(np.prod(self.obs_shape))

    @property
    def host_loop(self) -> bool:
        """True when the env steps in Python (a gymnasium env: jaxppo.run.hostloop runs it)."""
        return bool(getattr(self.env, "host_loop", False))


# ---------------------------------------------------------------------- stepping a batch of envs
# The vmapped axes of the batched step being traced (`step_batch`: its envs, and the runs
# `vmap_runs` vmaps it over), read by the adapters' auto-resets (`reset_if_needed`); None
# outside one.
_ENV_AXES: contextvars.ContextVar = contextvars.ContextVar("jaxppo_env_axes", default=None)
_RUN_AXES: contextvars.ContextVar = contextvars.ContextVar("jaxppo_run_axes", default=())
ENV_AXIS, RUNS_AXIS = "jaxppo_envs", "jaxppo_runs"


def vmap_runs(fn: Callable, in_axes) -> Callable:
    """`jax.vmap(fn, in_axes)` over runs (seeds, a sweep's or a population's members) that
    each step their envs (`step_batch`): their auto-resets decide together (a reset is
    computed on the steps where an env of any run ended; a decision per run would be a
    select under this vmap, computing every reset)."""
    vmapped = jax.vmap(fn, in_axes=in_axes, axis_name=RUNS_AXIS)

    def over_runs(*args):
        token = _RUN_AXES.set((*_RUN_AXES.get(), RUNS_AXIS))
        try:
            return vmapped(*args)
        finally:
            _RUN_AXES.reset(token)

    return over_runs


def step_batch(env, keys: jax.Array, states, actions, params):
    """`env.step` over a batch of envs (keys, states and actions [E, ...]), vmapped. The
    suite adapters' auto-resets (`reset_if_needed`) compute the reset only on the steps where
    an env of the batch ended, not at every step: the same numbers, with most steps' resets
    left out (an MPE episode ends every 26th step, a Craftax world is generated anew only
    when a game ends)."""
    token = _ENV_AXES.set((*_RUN_AXES.get(), ENV_AXIS))
    try:
        return jax.vmap(env.step, in_axes=(0, 0, 0, None), axis_name=ENV_AXIS)(
            keys, states, actions, params)
    finally:
        _ENV_AXES.reset(token)


def reset_if_needed(done: jax.Array, reset: Callable[[], Any]):
    """The (obs, state) `reset()` gives, for an env step's auto-reset where `done` (bool []).
    Traced within `step_batch`: computed only when an env of the batch ended (a branch on
    the whole batch; under vmap both sides of a per-env branch would run), else zeros, which
    the auto-reset's select leaves unused. Elsewhere (evaluation, a user's own vmap) always
    computed, as gymnax's auto-reset does."""
    axes = _ENV_AXES.get()
    if axes is None:
        return reset()
    ended = jax.lax.psum(jnp.asarray(done, jnp.int32), axes) > 0
    unused = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),  # noqa: E731
                                  jax.eval_shape(reset))
    return jax.lax.cond(ended, reset, unused)


def env_action(spec: EnvSpec, action: jax.Array) -> jax.Array:
    """A policy action [...] or [..., action_dim] as env.step takes it (clipped to bounds)."""
    if spec.discrete:
        return action
    action = jnp.clip(action, spec.action_low, spec.action_high)
    if spec.env.action_space(spec.env_params).shape == ():
        return action[..., 0]
    return action


def flatten_obs(obs: jax.Array, obs_shape: tuple[int, ...]) -> jax.Array:
    """[..., *obs_shape] -> [..., prod(obs_shape)] float32."""
    lead = obs.shape[: obs.ndim - len(obs_shape)]
    return obs.reshape(lead + (-1,)).astype(jnp.float32)


def init_reward_hooks(hooks, spec: EnvSpec) -> tuple:
    """Initial states of `hooks` (jaxppo.envs.transforms.RewardHook), one each; () for none."""
    return tuple(h.init(spec) for h in hooks)


def apply_reward_hooks(hooks, hook_state: tuple, traj, rewards, axis_name=None):
    """Runs reward hooks in order over the rollout batch.

    Args:
      hooks: the config's reward hooks (jaxppo.envs.transforms.reward_hooks).
      hook_state: one state per hook (`init_reward_hooks`).
      traj: the batch, leading axes [T, E].
      rewards: [T, E], the env's rewards.
      axis_name: the pmap axis of a batch split over devices, or None.

    Returns:
      (rewards [T, E], the new hook_state).
    """
    if not hooks:
        return rewards, hook_state
    new_states = []
    for hook, st in zip(hooks, hook_state):
        st, rewards = hook(st, traj._replace(reward=rewards), axis_name)
        new_states.append(st)
    return rewards, tuple(new_states)
