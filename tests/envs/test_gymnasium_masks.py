"""Action masks of gymnasium envs (info["action_mask"] of reset and step, as Taxi's): the
host loop acts among the legal actions of each observation, records them for the update, and
evaluation, the actor-learner and several seeds do the same; checked against the legal sets
a tiny registered env computes by hand."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

import jaxppo
from jaxppo.core.hyperparams import HyperParams
from jaxppo.errors import ConfigError
from jaxppo.run.hostloop import HostLoopRunner

ACTIONS = 4


def legal(x: int) -> np.ndarray:
    """Ladder's legal actions at rung x, by hand: 0 (down) above the bottom, 1 (up) below the
    top, 2 (stay) always, 3 (jump to the top) only on even rungs."""
    return np.array([x > 0, x < 5, True, x % 2 == 0], bool)


class Ladder(gymnasium.Env):
    """Rungs 0..5; observation [x]; reward 1 at the top, which ends the episode. An illegal
    action is counted in `illegal` (and does nothing). Gives its legal actions as
    info["action_mask"] (int8, as Taxi), or none with masked=False."""

    observation_space = gymnasium.spaces.Box(0.0, 5.0, (1,), np.float32)
    action_space = gymnasium.spaces.Discrete(ACTIONS)
    illegal = [0]
    steps = [0]

    def __init__(self, masked: bool = True):
        self.masked = masked

    def _out(self):
        info = {"action_mask": legal(self.x).astype(np.int8)} if self.masked else {}
        return np.array([self.x], np.float32), info

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = int(self.np_random.integers(0, 5))
        return self._out()

    def step(self, action):
        Ladder.steps[0] += 1
        if not legal(self.x)[int(action)]:
            Ladder.illegal[0] += 1
        else:
            self.x = {0: self.x - 1, 1: self.x + 1, 2: self.x, 3: 5}[int(action)]
        obs, info = self._out()
        return obs, float(self.x == 5), self.x == 5, False, info


class MethodLadder(Ladder):
    """Ladder giving its legal actions as `action_masks()` (SB3-contrib's MaskablePPO
    convention) instead of in its info."""

    def __init__(self):
        super().__init__(masked=False)

    def action_masks(self):
        return legal(self.x)


class DictLadder(Ladder):
    """Ladder giving its legal actions in its observation, {"observation": [x], "action_mask":
    legal} (PettingZoo's and RLlib's convention), instead of in its info."""

    observation_space = gymnasium.spaces.Dict({
        "observation": Ladder.observation_space,
        "action_mask": gymnasium.spaces.MultiBinary(ACTIONS)})

    def __init__(self):
        super().__init__(masked=False)

    def _out(self):
        obs, info = super()._out()
        return {"observation": obs, "action_mask": legal(self.x).astype(np.int8)}, info


if "JaxppoLadder-v0" not in gymnasium.envs.registry:
    gymnasium.register(id="JaxppoLadder-v0", entry_point=Ladder, max_episode_steps=8)
    gymnasium.register(id="JaxppoMethodLadder-v0", entry_point=MethodLadder, max_episode_steps=8)
    gymnasium.register(id="JaxppoDictLadder-v0", entry_point=DictLadder, max_episode_steps=8)

LADDER = jaxppo.PPOConfig(env="gymnasium:JaxppoLadder-v0", num_envs=3, num_steps=16,
                          num_epochs=1, num_minibatches=2, total_timesteps=3 * 16 * 3,
                          compilation_cache_dir=None, entropy_coeff=0.1,
                          network=jaxppo.NetworkConfig(hidden_sizes=(16,)))


@pytest.mark.parametrize("env", ["JaxppoLadder-v0", "JaxppoMethodLadder-v0",
                                 "JaxppoDictLadder-v0"], ids=["info", "action_masks", "obs"])
def test_the_rollout_acts_among_the_legal_actions_and_records_them(env):
    """Every action is legal for the observation it was taken in, and the recorded mask of
    each step is the hand-computed legal set of its observation (resets included), from the
    env's info, its action_masks() or its observation's "action_mask" (which the policy does
    not see: its observation is [x])."""
    run = jaxppo.resolve(LADDER.replace(env=f"gymnasium:{env}"))
    assert run.spec.masked and run.spec.obs_shape == (1,)
    runner = HostLoopRunner(run, HyperParams.from_config(run.config))
    try:
        Ladder.illegal[0] = 0
        for _ in range(3):
            metrics, traj = runner.iterate()
            obs = np.asarray(traj.obs)[..., 0].astype(int)  # [T, E]
            np.testing.assert_array_equal(np.asarray(traj.action_mask), legal_of(obs))
            taken = np.take_along_axis(legal_of(obs), np.asarray(traj.action)[..., None], -1)
            assert taken.all()
            assert np.isfinite(metrics["policy_loss"]) and metrics["masked_out_states"] == 0
        assert Ladder.illegal[0] == 0
    finally:
        runner.close()


def legal_of(x: np.ndarray) -> np.ndarray:
    return np.stack([legal(int(v)) for v in x.ravel()]).reshape(x.shape + (ACTIONS,))


def test_evaluation_seeds_and_the_actor_learner_act_legally_too(tmp_path):
    Ladder.illegal[0], Ladder.steps[0] = 0, 0
    result = jaxppo.train(LADDER.replace(num_seeds=2, eval_every=3, eval_episodes=2),
                          run_dir=tmp_path / "run", progress=False, plot=False)
    assert np.isfinite(result.metrics["eval_return_mean"][:, -1]).all()
    jaxppo.train(LADDER.replace(max_policy_lag=1), progress=False, plot=False)
    policy = jaxppo.load_policy(tmp_path / "run")
    assert policy.masked
    policy.evaluate(episodes=3, seed=1)
    assert Ladder.steps[0] > 3 * 16 * 3 * 3 and Ladder.illegal[0] == 0
    # A saved policy takes the legal actions as the env gives them.
    x = np.array([[1.0], [4.0]], np.float32)
    mask = legal_of(np.array([1, 4]))
    for seed in range(5):
        action = np.asarray(policy(x, __import__("jax").random.PRNGKey(seed), action_mask=mask))
        assert mask[np.arange(2), action].all()
    with pytest.raises(TypeError, match=r"pass the legal actions the env gave with each "
                                        r"observation, action_mask=info\['action_mask'\]"):
        policy(x)
    with pytest.raises(TypeError, match=r"steps in Python: its legal actions are "
                                        r"info\['action_mask'\] of the reset or step"):
        policy.action_mask(None)


def test_mask_actions_settings():
    unmasked = LADDER.replace(env_kwargs={"masked": False})
    assert not jaxppo.resolve(unmasked).spec.masked
    assert not jaxppo.resolve(LADDER.replace(mask_actions=False)).spec.masked
    with pytest.raises(ConfigError, match=r"mask_actions=true, but JaxppoLadder-v0 gives no "
                                          r"action mask: .*a gymnasium env gives it as "
                                          r"info\['action_mask'\] of its reset and step"):
        jaxppo.resolve(unmasked.replace(mask_actions=True))


def test_a_mask_carried_in_the_observation_leaves_the_rest_to_the_policy():
    """The Dict observation without "action_mask": the one other entry as it is, several
    flattened; a mask that is not one entry per action stays part of the observation."""
    from jaxppo.envs.gymnasium_mask import carries_mask, space_without_mask

    env = jaxppo.resolve(LADDER.replace(env="gymnasium:JaxppoDictLadder-v0")).spec.env
    obs = {"observation": np.array([3.0], np.float32), "action_mask": legal(3).astype(np.int8)}
    np.testing.assert_array_equal(env.policy_obs(obs), [3.0])
    spaces = gymnasium.spaces
    two = spaces.Dict({"a": spaces.Discrete(3), "b": spaces.Box(0, 1, (2,)),
                       "action_mask": spaces.MultiBinary(ACTIONS)})
    assert carries_mask(two, spaces.Discrete(ACTIONS))
    assert spaces.flatdim(space_without_mask(two)) == 5
    assert not carries_mask(two, spaces.Discrete(ACTIONS + 1))
    assert not carries_mask(two, spaces.Box(0, 1, (ACTIONS,)))
