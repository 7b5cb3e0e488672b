"""The suite adapters' auto-reset within a rollout (jaxppo.envs.spec.step_batch): an env step
under vmap computes the reset on the steps where an env of the batch (of every run vmapped
with `vmap_runs`) ended, and only there; the steps give what the env's own step gives
alone, reset computed at every step (up to float rounding: XLA compiles the reset inside a
branch then, and may round an operation's last bit otherwise). Counted by a callback in the
reset, which runs only when the reset is computed. The tests skip without jaxmarl (CI
installs it with the dev extra)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.envs.spec import step_batch, vmap_runs

pytest.importorskip("jaxmarl")

E, T = 3, 60  # MPE's episodes last 26 steps: every env ends on steps 26 and 52


def _assert_same_steps(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def counted_env():
    """MPE simple_spread with a reset that counts its calls (one per batched reset)."""
    from jaxppo.envs.make import make_env

    spec = make_env(jaxppo.PPOConfig(env="jaxmarl:MPE_simple_spread_v3"))
    env, calls = spec.env, []
    reset = type(env).reset

    class Counted(type(env)):
        def reset(self, key, params=None):
            jax.debug.callback(lambda: calls.append(1))
            return reset(self, key, params)

    env.__class__ = Counted
    return env, spec.env_params, calls


def _play(env, params, batched, keys):
    """T steps of E envs in each run (keys [R]: the runs vmapped with vmap_runs), fixed
    actions, stepped by step_batch or by a plain vmap of env.step; every step's outputs."""
    def one_run(key):
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, E), params)
        actions = jnp.ones((T, E, env.num_agents), jnp.int32)

        def step(state, xs):
            k, a = xs
            ks = jax.random.split(k, E)
            out = (step_batch(env, ks, state, a, params) if batched else
                   jax.vmap(env.step, in_axes=(0, 0, 0, None))(ks, state, a, params))
            obs, state, reward, term, trunc, info = out
            return state, (obs, reward, term, trunc, info["final_observation"])

        return jax.lax.scan(step, state, (jax.random.split(key, T), actions))[1]

    return jax.block_until_ready(jax.jit(vmap_runs(one_run, in_axes=0))(keys))


def test_a_batch_resets_on_the_steps_where_an_env_ended_and_steps_as_the_env_alone(
        counted_env):
    env, params, calls = counted_env
    keys = jax.random.split(jax.random.PRNGKey(0), 1)
    calls.clear()
    alone = _play(env, params, False, keys)
    assert len(calls) == 1 + T  # the first reset, then one computed at every step
    ended_steps = np.flatnonzero(np.any(np.asarray(alone[2] | alone[3])[0], axis=1))
    np.testing.assert_array_equal(ended_steps, [25, 51])  # steps 26 and 52
    calls.clear()
    batched = _play(env, params, True, keys)
    assert len(calls) == 1 + 2
    _assert_same_steps(alone, batched)


def test_runs_vmapped_together_reset_when_an_env_of_any_run_ended(counted_env):
    """Two runs: still one reset on each of the two steps where episodes ended; each run's
    steps are the ones it takes with the env's own step."""
    env, params, calls = counted_env
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    calls.clear()
    both = _play(env, params, True, keys)
    assert len(calls) == 1 + 2
    calls.clear()
    alone = _play(env, params, False, keys)
    assert len(calls) == 1 + T
    _assert_same_steps(alone, both)
