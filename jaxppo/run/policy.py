"""`load_policy(RUN_DIR)`: the trained policy of a run folder as a jitted function.

    act = jaxppo.load_policy("runs/CartPole-v1-20250101-120000")
    action = act(obs)                     # deterministic (the distribution's mode)
    action = act(obs, jax.random.PRNGKey(0))  # sampled
    action = act(obs, action_mask=act.action_mask(state))  # a policy trained with masks

The run folder's config.yaml gives the env and network; the newest checkpoint gives the
params and the observation-normalisation statistics (params.msgpack when there is no
checkpoint). Observations are raw env observations [*obs_shape] or [B, *obs_shape];
actions come back ready for `env.step` (continuous ones clipped to the action bounds). A
policy trained with the env's action mask (`policy.masked`) also takes the legal actions of
each observation's state and acts among them only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.core.algorithm import Algorithm
from jaxppo.run.checkpoints import (CHECKPOINT_DIR, CheckpointStore, checkpoint_dir, load_params_dict,
                               load_run_config)
from jaxppo.config import (LOCKED_FIELDS, MAX_TIMESTEPS, check_seed, function_hooks,
                           is_function_hook, transforms_to_list)
from jaxppo.config_fields import is_flax_module
from jaxppo.envs.make import check_recorded_env, refuse_imports
from jaxppo.errors import CheckpointError, ConfigError
from jaxppo.core.evaluation import EpisodeStats, run_episodes, summarize
from jaxppo.run.hostloop import evaluate_host
from jaxppo.program.memory import free_memory
from jaxppo.program.resolved import Resolved, resolve
from jaxppo.core.running_stats import RunningStats


class Policy:
    """A trained policy: `policy(obs, key=None)` -> actions. Deterministic when key is None.

    A recurrent policy keeps a carry from step to step: `policy.step(obs, carry, key=None)`
    -> (actions, carry), starting each episode from `policy.initial_carry(batch_shape)`
    (`step` works for feed-forward policies too, with an empty carry).
    A masked policy (trained with the env's action mask) needs the legal actions of each
    observation's state, `action_mask=policy.action_mask(state)` (bool [*batch, num_actions]),
    and acts among them only, sampled or deterministic.
    A multi-agent run's policy (`agents` names them) acts for all agents with `joint({agent:
    obs})` -> {agent: action} (a feed-forward one also as `policy({agent: obs})`), or for one
    with `agent(name)`; called on an array it takes the agents' observations stacked and
    padded, [*batch, agents, obs_dim].
    Attributes: config (PPOConfig of the run), spec (EnvSpec), env and env_params (the env it
    trained on), params, obs_stats,
    iteration (of the checkpoint it came from; None for params.msgpack), recurrent, masked.
    """

    def __init__(self, algorithm: Algorithm, params, obs_stats: RunningStats,
                 iteration: int | None = None):
        self.algorithm = algorithm
        self.config = algorithm.config
        self.spec = algorithm.spec
        self.recurrent = algorithm.recurrent
        self.masked = algorithm.spec.masked
        self.params = params
        self.obs_stats = obs_stats
        self.iteration = iteration
        self._step = jax.jit(algorithm.policy_step, static_argnames=("deterministic",))
        self._masks: dict[int, Any] = {}  # the env's mask, jitted, per number of batch axes

    @property
    def env(self):
        """The env the run trained on (with its observation transforms)."""
        return self.spec.env

    @property
    def env_params(self):
        return self.spec.env_params

    @functools.cached_property
    def jitted_env(self) -> tuple:
        """The env's reset and step, jitted once for this policy: (reset, step). Videos play
        the env with them."""
        return jax.jit(self.env.reset), jax.jit(self.env.step)

    def __call__(self, obs, key: jax.Array | None = None, action_mask=None):
        if isinstance(obs, dict) and self.agents and not self.recurrent:
            return self.joint(obs, (), key, action_mask)  # {agent: obs} -> {agent: action}
        if self.recurrent:
            raise TypeError(
                "this policy is recurrent: it needs its carry from step to step. Use "
                "policy.step(obs, carry, key=None) -> (action, carry), starting each episode "
                "from policy.initial_carry(batch_shape); policy.evaluate() does this for you")
        return self.step(obs, (), key, action_mask)[0]

    act = __call__

    def step(self, obs, carry, key: jax.Array | None = None, action_mask=None):
        """One step of the policy, carry included.

        Args:
          obs: [*obs_shape] or [B, *obs_shape] raw env observations.
          carry: the carry before them (`initial_carry` at an episode's start; () when
            feed-forward).
          key: a PRNG key to sample with; None acts with the distribution's mode.
          action_mask: a masked policy's legal actions for each observation, bool or 0/1
            [*batch, num_actions] (`action_mask(state)`); None for an unmasked policy.

        Returns:
          (actions ready for env.step, the new carry).

        Raises:
          TypeError: a masked policy without action_mask, or an unmasked one with it.
          ValueError: an action_mask of the wrong shape, or one with no legal action.
        """
        obs = check_obs(obs, self.algorithm)
        carry = self._check_carry(carry, obs)
        mask = check_action_mask(action_mask, obs, self.algorithm)
        if key is not None:
            check_key(key)
        return self._step(self.params, self.obs_stats, obs, carry, key,
                          deterministic=key is None, action_mask=mask)

    def action_mask(self, state):
        """The legal actions of env state(s), as `step` and `__call__` take them.

        Args:
          state: the env state whose observation the policy acts on: one (from env.reset /
            env.step) or a batch of them (from vmapped ones), any number of batch axes.

        Returns:
          bool [*batch, num_actions], true = legal: the env's `action_mask(state, params)`.

        Raises:
          TypeError: the policy was trained without an action mask, or `state` is not a
            state of its env.
        """
        fn = self.spec.action_mask
        if fn is None:
            raise TypeError(f"this policy was trained without an action mask "
                            f"({_no_mask(self.algorithm)}): it acts on observations alone, so "
                            "call it without action_mask")
        if self.spec.host_loop:
            fn(state, self.env_params)  # the TypeError that says where its masks come from
        want = jax.eval_shape(lambda k: self.env.reset(k, self.env_params)[1],
                              jax.random.PRNGKey(0))
        leaves, ref = jax.tree.leaves(state), jax.tree.leaves(want)
        extra = {np.ndim(x) - len(r.shape) for x, r in zip(leaves, ref)}
        if (jax.tree.structure(state) != jax.tree.structure(want) or len(extra) != 1
                or min(extra) < 0):
            raise TypeError(f"state={_short(state)} is not a state (or a batch of states) of "
                            f"{self.config.env_name}; pass the env state whose observation the "
                            "policy acts on, as env.reset / env.step return it")
        axes = extra.pop()
        if axes not in self._masks:
            one = lambda s: fn(s, self.env_params)
            for _ in range(axes):
                one = jax.vmap(one)
            self._masks[axes] = jax.jit(one)
        return self._masks[axes](state)

    def _check_carry(self, carry, obs):
        fix = ("start each episode from policy.initial_carry(batch_shape) and pass on the carry "
               "step returns")
        if not self.recurrent:
            if carry is None or (isinstance(carry, tuple) and not carry):
                return ()
            raise TypeError(f"carry={_short(carry)}: this policy is feed-forward, its carry is () "
                            "(policy.initial_carry())")
        batch = tuple(np.shape(obs))[:np.ndim(obs) - len(self.spec.obs_shape)]
        want = jax.eval_shape(lambda: self.algorithm.initial_carry(batch))  # an array or a pytree
        want_shapes = [tuple(x.shape) for x in jax.tree.leaves(want)]
        got_shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(carry) if hasattr(x, "shape")]
        if jax.tree.structure(carry) != jax.tree.structure(want) or got_shapes != want_shapes:
            def one(shapes):
                return shapes[0] if len(shapes) == 1 else tuple(shapes)
            got = (f"shape {one(got_shapes)}" if got_shapes and
                   len(got_shapes) == len(jax.tree.leaves(carry)) else _short(carry))
            raise ValueError(f"carry has {got}, but observations of batch shape {batch} need a "
                             f"carry of shape {one(want_shapes)}; {fix}")
        return carry

    def initial_carry(self, batch_shape: tuple[int, ...] = ()):
        """The carry at the start of an episode (() for a feed-forward policy)."""
        if not isinstance(batch_shape, tuple) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in batch_shape):
            raise TypeError(f"batch_shape={batch_shape!r} must be a tuple of sizes, e.g. () for "
                            "one observation or (8,) for a batch of 8")
        return self.algorithm.initial_carry(batch_shape)

    def evaluate(self, episodes: int = 10, seed: int = 0, deterministic: bool = True,
                 max_steps: int | None = None) -> dict:
        """Evaluates the policy: one episode in each of `episodes` envs (`evaluate_policy`)."""
        return evaluate_policy(self.algorithm, self.params, self.obs_stats, episodes=episodes,
                               seed=seed, deterministic=deterministic, max_steps=max_steps)

    # ------------------------------------------------------------------ many agents
    @property
    def agents(self) -> tuple[str, ...]:
        """A multi-agent run's agent names, in the env's order; () for a single-agent run."""
        return tuple(self.spec.agents)

    def joint(self, obs: dict, carry=(), key: jax.Array | None = None, action_mask=None):
        """The joint policy of a multi-agent run: every agent acts on its own observation with
        the network they share. An agent's Box action is a vector [A] ([B, A] for a batch).

        Args:
          obs: {agent: observation} for every agent, as JaxMARL's reset / step give them
            (each [*agent_obs_shape] or [B, *agent_obs_shape], the same batch for all).
          carry: a recurrent policy's carry before them, [*batch, agents, ...] (the
            `initial_carry(batch_shape + (len(policy.agents),))` at an episode's start); ()
            for a feed-forward one.
          key: a PRNG key to sample with (each agent's action drawn independently); None acts
            with each distribution's mode.
          action_mask: a masked policy's legal actions [*batch, agents, num_actions]
            (`policy.action_mask(state)` of the env state); None for an unmasked one.

        Returns:
          {agent: action}; a recurrent policy's is ({agent: action}, carry).
        """
        stacked = self._stack_agents(obs)
        actions, carry = self.step(stacked, carry, key, action_mask)
        axis = -1 if self.spec.discrete else -2  # a Box action's vector comes after the agents
        out = {a: jnp.take(actions, i, axis=axis) for i, a in enumerate(self.agents)}
        return (out, carry) if self.recurrent else out

    def agent(self, name: str) -> "AgentPolicy":
        """One agent's own policy: `policy.agent(name)(obs, key=None)` on that agent's
        observation alone (the network every agent shares, or with `agent_params: per_agent`
        the agent's own, with `per_group` its group's, fed the agent's observation padded as
        in training)."""
        if not self.agents:
            raise TypeError(f"{self.config.env_name} is a single-agent env: call the policy "
                            "itself on its observations")
        if name not in self.agents:
            raise ValueError(f"agent {name!r} is not one of {self.config.env_name}'s agents "
                             f"{list(self.agents)}")
        if self.algorithm.with_agent_id:
            raise TypeError("this policy was trained with agent_id=true: its input holds the "
                            "env's agents together, so it acts for all of them at once; use "
                            "policy.joint({agent: obs}) and take this agent's action")
        if self.algorithm.per_agent:  # the agent's own network: its slice of the params
            algorithm = dataclasses.replace(self.algorithm, network=self.algorithm.network.inner)
            own = self.algorithm.agent_params(self.params, self.agents.index(name))
            return AgentPolicy(Policy(algorithm, own, self.obs_stats, self.iteration), name)
        return AgentPolicy(self, name)

    def _stack_agents(self, obs: dict) -> jax.Array:
        """{agent: obs} -> [*batch, agents, *obs_shape], each zero-padded (`_pad`)."""
        if not self.agents:
            raise TypeError(f"{self.config.env_name} is a single-agent env: the joint policy "
                            "takes the observations of a multi-agent env's agents")
        if not isinstance(obs, dict) or set(obs) != set(self.agents):
            got = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
            raise ValueError(f"obs must map every agent to its observation, {list(self.agents)}; "
                             f"got {got}")
        # the agents' axis comes before each one's observation (and its frames)
        return jnp.stack([self._pad(a, obs[a]) for a in self.agents],
                         axis=-1 - len(self.spec.obs_shape))

    def _pad(self, name: str, obs) -> jax.Array:
        """One agent's observation(s) as the network takes them: [*batch, *obs_shape], its
        own [size] zero-padded to obs_shape[0] (frame-stacked: [size, k] to [obs_dim, k])."""
        size = self.env.agent_obs_size(name)
        frames = tuple(self.spec.obs_shape[1:])  # frame_stack's axis after the observation
        arr = jnp.asarray(obs, jnp.float32)
        own = (size, *frames)
        if arr.ndim < len(own) or tuple(arr.shape[arr.ndim - len(own):]) != own:
            what = (f"{size} numbers" if not frames else
                    f"shape {list(own)} (its last {frames[0]} observations, stacked)")
            raise ValueError(f"agent {name!r}'s observation has shape {tuple(arr.shape)}, but "
                             f"its observations have {what}; pass one {list(own)} or a "
                             f"batch {['B', *own]}".replace("'B'", "B"))
        lead = [(0, 0)] * (arr.ndim - len(own))
        return jnp.pad(arr, lead + [(0, self.spec.obs_shape[0] - size)] + [(0, 0)] * len(frames))

    def __repr__(self):
        return (f"Policy({self.config.env_name}, obs_shape={self.spec.obs_shape}, "
                f"iteration={self.iteration}{', recurrent' if self.recurrent else ''}"
                f"{', masked' if self.masked else ''})")


class AgentPolicy:
    """One agent's policy of a multi-agent run (`Policy.agent(name)`): the network every agent
    shares (or the agent's own), on that agent's own observation [*agent_obs_shape] or [B, *agent_obs_shape],
    padded as in training. `agent_policy(obs, key=None, action_mask=None)` -> actions;
    `agent_policy.step(obs, carry, key=None, action_mask=None)` -> (actions, carry) for a
    recurrent policy (carry [*batch, ...] from `initial_carry(batch_shape)`). A masked policy
    takes that agent's legal actions [*batch, num_actions]."""

    def __init__(self, policy: Policy, name: str):
        self.policy, self.name = policy, name
        self.recurrent, self.masked = policy.recurrent, policy.masked

    def __call__(self, obs, key: jax.Array | None = None, action_mask=None):
        return self.policy(self.policy._pad(self.name, obs), key, action_mask)

    def step(self, obs, carry, key: jax.Array | None = None, action_mask=None):
        return self.policy.step(self.policy._pad(self.name, obs), carry, key, action_mask)

    def initial_carry(self, batch_shape: tuple[int, ...] = ()):
        return self.policy.initial_carry(batch_shape)

    def __repr__(self):
        return f"AgentPolicy({self.policy.config.env_name}, {self.name!r})"


def evaluate_policy(algorithm: Algorithm, params, obs_stats, *, episodes: int, seed: int,
                    deterministic: bool, max_steps: int | None = None) -> dict:
    """Evaluates params: one episode in each of `episodes` envs, all at once.

    Args:
      algorithm: the run's Algorithm (env and network).
      params: the network's params (one seed).
      obs_stats: the observation-normalisation statistics.
      episodes: how many envs, one episode each.
      seed: the envs are reset from PRNGKey(seed).
      deterministic: act with the distribution's mode (else sample).
      max_steps: caps each episode (default: the env's time limit).

    Returns:
      The return and length mean and std (floats), and "returns" and "lengths" per episode.

    Raises:
      ValueError: an argument out of range, or more episodes than free memory holds.
    """
    return _evaluator(algorithm, params, obs_stats, episodes=episodes, seed=seed,
                      deterministic=deterministic, max_steps=max_steps)(params, obs_stats)


def evaluate_policies(policies: list[Policy], episodes: int = 10, seed: int = 0,
                      deterministic: bool = True, max_steps: int | None = None) -> list[dict]:
    """Evaluates each policy of one run (`load_policies`) as `Policy.evaluate` does, with one
    compiled program for all: the params are its arguments, so seed i's figures equal
    `load_policy(run, seed_index=i).evaluate(...)`'s."""
    if not policies:
        return []
    first = policies[0]
    if any(p.algorithm is not first.algorithm for p in policies):
        raise ValueError("evaluate_policies takes the policies of one run (load_policies); "
                         "evaluate policies of different runs one by one")
    run = _evaluator(first.algorithm, first.params, first.obs_stats, episodes=episodes,
                     seed=seed, deterministic=deterministic, max_steps=max_steps)
    return [run(p.params, p.obs_stats) for p in policies]


def _evaluator(algorithm: Algorithm, params, obs_stats, *, episodes: int, seed: int,
               deterministic: bool, max_steps: int | None):
    """`evaluate_policy`'s episodes as a function of (params, obs_stats) -> its dict,
    compiled once (for params shaped like `params`) after the arguments are checked."""
    if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
        raise ValueError(f"episodes={episodes!r} must be an integer >= 1")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool)
                                  or not 1 <= max_steps <= MAX_TIMESTEPS):
        raise ValueError(f"max_steps={max_steps!r} must be an integer >= 1 and at most "
                         f"{MAX_TIMESTEPS} (2**31 - 1, the int32 step counter's limit), or None "
                         "for the env's time limit")
    try:
        check_seed(seed, "seed")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    bound = max_steps if max_steps is not None else algorithm.eval_bound()
    if algorithm.spec.host_loop:  # a gymnasium env steps in Python
        def run_host(params, obs_stats) -> dict:
            stats = EpisodeStats(*evaluate_host(algorithm, params, obs_stats, episodes=episodes,
                                                seed=seed, deterministic=deterministic,
                                                max_steps=bound))
            out = summarize(stats)
            out["returns"], out["lengths"] = stats.returns.tolist(), stats.lengths.tolist()
            return out

        return run_host

    def play(params, obs_stats, key):
        def step(obs, k, carry, mask=None):
            return algorithm.policy_step(params, obs_stats, obs, carry, k, deterministic, mask)

        return run_episodes(step, algorithm.spec.env, algorithm.spec.eval_params, key, episodes,
                            bound, algorithm.envs_carry(episodes),
                            action_mask=algorithm.spec.action_mask,
                            num_agents=len(algorithm.spec.agents))

    key = jax.random.PRNGKey(seed)
    compiled = jax.jit(play).lower(params, obs_stats, key).compile()
    _check_eval_memory(compiled, episodes)

    def run(params, obs_stats) -> dict:
        stats = compiled(params, obs_stats, key)
        out = summarize(stats, algorithm.spec.agents, algorithm.spec.episode_values)
        out["returns"] = np.asarray(stats.returns).tolist()
        out["lengths"] = np.asarray(stats.lengths).tolist()
        return out

    return run


def _check_eval_memory(compiled, episodes: int) -> None:
    """ValueError when evaluating `episodes` envs at once needs more memory than is free
    (XLA's figure from compiling), instead of an allocation failure deep inside."""
    try:
        m = compiled.memory_analysis()
        needed = int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - no analysis on this backend: nothing to check
        return
    free = free_memory()
    if free is None or needed <= free:
        return
    raise ValueError(
        f"episodes={episodes:,} needs about {needed / 2**30:.1f} GiB to evaluate (one env per "
        f"episode, all at once), but {free / 2**30:.1f} GiB is free; use at most about "
        f"{max(1, int(episodes * free / needed)):,} episodes")


def check_obs(obs, algorithm: Algorithm):
    """Checks observations before they reach the network.

    Returns:
      `obs` as a jax array [..., *obs_shape].

    Raises:
      TypeError: `obs` is not an array of numbers.
      ValueError: its trailing shape is not the env's observation shape.
    """
    spec = algorithm.spec
    want = tuple(spec.obs_shape)
    example = f"one observation of shape {want} or a batch [B, {', '.join(map(str, want))}]"
    try:
        arr = obs if isinstance(obs, jax.Array) else np.asarray(obs)
    except Exception:  # noqa: BLE001 - ragged lists and other objects numpy cannot hold
        arr = None
    if arr is None or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise TypeError(f"obs={_short(obs)} is not an array of numbers; pass {example}, as "
                        f"env.reset / env.step of {algorithm.config.env_name} return them")
    shape = tuple(arr.shape)
    if len(shape) < len(want) or shape[len(shape) - len(want):] != want:
        raise ValueError(f"obs has shape {shape}, but {algorithm.config.env_name}'s observations "
                         f"have shape {want}; pass {example}")
    return jnp.asarray(arr)


def check_action_mask(action_mask, obs, algorithm: Algorithm):
    """Checks the legal actions given with observations `obs` (as `check_obs` returns them).

    Returns:
      The mask as a bool jax array [*batch, num_actions] for a masked policy; None for an
      unmasked one (which takes none).

    Raises:
      TypeError: a masked policy without a mask, an unmasked one with one, or a mask that is
        not an array of bools or 0/1 numbers.
      ValueError: a mask whose shape is not the observations' batch shape + (num_actions,),
        or one that leaves an observation no legal action.
    """
    spec, name = algorithm.spec, algorithm.config.env_name
    if not spec.masked:
        if action_mask is None:
            return None
        raise TypeError(
            f"action_mask given, but this policy was trained without an action mask "
            f"({_no_mask(algorithm)}): it never learned to act among the legal actions only, "
            "and jaxppo does not silently restrict it. Call it without action_mask, or train "
            "with the mask (an env that defines action_mask(state, params), mask_actions unset "
            "or true)")
    batch = tuple(obs.shape)[:obs.ndim - len(spec.obs_shape)]
    want = (*batch, spec.action_dim)
    if action_mask is None and spec.host_loop:
        raise TypeError(
            f"this policy was trained with {name}'s action mask: pass the legal actions the "
            f"env gave with each observation, action_mask=info['action_mask'] of its reset or "
            f"step, its action_masks() after it, or obs['action_mask'] of a Dict observation "
            f"(bool {list(want)}, true = legal). "
            "policy.evaluate() passes them itself")
    if action_mask is None:
        raise TypeError(
            f"this policy was trained with {name}'s action mask: pass the legal actions of "
            f"each observation's state, action_mask=policy.action_mask(state) (bool {list(want)}, "
            "true = legal; it calls policy.env.action_mask(state, policy.env_params), vmapped "
            "over a batch of states). policy.evaluate() passes them itself")
    try:
        arr = action_mask if isinstance(action_mask, jax.Array) else np.asarray(action_mask)
    except Exception:  # noqa: BLE001 - ragged lists and other objects numpy cannot hold
        arr = None
    if arr is None or not (arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.number)):
        raise TypeError(f"action_mask={_short(action_mask)} is not an array of bools; pass "
                        f"bool {list(want)} (true = legal), e.g. policy.action_mask(state)")
    if tuple(arr.shape) != want:
        raise ValueError(
            f"action_mask has shape {tuple(arr.shape)}, but observations of batch shape {batch} "
            f"need the legal actions {want}: one row of {spec.action_dim} per observation "
            "(policy.action_mask(state) of the states they came from)")
    if isinstance(arr, jax.core.Tracer):  # inside the caller's jit: values unknown here
        return arr.astype(bool)
    values = np.asarray(arr)
    if values.dtype != np.bool_ and not np.all((values == 0) | (values == 1)):
        raise TypeError(f"action_mask holds values other than 0 and 1 ({_short(values)}); pass "
                        "bools, true = legal")
    values = values.astype(bool)
    empty = np.argwhere(~values.any(axis=-1))
    if empty.size:
        at = tuple(int(i) for i in empty[0])
        raise ValueError(
            f"action_mask leaves {len(empty)} observation(s) with no legal action (the first "
            f"at index {at}), so the policy has no action to choose; every state an episode "
            "continues from must have a legal action (a state with none should end it)")
    return jnp.asarray(values)


def _no_mask(algorithm: Algorithm) -> str:
    """Why a policy does not mask: its config said so, or its env gives no mask."""
    if algorithm.config.mask_actions is False:
        return "mask_actions=false"
    return f"{algorithm.config.env_name} gives no action mask"


def check_key(key) -> None:
    """TypeError unless `key` is one PRNG key (jax.random.PRNGKey(s) or jax.random.key(s))."""
    raw = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    if hasattr(key, "dtype") and hasattr(key, "shape"):
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and tuple(key.shape) == ():
            return
        if key.dtype == raw.dtype and tuple(key.shape) == tuple(raw.shape):
            return
        got = f"an array of shape {tuple(key.shape)} and dtype {key.dtype}"
    else:
        got = f"{type(key).__name__} {_short(key)}"
    raise TypeError(f"key must be one PRNG key, e.g. jax.random.PRNGKey(0) (shape {tuple(raw.shape)}, "
                    f"{raw.dtype}) or jax.random.key(0), got {got}; for a batch of keys, "
                    "jax.vmap over them")


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def load_policy(run_dir: str | Path, *, seed_index: int = 0, step: int | None = None,
                env: Any = None, trust_config: bool = True, best: bool = False,
                network: Any = None) -> Policy:
    """The trained policy of a run folder as a callable `act(obs, key=None)` (with
    `action_mask=` the legal actions, for a policy trained with the env's action mask).

    A multi-agent run's (a `jaxmarl:` env) is also the joint policy: `policy.joint(obs)`
    takes {agent: observation} and returns {agent: action} (with the carry for a recurrent
    policy), `policy.agents` names the agents and `policy.agent(name)` is one agent's own
    policy on that agent's observation alone (an `AgentPolicy`).

    Args:
      run_dir: the run folder.
      seed_index: which seed of a multi-seed run.
      step: a checkpoint iteration (default: the newest; params.msgpack without checkpoints).
      env: the env (an object or "module:Class"), for runs of a custom env that config.yaml
        can only name (one whose class is not importable; importable ones are recorded as
        "module:Class" and rebuilt).
      trust_config: False refuses a config.yaml that names a module to import (its
        "module:Class" env): for run folders you did not write. Registered gymnax names and
        the suites' envs ("brax:...", ...) import nothing of the folder's; `env=` is yours.
      best: the best-evaluated params (RUN_DIR/best/, kept by a run with eval_every)
        instead of the newest; the Policy's `iteration` is the evaluation's.
      network: your own flax module object (as given to `PPOConfig(network=...)`), for runs
        of a network that config.yaml can only name (its class defined in `__main__`, a
        notebook or a function); the params must fit it, as SB3's `custom_objects`.

    Returns:
      The `Policy`.

    Raises:
      CheckpointError: a missing or unreadable run folder or checkpoint, or params that do
        not fit the config's network.
      ConfigError: an env that cannot be rebuilt, or one whose module trust_config=False
        refuses to import.
      TypeError, ValueError: a run_dir, step or seed_index of the wrong kind or range.
    """
    saved = _load_saved(run_dir, step, env, trust_config, best, network)
    return saved.policy(seed_index)


def load_policies(run_dir: str | Path, *, step: int | None = None, env: Any = None,
                  trust_config: bool = True, best: bool = False,
                  network: Any = None) -> list[Policy]:
    """The trained policy of every seed of a run folder, in seed order (one for a one-seed
    run), read from one restore and sharing one Algorithm (`evaluate_policies` evaluates them
    with one compiled program). Arguments and errors as `load_policy`'s."""
    saved = _load_saved(run_dir, step, env, trust_config, best, network)
    return [saved.policy(i) for i in range(saved.seeds)]


@dataclass(frozen=True)
class _Saved:
    """What a run folder holds for `load_policy`: the params of all its seeds."""

    run_dir: Path
    algorithm: Algorithm
    params: Any
    obs_stats: Any
    seeds: int
    source: str
    iteration: int | None
    env_given: bool

    def policy(self, seed_index: int) -> Policy:
        """Seed `seed_index`'s Policy; ValueError out of range, CheckpointError for params
        that do not fit the config."""
        return _policy_of(self, seed_index)


def _load_saved(run_dir, step, env, trust_config, best: bool = False, network=None) -> _Saved:
    run_dir = _run_folder(run_dir, step)
    if best:
        return _load_best(run_dir, step, env, trust_config, network)
    state, meta, step = _restore_checkpoint(run_dir, step)
    # The fields that fix the policy must agree with the checkpoint's record (the rest, such as
    # a total_timesteps changed by a resume that stopped before its next checkpoint, need not).
    config = load_run_config(run_dir, meta, fields=LOCKED_FIELDS)
    algorithm = Algorithm.create(_resolve_recorded(config, run_dir, env, trust_config, network))
    if state is not None:
        params, obs_stats = state["params"], state["obs_stats"]
        seeds = int(meta.get("num_seeds", 1))
        source = f"checkpoint {checkpoint_dir(run_dir) / str(step)}"
    else:
        params, obs_stats = _saved_params(run_dir)
        seeds = algorithm.config.num_seeds
        source = str(run_dir / "params.msgpack")
    return _Saved(run_dir, algorithm, params, obs_stats, seeds, source,
                  None if meta is None else int(meta["iteration"]), env is not None)


def _load_best(run_dir: Path, step, env, trust_config, network=None) -> _Saved:
    """The params of RUN_DIR/best/ (the best evaluation) with the run's config.yaml."""
    from jaxppo.run.folder import BEST_DIR, BEST_RECORD

    if step is not None:
        raise ValueError(f"step={step} and best=True name two different params; give one")
    folder = run_dir / BEST_DIR
    path = folder / "params.msgpack"
    if not path.is_file():
        raise CheckpointError(
            f"{run_dir} has no {BEST_DIR}/params.msgpack: a run keeps its best-evaluated "
            "params only when it evaluates (eval_every > 0, e.g. --set eval_every=10), from "
            "its first evaluation on. Load the newest params instead (without best=True / "
            "--best)")
    try:
        record = json.loads((folder / BEST_RECORD).read_text())
        iteration = int(record["iteration"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder / BEST_RECORD} cannot be read ({str(e)[:120]}); it "
                              "says which evaluation best/ holds. Load the newest params "
                              "instead (without best=True / --best)") from None
    config = load_run_config(run_dir, None, fields=LOCKED_FIELDS)
    algorithm = Algorithm.create(_resolve_recorded(config, run_dir, env, trust_config, network))
    saved = load_params_dict(path)
    return _Saved(run_dir, algorithm, saved["params"], saved["obs_stats"],
                  algorithm.config.num_seeds, str(path), iteration, env is not None)


def _policy_of(saved: _Saved, seed_index: int) -> Policy:
    run_dir, algorithm, seeds, source = saved.run_dir, saved.algorithm, saved.seeds, saved.source
    params, obs_stats = saved.params, saved.obs_stats
    if not isinstance(seed_index, int) or isinstance(seed_index, bool) or not 0 <= seed_index < seeds:
        raise ValueError(f"seed_index={seed_index!r}, but {run_dir} holds {seeds} seed(s): use "
                         f"a seed index from 0 to {seeds - 1}")
    if seeds > 1:
        short = [np.shape(x) for x in jax.tree.leaves((params, obs_stats))
                 if not np.shape(x) or np.shape(x)[0] != seeds]
        if short:
            raise CheckpointError(
                f"{run_dir}/config.yaml says num_seeds={seeds}, but {source} holds arrays of "
                f"shape {short[0]}, not one per seed; config.yaml does not belong to these "
                "params: restore the run's own config.yaml")
        params, obs_stats = jax.tree.map(lambda x: x[seed_index], (params, obs_stats))
    _check_params(params, obs_stats, algorithm, run_dir, source, env_given=saved.env_given)
    obs_stats = RunningStats(jnp.asarray(obs_stats["mean"]), jnp.asarray(obs_stats["var"]),
                             jnp.asarray(obs_stats["count"]))
    params = jax.tree.map(jnp.asarray, params)
    return Policy(algorithm, params, obs_stats, iteration=saved.iteration)


def _run_folder(run_dir, step) -> Path:
    """`run_dir` as a Path to an existing folder; TypeError/CheckpointError naming the fix."""
    if not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir={_short(run_dir)} must be the path of a run folder (a str or "
                        "Path), e.g. 'runs/CartPole-v1-20250101-120000'")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise TypeError(f"step={step!r} must be a checkpoint iteration (an int) or None for the "
                        "newest")
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise CheckpointError(f"{run_dir} is a file; give the run folder that holds it "
                              f"({run_dir.parent})")
    if not run_dir.is_dir():
        raise CheckpointError(f"run folder {run_dir} does not exist; check the path")
    return run_dir


def _restore_checkpoint(run_dir: Path, step: int | None):
    """(state, meta, step) of checkpoint `step` (None: the newest), read-only; (None, None,
    step) when the folder has no checkpoint."""
    if not checkpoint_dir(run_dir).is_dir():
        return None, None, step
    with CheckpointStore(run_dir, read_only=True) as store:
        steps = store.steps()
        if not steps:
            return None, None, step
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(f"no checkpoint for iteration {step} in {store.directory}; "
                                  f"available: {', '.join(map(str, steps))}")
        state, meta = store.restore(step)
    return state, meta, step


def _resolve_recorded(config, run_dir: Path, env, trust_config: bool, network=None) -> Resolved:
    """The folder's config resolved, with `env` and `network` (when given) in place of the
    recorded ones, and without the reward hooks recorded as Python functions: acting needs no
    reward hook."""
    if network is not None:
        if not is_flax_module(network):
            raise TypeError(f"network={network!r} must be a flax.linen.Module object, as given "
                            "to PPOConfig(network=...) when the run trained")
        config = config.replace(network=network)
    if function_hooks(config.transforms):
        config = config.replace(transforms=[
            t for t in transforms_to_list(config.transforms) if not is_function_hook(t)])
    if env is not None:
        config = config.replace(env=env)
    else:
        if not trust_config:
            refuse_imports(config.env, f"{run_dir}/config.yaml", (
                f"Pass the env yourself (load_policy({str(run_dir)!r}, env=YourEnv()), "
                "`--env module:Class`) or trust the folder (trust_config=True)"))
        check_recorded_env(config, run_dir, (
            f"Pass the env: jaxppo.load_policy({str(run_dir)!r}, env=YourEnv()) (or "
            f"`jaxppo eval {run_dir} --env module:Class`)"))
    if not trust_config and network is None:
        refuse_imports(None, f"{run_dir}/config.yaml", network=config.network, fix=(
            "Its policy is that module's network, so it loads only with the module: if you "
            "trust the folder, load it with trust_config=True (without --no-imports)"))
    try:
        return resolve(config)
    except ConfigError as e:
        if env is None and str(e).startswith(f"env={config.env!r}"):  # "module:Class" failed
            raise ConfigError(f"{e}. (This is the env {run_dir}/config.yaml records; or pass "
                              "it: load_policy(run_dir, env=YourEnv()))") from e
        raise


def _saved_params(run_dir: Path):
    """(params, obs_stats) of the folder's params.msgpack; CheckpointError when it has none."""
    path = run_dir / "params.msgpack"
    if not path.exists():
        raise CheckpointError(
            f"run folder {run_dir} has neither a checkpoint in {CHECKPOINT_DIR}/ nor "
            "params.msgpack; it holds no trained policy (did the run finish?)")
    saved = load_params_dict(path)
    return saved["params"], saved["obs_stats"]


def _check_params(params, obs_stats, algorithm: Algorithm, run_dir: Path, source: str,
                  env_given: bool) -> None:
    """CheckpointError when the saved params do not fit the network the run's config (and
    env) describe: a config.yaml edited or copied from another run, or another env given."""
    spec = algorithm.spec
    want = jax.eval_shape(algorithm.init_params, jax.random.PRNGKey(0))
    got_leaves = dict((jax.tree_util.keystr(k), np.shape(v))
                      for k, v in jax.tree_util.tree_flatten_with_path(params)[0])
    want_leaves = dict((jax.tree_util.keystr(k), tuple(v.shape))
                       for k, v in jax.tree_util.tree_flatten_with_path(want)[0])
    stats = obs_stats.get("mean") if isinstance(obs_stats, dict) else None
    problem = None
    if set(got_leaves) != set(want_leaves):
        extra = sorted(set(got_leaves) ^ set(want_leaves))[0]
        problem = (f"{extra} is {'missing from' if extra in want_leaves else 'extra in'} the "
                   "saved params")
    else:
        for k, shape in want_leaves.items():
            if got_leaves[k] != shape:
                problem = f"{k} has shape {got_leaves[k]}, the network needs {shape}"
                break
    if problem is None and stats is not None and np.shape(stats) != (spec.obs_dim,):
        problem = (f"the observation statistics have shape {np.shape(stats)}, the env's "
                   f"observations {spec.obs_dim} values")
    if problem is None:
        return
    where = ("the env given" if env_given else f"{run_dir}/config.yaml")
    net = algorithm.config.network
    shape = f"network.hidden_sizes={list(net.hidden_sizes)}" + (
        f", network.recurrent_size={net.recurrent_size}" if net.recurrent_size else "") + (
        f", network.head_sizes={list(net.head_sizes)}" if net.head_sizes else "")
    if net.custom:  # the module's own arguments shape it
        shape = f"network.module={net.module!r:.80}" + (
            f", network.kwargs={net.kwargs}" if net.kwargs else "")
    raise CheckpointError(
        f"the params in {source} do not fit the network that {where} describes for "
        f"{algorithm.config.env_name} with {shape} ({problem}); they were trained with another env or "
        "network: " + ("pass the env the run trained on" if env_given else
                       "restore the run's own config.yaml"))
