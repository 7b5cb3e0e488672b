"""The env wrappers of jaxppo.envs.transforms for envs that step in Python (gymnasium envs,
envpool tasks): the same transform applied in numpy to the host vector env's outputs, with
the semantics of the gymnax wrapper on the compiled path.

`FrameStack` -> `HostFrameStackEnv` (its vector env keeps each env's last k frames) and
`DiscretizeActions` -> `HostDiscreteActionEnv` (discrete action indices to Box actions). A
wrapped env is what the rest of jaxppo sees of a host env (spaces, `make_vec(n)`,
`env_actions`) and the wrapped env's attributes otherwise (time limit, name). What a wrapper
keeps (the frames) lives in the vector env, like the env's own state: a resumed run restarts
its envs, and with them the stacks.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def stack_layout(frames: np.ndarray) -> np.ndarray:
    """Frames [n, k, *obs_shape] as n stacked observations, as `FrameStackEnv` lays them out:
    on a new last axis [n, *obs_shape, k], except images [H, W, C], whose channels are
    concatenated oldest first [n, H, W, k*C]."""
    if frames.ndim == 5:  # images [n, k, H, W, C] -> [n, H, W, k*C]
        n, k, h, w, c = frames.shape
        return np.transpose(frames, (0, 2, 3, 1, 4)).reshape(n, h, w, k * c)
    return np.moveaxis(frames, 1, -1)


class _Wrapped:
    """A host env seen through a wrapper: everything not overridden is the wrapped env's."""

    host_loop = True

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def observation_space(self, params=None):
        return self._env.observation_space(params)

    def action_space(self, params=None):
        return self._env.action_space(params)

    def make_vec(self, num_envs: int, render: bool = False):
        return self._env.make_vec(num_envs, render)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        return self._env.env_actions(actions)


class HostFrameStackEnv(_Wrapped):
    """A host env whose observations are the last k of the wrapped env's (`FrameStack`)."""

    def __init__(self, env, k: int):
        super().__init__(env)
        self.k = k

    def observation_space(self, params=None):
        import gymnasium

        inner = self._env.observation_space(params)
        stacked = lambda b: stack_layout(  # noqa: E731
            np.repeat(np.broadcast_to(np.asarray(b, inner.dtype), inner.shape)[None, None],
                      self.k, axis=1))[0]
        return gymnasium.spaces.Box(stacked(inner.low), stacked(inner.high), dtype=inner.dtype)

    def make_vec(self, num_envs: int, render: bool = False) -> "FrameStackVectorEnv":
        inner = self._env.observation_space(None)
        return FrameStackVectorEnv(self._env.make_vec(num_envs, render), self.k,
                                   tuple(inner.shape), inner.dtype)

    def __repr__(self):
        return f"HostFrameStackEnv({self._env!r}, k={self.k})"


class FrameStackVectorEnv:
    """A SAME_STEP vector env whose observations are each env's last k: at an episode's start
    every slot holds its first observation, and info["final_obs"] of an env whose episode
    ended is the stack ending in its pre-reset observation (as `FrameStackEnv` keeps them)."""

    def __init__(self, envs, k: int, obs_shape: tuple[int, ...], dtype):
        self.envs = envs
        self.k = k
        self.obs_shape = obs_shape
        self.dtype = np.dtype(dtype)
        self.num_envs = envs.num_envs
        self.metadata = getattr(envs, "metadata", {})
        self.frames: np.ndarray | None = None  # [n, k, *obs_shape], oldest first

    def _obs(self, obs) -> np.ndarray:
        return np.asarray(obs, self.dtype).reshape((self.num_envs,) + self.obs_shape)

    def reset(self, *, seed=None, options=None):
        obs, info = self.envs.reset(seed=seed, options=options)
        self.frames = np.repeat(self._obs(obs)[:, None], self.k, axis=1)
        return stack_layout(self.frames), info

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.envs.step(actions)
        obs = self._obs(obs)
        done = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        shifted = np.concatenate([self.frames[:, 1:], obs[:, None]], axis=1)
        if done.any():
            final = np.array(shifted)
            for i in np.flatnonzero(done):
                final[i, -1] = np.asarray(info["final_obs"][i], self.dtype).reshape(self.obs_shape)
            final_obs = np.empty(self.num_envs, object)
            final_obs[:] = list(stack_layout(final))
            info = {**info, "final_obs": final_obs}
            shifted[done] = np.repeat(obs[done][:, None], self.k, axis=1)
        self.frames = shifted
        return stack_layout(shifted), reward, terminated, truncated, info

    def render(self):
        """The wrapped vector env's pictures (what the env shows, not the stack)."""
        return self.envs.render()

    def close(self) -> None:
        self.envs.close()


class HostDiscreteActionEnv(_Wrapped):
    """A host env with a Box action space seen through Discrete(bins**D) actions
    (`DiscretizeActions`): action index i has base-`bins` digits, the first dimension's most
    significant, digit j of dimension d meaning low[d] + j * (high[d] - low[d]) / (bins - 1)."""

    def __init__(self, env, bins: int, compiled: Any):
        """`compiled`: the compiled path's `DiscreteActionEnv` of `env` (its bounds, checked,
        and its JAX action table)."""
        super().__init__(env)
        self.bins = bins
        self._compiled = compiled
        self.shape, self.dim, self.low, self.high = compiled._box(None)

    def action_space(self, params=None):
        import gymnasium

        return gymnasium.spaces.Discrete(self.bins ** self.dim)

    def continuous_action(self, index, params=None):
        """The Box action of a discrete action index, in JAX (what an exported policy's
        action table lists): `DiscreteActionEnv.continuous_action`."""
        return self._compiled.continuous_action(index, params)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Discrete action indices [E] as the wrapped env's Box actions [E, *shape]."""
        index = np.asarray(actions, np.int64).reshape(-1)
        powers = self.bins ** np.arange(self.dim - 1, -1, -1)
        digits = ((index[:, None] // powers) % self.bins).astype(np.float32)
        values = self.low + digits * ((self.high - self.low) / (self.bins - 1))  # float32
        return self._env.env_actions(values.reshape((-1,) + self.shape))

    def __repr__(self):
        return f"HostDiscreteActionEnv({self._env!r}, bins={self.bins})"
