"""Gymnasium environments by name (`env="gymnasium:CartPole-v1"`), for the host-loop mode:
the env steps in Python (`jaxppo.run.hostloop` runs its vector env in SAME_STEP autoreset
mode, which keeps the gymnax contract), the policy and the update stay compiled.
`GymnasiumEnv` is what the rest of jaxppo sees of it: spaces, time limit, actions.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
from typing import Any

import numpy as np

from jaxppo.envs.imports import import_package, import_user_module
from jaxppo.envs.spec import MAX_JOINT_ACTIONS
from jaxppo.errors import ConfigError

PREFIX = "gymnasium:"
INSTALL = "pip install 'jaxppo[gymnasium]'"


def is_gymnasium_env(env: Any) -> bool:
    """True for an env named "gymnasium:<id>"."""
    return isinstance(env, str) and env.startswith(PREFIX)


def import_gymnasium():
    """gymnasium, at a version with SAME_STEP autoreset; ConfigError naming the install."""
    try:
        gymnasium = import_package("gymnasium")
    except ImportError:
        raise ConfigError(f"env='gymnasium:...' needs the gymnasium package: {INSTALL}") from None
    mode = getattr(getattr(gymnasium.vector, "AutoresetMode", None), "SAME_STEP", None)
    if mode is None:
        raise ConfigError(
            f"gymnasium {gymnasium.__version__} has no SAME_STEP autoreset (added in 1.1), which "
            f"jaxppo's host loop relies on: {INSTALL} (gymnasium 1.3.0)")
    return gymnasium


def registered_gymnasium_envs() -> list[str]:
    """gymnasium's registered env ids (the <id> of "gymnasium:<id>")."""
    return list(import_gymnasium().envs.registry)


@dataclasses.dataclass(frozen=True)
class GymnasiumParams:
    """The only env param jaxppo reads of a gymnasium env: its time limit (TimeLimit's
    max_episode_steps), the bound on an evaluation episode."""

    max_steps_in_episode: int


class GymnasiumEnv:
    """A registered gymnasium env (by id, with its make kwargs), as jaxppo sees it: the single
    env's spaces, its time limit, and actions.

    Box observations as they are; any other observation space (Discrete, MultiDiscrete,
    MultiBinary, a Tuple or Dict of spaces) as one float32 vector, gymnasium's flattening
    (`gymnasium.spaces.flatten`: a Discrete one-hot, a MultiDiscrete one-hot per part, a
    Dict's parts in key order), done by a wrapper on each env of the vector env. Discrete or
    Box actions; a 1-D MultiDiscrete or MultiBinary action space as one Discrete over its
    combinations (at most MAX_JOINT_ACTIONS; index i is `np.unravel_index(i, nvec)`), as
    Jumanji's adapter does. An env whose reset's info holds "action_mask" (bool or 0/1, one
    per Discrete action, as Taxi's), that has SB3-contrib's `action_masks()` method, or whose
    Dict observation has an "action_mask" entry (PettingZoo's and RLlib's convention; the
    policy sees the rest of the observation) `gives_action_mask`: the policy acts among the
    legal actions of each observation, read after the reset or step that gave it.
    """

    host_loop = True  # it steps in Python: jaxppo.run.hostloop runs it

    def __init__(self, env_id: str, kwargs: dict | None = None, vectorization: str = "sync"):
        gym = import_gymnasium()
        self.id = env_id
        self.kwargs = dict(kwargs or {})
        self.vectorization = vectorization
        self.name = env_id.rpartition(":")[2].rpartition("/")[2]
        _check_registered(gym, env_id)
        try:
            probe = gym.make(env_id, **self.kwargs)
        except Exception as e:  # noqa: BLE001 - a missing extra, a bad kwarg: one clear error
            raise ConfigError(
                f"env='gymnasium:{env_id}': gymnasium.make({env_id!r}"
                + "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
                + f") raised {type(e).__name__}: {_one_line(e)} (env_kwargs go to gymnasium.make)"
            ) from None
        from jaxppo.envs import gymnasium_mask

        try:
            self.env_obs_space = probe.observation_space
            self.env_act_space = probe.action_space
            limit = getattr(probe.spec, "max_episode_steps", None)
            # The legal actions, where the env gives them with each observation: its
            # info["action_mask"] of reset and step, else its action_masks() (SB3-contrib's
            # MaskablePPO convention), else its Dict observation's "action_mask" (moved to
            # the info by a wrapper); one entry per Discrete action.
            self.mask_in_obs = gymnasium_mask.carries_mask(self.env_obs_space, self.env_act_space)
            if self.mask_in_obs:
                probe = gymnasium_mask.MaskFromObservation(probe)
            mask = None
            if isinstance(self.env_act_space, gym.spaces.Discrete):
                mask = probe.reset(seed=0)[1].get("action_mask")
                if mask is None and callable(_attr(probe, "action_masks")):
                    mask = _attr(probe, "action_masks")()
        except Exception as e:  # noqa: BLE001 - the env's own reset: one clear error
            raise ConfigError(f"env='gymnasium:{env_id}': its reset(seed=0) raised "
                              f"{type(e).__name__}: {_one_line(e)}") from None
        finally:
            probe.close()
        self.gives_action_mask = (mask is not None
                                  and np.shape(mask) == (int(self.env_act_space.n),))
        self.max_episode_steps = int(limit) if limit else None
        where = f"env='gymnasium:{self.id}'"
        # The observation the policy is given before any flattening (without a carried mask).
        self.given_obs_space = probe.observation_space
        self.obs_space = _presented_obs_space(gym, self.given_obs_space, where)
        self.act_space, self.joint_actions = _presented_act_space(gym, self.env_act_space, where)

    @property
    def params(self) -> GymnasiumParams | None:
        return None if self.max_episode_steps is None else GymnasiumParams(self.max_episode_steps)

    # The gymnax-style accessors the rest of jaxppo reads spaces through.
    def observation_space(self, params=None):
        return self.obs_space

    def action_space(self, params=None):
        return self.act_space

    def make_vec(self, num_envs: int, render: bool = False):
        """A vector env of `num_envs` copies in SAME_STEP autoreset mode: "sync" (stepped one
        after another in this process) or "async" (a subprocess each, started by forkserver:
        forking a process that runs JAX's threads can deadlock the child). With `render`
        (always "sync"), each env is made with render_mode='rgb_array': `render()` gives
        every env's picture."""
        gym = import_gymnasium()
        vector_kwargs = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
        mode = "sync" if render else self.vectorization
        if mode == "async":
            vector_kwargs["context"] = "forkserver"
        kwargs = {**self.kwargs, "render_mode": "rgb_array"} if render else self.kwargs
        if render:  # pygame (classic control's renderer) draws off screen, without sound
            for driver in ("SDL_VIDEODRIVER", "SDL_AUDIODRIVER"):
                os.environ.setdefault(driver, "dummy")
        from jaxppo.envs.gymnasium_mask import MaskFromObservation

        wrappers = [MaskFromObservation] if self.mask_in_obs else []
        if self.obs_space is not self.given_obs_space:
            wrappers.append(functools.partial(_flattened, self.given_obs_space, self.obs_space))
        try:
            envs = gym.make_vec(self.id, num_envs=num_envs, vectorization_mode=mode,
                                vector_kwargs=vector_kwargs, wrappers=wrappers, **kwargs)
        except (ConnectionError, EOFError) as e:  # a subprocess that died while starting
            raise ConfigError(
                f"gymnasium:{self.id} with gymnasium_vectorization='async': a subprocess of its "
                f"vector env ended while starting ({type(e).__name__}). Each starts a fresh "
                "Python that imports your main script again: keep a script's training under "
                "`if __name__ == \"__main__\":`, and register the env in a module the "
                "subprocess imports (gymnasium:module:Env-v0); or use "
                "gymnasium_vectorization='sync'") from None
        if envs.metadata.get("autoreset_mode") != gym.vector.AutoresetMode.SAME_STEP:
            envs.close()
            raise ConfigError(f"gymnasium:{self.id}: its vector env did not take SAME_STEP "
                              "autoreset, which the host loop needs")
        return envs

    def policy_obs(self, obs) -> np.ndarray:
        """One observation of the env as the policy takes it: a Box observation as it is, any
        other flattened into a float32 vector (what the vector env's wrappers give); a Dict
        observation that carries the legal actions without its "action_mask" (pass that as
        the policy's action_mask)."""
        if self.mask_in_obs:
            from jaxppo.envs.gymnasium_mask import obs_without_mask

            obs = obs_without_mask(obs)
        if self.obs_space is self.given_obs_space:
            return np.asarray(obs)
        return flatten_observation(self.given_obs_space, obs)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Policy actions [E, ...] (already clipped to the bounds) as the vector env takes them:
        Discrete ones shifted by the space's start, a joint Discrete one as the MultiDiscrete
        (or MultiBinary) vector [E, D] it stands for, Box ones in the space's dtype."""
        space = self.env_act_space
        if self.joint_actions is not None:
            nvec, start = self.joint_actions
            parts = np.unravel_index(np.asarray(actions, np.int64), nvec)
            return (np.stack(parts, axis=-1) + start).astype(space.dtype)
        if hasattr(space, "n"):
            return np.asarray(actions, np.int64) + int(space.start)
        return np.asarray(actions, space.dtype).reshape((-1,) + tuple(space.shape))

    def __repr__(self):
        return f"GymnasiumEnv({self.id!r})"


def _attr(env, name: str):
    """`env`'s attribute `name` through its wrappers (None where it has none)."""
    try:
        return env.get_wrapper_attr(name)
    except AttributeError:
        return None


def _presented_obs_space(gym, space, where: str):
    """The observation space the policy sees: a Box as it is, any other as gymnasium's
    flattening of it, a float32 Box (a ConfigError for a space that has none)."""
    if isinstance(space, gym.spaces.Box):
        return space
    try:
        flat = gym.spaces.flatten_space(space)
        why = "" if isinstance(flat, gym.spaces.Box) else f"its flattening is {flat}"
    except (NotImplementedError, TypeError, ValueError) as e:
        why = f"{type(e).__name__}: {_one_line(e)}"
    if why:  # e.g. a Sequence or a Graph: no fixed size
        raise ConfigError(
            f"{where} has observation space {space}, which gymnasium cannot flatten into one "
            f"vector ({why}); jaxppo takes Box observations and flattens Discrete, "
            "MultiDiscrete, MultiBinary, Tuple and Dict ones; register an env of your own with "
            "a wrapper that gives a fixed-size array")
    return gym.spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32),
                          flat.shape, np.float32)


def _flattened(space, flat_space, env):
    """`env` whose observations are `gymnasium.spaces.flatten(space, obs)` in float32 (a wrapper
    of each env of the vector env; module-level parts, so an async one pickles them)."""
    gym = import_gymnasium()
    return gym.wrappers.TransformObservation(env, functools.partial(flatten_observation, space),
                                             flat_space)


def flatten_observation(space, obs) -> np.ndarray:
    """One observation of `space` as one float32 vector: `gymnasium.spaces.flatten`."""
    return np.asarray(import_gymnasium().spaces.flatten(space, obs), np.float32)


def _presented_act_space(gym, space, where: str):
    """(the action space the policy acts in, (nvec, start) of a joint Discrete action or
    None); a ConfigError for a space jaxppo does not act in."""
    spaces = gym.spaces
    if isinstance(space, spaces.Discrete):
        return space, None
    if isinstance(space, spaces.Box):
        if len(space.shape) > 1:
            raise ConfigError(f"{where}: Box actions must be a vector, got shape {space.shape}")
        return space, None
    if isinstance(space, (spaces.MultiDiscrete, spaces.MultiBinary)) and len(space.shape) == 1:
        multi = isinstance(space, spaces.MultiDiscrete)
        nvec = tuple(int(v) for v in (space.nvec if multi else [2] * space.shape[0]))
        start = np.asarray(space.start if multi else 0, np.int64)
        if math.prod(nvec) <= MAX_JOINT_ACTIONS:
            return spaces.Discrete(math.prod(nvec)), (nvec, start)
        raise ConfigError(
            f"{where} has action space {space}, {math.prod(nvec)} combinations; jaxppo acts in "
            f"a MultiDiscrete or MultiBinary space as one Discrete action over its combinations, "
            f"up to {MAX_JOINT_ACTIONS} (register a smaller variant of the env)")
    raise ConfigError(f"{where} has action space {space}; jaxppo supports Discrete, Box, "
                      "and 1-D MultiDiscrete and MultiBinary actions")


def make_gymnasium_env(config) -> tuple[GymnasiumEnv, GymnasiumParams | None]:
    """(env, params: its time limit or None) for config.env = "gymnasium:<id>".

    Raises:
      ConfigError: env_params given, an unknown id, or spaces the host loop cannot run.
    """
    if config.env_params is not None:
        raise ConfigError("env_params is for gymnax envs; a gymnasium env takes its options "
                          "as env_kwargs (passed to gymnasium.make)")
    env = GymnasiumEnv(config.env[len(PREFIX):], config.env_kwargs, config.gymnasium_vectorization)
    return env, env.params


# The options of envs that step in Python, with their defaults.
HOST_OPTIONS = {"max_policy_lag": 0, "actor_threads": None, "rollout_timeout": None,
                "gymnasium_vectorization": "sync"}
# Those that only the actor-learner (max_policy_lag >= 1) reads.
ACTOR_LEARNER_OPTIONS = ("actor_threads", "rollout_timeout")


def _given(config, names) -> list[str]:
    return [f"{n}={getattr(config, n)!r}" for n in names if getattr(config, n) != HOST_OPTIONS[n]]


def _them(given: list[str]) -> str:
    return "them" if len(given) > 1 else "it"


def refuse_host_options(config) -> None:
    """ConfigError when a config whose env steps inside the compiled program sets an option
    of envs that step in Python (a policy lag, actor threads, a vector env's mode)."""
    given = _given(config, HOST_OPTIONS)
    if not given:
        return
    raise ConfigError(
        f"{', '.join(given)} {'are options' if len(given) > 1 else 'is an option'} of envs that "
        f"step in Python, but {config.env_name} steps inside the compiled program, where every "
        "iteration acts and then learns with the same params (there is no host loop to split "
        f"into actors and a learner); remove {_them(given)}, or train on an env that steps in "
        "Python (env='gymnasium:<id>')")


def check_actor_options(config) -> None:
    """The host loop's own options: the actor-learner's only with max_policy_lag >= 1, actor
    threads that split num_envs evenly, "async" vectorization for a gymnasium env only."""
    if config.gymnasium_vectorization != "sync" and not is_gymnasium_env(config.env):
        raise ConfigError(
            f"gymnasium_vectorization={config.gymnasium_vectorization!r} is for gymnasium envs "
            f"(env='gymnasium:<id>'), but env={config.env!r} makes its vector env itself; remove it")
    given = _given(config, ACTOR_LEARNER_OPTIONS)
    if config.max_policy_lag == 0 and given:
        raise ConfigError(
            f"{', '.join(given)} only {'apply' if len(given) > 1 else 'applies'} to the "
            "actor-learner (max_policy_lag >= 1), but max_policy_lag=0 runs the synchronous host "
            f"loop (act, then learn, in one thread); set max_policy_lag=1 or remove {_them(given)}")
    threads = config.actor_threads
    if threads is not None and config.num_envs % threads:
        fits = [d for d in range(1, config.num_envs + 1) if config.num_envs % d == 0]
        raise ConfigError(
            f"num_envs={config.num_envs} is not divisible by actor_threads={threads}: each actor "
            f"thread steps num_envs / actor_threads envs; use actor_threads in {fits} (or null "
            "to choose from the cores), or change num_envs")


def check_hosts(config, hosts: int) -> None:
    """Checks that the host loop (or the actor-learner) can run the config on `hosts` hosts,
    each stepping num_envs / hosts of the envs (its actor threads a share of those).

    Raises:
      ConfigError: sync='batch' on several hosts, or actor threads that do not split a
        host's envs evenly.
    """
    if hosts <= 1:
        return
    where = f"env={config.env!r} steps in Python (host-loop mode)"
    if config.sync == "batch":
        raise ConfigError(
            f"sync='batch' with {hosts} hosts: {where}, and each host's learner updates on its "
            "own envs' rollout with every minibatch's gradient all-reduced over the hosts; use "
            "sync='gradients' (the default)")
    per, threads = config.num_envs // hosts, config.actor_threads
    if config.max_policy_lag and threads is not None and per % threads:
        fits = [d for d in range(1, per + 1) if per % d == 0]
        raise ConfigError(
            f"actor_threads={threads} does not divide the {per} envs of each of {hosts} hosts "
            f"(num_envs={config.num_envs} / {hosts}): every host runs actor_threads threads of "
            f"the same number of envs; use actor_threads in {fits} (or null to choose from each "
            "host's cores), or change num_envs")


def check_config(config) -> None:
    """Checks that the host loop (or the actor-learner) can run the config (a gymnasium
    env's or an envpool task's).

    Raises:
      ConfigError: sync='batch' over several devices, population-based training, or
        actor-learner options that do not fit (on several hosts also `check_hosts`, once the
        layout is known).
    """
    check_actor_options(config)
    where = f"env={config.env!r} steps in Python (host-loop mode)"
    if config.pbt is not None:
        raise ConfigError(f"pbt={config.pbt!r}: {where}, where seeds train side by side but "
                          "population-based training (exploit and explore between members) "
                          "runs only in the compiled program; use a gymnax env, or a sweep "
                          "(one set of hyperparameters per seed) without pbt")
    if config.sync == "batch" and config.num_devices not in (None, "auto", 1):
        raise ConfigError(
            f"sync='batch' with num_devices={config.num_devices}: {where}, so its rollout is "
            "whole on this host already, and every device would run the same whole update; "
            "use sync='gradients' (the default) to split the update over the devices, or "
            "num_devices=1")


def _check_registered(gym, env_id: str) -> None:
    module, _, short = env_id.rpartition(":")
    if module:  # "module:Env-v0": gymnasium.make imports the module that registers it
        try:
            import_user_module(module)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"env='gymnasium:{env_id}': importing module {module!r} (which "
                              f"should register {short!r}) failed with {type(e).__name__}: "
                              f"{_one_line(e)}") from None
        env_id = short
    names = list(gym.envs.registry)
    if env_id in names:
        return
    if env_id.startswith("ALE/"):  # ale-py's ids: registered once ale_py is imported
        try:
            gym.register_envs(import_package("ale_py"))
        except ImportError:
            raise ConfigError(
                f"env='gymnasium:{env_id}': the ALE/ ids come from the ale-py package, which "
                "is not installed: pip install ale-py (or train envpool's Atari, "
                f"env='envpool:{env_id[4:]}', with CleanRL's preprocessing: "
                "pip install 'jaxppo[envpool]')") from None
        if env_id in gym.envs.registry:
            return
        names = list(gym.envs.registry)
    lowered = {n.lower(): n for n in names}
    close = ([lowered[env_id.lower()]] if env_id.lower() in lowered
             else difflib.get_close_matches(env_id, names, n=5, cutoff=0.5))
    hint = (f"; registered ids like it: {', '.join(close)}" if close else
            f"; registered: {', '.join(sorted(names)[:40])}{', ...' if len(names) > 40 else ''}")
    raise ConfigError(
        f"env='gymnasium:{env_id}' is not a registered gymnasium env{hint}. (A gymnasium env "
        "of your own: gymnasium.register(id=..., entry_point=...) before training; gymnax env "
        "names take no prefix)")


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]
