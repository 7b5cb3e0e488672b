"""Gymnasium spaces beyond Box observations and Discrete or Box actions, in the host loop: a
Dict of a Discrete and a MultiBinary observed as one float32 vector (gymnasium's flattening,
checked by hand), a MultiDiscrete action space acted in as one Discrete over its
combinations (the vectors the env receives checked by hand), training, evaluation and the
errors for spaces jaxppo cannot take."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.gymnasium_env import GymnasiumEnv
from jaxppo.errors import ConfigError

CELLS = 5  # Pick's cells: it ends when the walker stands on the last one holding the flag up


class Pick(gymnasium.Env):
    """A walker on CELLS cells. Observation {"cell": Discrete(CELLS), "flags": MultiBinary(2)}
    (flag 0: the flag it holds up; flag 1: it has stood on the last cell); action
    MultiDiscrete([3, 2], start=[-1, 0]): a step of -1, 0 or +1 and the flag down or up.
    Reward 1 and the end on the last cell with the flag up. Every action it receives is kept
    in `received`. `kind` makes the spaces jaxppo refuses."""

    received: list = []

    def __init__(self, kind: str = "pick"):
        self.observation_space = gymnasium.spaces.Dict(
            cell=gymnasium.spaces.Discrete(CELLS), flags=gymnasium.spaces.MultiBinary(2))
        self.action_space = gymnasium.spaces.MultiDiscrete([3, 2], start=[-1, 0])
        if kind == "big":  # 8,192 combinations
            self.action_space = gymnasium.spaces.MultiDiscrete([64, 64, 2])
        if kind == "sequence":
            self.observation_space = gymnasium.spaces.Sequence(gymnasium.spaces.Discrete(3))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cell, self.flags = 0, np.zeros(2, np.int8)
        return self._obs(), {}

    def step(self, action):
        Pick.received.append(np.asarray(action).tolist())
        step, flag = int(action[0]), int(action[1])
        self.cell = min(max(self.cell + step, 0), CELLS - 1)
        self.flags = np.array([flag, self.flags[1] or self.cell == CELLS - 1], np.int8)
        done = self.cell == CELLS - 1 and flag == 1
        return self._obs(), float(done), done, False, {}

    def _obs(self):
        return {"cell": self.cell, "flags": self.flags.copy()}


if "JaxppoPick-v0" not in gymnasium.envs.registry:
    gymnasium.register(id="JaxppoPick-v0", entry_point=Pick, max_episode_steps=12)

PICK = jaxppo.PPOConfig(env="gymnasium:JaxppoPick-v0", num_envs=2, num_steps=12, num_epochs=2,
                        num_minibatches=2, total_timesteps=2 * 12 * 3, compilation_cache_dir=None,
                        network=jaxppo.NetworkConfig(hidden_sizes=(16,)))


def _by_hand(cell: int, flags) -> list[float]:
    """The flattened observation: the cell one-hot, then the flags (a Dict's keys in order)."""
    return [float(c == cell) for c in range(CELLS)] + [float(f) for f in flags]


def test_spaces_as_the_policy_sees_them_and_the_actions_the_env_receives():
    env = GymnasiumEnv("JaxppoPick-v0")
    assert env.obs_space == gymnasium.spaces.Box(0.0, 1.0, (CELLS + 2,), np.float32)
    assert env.act_space == gymnasium.spaces.Discrete(6)
    # Index i is np.unravel_index(i, (3, 2)), each part shifted by its start.
    np.testing.assert_array_equal(env.env_actions(np.array([0, 1, 2, 3, 5])),
                                  [[-1, 0], [-1, 1], [0, 0], [0, 1], [1, 1]])
    envs = env.make_vec(2)
    try:
        obs, _ = envs.reset(seed=[0, 1])
        assert obs.dtype == np.float32
        np.testing.assert_array_equal(obs, [_by_hand(0, [0, 0])] * 2)
        Pick.received.clear()
        obs, *_ = envs.step(env.env_actions(np.array([4, 5])))  # [+1, down] and [+1, up]
        assert Pick.received == [[1, 0], [1, 1]]
        np.testing.assert_array_equal(obs, [_by_hand(1, [0, 0]), _by_hand(1, [1, 0])])
    finally:
        envs.close()


def test_trains_evaluates_and_acts_through_the_actor_learner_too(tmp_path):
    Pick.received.clear()
    result = jaxppo.train(PICK, run_dir=tmp_path / "run", progress=False, plot=False)
    assert np.isfinite(result.metrics["policy_loss"]).all()
    acted = np.array(Pick.received)
    assert acted.shape == (2 * 12 * 3, 2) and set(acted[:, 0]) <= {-1, 0, 1}
    assert set(acted[:, 1]) <= {0, 1} and len({tuple(a) for a in acted}) > 3
    policy = jaxppo.load_policy(tmp_path / "run")
    assert policy.evaluate(episodes=2)["return_mean"] >= 0.0
    # One observation of the env in, the action env.step takes out, through policy.env.
    env = policy.env
    obs = env.policy_obs({"cell": 2, "flags": np.array([1, 0], np.int8)})
    np.testing.assert_array_equal(obs, _by_hand(2, [1, 0]))
    action = env.env_actions(np.asarray(policy(obs))[None])
    assert action.shape == (1, 2) and env.env_obs_space["cell"].contains(2)
    assert int(action[0, 0]) in (-1, 0, 1) and int(action[0, 1]) in (0, 1)
    lagged = jaxppo.train(PICK.replace(max_policy_lag=1), progress=False, plot=False)
    assert np.isfinite(lagged.metrics["policy_loss"]).all()


def test_a_space_jaxppo_cannot_take_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"8192 combinations; jaxppo acts in a MultiDiscrete "
                                          r"or MultiBinary space as one Discrete action over its "
                                          r"combinations, up to 4096"):
        jaxppo.resolve(PICK.replace(env_kwargs={"kind": "big"}))
    with pytest.raises(ConfigError, match=r"observation space Sequence\(Discrete\(3\).*gymnasium "
                                          r"cannot flatten into one vector"):
        jaxppo.resolve(PICK.replace(env_kwargs={"kind": "sequence"}))
