"""envpool's envs by name (`env="envpool:Breakout-v5"`, any task of `envpool.list_all_envs()`),
for the host-loop mode: envpool's C++ pool steps the envs outside the compiled program, as a
gymnasium vector env does (jaxppo.run.hostloop), with gymnax's contract kept.

* Auto-reset. envpool resets an env on the step after its episode ended (that step's action is
  ignored); `EnvpoolVectorEnv` takes that step at once, for the ended envs only, so the step
  that ends an episode returns the next episode's first observation and `info["final_obs"]`
  the true last one: gymnasium's SAME_STEP mode, every transition a real one.
* Atari (the tasks with every option of `ATARI_DEFAULTS`; ViZDoom's have only some) takes
  CleanRL's `ppo_atari_envpool.py` preprocessing (`ATARI_DEFAULTS`), each option overridable
  through env_kwargs. Learning sees
  clipped rewards and a termination at every life lost; `info["episode_reward"]` (envpool's
  unclipped reward) and `info["episode_end"]` (all lives lost, or the time limit) make the
  reported return the game score of whole games.
* Observations keep envpool's dtype (uint8 frames); channel-first frames ([C, H, W]: Atari's
  stacked frames, ViZDoom's) are given as [H, W, C], the layout of jaxppo's other image envs.
* Seeds. envpool takes its seeds when the pool is made: `reset(seed=[s_0, ...])` makes a pool
  whose env i is seeded with s_i (envpool's `env_seed`), so the same seeds replay the same envs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import subprocess
import sys
import threading
import warnings
from typing import Any

import numpy as np

from jaxppo.envs.gymnasium_env import flatten_observation
from jaxppo.envs.imports import import_package
from jaxppo.config_fields import did_you_mean
from jaxppo.errors import ConfigError, VideoError

PREFIX = "envpool:"
INSTALL = "pip install 'jaxppo[envpool]'"
# CleanRL's ppo_atari_envpool.py (envpool's own defaults for the frame, pinned here, plus the
# two options CleanRL turns on): 84x84 grey frames, 4 stacked, each step 4 emulator frames (max
# of the last two), up to 30 no-ops at a reset, fire at a reset where the game needs it, no
# sticky actions; a life lost ends the learning episode and rewards are clipped to their sign.
ATARI_DEFAULTS = {"img_height": 84, "img_width": 84, "gray_scale": True, "stack_num": 4,
                  "frame_skip": 4, "noop_max": 30, "use_fire_reset": True,
                  "repeat_action_probability": 0.0, "episodic_life": True, "reward_clip": True}
# env_kwargs jaxppo refuses, with what to set instead: the pool's size, mode and seeds are
# jaxppo's (the seeds derive from the reset seeds), and the time limit is envpool's own option.
_OWN_KWARGS = {"num_envs": "the config's num_envs", "batch_size": "the config's num_envs (a "
               "synchronous pool)", "seed": "the config's seed (the envs' seeds derive from it)",
               "env_seed": "the config's seed (the envs' seeds derive from it)",
               "env_type": "nothing (jaxppo uses envpool's gymnasium API)",
               "gym_reset_return_info": "nothing (jaxppo reads the reset's info)",
               "task": "the task in env (e.g. env='envpool:Pong-v5')",
               "max_steps_in_episode": "env_kwargs max_episode_steps (envpool's own time limit)"}


def is_envpool_env(env: Any) -> bool:
    """True for an env named "envpool:<task>"."""
    return isinstance(env, str) and env.startswith(PREFIX)


def import_envpool():
    """envpool; ConfigError naming the install when it is missing."""
    try:
        envpool = import_package("envpool")
    except ImportError as e:
        raise ConfigError(f"env='envpool:...' needs the envpool package ({type(e).__name__}: "
                          f"{e}): {INSTALL}") from None
    return envpool


@dataclasses.dataclass(frozen=True)
class EnvpoolParams:
    """The only env param jaxppo reads of an envpool task: its time limit in steps
    (envpool's max_episode_steps), the bound on an evaluation episode."""

    max_steps_in_episode: int


class EnvpoolEnv:
    """An envpool task (by id, with its make options), as jaxppo sees it: one env's spaces, its
    time limit, its actions, and `make_vec(n)`, the vector env the host loop steps. Box
    observations; Discrete or Box actions."""

    host_loop = True  # it steps in Python: jaxppo.run.hostloop runs it

    def __init__(self, task: str, kwargs: dict | None = None):
        envpool = import_envpool()
        self.id = self.name = task
        _check_task(envpool, task)
        given = dict(kwargs or {})
        _refuse_own_kwargs(task, given)
        try:
            defaults = envpool.make_spec(task).config
        except Exception as e:  # noqa: BLE001 - what the task needs (Procgen: Qt 5): one error
            raise ConfigError(
                f"env='envpool:{task}': envpool cannot make this task on this machine: "
                f"envpool.make_spec({task!r}) raised {type(e).__name__}: {_one_line(e)}"
            ) from None
        self.atari = is_atari_spec(defaults)
        self.kwargs = {**(ATARI_DEFAULTS if self.atari else {}), **given}
        spec = _make_spec(envpool, task, defaults, given, self.kwargs)
        with _quiet_space_casts():
            observation_space = spec.gymnasium_observation_space
            self.act_space = spec.gymnasium_action_space
        # A Dict (DeepMind Control's {"position": ..., "velocity": ...}, MiniGrid's) or
        # another space not a Box: one float32 vector, as gymnasium flattens it.
        self.flattened = None if _is_box(observation_space) else observation_space
        if self.flattened is None:
            self.obs_space, self.channels_first = _presented_obs_space(observation_space)
        else:
            self.obs_space = _flat_space(observation_space, f"env='envpool:{task}'")
            self.channels_first = False
        self.max_episode_steps = int(spec.config.max_episode_steps)
        self._check_spaces()

    def _check_spaces(self) -> None:
        import gymnasium

        spaces = gymnasium.spaces
        where = f"env='envpool:{self.id}'"
        if not isinstance(self.obs_space, spaces.Box):
            raise ConfigError(f"{where} has observation space {_short(self.obs_space)}; jaxppo "
                              "takes envpool tasks with Box observations (an array per step)")
        if isinstance(self.act_space, spaces.Discrete):
            return
        if isinstance(self.act_space, spaces.Box) and len(self.act_space.shape) == 1:
            return
        raise ConfigError(f"{where} has action space {_short(self.act_space)}; jaxppo supports "
                          "Discrete actions and Box actions of one vector")

    @property
    def params(self) -> EnvpoolParams:
        return EnvpoolParams(self.max_episode_steps)

    # The gymnax-style accessors the rest of jaxppo reads spaces through.
    def observation_space(self, params=None):
        return self.obs_space

    def action_space(self, params=None):
        return self.act_space

    def make_vec(self, num_envs: int, render: bool = False) -> "EnvpoolVectorEnv":
        """A vector env of `num_envs` copies in SAME_STEP autoreset mode (its pool is made at
        the first reset, with that reset's seeds); with `render`, its `render()` draws them
        (VideoError first where the task cannot draw here: `check_renders`)."""
        if render:
            check_renders(self.id, self.kwargs)
        return EnvpoolVectorEnv(self.id, self.kwargs, num_envs, self.channels_first, render,
                                self.flattened)

    def policy_obs(self, obs) -> np.ndarray:
        """One observation of the task as the policy takes it: frames channel-last, any space
        not a Box flattened into one float32 vector (gymnasium.spaces.flatten's)."""
        if self.flattened is not None:
            return flatten_observation(self.flattened, obs)
        return np.moveaxis(np.asarray(obs), 0, -1) if self.channels_first else np.asarray(obs)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Policy actions [E, ...] (already clipped to the bounds) as envpool takes them:
        Discrete ones as int32 (shifted by the space's start), Box ones in the space's dtype."""
        space = self.act_space
        if hasattr(space, "n"):
            return (np.asarray(actions, np.int64) + int(space.start)).astype(np.int32)
        return np.asarray(actions, space.dtype).reshape((-1,) + tuple(space.shape))

    def __repr__(self):
        return f"EnvpoolEnv({self.id!r})"


class EnvpoolVectorEnv:
    """`num_envs` envs of one envpool task behind gymnasium's vector-env API in SAME_STEP
    autoreset mode (the interface jaxppo.run.hostloop steps):

    * `reset(seed=[s_0, ...]) -> (obs [E, ...], info)`: a new pool, env i seeded with s_i
      (an int s: s + i; no seed: the pool's envs restart where their random streams are);
    * `step(actions) -> (obs, reward, terminated, truncated, info)`, arrays [E, ...] in env
      order; where an episode ended, obs[i] already starts the next one and
      `info["final_obs"][i]` is the episode's last observation (elsewhere it equals obs[i]);
      an Atari life lost is such an end, after which the game goes on;
    * `info["episode_reward"]` float32 [E] and `info["episode_end"]` bool [E] (Atari): the
      unclipped reward and the end of the whole game (all lives lost, or the time limit),
      which the reported episode return and length count instead of the learning reward
      and ends; and envpool's own per-env info arrays (Atari's `lives`, ...).
    """

    def __init__(self, task: str, kwargs: dict, num_envs: int, channels_first: bool,
                 render: bool = False, flattened=None):
        self.task, self.kwargs, self.num_envs = task, dict(kwargs), int(num_envs)
        self.channels_first, self.flattened = channels_first, flattened
        self.render_mode = "rgb_array" if render else None
        self.pool = None

    def _make_pool(self, seeds: list[int]):
        envpool = import_envpool()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        with _quiet_space_casts():
            self.pool = envpool.make(
                self.task, env_type="gymnasium", num_envs=self.num_envs,
                batch_size=self.num_envs, seed=int(seeds[0]), env_seed=[int(s) for s in seeds],
                **self.kwargs, **({"render_mode": self.render_mode} if self.render_mode else {}))
            self.pool.observation_space, self.pool.action_space  # noqa: B018 - built once, here

    def render(self) -> np.ndarray:
        """Every env's picture [E, H, W, 3] (uint8 RGB; Atari's full 210x160 colour screen),
        for a vector env made with `render=True`."""
        if self.render_mode is None or self.pool is None:
            raise RuntimeError("render() needs a vector env made with render=True, reset first")
        return np.asarray(self.pool.render(env_ids=list(range(self.num_envs))))

    def reset(self, *, seed: int | list[int] | None = None, options=None):
        """Every env's first observation [E, ...] and envpool's info (in env order)."""
        if options:
            raise ValueError(f"EnvpoolVectorEnv.reset takes no options, got {options!r}")
        if seed is not None or self.pool is None:
            self._make_pool(_env_seeds(seed, self.num_envs))
        obs, info = self.pool.reset()
        order = _order(info, self.num_envs)
        return self._obs(obs, order), _per_env(info, order, self.num_envs)

    def step(self, actions):
        """One step of every env (SAME_STEP auto-reset; see the class)."""
        obs, reward, terminated, truncated, info = self.pool.step(np.asarray(actions))
        order = _order(info, self.num_envs)
        obs = self._obs(obs, order)
        reward = np.asarray(reward, np.float32)[order]
        terminated = np.asarray(terminated, bool)[order]
        truncated = np.asarray(truncated, bool)[order]
        info = _per_env(info, order, self.num_envs)
        ended = terminated | truncated
        info["final_obs"] = obs.copy()
        if ended.any():
            # envpool resets an ended env on its next step, ignoring that step's action: take
            # that step now, for the ended envs only. (Its explicit reset(env_id) would restart
            # an Atari game where a life lost only ends the learning episode.)
            ids = np.flatnonzero(ended).astype(np.int32)
            actions = np.asarray(actions)
            reset_obs, *_, reset_info = self.pool.step(actions[ids], ids)
            obs[np.asarray(reset_info["env_id"])] = self._obs(reset_obs)
        if "terminated" in info and "reward" in info:  # Atari: the game's own score and end
            info["episode_reward"] = np.asarray(info["reward"], np.float32)
            info["episode_end"] = np.asarray(info["terminated"], bool) | truncated
        return obs, reward, terminated, truncated, info

    def _obs(self, obs, order: np.ndarray | None = None) -> np.ndarray:
        """envpool's observations [N, ...] (in `order`) as an array of jaxppo's own: frames
        channel-last, a space not a Box flattened into float32 vectors [N, D], C-contiguous,
        not a view of envpool's buffers."""
        if self.flattened is not None:
            obs = _flatten_batch(self.flattened, obs)
            return obs[order] if order is not None else obs
        obs = np.asarray(obs)
        obs = obs[order] if order is not None else obs.copy()
        if not self.channels_first:
            return obs
        out = np.empty(obs.shape[:1] + obs.shape[2:] + obs.shape[1:2], obs.dtype)
        for c in range(obs.shape[1]):  # plane by plane: 3-4x numpy's transposing copy
            out[..., c] = obs[:, c]
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __repr__(self):
        return f"EnvpoolVectorEnv({self.task!r}, num_envs={self.num_envs})"


def check_renders(task: str, kwargs: dict) -> None:
    """VideoError when the task cannot draw a picture here. A MuJoCo task's renderer needs an
    OpenGL context, and where none can be made (a machine without a display) it ends the
    process; so it draws its first picture in a process of its own first."""
    from envpool.registration import registry

    if not str(registry.specs.get(task, ("",))[0]).startswith("envpool.mujoco"):
        return
    code = ("import envpool, json, sys\n"
            "e = envpool.make(sys.argv[1], env_type='gymnasium', num_envs=1, batch_size=1, "
            "render_mode='rgb_array', **json.loads(sys.argv[2]))\n"
            "e.reset()\ne.render(env_ids=[0])\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, task, json.dumps(kwargs)],
                              capture_output=True, text=True, timeout=300)
        said = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines()
                if ln.strip() and "WARN" not in ln]
        failed = proc.returncode != 0
    except (subprocess.TimeoutExpired, OSError, TypeError) as e:
        said, failed = [f"{type(e).__name__}: {e}"], True
    if failed:
        raise VideoError(
            f"no video for envpool:{task}: its MuJoCo renderer could not draw a picture on this "
            f"machine ({(said or ['no message'])[-1][:200]}); it needs an OpenGL context, which "
            "a machine without a display or a GPU's EGL does not give. Evaluate without a "
            "video, or make the video on a machine with a display")


def make_envpool_env(config) -> tuple[EnvpoolEnv, EnvpoolParams]:
    """(env, params: its time limit) for config.env = "envpool:<task>".

    Raises:
      ConfigError: env_params given, envpool missing, an unknown task, options envpool
        refuses, or spaces the host loop cannot run.
    """
    if config.env_params is not None:
        raise ConfigError("env_params is for gymnax envs; an envpool task takes its options as "
                          "env_kwargs (passed to envpool.make, e.g. {'episodic_life': False})")
    env = EnvpoolEnv(config.env[len(PREFIX):], config.env_kwargs)
    return env, env.params


def is_atari_spec(config) -> bool:
    """True for the config of an envpool task (`envpool.make_spec(task).config`) that is an
    Atari game: it has every option of `ATARI_DEFAULTS` (ViZDoom's tasks have episodic_life,
    frame_skip and the frame's size, but no noop_max, reward_clip or gray_scale)."""
    return set(ATARI_DEFAULTS) <= set(config._fields)


def is_atari_task(task: str) -> bool:
    """True when envpool (installed) has `task` and it is an Atari game (`is_atari_spec`)."""
    envpool = import_envpool()
    if task not in envpool.list_all_envs():
        return False
    try:
        return is_atari_spec(envpool.make_spec(task).config)
    except Exception:  # noqa: BLE001 - a task envpool cannot describe here (Procgen without Qt)
        return False


def registered_envpool_envs() -> list[str]:
    """envpool's task ids (`envpool.list_all_envs()`)."""
    return list(import_envpool().list_all_envs())


# ------------------------------------------------------------------------------ helpers
def _check_task(envpool, task: str) -> None:
    names = list(envpool.list_all_envs())
    if task in names:
        return
    lowered = {n.lower(): n for n in names}
    close = ([lowered[task.lower()]] if task.lower() in lowered
             else difflib.get_close_matches(task, names, n=5, cutoff=0.6))
    hint = f"; did you mean {' or '.join(repr(PREFIX + c) for c in close)}?" if close else "."
    raise ConfigError(
        f"env='envpool:{task}': {task!r} is not an envpool task{hint} envpool.list_all_envs() "
        f"lists its {len(names)} tasks (Atari: 'envpool:Breakout-v5', 'envpool:Pong-v5', ...; "
        "classic control: 'envpool:CartPole-v1', ...)")


def _refuse_own_kwargs(task: str, kwargs: dict) -> None:
    own = sorted(k for k in kwargs if k in _OWN_KWARGS)
    if own:
        raise ConfigError(
            f"env='envpool:{task}': env_kwargs {own} cannot be given; "
            + "; ".join(f"instead of {k}, set {_OWN_KWARGS[k]}" for k in own))


_WARNINGS_LOCK = threading.Lock()  # catch_warnings swaps the process's filters: one at a time


@contextlib.contextmanager
def _quiet_space_casts():
    """Within it, no warning of gymnasium's that a Box's bounds were cast: envpool gives its
    float32 spaces float64 bounds (CartPole's), and the warning says nothing about the run.
    (A pool builds its spaces once, on first use: `_make_pool` uses them within.)"""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*Box (low|high)'s precision lowered")
        yield


def _make_spec(envpool, task: str, defaults, given: dict, kwargs: dict):
    """envpool's spec of the task with options `kwargs` (jaxppo's defaults, then the config's
    `given` env_kwargs, checked against the task's `defaults` config); ConfigError naming a
    bad option."""
    ours = {k: v for k, v in kwargs.items() if k not in given}  # jaxppo's defaults
    options = {k: ours.get(k, getattr(defaults, k)) for k in defaults._fields
               if k not in _OWN_KWARGS and k not in ("base_path", "max_num_players")}
    where = f"env='envpool:{task}'"
    for key, value in given.items():
        if key not in options:
            raise ConfigError(
                f"{where}: env_kwargs {key!r} is not an option of the task"
                f"{did_you_mean(key, list(options))}; its options (env_kwargs go to "
                f"envpool.make), as jaxppo sets them: "
                + ", ".join(f"{k}={v!r}" for k, v in options.items()))
        default = getattr(defaults, key)
        if not _same_kind(value, default):
            kind = {"bool": "a bool", "int": "an integer", "float": "a number",
                    "str": "a string"}.get(type(default).__name__, f"a {type(default).__name__}")
            raise ConfigError(f"{where}: env_kwargs {key}={value!r} must be {kind}, like its "
                              f"default {options[key]!r}")
    try:
        return envpool.make_spec(task, **kwargs)
    except Exception as e:  # noqa: BLE001 - a value envpool refuses: one clear error
        raise ConfigError(
            f"{where}: envpool.make_spec({task!r}"
            + "".join(f", {k}={v!r}" for k, v in kwargs.items())
            + f") raised {type(e).__name__}: {_one_line(e)} (env_kwargs go to envpool.make)"
        ) from None


def _same_kind(value, default) -> bool:
    """A value of the kind of an option's default: a bool for a bool, an integer for an int,
    a number for a float, a string for a string, a list for a list."""
    if isinstance(default, bool):
        return isinstance(value, (bool, np.bool_))
    if isinstance(default, int):
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    return isinstance(value, type(default))


def _is_box(space) -> bool:
    import gymnasium

    return isinstance(space, gymnasium.spaces.Box)


def _flat_space(space, where: str):
    """The float32 vector the policy sees of a space that is not a Box (a Dict of Box,
    Discrete, MultiBinary and MultiDiscrete parts, or one of those), unbounded: envpool's Box
    bounds are not always the observations' (DeepMind Control's low is the smallest positive
    double)."""
    import gymnasium

    spaces = gymnasium.spaces
    leaves = list(space.spaces.values()) if isinstance(space, spaces.Dict) else [space]
    kinds = (spaces.Box, spaces.Discrete, spaces.MultiBinary, spaces.MultiDiscrete)
    if not leaves or not all(isinstance(leaf, kinds) for leaf in leaves):
        raise ConfigError(f"{where} has observation space {_short(space)}; jaxppo takes "
                          "envpool tasks whose observations are a Box, or a Dict of Box, "
                          "Discrete, MultiBinary and MultiDiscrete parts (made one vector)")
    return spaces.Box(-np.inf, np.inf, (spaces.flatdim(space),), np.float32)


def _flatten_batch(space, obs) -> np.ndarray:
    """Observations of N envs (arrays [N, ...], a dict of them for a Dict space) as float32
    [N, D]: each env's row is `gymnasium.spaces.flatten(space, its observation)` (a Discrete
    one-hot, a MultiDiscrete one-hot per part, a Dict's parts in the space's key order)."""
    import gymnasium

    spaces = gymnasium.spaces
    if isinstance(space, spaces.Dict):
        return np.concatenate([_flatten_batch(part, obs[k]) for k, part in space.spaces.items()],
                              axis=1)
    x = np.asarray(obs)
    n = len(x)
    if isinstance(space, spaces.Discrete):
        return np.eye(int(space.n), dtype=np.float32)[x.reshape(n) - int(space.start)]
    if isinstance(space, spaces.MultiDiscrete):
        parts = (x - space.start).reshape(n, -1)
        return np.concatenate([np.eye(int(k), dtype=np.float32)[parts[:, i]]
                               for i, k in enumerate(np.asarray(space.nvec).reshape(-1))], axis=1)
    return x.reshape(n, -1).astype(np.float32)  # a Box, a MultiBinary


def _presented_obs_space(space):
    """(the observation space as jaxppo sees it, whether frames are moved from [C, H, W]):
    a 3-D Box whose first axis is its smallest (envpool's channel-first frames) becomes
    [H, W, C]."""
    import gymnasium

    shape = getattr(space, "shape", None)
    if (not isinstance(space, gymnasium.spaces.Box) or shape is None or len(shape) != 3
            or shape[0] >= min(shape[1], shape[2])):
        return space, False
    low, high = (np.moveaxis(np.asarray(b), 0, -1) for b in (space.low, space.high))
    return gymnasium.spaces.Box(low, high, low.shape, space.dtype), True


def _env_seeds(seed, n: int) -> list[int]:
    """Each env's seed: seeds[i] of a list, seed + i of an int, fresh entropy for None (as a
    gymnasium vector env seeds its envs), each taken mod 2**31 (envpool's seeds are int32)."""
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1)[0])
    seeds = [int(seed) + i for i in range(n)] if np.ndim(seed) == 0 else [int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"reset(seed=...) got {len(seeds)} seeds for {n} envs")
    return [s % 2**31 for s in seeds]


def _order(info: dict, n: int) -> np.ndarray:
    """The permutation that puts a batch of n envs' results in env order (envpool gives each
    result's env_id)."""
    ids = np.asarray(info["env_id"])
    if ids.shape != (n,):
        raise RuntimeError(f"envpool returned {ids.shape} results for {n} envs")
    return np.argsort(ids, kind="stable")


def _per_env(info: dict, order: np.ndarray, n: int) -> dict:
    """envpool's info arrays with one row per env, in env order (nested dicts dropped)."""
    out = {}
    for k, v in info.items():
        if isinstance(v, dict):
            continue
        v = np.asarray(v)
        if v.ndim >= 1 and v.shape[0] == n:
            out[k] = v[order]
    return out


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 160 else text[:157] + "..."


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]
