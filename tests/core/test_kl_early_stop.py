"""kl_early_stop (CleanRL's and SB3's target_kl): an iteration's gradient steps end at the
first minibatch whose approx KL exceeds it, checked against a plain Python loop over the
same minibatches (SB3's), and off it changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.collectives import minibatch_indices
from jaxppo.core.hyperparams import HyperParams

CFG = jaxppo.PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=16, num_epochs=3, num_minibatches=4,
    total_timesteps=4 * 16 * 3, lr=3e-3, network=jaxppo.NetworkConfig((16, 16)),
    compilation_cache_dir=None)
EPOCHS, MINIBATCHES = CFG.num_epochs, CFG.num_minibatches
LR, ENT, KL_COEFF = 3e-3, 0.01, 0.2


@pytest.fixture(scope="module")
def setup():
    """An algorithm, the params before the update, and a batch with advantages of a fixed
    random draw (large enough for the policy to move within an iteration)."""
    algo = Algorithm.create(jaxppo.resolve(CFG))
    hp = HyperParams.from_config(CFG)
    state = ppo.init(algo, jax.random.PRNGKey(0), hp)
    state, traj = jax.jit(ppo.rollout, static_argnums=0)(algo, state, hp)
    values, _ = jax.jit(ppo.rollout_values, static_argnums=0)(
        algo, state.params, state.obs_stats, traj)
    advantages = jax.random.normal(jax.random.PRNGKey(1), values.shape)
    batch = ppo.make_batch(algo, state.obs_stats, traj, values, advantages, values + advantages)
    return algo, hp, state, batch


def _learn(setup, kl_early_stop):
    algo, hp, state, batch = setup
    algo = Algorithm.create(jaxppo.resolve(CFG.replace(kl_early_stop=kl_early_stop)))
    run = jax.jit(lambda p, o: ppo.learn(algo, p, o, batch, state.env_ids, jax.random.PRNGKey(2),
                                         hp, jnp.float32(LR), jnp.float32(ENT),
                                         jnp.float32(KL_COEFF)))
    (params, _), stats = run(state.params, state.opt_state)
    return params, jax.tree.map(np.asarray, stats)


def _python_loop(setup, threshold):
    """SB3's loop: before each step, the minibatch's approx KL; past the threshold, stop."""
    algo, hp, state, batch = setup
    grads_of = jax.jit(lambda p, mb: ppo.loss_and_grads(algo, p, mb, hp, ENT, KL_COEFF))
    step = jax.jit(lambda p, o, g: ppo.apply_grads(algo, p, o, g, hp, LR)[:2])
    params, opt_state, steps = state.params, state.opt_state, 0
    for key in jax.random.split(jax.random.PRNGKey(2), EPOCHS):
        idx = minibatch_indices(key, state.env_ids, CFG.num_steps, MINIBATCHES, False)
        for m in range(MINIBATCHES):
            grads, terms = grads_of(params, ppo.gather_minibatch(algo, batch, idx[m]))
            if float(terms.approx_kl) > threshold:
                return params, steps
            params, opt_state = step(params, opt_state, ravel_pytree(grads)[0])
            steps += 1
    return params, steps


def _max_diff(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_updates_stop_at_the_first_minibatch_past_the_kl(setup):
    full_params, full = _learn(setup, None)
    kls = full.approx_kl.ravel()  # each step's, before it, without a stop
    assert kls[0] == pytest.approx(0.0, abs=1e-7)  # the first minibatch: old and new agree
    # A threshold the KL first passes in the second epoch: the steps before it are taken.
    first = next(i for i in range(MINIBATCHES + 1, len(kls)) if kls[i] > kls[:i].max() * 1.05)
    threshold = float((kls[:first].max() + kls[first]) / 2)
    params, stats = _learn(setup, threshold)
    expected, steps = _python_loop(setup, threshold)
    assert steps == first
    evaluated, stepped = stats.evaluated.ravel(), stats.stepped.ravel()
    assert evaluated.tolist() == [True] * (first + 1) + [False] * (len(kls) - first - 1)
    assert stepped.tolist() == [True] * first + [False] * (len(kls) - first)
    np.testing.assert_allclose(stats.approx_kl.ravel()[:first + 1], kls[:first + 1], rtol=1e-5)
    assert _max_diff(params, expected) < 1e-6
    assert _max_diff(params, full_params) > 1e-4  # the stop changed the update


def test_a_kl_never_reached_changes_nothing(setup):
    full_params, full = _learn(setup, None)
    params, stats = _learn(setup, 1e6)
    assert stats.stepped.all() and full.evaluated is None
    assert _max_diff(params, full_params) < 1e-6
    np.testing.assert_allclose(stats.policy_loss, full.policy_loss, rtol=1e-5, atol=1e-7)


def test_training_reports_the_gradient_steps_and_averages_what_was_evaluated():
    cfg = CFG.replace(total_timesteps=4 * 16 * 4)
    off = jaxppo.train(cfg, progress=False, plot=False).metrics
    assert "gradient_steps" not in off
    never = jaxppo.train(cfg.replace(kl_early_stop=1e6), progress=False, plot=False).metrics
    assert (never["gradient_steps"] == EPOCHS * MINIBATCHES).all()
    for key in ("policy_loss", "approx_kl", "episode_return_mean"):
        np.testing.assert_allclose(never[key], off[key], rtol=1e-5, atol=1e-7)
    tight = jaxppo.train(cfg.replace(kl_early_stop=1e-6), progress=False, plot=False).metrics
    steps = tight["gradient_steps"]
    assert (steps >= 1).all() and (steps < EPOCHS * MINIBATCHES).all(), steps
    # The mean over the minibatches evaluated, each stop's own included: above the threshold.
    assert (tight["approx_kl"] > 1e-6 / (steps + 1) - 1e-9).all()


def test_config_checks_and_the_name_other_libraries_use():
    with pytest.raises(jaxppo.ConfigError, match=r"kl_early_stop=0 must be a positive number"):
        CFG.replace(kl_early_stop=0).validate()
    with pytest.raises(jaxppo.ConfigError, match=r"unknown .*'target_kl'.*did you mean 'kl_early_stop'"):
        jaxppo.PPOConfig.from_dict({"target_kl": 0.02})
