"""GAE against a plain-numpy reference and hand-computed numbers.

Semantics (ARCHITECTURE.md): a terminated step bootstraps with 0; a truncated step (time limit)
bootstraps with V(final_observation) and cuts the trace; an ongoing step bootstraps with the
value of the next state and carries the trace on. A step flagged both terminated and truncated
counts as terminated.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.core.gae import compute_gae


def gae_reference(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Loop over envs and (backwards) over time; ongoing steps use values[t + 1].

    `next_values[t]` is only read where step t ended (V(final_observation)) or at the last step
    of the rollout (V of the observation the rollout stops at).
    """
    T, E = rewards.shape
    adv = np.zeros((T, E), np.float64)
    for e in range(E):
        running = 0.0
        for t in reversed(range(T)):
            r, v = float(rewards[t, e]), float(values[t, e])
            if terminated[t, e]:
                delta = r - v  # death: nothing after it
                running = delta
            elif truncated[t, e]:
                delta = r + gamma * float(next_values[t, e]) - v  # time limit: V(final obs)
                running = delta  # the next episode's advantages do not leak in
            else:
                bootstrap = float(values[t + 1, e]) if t + 1 < T else float(next_values[t, e])
                delta = r + gamma * bootstrap - v
                running = delta + gamma * lam * running
            adv[t, e] = running
    return adv, adv + values.astype(np.float64)


def _random_rollout(seed, T=17, E=5):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(T, E)).astype(np.float32)
    values = rng.normal(size=(T, E)).astype(np.float32)
    u = rng.uniform(size=(T, E))
    terminated = u < 0.15
    truncated = u > 0.85
    terminated[3, 0] = truncated[3, 0] = True  # a step flagged both ways counts as terminated
    done = terminated | truncated
    # next_values: V(final obs) where the episode ended, V(s_{t+1}) otherwise (consistent
    # with `values`, as the trainer produces them), a fresh value after the last step.
    next_values = np.empty((T, E), np.float32)
    next_values[:-1] = values[1:]
    next_values[-1] = rng.normal(size=E)
    final_values = rng.normal(loc=3.0, size=(T, E)).astype(np.float32)
    next_values = np.where(done, final_values, next_values).astype(np.float32)
    assert terminated.any() and truncated.any() and (~done).any()
    return rewards, values, next_values, terminated, truncated


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 0.5), (1.0, 1.0), (0.97, 0.0)])
def test_matches_numpy_reference(seed, gamma, lam):
    rewards, values, next_values, term, trunc = _random_rollout(seed)
    adv, targets = compute_gae(
        jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(next_values),
        jnp.asarray(term), jnp.asarray(trunc), gamma, lam,
    )
    ref_adv, ref_targets = gae_reference(rewards, values, next_values, term, trunc, gamma, lam)
    assert adv.shape == (17, 5) and targets.shape == (17, 5)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(targets), ref_targets, rtol=1e-5, atol=1e-5)


def test_gamma_lambda_as_arrays():
    """gamma/lambda are traced HyperParams leaves in the trainer: jnp scalars must work."""
    rewards, values, next_values, term, trunc = _random_rollout(0)
    adv, _ = compute_gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(next_values),
                         jnp.asarray(term), jnp.asarray(trunc), jnp.float32(0.95), jnp.float32(0.9))
    ref_adv, _ = gae_reference(rewards, values, next_values, term, trunc, 0.95, 0.9)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-5)


def _run(rewards, values, next_values, term, trunc, gamma, lam):
    col = lambda x, dt=np.float32: jnp.asarray(np.asarray(x, dt)[:, None])  # noqa: E731
    adv, tgt = compute_gae(col(rewards), col(values), col(next_values), col(term, bool),
                           col(trunc, bool), gamma, lam)
    return np.asarray(adv)[:, 0], np.asarray(tgt)[:, 0]


def test_hand_computed_truncation():
    # gamma=0.9, lambda=0.8; step 1 hits the time limit with V(final obs) = 4.
    # t=2 (ongoing, last): delta = 3 + 0.9*2.0 - 1.5 = 3.3                  -> A2 = 3.3
    # t=1 (truncated):     delta = 2 + 0.9*4.0 - 1.0 = 4.6, trace cut       -> A1 = 4.6
    # t=0 (ongoing):       delta = 1 + 0.9*1.0 - 0.5 = 1.4; 1.4 + 0.72*4.6 -> A0 = 4.712
    adv, tgt = _run([1, 2, 3], [0.5, 1.0, 1.5], [1.0, 4.0, 2.0], [0, 0, 0], [0, 1, 0], 0.9, 0.8)
    np.testing.assert_allclose(adv, [4.712, 4.6, 3.3], rtol=1e-6)
    np.testing.assert_allclose(tgt, [5.212, 5.6, 4.8], rtol=1e-6)


def test_hand_computed_termination():
    # Same numbers, but step 1 terminates: it bootstraps with 0 (V(final obs) is ignored).
    # A2 = 3.3; A1 = 2 - 1.0 = 1.0; A0 = 1.4 + 0.72*1.0 = 2.12
    adv, tgt = _run([1, 2, 3], [0.5, 1.0, 1.5], [1.0, 4.0, 2.0], [0, 1, 0], [0, 0, 0], 0.9, 0.8)
    np.testing.assert_allclose(adv, [2.12, 1.0, 3.3], rtol=1e-6)
    np.testing.assert_allclose(tgt, [2.62, 2.0, 4.8], rtol=1e-6)


def test_hand_computed_no_done():
    # Nothing ends: plain GAE. gamma=0.5, lambda=0.5, bootstrap after the last step V=8.
    # d2 = 1 + 0.5*8 - 2 = 3;  d1 = 0 + 0.5*2 - 4 = -3;  d0 = 2 + 0.5*4 - 1 = 3
    # A2 = 3; A1 = -3 + 0.25*3 = -2.25; A0 = 3 + 0.25*(-2.25) = 2.4375
    adv, tgt = _run([2, 0, 1], [1, 4, 2], [4, 2, 8], [0, 0, 0], [0, 0, 0], 0.5, 0.5)
    np.testing.assert_allclose(adv, [2.4375, -2.25, 3.0], rtol=1e-6)
    np.testing.assert_allclose(tgt, [3.4375, 1.75, 5.0], rtol=1e-6)


def test_terminated_and_truncated_counts_as_terminated():
    adv, _ = _run([1, 2, 3], [0.5, 1.0, 1.5], [1.0, 4.0, 2.0], [0, 1, 0], [0, 1, 0], 0.9, 0.8)
    np.testing.assert_allclose(adv, [2.12, 1.0, 3.3], rtol=1e-6)


def test_time_limit_is_not_death():
    """The truncated step's advantage keeps gamma * V(final obs); a terminated one drops it."""
    gamma, v_final = 0.99, 7.0
    rewards, values = [1.0, 1.0], [2.0, 3.0]
    nv = [3.0, v_final]
    adv_trunc, _ = _run(rewards, values, nv, [0, 0], [0, 1], gamma, 0.95)
    adv_term, _ = _run(rewards, values, nv, [0, 1], [0, 0], gamma, 0.95)
    assert adv_trunc[1] == pytest.approx(1.0 + gamma * v_final - 3.0, rel=1e-6)
    assert adv_term[1] == pytest.approx(1.0 - 3.0, rel=1e-6)
    assert adv_trunc[1] - adv_term[1] == pytest.approx(gamma * v_final, rel=1e-6)


def test_trace_is_cut_at_episode_end():
    """A huge reward right after a truncation must not leak into the earlier episode."""
    base = dict(values=[0.0, 0.0, 0.0], next_values=[0.0, 0.0, 0.0], gamma=0.99, lam=0.95)
    for term, trunc in (([0, 1, 0], [0, 0, 0]), ([0, 0, 0], [0, 1, 0])):
        small, _ = _run([0.0, 0.0, 1.0], base["values"], base["next_values"], term, trunc,
                        base["gamma"], base["lam"])
        big, _ = _run([0.0, 0.0, 1e6], base["values"], base["next_values"], term, trunc,
                      base["gamma"], base["lam"])
        np.testing.assert_array_equal(small[:2], big[:2])


def test_bootstrap_truncation_false_treats_a_time_limit_as_the_end():
    """A CartPole rollout cut every 6 steps by its time limit: the update's advantages equal the
    reference's with truncations bootstrapped, and with bootstrap_truncation=false the
    reference's with every truncation a termination (PureJaxRL's and CleanRL's GAE)."""
    import jax

    import jaxppo
    from jaxppo.core import ppo
    from jaxppo.core.algorithm import Algorithm
    from jaxppo.core.hyperparams import HyperParams

    base = jaxppo.PPOConfig(env="CartPole-v1", num_envs=3, num_steps=20, num_minibatches=1,
                            env_kwargs={"max_steps_in_episode": 6}, normalize_advantages=False,
                            network=jaxppo.NetworkConfig((8,)), compilation_cache_dir=None)
    out = {}
    for bootstrap in (True, False):
        algo = Algorithm.create(jaxppo.resolve(base.replace(bootstrap_truncation=bootstrap)))
        hp = HyperParams.from_config(algo.config)
        state = ppo.init(algo, jax.random.PRNGKey(0), hp)

        @jax.jit
        def advantages(s, algo=algo, hp=hp):
            s, traj = ppo.rollout(algo, s, hp)
            values, next_values = ppo.rollout_values(algo, s.params, s.obs_stats, traj)
            stats = ppo.gather_rollout_stats(algo, traj)
            adv = ppo.gae(algo, s, traj, values, next_values, stats, hp)[1]
            return adv, traj, values, next_values

        out[bootstrap] = jax.tree.map(np.asarray, advantages(state))
    adv, traj, values, next_values = out[True]
    term, trunc = traj.terminated.astype(bool), traj.truncated.astype(bool)
    assert trunc.sum() >= 6 and not term[trunc].any()
    args = (traj.reward, values, next_values)
    np.testing.assert_allclose(adv, gae_reference(*args, term, trunc, 0.99, 0.95)[0],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out[False][1].obs, traj.obs)  # the same rollout
    ended = gae_reference(*args, term | trunc, np.zeros_like(trunc), 0.99, 0.95)[0]
    np.testing.assert_allclose(out[False][0], ended, rtol=1e-4, atol=1e-5)
    assert not np.allclose(out[False][0], adv)
