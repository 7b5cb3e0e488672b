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
    from jaxppo.core.hyperparams import schedule_value

    p = jnp.asarray(points, jnp.float32)
    steps = np.concatenate([np.random.default_rng(0).integers(0, 2_000_000, 500),
                            np.asarray(points)[:, 0].astype(int), [0, 999, 1001, 2001]])
    xs = jnp.asarray(steps, jnp.int32)
    ours = jax.jit(jax.vmap(lambda x: schedule_value(p, x)))(xs)
    ref = jax.jit(jax.vmap(lambda x: jnp.interp(x.astype(jnp.float32), p[:, 0], p[:, 1])))(xs)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


# ---------------------------------------------------------------------- bad arguments at the API edge
def _one():
    return jaxppo.HyperParams.from_config(TINY)


def _sweep(n=2):
    return jaxppo.HyperParams.stack([jaxppo.HyperParams.from_config(TINY.replace(lr=1e-3 * (i + 1)))
                                     for i in range(n)])


@pytest.mark.parametrize("call,match", [
    (lambda: jaxppo.HyperParams.stack([]), r"^HyperParams\.stack takes a non-empty list of HyperParams, got an empty list"),
    (lambda: jaxppo.HyperParams.stack(_one()), r"^HyperParams\.stack takes a non-empty list .* got HyperParams"),
    (lambda: jaxppo.HyperParams.stack([1, 2]), r"^HyperParams\.stack: item 0 is int 1, not a HyperParams"),
    (lambda: jaxppo.HyperParams.stack([_one(), _sweep()]), r"^HyperParams\.stack: some items are already stacked"),
    (lambda: jaxppo.HyperParams.from_config("CartPole-v1"), r"^the config must be a jaxppo\.PPOConfig, got str"),
    (lambda: jaxppo.HyperParams.from_config(TINY.replace(lr="fast")), r"^lr='fast' must be a number"),
])
def test_hyperparams_constructors_refuse_bad_input(call, match):
    with pytest.raises(jaxppo.ConfigError, match=match):
        call()


@pytest.mark.parametrize("kwargs,match", [
    (dict(hparams=5), r"^train\(config, hparams\): hparams is int 5, not a jaxppo\.HyperParams"),
    (dict(hparams={"lr": 1e-3}), r"^train\(config, hparams\): hparams is dict .*not a jaxppo\.HyperParams"),
    (dict(hparams=_sweep()), r"hparams is a stack of 2 settings \(a sweep\), but this trains one; set num_seeds=2"),
    (dict(callback=5), r"^callback=5 must be a function of the metric rows"),
    (dict(stop_after_iterations=0), r"^stop_after_iterations=0 must be an integer >= 1"),
])
def test_train_refuses_bad_arguments_before_writing_anything(tmp_path, kwargs, match):
    with pytest.raises(jaxppo.ConfigError, match=match):
        jaxppo.train(TINY, run_dir=tmp_path / "run", progress=False, **kwargs)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where,match", [
    ("file", r"^cannot make the run folder .*/f: .*/f is a file, not a folder"),
    ("under_file", r"^cannot make the run folder .*/f/run: .*/f is a file, not a folder"),
    ("int", r"^train\(run_dir=5\): run_dir must be the path of a run folder"),
    ("resume_int", r"^train\(resume=5\): resume must be the path of a run folder"),
    ("too_long", r"^cannot make the run folder: the folder name ü+\.\.\. is 260 bytes long \(130 "
                 r"characters\), more than the 255 bytes the file system under .* allows in a name"),
])
def test_train_refuses_run_folders_that_cannot_be(tmp_path, where, match):
    (tmp_path / "f").write_text("x")
    kwargs = {"file": dict(run_dir=tmp_path / "f"), "under_file": dict(run_dir=tmp_path / "f" / "run"),
              "int": dict(run_dir=5), "resume_int": dict(resume=5),
              "too_long": dict(run_dir=tmp_path / ("ü" * 130))}[where]
    with pytest.raises(jaxppo.ConfigError, match=match):
        jaxppo.train(TINY, progress=False, **kwargs)
    assert (tmp_path / "f").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_make_train_refuses_bad_keys_and_hyperparams_before_tracing():
    with pytest.raises(jaxppo.ConfigError, match=r"^make_train\(config, hparams\): hparams is int 5"):
        jaxppo.make_train(TINY, hparams=5)
    with pytest.raises(jaxppo.ConfigError, match=r"make_train\(config, hparams\): hparams is a stack of 2"):
        jaxppo.make_train(TINY, hparams=_sweep())
    train_fn = jaxppo.make_train(TINY)
    one_key = r"key must be one PRNG key, e.g\. jax\.random\.PRNGKey\(0\)"
    for key, got in ((0, "got int 0"), (None, "got NoneType None"),
                     (jnp.zeros(2), r"shape \(2,\) and dtype float32"),
                     (jnp.zeros(3, jnp.uint32), r"shape \(3,\) and dtype uint32"),
                     (jax.random.split(jax.random.PRNGKey(0), 3), r"shape \(3, 2\)")):
        with pytest.raises(TypeError, match=rf"^train_fn\(key, \.\.\.\): {one_key}.*{got}.*jax\.vmap"):
            train_fn(key)
    with pytest.raises(jaxppo.ConfigError, match=r"^train_fn\(key, hparams\): hparams is a stack of 2 "
                                                 r"settings .*jax\.vmap\(train_fn\)\(keys, hparams\)"):
        train_fn(jax.random.PRNGKey(0), _sweep())
    with pytest.raises(jaxppo.ConfigError, match=r"^train_fn\(key, hparams\): hparams is int 5"):
        train_fn(jax.random.PRNGKey(0), 5)
    # Inside vmap each key and setting is checked per member: the documented sweep passes.
    jax.eval_shape(jax.vmap(train_fn), jax.random.split(jax.random.PRNGKey(0), 2), _sweep())
    jax.eval_shape(train_fn, jax.random.key(0))  # a typed key is one key too
