"""Network pieces against independent references."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxppo
from jaxppo.algorithm import Algorithm, HyperParams
from jaxppo.networks import _patches


def test_patches_dense_equals_same_padded_convolution():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 10, 10, 4))
    kernel = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 4, 16))
    ours = _patches(x, 3) @ kernel.reshape(-1, 16)
    ref = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_cnn_torso_is_chosen_for_image_observations_and_runs():
    cfg = jaxppo.PPOConfig(env="Breakout-MinAtar", num_envs=4, num_steps=8, num_minibatches=2,
                           num_epochs=1, total_timesteps=32, compilation_cache_dir=None,
                           network=jaxppo.NetworkConfig((16,), activation="relu"))
    algo = Algorithm(cfg)
    assert algo.network.torso == "cnn"
    hp = HyperParams.from_config(cfg)
    state = jax.jit(algo.init)(jax.random.PRNGKey(0), hp)
    conv = state.params["params"]["actor_torso"]["Dense_0"]["kernel"]
    assert conv.shape == (3 * 3 * 4, 16)  # a 3x3 conv over 4 channels, 16 out
    state, m = jax.jit(algo.iteration)(state, hp)
    assert np.isfinite(float(m["policy_loss"]))
    assert Algorithm(cfg.replace(env="CartPole-v1")).network.torso == "mlp"


def test_cnn_torso_on_flat_observations_is_a_config_error():
    cfg = jaxppo.PPOConfig(env="CartPole-v1", network=jaxppo.NetworkConfig(torso="cnn"))
    try:
        Algorithm(cfg)
    except jaxppo.ConfigError as e:
        assert "network.torso='cnn' needs image observations" in str(e)
    else:
        raise AssertionError("expected ConfigError")
