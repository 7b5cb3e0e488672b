"""JaxMARL's multi-agent environments by name (`env="jaxmarl:<name>"`, e.g.
"jaxmarl:MPE_simple_spread_v3" or "jaxmarl:hanabi", "jaxmarl:smax:<map>" for SMAX against its
heuristic enemy, e.g. "jaxmarl:smax:3m", or "jaxmarl:overcooked:<layout>", e.g.
"jaxmarl:overcooked:cramped_room") behind the gymnax API with an agent axis: `JaxMarlEnv`
stacks the agents' observations, rewards and actions in `env.agents` order, splits the
episode's end into terminated and truncated, and auto-resets.

The core folds the agent axis into the batch (one actor per env and agent, as JaxMARL's IPPO
baselines do); jaxppo.envs.spec says how.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxppo.envs import adapter
from jaxppo.errors import ConfigError

PREFIX = "jaxmarl:"
SMAX_PREFIX = "smax:"  # "jaxmarl:smax:<map>": HeuristicEnemySMAX on that scenario
OVERCOOKED_PREFIX = "overcooked:"  # "jaxmarl:overcooked:<layout>": Overcooked on that layout
DEFAULT_EPISODE_LENGTH = 1000  # jaxppo's limit for an env without a `max_steps` of its own


def import_jaxmarl(module: str | None = None):
    """jaxmarl (or its submodule `module`), imported without the lines it prints to stdout on
    import ("Importing submoduled environments..."): jaxppo's output stays its own."""
    with _quiet_stdout():
        return adapter.import_suite("jaxmarl", module)


@contextlib.contextmanager
def _quiet_stdout():
    """stdout to a sink, and no DeprecationWarning (jaxopt's, which jaxmarl imports). jaxmarl's
    MABrax module sets sys.stdout and sys.stderr back to sys.__stdout__ and sys.__stderr__
    after its own import, so those point at the sink and at the current stderr meanwhile."""
    saved = sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__
    sys.stdout = sys.__stdout__ = io.StringIO()
    sys.__stderr__ = sys.stderr
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__ = saved


def registered_jaxmarl_envs() -> list[str]:
    """JaxMARL's registered env names, then "smax:<map>" for each SMAX scenario and
    "overcooked:<layout>" for each Overcooked layout."""
    jaxmarl = import_jaxmarl()
    maps = import_jaxmarl("jaxmarl.environments.smax.smax_env").MAP_NAME_TO_SCENARIO
    layouts = import_jaxmarl("jaxmarl.environments.overcooked").overcooked_layouts
    return (list(jaxmarl.registered_envs) + [SMAX_PREFIX + m for m in maps]
            + [OVERCOOKED_PREFIX + name for name in layouts])


def make_jaxmarl_env(path: str, env_kwargs: dict) -> tuple[JaxMarlEnv, dict]:
    """Builds the env "jaxmarl:<name>" names with `jaxmarl.make` (or HeuristicEnemySMAX on
    the scenario of "jaxmarl:smax:<map>").

    Args:
      path: "jaxmarl:<name>".
      env_kwargs: the config's; max_steps_in_episode is jaxppo's param, the rest go to the
        env's constructor (e.g. num_agents=4 for MPE_simple_spread_v3).

    Returns:
      (env, the other env_kwargs: params, which make_env sets).

    Raises:
      ConfigError: jaxmarl is not installed, an unknown name, a failing constructor, or an
        env jaxppo cannot adapt.
    """
    name = path[len(PREFIX):]
    jaxmarl = import_jaxmarl()
    names = registered_jaxmarl_envs()
    if name not in names:
        raise adapter.unknown_env_error(path, names, "a JaxMARL environment")
    params, kwargs = adapter.split_env_kwargs(env_kwargs)
    rest = "go to the env's constructor (e.g. num_agents=4 for MPE_simple_spread_v3)"
    if name.startswith(SMAX_PREFIX):
        smax = import_jaxmarl("jaxmarl.environments.smax")
        scenario = smax.map_name_to_scenario(name[len(SMAX_PREFIX):])
        make = lambda _, **kw: smax.HeuristicEnemySMAX(scenario=scenario, **kw)  # noqa: E731
        marl_env = adapter.construct(path, "HeuristicEnemySMAX", make, name, kwargs, rest)
    elif name.startswith(OVERCOOKED_PREFIX):
        return _make_overcooked(path, name, kwargs, rest), params
    else:
        marl_env = adapter.construct(path, "jaxmarl.make", jaxmarl.make, name, kwargs, rest)
    env = JaxMarlEnv(marl_env, name=f"jaxmarl-{name}")
    adapter.trace_step(env, path, "jaxmarl", "JaxMARL", env.zero_actions())
    return env, params


@struct.dataclass
class JaxMarlParams:
    """What jaxppo's reset and step take for a JaxMARL env: jaxppo's time limit (steps after
    which an episode that has not ended is truncated)."""

    max_steps_in_episode: int = DEFAULT_EPISODE_LENGTH


@struct.dataclass
class JaxMarlEnvState:
    """A JaxMARL env's state and the steps taken in the current episode."""

    marl_state: Any
    time: jax.Array  # int32 []


class JaxMarlEnv:
    """A JaxMARL env (`MultiAgentEnv`, one env: jaxppo vmaps it) with the gymnax API and an
    agent axis of `num_agents` (`agents` names them, in JaxMARL's order).

    reset(key, params) -> (obs [N, D], state); step(key, state, action [N] (Box: [N, A]),
    params) -> (obs [N, D], state, reward [N], terminated [], truncated [], info),
    auto-resetting with `key`
    when the episode ends and keeping the observations before the reset in
    info["final_observation"] (and JaxMARL's state before it in info["final_state"]).

    * Ends: the episode ends where JaxMARL's dones["__all__"] is true (the done every agent
      shares). An end once the env's own `max_steps` steps are reached (MPE: max_steps 25,
      its episodes last 26 steps; SMAX: 100) is `truncated` (its value is bootstrapped), any
      other end `terminated`; a step that reaches `params.max_steps_in_episode` (one past
      the env's `max_steps` by default, else 1000) is truncated too. JaxMARL's baselines
      treat every end as terminal.
    * Observations: each agent's Box observation, flattened; agents with smaller
      observations are zero-padded at the end to the largest (as JaxMARL's baselines pad).
    * Actions: one Discrete action per agent, `action_space().n` the largest agent's count;
      an agent with fewer actions has the others masked out. Or one Box action per agent
      (MPE's `action_type="Continuous"`), a vector [A] within the bounds every agent shares
      (`action_space()` is that Box). Agents whose Box actions differ in size or bounds, and
      a mix of Discrete and Box agents, are refused (`_check_boxes`).
    * Action masks: `action_mask(state, params) -> bool [N, n]` when the env gives available
      actions (SMAX's `get_avail_actions`, Hanabi's `get_legal_moves`) or agents have
      different action counts; jaxppo masks the policy with it.
    * Wins (`reports_wins`, SMAX against its enemy): info["won"] (bool []) is true on the step
      that ends an episode with every enemy dead and an ally alive, the battle SMAX rewards
      with its won_battle_bonus (JaxMARL's SMAX baselines count a win where that last step's
      reward is at least the bonus, 1.0 by default).
    * World state: `world_state(state, params) -> [C]` for SMAX and MPE (MAPPO's critic
      input), with the pre-reset state's in info["final_world_state"].
    * Episode values (`episode_values`, names; Overcooked's sparse return and dishes):
      info["episode_values"] (float32 [K]) holds on the step that ends an episode that
      episode's value of each, 0 on other steps; training and evaluation report each one's
      mean over the episodes that ended (`<name>_mean`), and the progress line shows the
      `progress_value` one.
    """

    episode_values: tuple[str, ...] = ()
    progress_value: str | None = None

    def __init__(self, marl_env, name: str | None = None):
        self.marl_env = marl_env
        self.name = name or f"jaxmarl-{type(marl_env).__name__}"
        self.agents = tuple(marl_env.agents)
        # Hanabi's observation shape is an int
        obs_dims = [int(np.prod(marl_env.observation_space(a).shape)) for a in self.agents]
        act_spaces = [marl_env.action_space(a) for a in self.agents]
        self.discrete = _discrete_actions(self.name, self.agents, act_spaces)
        self._box = None if self.discrete else _check_boxes(self.name, self.agents, act_spaces)
        self._num_actions = ([int(s.n) for s in act_spaces] if self.discrete
                             else [len(self._box[0])] * len(self.agents))
        self._obs_dims = tuple(obs_dims)
        self.obs_dim, self.n = max(obs_dims), max(self._num_actions)
        self._avail = _available_actions_fn(marl_env)
        self._has_mask = self.discrete and (self._avail is not None
                                            or len(set(self._num_actions)) > 1)
        self._world_state_fn = _world_state_fn(marl_env)
        limit = getattr(marl_env, "max_steps", None)
        self._time_limit = (int(limit) if isinstance(limit, (int, np.integer))
                            and not isinstance(limit, bool) and limit > 0 else None)
        enemy = import_jaxmarl("jaxmarl.environments.smax.heuristic_enemy_smax_env").EnemySMAX
        self.reports_wins = isinstance(marl_env, enemy)

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    @property
    def default_params(self) -> JaxMarlParams:
        # One past the env's max_steps: JaxMARL's MPE envs end on the step after step
        # max_steps (26 steps for max_steps=25), and jaxppo's limit must not cut them earlier.
        return JaxMarlParams(self._time_limit + 1 if self._time_limit
                             else DEFAULT_EPISODE_LENGTH)

    def zero_actions(self) -> jax.Array:
        """Every agent's action 0 (Discrete: [N] int32) or zeros (Box: [N, A] float32), an
        example action to trace the env with."""
        if self.discrete:
            return jnp.zeros((self.num_agents,), jnp.int32)
        return jnp.zeros((self.num_agents, self.n), jnp.float32)

    def agent_obs_size(self, agent: str) -> int:
        """How many numbers agent `agent`'s own observation holds (before padding)."""
        return self._obs_dims[self.agents.index(agent)]

    def stack(self, per_agent: dict) -> jax.Array:
        """{agent: obs} -> [N, D] float32, each agent's flattened and zero-padded to D."""
        rows = [jnp.ravel(jnp.asarray(per_agent[a])).astype(jnp.float32) for a in self.agents]
        return jnp.stack([jnp.pad(r, (0, self.obs_dim - r.shape[0])) for r in rows])

    def reset(self, key: jax.Array, params: JaxMarlParams | None = None):
        obs, state = self.marl_env.reset(key)
        return self.stack(obs), JaxMarlEnvState(state, jnp.zeros((), jnp.int32))

    def step(self, key: jax.Array, state: JaxMarlEnvState, action: jax.Array,
             params: JaxMarlParams | None = None):
        params = self.default_params if params is None else params
        k_step, k_reset = jax.random.split(key)
        actions = {a: action[i] for i, a in enumerate(self.agents)}
        obs, stepped, reward, dones, step_info = self.marl_env.step_env(k_step, state.marl_state,
                                                                        actions)
        time = state.time + 1
        ended = jnp.asarray(dones["__all__"], bool)
        own_limit = self._time_limit is not None and time >= self._time_limit
        truncated = jnp.logical_or(jnp.logical_and(ended, own_limit),
                                   time >= params.max_steps_in_episode)
        terminated = jnp.logical_and(ended, ~truncated)
        done = jnp.logical_or(terminated, truncated)
        after = self.advance(state, stepped, time, reward)
        obs, next_state, info = adapter.auto_reset(
            done, lambda: self.reset(k_reset, params), self.stack(obs), after)
        if self.reports_wins:
            info["won"] = jnp.logical_and(done, self._won(stepped))
        if self.episode_values:
            info["episode_values"] = jnp.where(done, after.episode_values, 0.0)
        if self._world_state_fn is not None:
            info["final_world_state"] = self._world_state_fn(stepped)
        info["final_state"] = stepped  # JaxMARL's, before the reset: what videos draw
        rewards = self.rewards(reward, step_info, state, params)
        return obs, next_state, rewards, terminated, truncated, info

    def advance(self, state: JaxMarlEnvState, marl_state, time: jax.Array, reward: dict):
        """The state after a step, before any reset: JaxMARL's `marl_state` at `time`, the
        step's reward dict (JaxMARL's) added to what the state tracks of the episode."""
        return state.replace(marl_state=marl_state, time=time)

    def rewards(self, reward: dict, step_info: dict, state, params) -> jax.Array:
        """The agents' rewards [N] of a step from JaxMARL's (the env's reward dict, its info,
        the state before the step, the params)."""
        return jnp.stack([jnp.asarray(reward[a], jnp.float32) for a in self.agents])

    def _won(self, marl_state) -> jax.Array:
        """Every enemy dead and an ally alive (SMAX's won battle) in an EnemySMAX state."""
        alive = marl_state.state.unit_alive  # allies, then enemies
        allies = self.marl_env.num_allies
        return jnp.logical_and(~jnp.any(alive[allies:]), jnp.any(alive[:allies]))

    @property
    def action_mask(self):
        """`action_mask(state, params) -> bool [N, n]` (AttributeError when every agent has
        every action at every state)."""
        if not self._has_mask:
            raise AttributeError("action_mask")
        return self._mask

    def _mask(self, state: JaxMarlEnvState, params=None) -> jax.Array:
        avail = (self._avail(state.marl_state) if self._avail is not None
                 else {a: jnp.ones((k,), bool) for a, k in zip(self.agents, self._num_actions)})
        rows = [jnp.asarray(avail[a]).astype(bool) for a in self.agents]
        return jnp.stack([jnp.pad(r, (0, self.n - r.shape[0])) for r in rows])

    @property
    def world_state(self):
        """`world_state(state, params) -> float32 [C]`, the env's global state (MAPPO's critic
        input; AttributeError when the env has none): SMAX's own `get_world_state` (or any
        env's that defines one), and for MPE every agent's observation concatenated in
        `agents` order, as JaxMARL's MAPPO wrappers build them."""
        if self._world_state_fn is None:
            raise AttributeError("world_state")
        return lambda state, params=None: self._world_state_fn(state.marl_state)

    def observation_space(self, params: JaxMarlParams | None = None):
        """One agent's (padded) observation: Box [D]."""
        return adapter.gymnax_spaces().Box(-jnp.inf, jnp.inf, (self.obs_dim,), jnp.float32)

    def action_space(self, params: JaxMarlParams | None = None):
        """One agent's action: Discrete(n), or the Box [A] every agent shares."""
        if self.discrete:
            return adapter.gymnax_spaces().Discrete(self.n)
        low, high = self._box
        return adapter.gymnax_spaces().Box(low, high, (self.n,), jnp.float32)

    def __repr__(self) -> str:
        return f"JaxMarlEnv({type(self.marl_env).__name__}, {self.name!r})"


def _discrete_actions(name: str, agents: tuple, spaces: list) -> bool:
    """True when every agent's action space is Discrete, False when every one is a Box.

    Raises:
      ConfigError: a mix of the two, or another kind of space.
    """
    kinds = ["discrete" if hasattr(s, "n") else "box" if hasattr(s, "low") else None
             for s in spaces]
    for a, s, kind in zip(agents, spaces, kinds):
        if kind is None:
            raise ConfigError(
                f"{name}: agent {a!r} has action space {type(s).__name__}; jaxppo's JaxMARL "
                "adapter takes Discrete or Box actions")
    if len(set(kinds)) > 1:
        listed = ", ".join(f"{a}: {type(s).__name__}" for a, s in zip(agents, spaces))
        raise ConfigError(
            f"{name} mixes Discrete and Box actions across its agents ({listed}); jaxppo's "
            "agents share one policy head and one action distribution (a categorical or a "
            "Gaussian), so every agent's action space must be of one kind: choose the env's "
            "all-Discrete or all-continuous variant (MPE envs: env_kwargs action_type: "
            "Discrete or Continuous)")
    return kinds[0] == "discrete"


def _check_boxes(name: str, agents: tuple, spaces: list) -> tuple[np.ndarray, np.ndarray]:
    """The Box bounds (low, high: float32 [A]) every agent's action shares.

    Raises:
      ConfigError: an agent's action is not a vector, or agents' actions differ in size or
        bounds (docs/environments.md: why jaxppo does not pad Box actions).
    """
    bounds = []
    for a, s in zip(agents, spaces):
        shape = tuple(int(d) for d in np.shape(np.zeros(s.shape)))
        if len(shape) != 1:
            raise ConfigError(f"{name}: agent {a!r}'s Box action has shape {shape}; jaxppo "
                              "takes Box actions that are vectors [A]")
        bounds.append(tuple(np.broadcast_to(np.asarray(b, np.float32), shape).copy()
                            for b in (s.low, s.high)))
    sizes = [len(low) for low, _ in bounds]
    if len(set(sizes)) > 1 or any(
            not (np.array_equal(low, bounds[0][0]) and np.array_equal(high, bounds[0][1]))
            for low, high in bounds):
        listed = ", ".join(f"{a}: [{n}] in [{lo.min():g}, {hi.max():g}]"
                           for a, n, (lo, hi) in zip(agents, sizes, bounds))
        raise ConfigError(
            f"{name}'s agents have Box actions of different sizes or bounds ({listed}); jaxppo "
            "takes Box actions that every agent shares. Zero-padding a Gaussian's action to "
            "the largest size (as JaxMARL's MABrax homogenisation does) would put the padded "
            "dimensions, which the env ignores, into every log-probability, PPO ratio and "
            "entropy bonus: noise in the update and an entropy term that grows their spread "
            "without end. Use the env's Discrete actions (MPE envs: env_kwargs action_type: "
            "Discrete; agents with different action counts are masked), or an env that "
            "homogenises its agents' actions itself")
    return bounds[0]


def _available_actions_fn(marl_env):
    """marl_state -> {agent: [n] legal actions}: the env's own `get_avail_actions` (SMAX), or
    Hanabi's `get_legal_moves` (only the player whose turn it is has moves other than the
    no-op); None for an env whose agents may take every action."""
    base = import_jaxmarl("jaxmarl.environments.multi_agent_env").MultiAgentEnv
    if type(marl_env).get_avail_actions is not base.get_avail_actions:
        return marl_env.get_avail_actions
    legal = getattr(marl_env, "get_legal_moves", None)
    return legal if callable(legal) else None


def _world_state_fn(marl_env):
    """marl_state -> float32 [C], the global state JaxMARL's MAPPO baselines give the critic
    (their SMAXWorldStateWrapper and MPEWorldStateWrapper): the env's `get_world_state` where
    it has one (SMAX, simple_facmac), else for an MPE env every agent's observation flattened
    and concatenated in `agents` order; None for any other env."""
    own = getattr(marl_env, "get_world_state", None)
    if callable(own):
        return lambda state: jnp.ravel(own(state)).astype(jnp.float32)
    if type(marl_env).__module__.startswith("jaxmarl.environments.mpe."):
        agents = tuple(marl_env.agents)

        def joint(state):
            obs = marl_env.get_obs(state)
            return jnp.concatenate([jnp.ravel(obs[a]) for a in agents]).astype(jnp.float32)

        return joint
    return None


def _make_overcooked(path: str, name: str, kwargs: dict, rest: str) -> OvercookedEnv:
    """Overcooked on the layout "overcooked:<layout>" names (`jaxmarl.make("overcooked",
    layout=overcooked_layouts[layout])`); `shaped_reward_steps` is the adapter's, the other
    kwargs go to the env."""
    layout = import_jaxmarl("jaxmarl.environments.overcooked").overcooked_layouts[
        name[len(OVERCOOKED_PREFIX):]]
    kwargs = dict(kwargs)
    steps = kwargs.pop("shaped_reward_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ConfigError(
            f"env_kwargs shaped_reward_steps={steps!r} must be an int >= 0: the steps of each "
            "env over which Overcooked's shaped reward is annealed from 1 to 0 (JaxMARL's "
            "REW_SHAPING_HORIZON / NUM_ENVS), 0 = the sparse reward only")
    make = lambda _, **kw: import_jaxmarl().make("overcooked", layout=layout, **kw)  # noqa: E731
    marl_env = adapter.construct(path, "jaxmarl.make", make, "overcooked", kwargs, rest)
    env = OvercookedEnv(marl_env, name=f"jaxmarl-{name}", shaped_reward_steps=int(steps))
    adapter.trace_step(env, path, "jaxmarl", "JaxMARL", env.zero_actions())
    return env


@struct.dataclass
class OvercookedParams(JaxMarlParams):
    """Overcooked's params: jaxppo's time limit, and whether the reward is shaped (the
    config's `shaped_reward_steps`; evaluation plays the game unshaped)."""

    shaped: bool = struct.field(pytree_node=False, default=True)


@struct.dataclass
class OvercookedEnvState(JaxMarlEnvState):
    """Overcooked's state with the steps this env has taken since training began (every
    episode's), which anneal the shaped reward, and the episode's sparse team return and
    dishes delivered so far."""

    env_steps: jax.Array = 0  # int32 []
    episode_values: jax.Array = 0.0  # float32 [2]: sparse team return, dishes


class OvercookedEnv(JaxMarlEnv):
    """Overcooked (2 agents, 6 actions, a [H, W, 26] grid of feature planes per agent,
    flattened as JaxMARL's ippo_ff_overcooked flattens it for its MLP) with JaxMARL's reward
    shaping. Every agent's reward is the team's sparse reward (20 per dish delivered, shared),
    plus, with `shaped_reward_steps` > 0, its own shaped reward (onion in pot, plate and soup
    pick-ups) times a coefficient annealed linearly from 1 to 0 over this env's first
    `shaped_reward_steps` steps (JaxMARL's `REW_SHAPING_HORIZON` of env steps over its envs;
    `shaped_reward_steps` counts the steps of each env). Params with `shaped=False`
    (`evaluation_params`) give the sparse reward alone. Episodes last 400 steps, a
    truncation. Each episode's sparse team return (the sum over agents of their unshaped
    rewards, 40 per dish) and dishes delivered are its episode values."""

    episode_values = ("sparse_return", "dishes")
    progress_value = "dishes"

    def __init__(self, marl_env, name: str, shaped_reward_steps: int = 0):
        super().__init__(marl_env, name)
        self.shaped_reward_steps = shaped_reward_steps
        self._dish_reward = float(import_jaxmarl(
            "jaxmarl.environments.overcooked.overcooked").DELIVERY_REWARD)

    @property
    def default_params(self) -> OvercookedParams:
        return OvercookedParams(super().default_params.max_steps_in_episode)

    def evaluation_params(self, params: JaxMarlParams) -> OvercookedParams:
        """The params evaluation plays with: `params` without reward shaping (the game's
        own reward, 20 per dish to each agent)."""
        return OvercookedParams(params.max_steps_in_episode, shaped=False)

    def reset(self, key: jax.Array, params: JaxMarlParams | None = None):
        obs, state = super().reset(key, params)
        return obs, OvercookedEnvState(state.marl_state, state.time, jnp.zeros((), jnp.int32),
                                       jnp.zeros((len(self.episode_values),), jnp.float32))

    def step(self, key: jax.Array, state: OvercookedEnvState, action: jax.Array,
             params: JaxMarlParams | None = None):
        obs, next_state, rewards, terminated, truncated, info = super().step(
            key, state, action, params)
        # The count goes on through the auto-reset (a reset state starts it at 0).
        next_state = next_state.replace(env_steps=state.env_steps + 1)
        return obs, next_state, rewards, terminated, truncated, info

    def advance(self, state: OvercookedEnvState, marl_state, time: jax.Array, reward: dict):
        sparse = jnp.stack([jnp.asarray(reward[a], jnp.float32) for a in self.agents])
        # Every agent receives the team's delivery reward: one agent's counts the dishes.
        step_values = jnp.stack([jnp.sum(sparse), sparse[0] / self._dish_reward])
        return super().advance(state, marl_state, time, reward).replace(
            episode_values=state.episode_values + step_values)

    def rewards(self, reward: dict, step_info: dict, state, params) -> jax.Array:
        sparse = super().rewards(reward, step_info, state, params)
        if not self.shaped_reward_steps or not getattr(params, "shaped", True):
            return sparse
        shaped = jnp.stack([jnp.asarray(step_info["shaped_reward"][a], jnp.float32)
                            for a in self.agents])
        coef = jnp.clip(1.0 - state.env_steps / self.shaped_reward_steps, 0.0, 1.0)
        return sparse + coef * shaped
