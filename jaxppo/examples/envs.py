"""An env of one's own with an action mask, as a user writes one (docs/environments.md,
"Action masks"): `env: jaxppo.examples.envs:PickLegal`.

An env masks its illegal actions by defining `action_mask(state, params) -> bool
[num_actions]` (true = legal) for the state whose observation the policy sees; jaxppo then
samples, scores and evaluates the policy over the legal actions only (`mask_actions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces


@struct.dataclass
class PickLegalState(environment.EnvState):
    values: jax.Array  # [num_actions] what each action pays this step
    legal: jax.Array  # [num_actions] bool


@struct.dataclass
class PickLegalParams(environment.EnvParams):
    max_steps_in_episode: int = 16
    illegal_reward: float = -1.0


class PickLegal(environment.Environment):
    """Each step `num_legal` of `num_actions` actions are legal, each paying a value drawn
    uniformly from [0, 1); an illegal action pays `illegal_reward` and ends the episode.

    The observation is [values of the legal actions (0 for illegal ones), the legality flags]
    (2 * num_actions). The best policy picks the legal action of highest value, for an
    expected return of `max_steps_in_episode * num_legal / (num_legal + 1)` (12.0 with the
    defaults); a uniformly random legal action earns half that per step. Without a mask the
    policy must also learn which actions are legal, while every mistake ends its episode.
    """

    def __init__(self, num_actions: int = 8, num_legal: int = 3):
        super().__init__()
        if not 1 <= num_legal <= num_actions:
            raise ValueError(f"num_legal={num_legal} must be in [1, num_actions={num_actions}]")
        self.n_actions, self.num_legal = num_actions, num_legal

    @property
    def default_params(self) -> PickLegalParams:
        return PickLegalParams()

    def action_mask(self, state: PickLegalState, params=None) -> jax.Array:
        """The legal actions of the state's observation: bool [num_actions]."""
        return state.legal

    def _draw(self, key, time) -> PickLegalState:
        k_values, k_legal = jax.random.split(key)
        values = jax.random.uniform(k_values, (self.n_actions,))
        chosen = jax.random.permutation(k_legal, self.n_actions)[:self.num_legal]
        legal = jnp.zeros((self.n_actions,), bool).at[chosen].set(True)
        return PickLegalState(time=time, values=values, legal=legal)

    def step_env(self, key, state: PickLegalState, action, params: PickLegalParams):
        legal = state.legal[action]
        reward = jnp.where(legal, state.values[action], params.illegal_reward)
        next_state = self._draw(key, state.time + 1)
        done = jnp.logical_or(~legal, next_state.time >= params.max_steps_in_episode)
        return self._obs(next_state), next_state, reward.astype(jnp.float32), done, {}

    def reset_env(self, key, params: PickLegalParams):
        state = self._draw(key, jnp.int32(0))
        return self._obs(state), state

    def _obs(self, state: PickLegalState) -> jax.Array:
        return jnp.concatenate([jnp.where(state.legal, state.values, 0.0),
                                state.legal.astype(jnp.float32)])

    def action_space(self, params=None):
        return spaces.Discrete(self.n_actions)

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, (2 * self.n_actions,), jnp.float32)
