"""Network pieces against independent references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from jaxppo.core.losses import Batch
from jaxppo.core.networks import (LOG_STD_MAX, LOG_STD_MIN, ActorCritic, DistParams, _patches,
                                  log_prob)

PENDULUM = jaxppo.PPOConfig(env="Pendulum-v1", num_envs=4, num_steps=16, num_minibatches=2,
                            num_epochs=2, total_timesteps=4 * 16 * 2, compilation_cache_dir=None)


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
    algo = Algorithm.create(jaxppo.resolve(cfg))
    assert algo.network.torso == "cnn"
    hp = HyperParams.from_config(cfg)
    state = jax.jit(ppo.init, static_argnums=0)(algo, jax.random.PRNGKey(0), hp)
    conv = state.params["params"]["actor_torso"]["Dense_0"]["kernel"]
    assert conv.shape == (3 * 3 * 4, 16)  # a 3x3 conv over 4 channels, 16 out
    state, m = jax.jit(ppo.iteration, static_argnums=0)(algo, state, hp)
    assert np.isfinite(float(m["policy_loss"]))
    assert Algorithm.create(jaxppo.resolve(cfg.replace(env="CartPole-v1"))).network.torso == "mlp"


def test_pooled_cnn_torso_equals_conv_then_average_pool_then_dense():
    """conv_pool: the torso's output against lax's convolution and reduce_window average pool
    with the torso's own weights; 10x10 pooled by 3 drops the last row and column."""
    net = ActorCritic(action_dim=3, discrete=True, hidden_sizes=(8,), activation="relu",
                      torso="cnn", obs_shape=(10, 10, 4), conv_channels=(6,), conv_kernel=2,
                      conv_pool=3)
    obs = jax.random.bernoulli(jax.random.PRNGKey(0), 0.3, (5, 400)).astype(jnp.float32)
    params = net.init(jax.random.PRNGKey(1), obs)
    p = params["params"]["critic_torso"]
    assert p["Dense_0"]["kernel"].shape == (2 * 2 * 4, 6)
    assert p["MLP_0"]["Dense_0"]["kernel"].shape == (3 * 3 * 6, 8)  # 10 // 3 = 3 per side
    conv = jax.lax.conv_general_dilated(
        obs.reshape(5, 10, 10, 4), p["Dense_0"]["kernel"].reshape(2, 2, 4, 6), (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["Dense_0"]["bias"]
    pooled = jax.lax.reduce_window(jax.nn.relu(conv), 0.0, jax.lax.add, (1, 3, 3, 1),
                                   (1, 3, 3, 1), "VALID") / 9.0
    hidden = jax.nn.relu(pooled.reshape(5, -1) @ p["MLP_0"]["Dense_0"]["kernel"]
                         + p["MLP_0"]["Dense_0"]["bias"])
    value = hidden @ params["params"]["value_head"]["kernel"] + params["params"]["value_head"]["bias"]
    _, ours, _ = net.apply(params, obs)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(value[:, 0]), rtol=1e-5, atol=1e-5)


def _layer(x, p, act=jax.nn.relu):
    return act(x @ p["kernel"] + p["bias"])


@pytest.mark.parametrize("recurrent", [False, True], ids=["shared-trunk", "gru"])
def test_head_sizes_give_each_head_layers_of_its_own(recurrent):
    """network.head_sizes: the policy head (logits, and a state-dependent log std) and the
    value head each read layers of their own over the shared features, against a plain
    forward pass with the module's weights; without it no such layers exist."""
    from flax import linen as nn

    from jaxppo.core.networks import RecurrentActorCritic

    kw = dict(action_dim=2, discrete=False, state_dependent_std=True, hidden_sizes=(7,),
              activation="relu", head_sizes=(6, 5))
    net = (RecurrentActorCritic(carry_size=4, **kw) if recurrent
           else ActorCritic(shared_trunk=True, **kw))
    obs = jax.random.normal(jax.random.PRNGKey(0), (3, 9))
    params = net.init(jax.random.PRNGKey(1), obs)
    p = params["params"]
    h = _layer(obs, p["encoder" if recurrent else "actor_torso"]["Dense_0"])
    carry = jax.random.normal(jax.random.PRNGKey(2), (3, 4))
    if recurrent:
        new_carry, h = nn.GRUCell(4).apply({"params": p["core"]}, carry, h)
    pi = _layer(_layer(h, p["policy_layers"]["Dense_0"]), p["policy_layers"]["Dense_1"])
    v = _layer(_layer(h, p["value_layers"]["Dense_0"]), p["value_layers"]["Dense_1"])
    assert p["policy_layers"]["Dense_0"]["kernel"].shape == (4 if recurrent else 7, 6)
    assert p["value_layers"]["Dense_1"]["kernel"].shape == (6, 5)
    assert p["policy_head"]["kernel"].shape == (5, 2) and p["value_head"]["kernel"].shape == (5, 1)
    dist, value, out_carry = net.apply(params, obs, carry if recurrent else ())
    check = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    check(np.asarray(dist.loc), np.asarray(pi @ p["policy_head"]["kernel"] + p["policy_head"]["bias"]))
    log_std = jnp.clip(pi @ p["log_std_head"]["kernel"] + p["log_std_head"]["bias"], LOG_STD_MIN,
                       LOG_STD_MAX)
    check(np.asarray(dist.log_std), np.asarray(log_std))
    check(np.asarray(value), np.asarray((v @ p["value_head"]["kernel"] + p["value_head"]["bias"])[:, 0]))
    if recurrent:
        check(np.asarray(out_carry), np.asarray(new_carry))
    plain = net.clone(head_sizes=()).init(jax.random.PRNGKey(1), obs)["params"]
    assert set(p) - set(plain) == {"policy_layers", "value_layers"}


def test_head_sizes_round_trip_and_are_checked():
    cfg = jaxppo.PPOConfig(network=jaxppo.NetworkConfig(head_sizes=[16]))
    assert cfg.network.head_sizes == (16,) and jaxppo.PPOConfig().network.head_sizes == ()
    assert jaxppo.PPOConfig.from_dict(cfg.to_dict()) == cfg
    assert jaxppo.resolve(cfg).network.head_sizes == (16,)  # the network built has them
    with pytest.raises(jaxppo.ConfigError, match=r"network.head_sizes=\[0\] must be a list of "
                       r"positive layer widths, e.g. \[128\]"):
        jaxppo.PPOConfig(network=jaxppo.NetworkConfig(head_sizes=[0])).validate()


def test_cnn_torso_on_flat_observations_is_a_config_error():
    cfg = jaxppo.PPOConfig(env="CartPole-v1", network=jaxppo.NetworkConfig(torso="cnn"))
    try:
        Algorithm.create(jaxppo.resolve(cfg))
    except jaxppo.ConfigError as e:
        assert "network.torso='cnn' needs image observations" in str(e)
    else:
        raise AssertionError("expected ConfigError")


# ------------------------------------------------------------------ the Atari torsos
def _lax_conv(x, p, stride, padding):
    return jax.lax.conv_general_dilated(x, p["kernel"], (stride, stride), padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["bias"]


@pytest.mark.parametrize("via", ["windows", "xla"])
@pytest.mark.parametrize("features,k,stride,padding,shape", [
    (32, 8, 4, "VALID", (2, 84, 84, 4)), (64, 4, 2, "VALID", (2, 20, 20, 32)),
    (16, 3, 1, "SAME", (2, 21, 21, 4)), (8, 4, 3, "SAME", (2, 11, 10, 3)),
    (8, 3, 2, "SAME", (1, 9, 9, 3))])  # 25 windows: an odd count, not split in halves
def test_conv_is_flaxs_conv_either_way_it_is_computed(features, k, stride, padding, shape, via):
    """jaxppo's Conv, as a matmul over windows or with XLA's convolution, has nn.Conv's
    parameters (names, shapes and initial values), outputs and gradients (the windows' matmul
    and XLA's stride-1 convolution have gradient rules of their own)."""
    import flax.linen as nn

    from jaxppo.core.networks import Conv

    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    ours, ref = Conv(features, k, stride, padding, via), nn.Conv(features, (k, k), (stride, stride),
                                                                  padding=padding)
    params = ours.init(jax.random.PRNGKey(1), x)
    jax.tree.map(np.testing.assert_array_equal, params, ref.init(jax.random.PRNGKey(1), x))
    params = jax.tree.map(lambda a: a + jax.random.normal(jax.random.PRNGKey(2), a.shape), params)
    y, vjp = jax.vjp(ours.apply, params, x)
    y_ref, vjp_ref = jax.vjp(ref.apply, params, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-4, atol=1e-4)
    ct = jax.random.normal(jax.random.PRNGKey(3), y.shape)
    for a, b in zip(jax.tree.leaves(vjp(ct)), jax.tree.leaves(vjp_ref(ct))):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k,stride,padding", [(3, 1, "SAME"), (4, 1, "SAME"), (1, 1, "SAME"),
                                               (3, 1, "VALID"), (4, 2, "SAME")])
def test_xla_conv_gradients_are_jaxs_own(k, stride, padding):
    """xla_conv's value and both gradients (its own rule at stride 1) equal those JAX derives
    for lax.conv_general_dilated."""
    from jaxppo.core.networks import xla_conv

    x = jax.random.normal(jax.random.PRNGKey(0), (3, 9, 7, 4))
    w = jax.random.normal(jax.random.PRNGKey(1), (k, k, 4, 5))
    ref = lambda x, w: _lax_conv(x, {"kernel": w, "bias": 0.0}, stride, padding)
    y, vjp = jax.vjp(lambda x, w: xla_conv(x, w, stride, padding), x, w)
    y_ref, vjp_ref = jax.vjp(ref, x, w)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    ct = jax.random.normal(jax.random.PRNGKey(2), y.shape)
    for ours, theirs in zip(vjp(ct), vjp_ref(ct)):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_the_impala_cnns_gradient_in_a_scan_uses_xlas_fast_convolution_layout():
    """Inside the update's scan over minibatches XLA's CPU backend runs a convolution with its
    fast kernels only in one layout (input NHWC, kernel HWIO, output NHWC: b01f_01io->b01f),
    and leaves the other layouts of JAX's own conv gradients to slow generic loops there.
    Every convolution of a scanned IMPALA CNN gradient is in that layout."""
    import re

    from jaxppo.core.networks import ImpalaCNN

    # 20x20 frames (stages of 10, 5, 3 pixels a side): with a stage of 2 or fewer XLA swaps
    # the operands of the smallest convs, a layout of its own choosing
    net = ImpalaCNN((20, 20, 2))
    xs = jnp.zeros((2, 3, 20 * 20 * 2))
    params = net.init(jax.random.PRNGKey(0), xs[0])
    grad = jax.grad(lambda p, x: jnp.sum(net.apply(p, x) ** 2))

    def steps(p, xs):
        return jax.lax.scan(lambda p, x: (jax.tree.map(lambda a, g: a - g, p, grad(p, x)), None),
                            p, xs)[0]

    hlo = jax.jit(steps).lower(params, xs).compile().as_text()
    layouts = re.findall(r"convolution\(.*dim_labels=([a-z0-9_>-]+)", hlo)
    # 15 convs: forward, kernel gradient, and the input gradient of all but the first (its
    # input is the observation)
    assert len(layouts) == 15 + 15 + 14, layouts
    assert set(layouts) == {"b01f_01io->b01f"}, sorted(set(layouts))


def _flax_max_pool(x):
    import flax.linen as nn

    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


def _pool_and_gradient(pool):
    """(x, ct) -> (pool(x), its gradient with cotangent ct), jitted."""
    def both(x, ct):
        y, vjp = jax.vjp(pool, x)
        return y, vjp(ct)[0]

    return jax.jit(both)


@pytest.mark.parametrize("shape", [(8, 6, 3), (7, 5, 2), (1, 1, 1)])
def test_max_pool_and_its_gradient_are_flaxs_and_jaxs_bit_for_bit(shape):
    """max_pool (3x3, stride 2, "SAME": even and odd sides, padding before and after) gives
    nn.max_pool's values and the gradient JAX derives for it, bit for bit: on ties (small
    integers), signed zeros, infinities (a window of -inf next to padding) and NaN, with zero,
    negative-zero and NaN cotangents."""
    from jaxppo.core.networks import max_pool

    rng = np.random.default_rng(0)
    shape = (2,) + shape
    x = np.concatenate([  # five kinds of input, two images each
        rng.normal(size=shape),
        rng.integers(-2, 3, size=shape),
        np.where(rng.random(shape) < 0.5, -0.0, 0.0),
        np.where(rng.random(shape) < 0.4, -np.inf, np.where(rng.random(shape) < 0.2, np.inf, 1.0)),
        np.where(rng.random(shape) < 0.2, np.nan, rng.normal(size=shape))]).astype(np.float32)
    out_shape = _flax_max_pool(jnp.zeros(x.shape)).shape
    ct = rng.normal(size=out_shape)
    ct = np.where(rng.random(out_shape) < 0.2, -0.0, ct)
    ct = np.where(rng.random(out_shape) < 0.2, 0.0, ct)
    ct = np.where(rng.random(out_shape) < 0.1, np.nan, ct).astype(np.float32)
    ours = _pool_and_gradient(max_pool)(x, ct)
    theirs = _pool_and_gradient(_flax_max_pool)(x, ct)
    for a, b in zip(ours, theirs):
        a, b = np.asarray(a), np.asarray(b)
        assert a.tobytes() == b.tobytes(), np.argwhere(a.view(np.int32) != b.view(np.int32))


def _atari_net(torso: str, shared: bool = True) -> ActorCritic:
    return ActorCritic(action_dim=4, discrete=True, torso=torso, obs_shape=(84, 84, 4),
                       shared_trunk=shared)


def _frames(n: int):
    return jax.random.randint(jax.random.PRNGKey(3), (n, 84 * 84 * 4), 0, 256).astype(jnp.float32)


def test_nature_cnn_is_cleanrls_network():
    """CleanRL's Atari agent: its parameter count by hand, and the outputs against a plain
    lax forward pass with the torso's weights."""
    conv1 = 8 * 8 * 4 * 32 + 32  # 84 -> 20
    conv2 = 4 * 4 * 32 * 64 + 64  # 20 -> 9
    conv3 = 3 * 3 * 64 * 64 + 64  # 9 -> 7
    dense = 7 * 7 * 64 * 512 + 512
    heads = 512 * 4 + 4 + 512 + 1
    assert conv1 + conv2 + conv3 + dense + heads == 1_686_693
    net, obs = _atari_net("nature_cnn"), _frames(3)
    params = jax.jit(net.init)(jax.random.PRNGKey(0), obs)
    assert sum(a.size for a in jax.tree.leaves(params)) == 1_686_693
    # Two torsos (actor and critic apart, jaxppo's default) hold the trunk twice.
    two = jax.eval_shape(_atari_net("nature_cnn", shared=False).init, jax.random.PRNGKey(0), obs)
    assert sum(a.size for a in jax.tree.leaves(two)) == 2 * (conv1 + conv2 + conv3 + dense) + heads
    p = params["params"]
    x = obs.reshape(3, 84, 84, 4) / 255.0
    for i, stride in enumerate((4, 2, 1)):
        x = jax.nn.relu(_lax_conv(x, p["actor_torso"][f"Conv_{i}"], stride, "VALID"))
    h = jax.nn.relu(x.reshape(3, -1) @ p["actor_torso"]["Dense_0"]["kernel"]
                    + p["actor_torso"]["Dense_0"]["bias"])
    dist, value, _ = net.apply(params, obs)
    assert dist.loc.shape == (3, 4) and value.shape == (3,)
    logits = h @ p["policy_head"]["kernel"] + p["policy_head"]["bias"]
    np.testing.assert_allclose(np.asarray(dist.loc), np.asarray(logits), rtol=1e-4, atol=1e-5)
    v = (h @ p["value_head"]["kernel"] + p["value_head"]["bias"])[:, 0]
    np.testing.assert_allclose(np.asarray(value), np.asarray(v), rtol=1e-4, atol=1e-4)


def test_impala_cnn_is_cleanbas_network():
    """cleanba's IMPALA torso: its parameter count by hand (84 -> 42 -> 21 -> 11 per side),
    and the value against a plain lax forward pass (max-pool by reduce_window)."""
    count, c_in = 0, 4
    for c in (16, 32, 32):
        count += 3 * 3 * c_in * c + c + 4 * (3 * 3 * c * c + c)
        c_in = c
    count += 11 * 11 * 32 * 256 + 256 + 256 * 4 + 4 + 256 + 1
    net, obs = _atari_net("impala_cnn"), _frames(2)
    params = jax.jit(net.init)(jax.random.PRNGKey(0), obs)
    assert sum(a.size for a in jax.tree.leaves(params)) == count

    @jax.jit
    def reference(params, obs):
        p = params["params"]["actor_torso"]
        x, i = obs.reshape(2, 84, 84, 4) / 255.0, 0
        for _ in range(3):
            x = _lax_conv(x, p[f"Conv_{i}"], 1, "SAME")
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
            for _ in range(2):
                y = _lax_conv(jax.nn.relu(x), p[f"Conv_{i + 1}"], 1, "SAME")
                x = x + _lax_conv(jax.nn.relu(y), p[f"Conv_{i + 2}"], 1, "SAME")
                i += 2
            i += 1
        h = jax.nn.relu(jax.nn.relu(x).reshape(2, -1) @ p["Dense_0"]["kernel"]
                        + p["Dense_0"]["bias"])
        head = params["params"]["value_head"]
        return (h @ head["kernel"] + head["bias"])[:, 0]

    v = reference(params, obs)
    dist, value, _ = jax.jit(net.apply)(params, obs)
    assert dist.loc.shape == (2, 4) and value.shape == (2,)
    np.testing.assert_allclose(np.asarray(value), np.asarray(v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("env,network,match", [
    ("CartPole-v1", {"torso": "nature_cnn"},
     r"^network.torso='nature_cnn' needs image observations \[H, W, C\], but CartPole-v1 has "
     r"observation shape \(4,\)"),
    ("Breakout-MinAtar", {"torso": "nature_cnn"},
     r"needs images of at least 36x36 pixels .* Breakout-MinAtar's are 10x10; use "
     r"network.torso='impala_cnn'"),
    ("Breakout-MinAtar", {"torso": "impala_cnn", "hidden_sizes": [128]},
     r"^network.hidden_sizes=\[128\] shapes the 'mlp' and 'cnn' torsos, but "
     r"network.torso='impala_cnn' is a fixed architecture"),
    ("Breakout-MinAtar", {"torso": "impala_cnn", "activation": "relu", "conv_kernel": 2},
     r"^network.activation='relu' and network.conv_kernel=2 shape .* remove them"),
])
def test_fixed_cnn_torsos_refuse_what_they_cannot_take(env, network, match):
    cfg = jaxppo.PPOConfig(env=env, network=jaxppo.NetworkConfig(**network))
    with pytest.raises(jaxppo.ConfigError, match=match):
        jaxppo.resolve(cfg)


def test_fixed_cnn_torsos_refuse_observation_normalisation_and_take_small_images():
    cfg = jaxppo.PPOConfig(env="Breakout-MinAtar", network=jaxppo.NetworkConfig(torso="impala_cnn"))
    with pytest.raises(jaxppo.ConfigError, match=r"normalize_observations=true standardises the "
                                                 r"pixels that network.torso='impala_cnn' scales"):
        jaxppo.resolve(cfg.replace(normalize_observations=True))
    net = jaxppo.resolve(cfg).network  # 10x10 frames: 5 -> 3 -> 2 per side
    obs = jax.ShapeDtypeStruct((3, 10 * 10 * 4), jnp.float32)
    params = jax.eval_shape(net.init, jax.random.PRNGKey(0), obs)
    assert params["params"]["actor_torso"]["Dense_0"]["kernel"].shape == (2 * 2 * 32, 256)
    dist, value, _ = jax.eval_shape(net.apply, params, obs)
    assert dist.loc.shape == (3, 3) and value.shape == (3,)


# ------------------------------------------------------------------ Gaussian std options
def test_log_std_init_sets_the_free_log_std():
    net = ActorCritic(action_dim=2, discrete=False, hidden_sizes=(8,), log_std_init=-0.7)
    params = net.init(jax.random.PRNGKey(0), jnp.ones((3, 4)))
    np.testing.assert_array_equal(np.asarray(params["params"]["log_std"]), np.float32([-0.7, -0.7]))
    dist = net.apply(params, jnp.ones((3, 4)))[0]
    assert dist.log_std.shape == (2,)


def test_state_dependent_std_is_a_head_that_starts_near_log_std_init_and_is_clipped():
    net = ActorCritic(action_dim=2, discrete=False, hidden_sizes=(8,), log_std_init=-0.7,
                      state_dependent_std=True)
    obs = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    params = net.init(jax.random.PRNGKey(0), obs)
    assert "log_std" not in params["params"] and "log_std_head" in params["params"]
    log_std = np.asarray(net.apply(params, obs)[0].log_std)
    assert log_std.shape == (5, 2)
    assert np.all(np.abs(log_std + 0.7) < 0.1)  # small head init: std starts at exp(-0.7)
    assert np.ptp(log_std[:, 0]) > 0  # and depends on the state
    big = jax.tree_util.tree_map(lambda x: x, params)
    big["params"]["log_std_head"]["bias"] = jnp.full((2,), 50.0)
    np.testing.assert_array_equal(np.asarray(net.apply(big, obs)[0].log_std),
                                  LOG_STD_MAX)


def _batch_with_log_std(log_std):
    """A [T=4, E=3] batch whose fields are all functions of one per-sample tag."""
    tag = jnp.arange(12.0).reshape(4, 3)
    loc = jnp.stack([tag, -tag], -1)
    return Batch(obs=tag[..., None], actions=loc, old_log_probs=tag,
                     old_dist=DistParams(loc, log_std(tag)), old_values=tag, advantages=tag,
                     value_targets=tag)


def test_minibatches_keep_a_per_sample_log_std_with_its_sample_and_share_a_vector_one():
    algo = Algorithm.create(jaxppo.resolve(PENDULUM))
    idx = jnp.array([[2, 0, 3], [1, 3, 0]])  # [T/M, E]: each env's own time indices
    per = ppo.gather_minibatch(
        algo, _batch_with_log_std(lambda t: jnp.stack([t / 100, -t / 100], -1)), idx)
    tag = np.asarray(per.old_log_probs)
    np.testing.assert_array_equal(tag, [6, 1, 11, 3, 10, 2])
    np.testing.assert_allclose(np.asarray(per.old_dist.log_std), np.stack([tag / 100, -tag / 100], -1))
    shared = ppo.gather_minibatch(algo, _batch_with_log_std(lambda t: jnp.array([0.1, 0.2])), idx)
    np.testing.assert_array_equal(np.asarray(shared.old_dist.log_std), np.float32([0.1, 0.2]))


@pytest.mark.parametrize("recurrent", [False, True], ids=["feed-forward", "gru"])
def test_state_dependent_std_batch_replays_the_rollout_and_trains(recurrent):
    """The batch stores each step's own std: re-evaluating the policy on the batch gives the
    rollout's log-probs and std exactly, before any update."""
    net = jaxppo.NetworkConfig((16,), state_dependent_std=True, log_std_init=-0.5,
                               recurrent_size=8 if recurrent else 0)
    cfg = PENDULUM.replace(network=net)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    hp = HyperParams.from_config(cfg)
    state = jax.jit(ppo.init, static_argnums=0)(algo, jax.random.PRNGKey(0), hp)
    rolled, traj = jax.jit(ppo.rollout, static_argnums=0)(algo, state, hp)
    values, _ = ppo.rollout_values(algo, rolled.params, rolled.obs_stats, traj)
    batch = ppo.make_batch(algo, rolled.obs_stats, traj, values, values, values)
    mb = batch
    assert mb.old_dist.log_std.shape == (16, 4, 1)
    if recurrent:
        dist, _, _ = ppo.unroll(algo, rolled.params, batch.carry0, mb.obs, batch.reset)
    else:
        dist = algo.network.apply(rolled.params, mb.obs)[0]
    np.testing.assert_allclose(np.asarray(dist.log_std), np.asarray(mb.old_dist.log_std), atol=1e-6)
    np.testing.assert_allclose(np.asarray(log_prob(False, dist, mb.actions)),
                               np.asarray(mb.old_log_probs), atol=1e-5)
    new_state, m = jax.jit(ppo.iteration, static_argnums=0)(algo, state, hp)
    assert all(np.isfinite(float(m[k])) for k in ("policy_loss", "kl", "entropy"))
    head = "log_std_head"
    assert not np.allclose(np.asarray(new_state.params["params"][head]["kernel"]),
                           np.asarray(state.params["params"][head]["kernel"]))


@pytest.mark.parametrize("recurrent", [False, True], ids=["feed-forward", "gru"])
def test_advantages_standardised_per_minibatch(recurrent):
    """normalize_advantages_over='minibatch' (CleanRL's and PureJaxRL's way): one epoch
    learns as learning without normalisation from advantages that numpy standardised over
    each minibatch's own samples, the minibatches cut as the update cuts them."""
    from jaxppo.core.collectives import minibatch_indices

    net = jaxppo.NetworkConfig((16,), recurrent_size=8 if recurrent else 0)
    cfg = PENDULUM.replace(num_epochs=1, network=net, normalize_advantages_over="minibatch")
    algo = Algorithm.create(jaxppo.resolve(cfg))
    plain = Algorithm.create(jaxppo.resolve(cfg.replace(normalize_advantages=False)))
    hp = HyperParams.from_config(cfg)
    state = jax.jit(ppo.init, static_argnums=0)(algo, jax.random.PRNGKey(0), hp)
    rolled, traj = jax.jit(ppo.rollout, static_argnums=0)(algo, state, hp)
    values, _ = ppo.rollout_values(algo, rolled.params, rolled.obs_stats, traj)
    adv = np.asarray(jax.random.normal(jax.random.PRNGKey(2), values.shape)) * 3.0 + 1.0
    key = jax.random.PRNGKey(1)
    idx = np.asarray(minibatch_indices(jax.random.split(key, 1)[0], rolled.env_ids,
                                       cfg.num_steps, cfg.num_minibatches, recurrent))
    ref, cols = adv.astype(np.float64), np.arange(adv.shape[1])[None, :]
    for i in idx:  # each minibatch's samples: time rows of every env, or whole env columns
        part = (slice(None), i) if recurrent else (i, cols)
        ref[part] = (adv[part] - adv[part].mean()) / (adv[part].std() + 1e-8)
    assert not np.allclose(ref, (adv - adv.mean()) / adv.std(), atol=1e-3)  # not the batch's

    def learn(a, advantages):
        batch = ppo.make_batch(a, rolled.obs_stats, traj, values, jnp.asarray(advantages,
                               jnp.float32), values)
        return jax.jit(ppo.learn, static_argnums=0)(
            a, rolled.params, rolled.opt_state, batch, rolled.env_ids, key, hp, 1e-3, 0.01, 0.2)

    ours, theirs = learn(algo, adv), learn(plain, ref)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


MPE = jaxppo.PPOConfig(env="jaxmarl:MPE_simple_spread_v3", num_envs=2, num_steps=8,
                      num_minibatches=2, total_timesteps=48, compilation_cache_dir=None)
EACH_NETWORK = {  # max_grad_norm_over: each_network on the built-in networks it applies to
    "feed-forward": PENDULUM.replace(network=jaxppo.NetworkConfig((16,), head_sizes=(8,))),
    "mappo-gru": MPE.replace(critic_input="world_state", agent_id=True,
                             network=jaxppo.NetworkConfig((16,), recurrent_size=8,
                                                          head_sizes=(8,))),
    "per-agent": MPE.replace(critic_input="joint_obs", agent_params="per_agent",
                             network=jaxppo.NetworkConfig((16,))),
}


@pytest.mark.parametrize("name", list(EACH_NETWORK))
def test_each_network_clipping_and_critic_lr_are_an_optimiser_each_for_actor_and_critic(name):
    """max_grad_norm_over='each_network' with a critic_lr of its own (JaxMARL's MAPPO, Stoix,
    Mava): the parameters the value reads and those the policy reads, found from the
    network's own gradients, are two disjoint groups that cover them all; and two update
    steps equal optax's clip-by-global-norm and Adam run on each group as a tree of its own,
    the critic's stepping by critic_lr, which one clip over all of them with one learning
    rate does not."""
    from jax.flatten_util import ravel_pytree

    from jaxppo.core.networks import critic_param_mask

    cfg = EACH_NETWORK[name]
    if cfg.env_name.startswith("jaxmarl:"):
        pytest.importorskip("jaxmarl")
    cfg = cfg.replace(max_grad_norm_over="each_network", max_grad_norm=0.05)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    params = jax.jit(algo.init_params)(jax.random.PRNGKey(0))
    actor_dim, critic_dim = algo.input_dims()
    k = 2 * algo.spec.num_agents  # two envs' actors
    x = jax.random.normal(jax.random.PRNGKey(1), (k, actor_dim))
    extra = ({} if critic_dim is None else
             {"critic_obs": jax.random.normal(jax.random.PRNGKey(2), (k, critic_dim))})
    carry = jax.tree.map(  # not zeros: a GRU's recurrent kernels are read through its carry
        lambda c: jax.random.normal(jax.random.PRNGKey(4), c.shape), algo.train_carry((k,)))

    @jax.jit
    def reads(p):  # per leaf: do the value and the policy depend on it?
        def out(p):
            dist, v = algo.network.apply(p, x, carry, **extra)[:2]
            return jnp.sum(v), jnp.sum(dist.loc) + jnp.sum(dist.log_std)
        return jax.tree.map(lambda g: jnp.any(g != 0), jax.jacrev(out)(p))

    value, policy = ([bool(b) for b in jax.tree.leaves(r)] for r in reads(params))
    assert all(a != b for a, b in zip(value, policy))  # each leaf read by one of them alone
    leaves = jax.tree.leaves(params)
    sizes = [leaf.size for leaf in leaves]
    np.testing.assert_array_equal(critic_param_mask(params), np.repeat(value, sizes))

    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.PRNGKey(3), p.shape),
                         params)
    hp = HyperParams.from_config(cfg)
    lr, critic_lr = 1e-2, 3e-2

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def two_steps(a, apart=True):
        p, opt_state = params, ppo.optimizer(a, hp, params).init(ravel_pytree(params)[0])
        step = ppo.step_sizes(params, lr, critic_lr if apart else None)
        for _ in range(2):
            p, opt_state, _ = ppo.apply_grads(a, p, opt_state, ravel_pytree(grads)[0], hp, step)
        return jax.tree.leaves(p)

    @jax.jit
    def reference():  # an optax chain each, over its own group's leaves
        ref, g_leaves = list(leaves), jax.tree.leaves(grads)
        for group, group_lr in ((value, critic_lr), (policy, lr)):
            idx = [i for i, mine in enumerate(group) if mine]
            tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                             optax.scale_by_adam(eps=cfg.adam_eps))
            mine = [leaves[i] for i in idx]
            state = tx.init(mine)
            for _ in range(2):
                updates, state = tx.update([g_leaves[i] for i in idx], state, mine)
                mine = [m - group_lr * u for m, u in zip(mine, updates)]
            for i, m in zip(idx, mine):
                ref[i] = m
        return ref

    ref = reference()
    for ours, want in zip(two_steps(algo), ref):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-5, atol=1e-7)
    joint = Algorithm.create(jaxppo.resolve(cfg.replace(max_grad_norm_over="all")))
    for a, apart in ((joint, True), (algo, False)):  # one clip, or one learning rate
        assert not all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
                       for x, y in zip(two_steps(a, apart), ref))


@pytest.mark.parametrize("shape,scale", [((4, 64), np.sqrt(2.0)), ((64, 64), 1.0), ((64, 2), 0.01),
                                         ((300, 20), 1.0), ((3, 3, 5), 1.0)])
def test_orthogonal_init_is_orthogonal_with_its_scale_and_the_same_under_vmap(shape, scale):
    from jaxppo.core.networks import orthogonal

    init = orthogonal(float(scale))
    w = np.asarray(init(jax.random.PRNGKey(3), shape), np.float64).reshape(-1, shape[-1])
    gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
    np.testing.assert_allclose(gram, scale ** 2 * np.eye(len(gram)), atol=1e-5 * max(1.0, scale ** 2))
    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    batched = jax.vmap(lambda k: init(k, shape))(keys)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(init(keys[i], shape)))
    assert not np.allclose(np.asarray(batched[0]), np.asarray(batched[1]))


def test_sampling_from_noise_is_jax_categorical_and_normal():
    from jaxppo.core.networks import sample

    key = jax.random.PRNGKey(5)
    logits = jax.random.normal(jax.random.PRNGKey(6), (7, 5))
    np.testing.assert_array_equal(np.asarray(sample(True, DistParams(logits, jnp.zeros(5)), key)),
                                  np.asarray(jax.random.categorical(key, logits)))
    loc, log_std = jnp.ones((7, 2)), jnp.array([-0.5, 0.3])
    np.testing.assert_allclose(np.asarray(sample(False, DistParams(loc, log_std), key)),
                               np.asarray(loc + jnp.exp(log_std) * jax.random.normal(key, (7, 2))))
