"""A user's own env in a module of its own, for tests/test_custom_env.py: importable as
`custom_env_module:Corridor` (tests/ is on sys.path under pytest; a subprocess gets it
through PYTHONPATH)."""

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces


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
