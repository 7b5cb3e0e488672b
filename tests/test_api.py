"""The public API as the README shows it, on a tiny config."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo

TINY = jaxppo.PPOConfig(
    env="CartPole-v1", num_envs=4, num_steps=16, num_minibatches=2, num_epochs=2,
    total_timesteps=4 * 16 * 3, network=jaxppo.NetworkConfig((16, 16)),
)


def test_import_does_not_load_ray():
    assert "ray" not in sys.modules or "jaxppo.distributed" in sys.modules


def test_sweep_with_stacked_hyperparams_matches_separate_runs():
    lrs = (1e-4, 1e-3)
    sweep = jaxppo.HyperParams.stack(
        [jaxppo.HyperParams.from_config(TINY.replace(lr=lr)) for lr in lrs])
    assert sweep.lr_points.shape == (2, 2, 2)  # 2 configs x linear schedule (2 points)
    train_fn = jaxppo.make_train(TINY)
    key = jax.random.PRNGKey(7)
    swept, m = jax.jit(jax.vmap(train_fn, in_axes=(None, 0)))(key, sweep)
    for i, lr in enumerate(lrs):
        single, m1 = jax.jit(train_fn)(key, jaxppo.HyperParams.from_config(TINY.replace(lr=lr)))
        for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(swept.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b)[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(m1["lr"]), np.asarray(m["lr"])[i], rtol=1e-6)
    # Different lrs really gave different runs.
    assert not np.allclose(np.asarray(m["policy_loss"])[0], np.asarray(m["policy_loss"])[1])


def test_stack_rejects_mismatched_schedules():
    a = jaxppo.HyperParams.from_config(TINY.replace(lr_schedule="constant"))
    b = jaxppo.HyperParams.from_config(TINY.replace(lr_schedule="linear"))
    with pytest.raises(jaxppo.ConfigError, match="same schedule form"):
        jaxppo.HyperParams.stack([a, b])


def test_train_with_swept_hparams_gives_one_seed_per_setting():
    sweep = jaxppo.HyperParams.stack(
        [jaxppo.HyperParams.from_config(TINY.replace(clip_param=c)) for c in (0.1, 0.3)])
    result = jaxppo.train(TINY.replace(num_seeds=2), hparams=sweep, progress=False)
    assert result.metrics["policy_loss"].shape == (2, 3)
    with pytest.raises(jaxppo.ConfigError, match="one entry per seed"):
        jaxppo.train(TINY.replace(num_seeds=3), hparams=sweep, progress=False)


@pytest.mark.parametrize("points", [[[0.0, 2.5e-4]], [[0.0, 2.5e-4], [5e5, 0.0]],
                                    [[0, 1e-3], [1e5, 5e-4], [3e5, 5e-4], [1e6, 1e-5]],
                                    [[1000, 0.1], [1000, 0.2], [2000, 0.0]]])
def test_schedule_value_equals_jnp_interp(points):
    """The schedule's own interpolation gives jnp.interp's numbers, at and between points,
    before the first and past the last."""
    from jaxppo.algorithm import schedule_value

    p = jnp.asarray(points, jnp.float32)
    steps = np.concatenate([np.random.default_rng(0).integers(0, 2_000_000, 500),
                            np.asarray(points)[:, 0].astype(int), [0, 999, 1001, 2001]])
    xs = jnp.asarray(steps, jnp.int32)
    ours = jax.jit(jax.vmap(lambda x: schedule_value(p, x)))(xs)
    ref = jax.jit(jax.vmap(lambda x: jnp.interp(x.astype(jnp.float32), p[:, 0], p[:, 1])))(xs)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
