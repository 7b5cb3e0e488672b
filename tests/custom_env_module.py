"""A user's own env in a module of its own, for tests/test_custom_env.py: importable as
`custom_env_module:Corridor` (tests/ is on sys.path under pytest; a subprocess gets it
through PYTHONPATH). `GatedCartPole` lets tests/run/test_interrupts.py hold a chunk running."""

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment, spaces
from gymnax.environments.classic_control.cartpole import CartPole


@struct.dataclass
class CorridorState(environment.EnvState):
    position: jax.Array


@struct.dataclass
class CorridorParams(environment.EnvParams):
    max_steps_in_episode: int = 20
    length: int = 4


class Corridor(environment.Environment):
    """Walk right (action 1) or left (action 0) along a corridor; reward 1 and the end of
    the episode at its far end. Observation [position / length, 1]."""

    @property
    def default_params(self):
        return CorridorParams()

    def step_env(self, key, state, action, params):
        position = jnp.clip(state.position + 2 * action - 1, 0, params.length)
        state = CorridorState(time=state.time + 1, position=position)
        done = position >= params.length
        return self._obs(state, params), state, done.astype(jnp.float32), done, {}

    def reset_env(self, key, params):
        state = CorridorState(time=0, position=jnp.int32(0))
        return self._obs(state, params), state

    def _obs(self, state, params):
        return jnp.stack([state.position / params.length, 1.0]).astype(jnp.float32)

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, (2,), jnp.float32)


class ScaledCorridor(Corridor):
    """A Corridor built with a constructor argument (observations times `scale`)."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale={scale} must be positive")
        self.scale = scale

    def _obs(self, state, params):
        return super()._obs(state, params) * self.scale

    def observation_space(self, params):
        return spaces.Box(0.0, self.scale, (2,), jnp.float32)


def make_corridor():
    """A factory, for env="custom_env_module:make_corridor"."""
    return Corridor()


GATE = "JAXPPO_TEST_GATE"


def _wait_at_gate(reward):
    """While the file named by $JAXPPO_TEST_GATE exists, mark it as reached (a file beside it
    named `<gate>.reached`) and wait; a step then goes on only once the test removes it."""
    gate = os.environ.get(GATE)
    if gate and os.path.exists(gate):
        Path(gate + ".reached").touch()
        while os.path.exists(gate):
            time.sleep(0.01)
    return np.zeros_like(reward)


class GatedCartPole(CartPole):
    """gymnax's CartPole whose step waits while a gate file exists (see `_wait_at_gate`), so
    that a test can hold a training chunk running for as long as it needs, whatever the
    machine's speed: tests/run/test_interrupts.py signals a process whose chunk is held."""

    def step_env(self, key, state, action, params):
        obs, state, reward, done, info = super().step_env(key, state, action, params)
        reward = reward + jax.pure_callback(
            _wait_at_gate, jax.ShapeDtypeStruct(jnp.shape(reward), jnp.result_type(reward)),
            reward, vmap_method="broadcast_all")
        return obs, state, reward, done, info
