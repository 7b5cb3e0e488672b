"""Legal actions carried in a gymnasium env's observation: a Dict observation with an
"action_mask" entry (PettingZoo's classic games, RLlib's action-masking examples). The mask
moves to info["action_mask"], where jaxppo reads a gymnasium env's legal actions, and the
policy sees the rest of the observation. A wrapper of each env of the vector env (a
module-level class, so an async vector env's subprocesses unpickle it); imported only for a
gymnasium env.
"""

from __future__ import annotations

import gymnasium
import numpy as np

MASK_KEY = "action_mask"


def carries_mask(obs_space, act_space) -> bool:
    """True for a Dict observation space with an "action_mask" entry of one value per action
    of a Discrete action space, and at least one other entry."""
    spaces = gymnasium.spaces
    if not (isinstance(obs_space, spaces.Dict) and isinstance(act_space, spaces.Discrete)):
        return False
    mask = obs_space.spaces.get(MASK_KEY)
    return (mask is not None and len(obs_space.spaces) > 1
            and tuple(mask.shape or ()) == (int(act_space.n),))


def space_without_mask(space):
    """The observation space without its mask: the one other entry itself, else a Dict of the
    others (which jaxppo flattens)."""
    rest = {k: v for k, v in space.spaces.items() if k != MASK_KEY}
    return next(iter(rest.values())) if len(rest) == 1 else gymnasium.spaces.Dict(rest)


def obs_without_mask(obs):
    """One observation (a dict) without its mask, as `space_without_mask` describes it."""
    rest = {k: v for k, v in obs.items() if k != MASK_KEY}
    return next(iter(rest.values())) if len(rest) == 1 else rest


class MaskFromObservation(gymnasium.Wrapper):
    """`env` whose observation's "action_mask" entry is its info["action_mask"] instead (of
    reset and of step), and whose observation is the rest."""

    def __init__(self, env):
        super().__init__(env)
        self.observation_space = space_without_mask(env.observation_space)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs_without_mask(obs), _with_mask(info, obs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs_without_mask(obs), reward, terminated, truncated, _with_mask(info, obs)


def _with_mask(info: dict, obs) -> dict:
    return {**info, MASK_KEY: np.asarray(obs[MASK_KEY])}
