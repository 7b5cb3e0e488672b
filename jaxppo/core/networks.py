"""Actor-critic networks (flax) and the action distributions PPO needs, as pure functions
of the distribution parameters (which the rollout stores for the KL term).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.config import LOG_STD_MAX, LOG_STD_MIN
from jaxppo.errors import ConfigError

_ACTIVATIONS = {
    "tanh": jnp.tanh,
    "relu": nn.relu,
    "gelu": nn.gelu,
    "silu": nn.silu,
    "elu": nn.elu,
}
_LOG_2PI = float(np.log(2.0 * np.pi))


class DistParams(NamedTuple):
    """Parameters of the policy's action distribution.

    Discrete: `loc` are logits [..., A] and `log_std` is unused (zeros [A]).
    Continuous: `loc` is the Gaussian mean [..., D]; `log_std` is [D], one learned vector
    shared by every state, or [..., D] like `loc` with `network.state_dependent_std`.
    """

    loc: jax.Array
    log_std: jax.Array


# ---------------------------------------------------------------- distributions
# The logit an illegal action gets: exp(MASKED_LOGIT - max) is exactly 0 in float32, so it is
# never sampled and adds nothing to a log-probability, entropy or KL, while staying finite
# (-inf would make 0 * log 0 = NaN in the entropy). Its gradient is zero (jnp.where).
MASKED_LOGIT = -1e9


def mask_logits(dist: DistParams, mask: jax.Array | None) -> DistParams:
    """The categorical restricted to the legal actions: logits [..., A] where `mask` [..., A]
    is false set to MASKED_LOGIT (None: unchanged). Sampling, the mode, log-probabilities,
    entropy and KL of the result are those of the distribution renormalised over the legal
    set (Huang & Ontanon, "A Closer Look at Invalid Action Masking in Policy Gradient
    Algorithms")."""
    if mask is None:
        return dist
    return dist._replace(loc=jnp.where(mask, dist.loc, jnp.asarray(MASKED_LOGIT, dist.loc.dtype)))


def sample(discrete: bool, dist: DistParams, key: jax.Array) -> jax.Array:
    """A sample from `dist`: [...] action indices, or [..., D] continuous actions."""
    return sample_with_noise(discrete, dist, sampling_noise(discrete, key, dist.loc.shape))


def sampling_noise(discrete: bool, key: jax.Array, shape) -> jax.Array:
    """Gumbel noise of `shape` for logits (the Gumbel-max trick), else standard normal."""
    return jax.random.gumbel(key, shape) if discrete else jax.random.normal(key, shape)


def sample_with_noise(discrete: bool, dist: DistParams, noise: jax.Array) -> jax.Array:
    """A sample from `dist` given `sampling_noise` of its shape: argmax(logits + Gumbel)
    (what jax.random.categorical computes), or mean + std * normal."""
    if discrete:
        return jnp.argmax(dist.loc + noise, axis=-1)
    return dist.loc + jnp.exp(dist.log_std) * noise


def mode(discrete: bool, dist: DistParams) -> jax.Array:
    """The most likely action (the deterministic policy's)."""
    return jnp.argmax(dist.loc, axis=-1) if discrete else dist.loc


def log_prob(discrete: bool, dist: DistParams, action: jax.Array) -> jax.Array:
    """log p(action) [...], summed over a continuous action's dimensions."""
    if discrete:
        logp = jax.nn.log_softmax(dist.loc)
        return jnp.take_along_axis(logp, action[..., None].astype(jnp.int32), axis=-1)[..., 0]
    z = (action - dist.loc) * jnp.exp(-dist.log_std)
    return jnp.sum(-0.5 * z * z - dist.log_std - 0.5 * _LOG_2PI, axis=-1)


def entropy(discrete: bool, dist: DistParams) -> jax.Array:
    """The distribution's entropy [...], summed over action dimensions."""
    if discrete:
        logp = jax.nn.log_softmax(dist.loc)
        return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    ent = dist.log_std + 0.5 * (1.0 + _LOG_2PI)
    return jnp.sum(jnp.broadcast_to(ent, dist.loc.shape), axis=-1)


def kl_divergence(discrete: bool, p: DistParams, q: DistParams) -> jax.Array:
    """KL(p || q), analytic, summed over action dimensions."""
    if discrete:
        logp = jax.nn.log_softmax(p.loc)
        logq = jax.nn.log_softmax(q.loc)
        return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    var_p = jnp.exp(2.0 * p.log_std)
    var_q = jnp.exp(2.0 * q.log_std)
    kl = q.log_std - p.log_std + (var_p + (p.loc - q.loc) ** 2) / (2.0 * var_q) - 0.5
    return jnp.sum(kl, axis=-1)


# ---------------------------------------------------------------- networks
# Every orthogonal init draws at least this many normals (then keeps what its shape needs), so
# the small layers of a network share one shape of random draw, which XLA compiles once.
_MIN_DRAW = 4096


def orthogonal(scale: float):
    """An orthogonal initializer, as flax's, for kernels of any shape.

    The Q of a Gaussian matrix's QR, signs fixed by R's diagonal, times `scale`. Two changes
    from flax's, both for the CPU (docs/design.md): the Gaussian matrix is the first entries
    of a draw of at least `_MIN_DRAW` normals (one compile for every small layer), and under
    vmap (seeds) the QRs run one at a time (jaxlib's batched QR deadlocked its CPU thread
    pool).

    Args:
      scale: the gain.

    Returns:
      init(key, shape, dtype=float32) -> array.
    """

    def one(key, shape, dtype):
        rows, cols = math.prod(shape[:-1]), shape[-1]
        big, small = max(rows, cols), min(rows, cols)
        z = jax.random.normal(key, (max(big * small, _MIN_DRAW),), dtype)[:big * small]
        q, r = jnp.linalg.qr(z.reshape(big, small))
        q = q * jnp.sign(jnp.diagonal(r))
        return (scale * (q if rows >= cols else q.T)).reshape(shape).astype(dtype)

    def init(key, shape, dtype=jnp.float32):
        batched = jax.custom_batching.custom_vmap(lambda k: one(k, shape, dtype))

        @batched.def_vmap
        def _one_at_a_time(axis_size, in_batched, k):
            if not in_batched[0]:
                return one(k, shape, dtype), False
            return jax.lax.map(lambda kk: one(kk, shape, dtype), k), True

        return batched(key)

    return init


def _dense(features: int, scale: float) -> nn.Dense:
    return nn.Dense(
        features,
        kernel_init=orthogonal(scale),
        bias_init=nn.initializers.constant(0.0),
    )


class MLP(nn.Module):
    """Dense layers of `hidden_sizes`, each followed by `activation`."""

    hidden_sizes: Sequence[int]
    activation: str

    @nn.compact
    def __call__(self, x):
        act = _ACTIVATIONS[self.activation]
        for h in self.hidden_sizes:
            x = act(_dense(h, float(np.sqrt(2.0)))(x))
        return x


class CNN(nn.Module):
    """Conv layers over [..., H, W, C] images (given flat), each followed by a `pool` x `pool`
    average pool (stride `pool`; none when 1), then the MLP layers.

    The MinAtar-sized default (one 3x3 conv of 16 channels, then 64-64) follows the small
    torsos of gymnax's own PPO baselines; channels=(32,), kernel=2, pool=2, hidden (64,) is
    the conv-pool torso of Pgx's MinAtar PPO example.
    """

    obs_shape: Sequence[int]
    channels: Sequence[int]
    kernel: int
    hidden_sizes: Sequence[int]
    activation: str
    pool: int = 1

    @nn.compact
    def __call__(self, x):
        act = _ACTIVATIONS[self.activation]
        lead = x.shape[:-1]
        x = x.reshape((-1,) + tuple(self.obs_shape))
        for c in self.channels:
            x = act(_dense(c, float(np.sqrt(2.0)))(_patches(x, self.kernel)))
            if self.pool > 1:
                x = _avg_pool(x, self.pool)
        x = x.reshape(lead + (-1,))
        return MLP(self.hidden_sizes, self.activation)(x)


def _patches(x: jax.Array, k: int) -> jax.Array:
    """[N, H, W, C] -> [N, H, W, k*k*C]: each pixel's k x k neighbourhood (zero "SAME" padding).

    A conv is then one Dense over the last axis: on a CPU much faster than XLA's convolution
    (docs/design.md).
    """
    lo = (k - 1) // 2
    hi = k - 1 - lo
    padded = jnp.pad(x, ((0, 0), (lo, hi), (lo, hi), (0, 0)))
    h, w = x.shape[1], x.shape[2]
    views = [padded[:, i:i + h, j:j + w, :] for i in range(k) for j in range(k)]
    return jnp.concatenate(views, axis=-1)


class Conv(nn.Module):
    """A 2-D convolution over [N, H, W, C] with nn.Conv's parameters (`kernel` [k, k, C,
    features], `bias` [features]; its layout, whichever way it is computed): `via="windows"`
    as one matmul over each output pixel's k x k window (`_windows`, `window_matmul`),
    `via="xla"` with XLA's convolution. Which is faster on a CPU depends on the layer
    (docs/design.md)."""

    features: int
    kernel: int
    stride: int = 1
    padding: str = "SAME"  # or "VALID"
    via: str = "windows"  # or "xla"
    kernel_init: Callable = nn.initializers.lecun_normal()  # nn.Conv's default

    @nn.compact
    def __call__(self, x):
        k = self.kernel
        kernel = self.param("kernel", self.kernel_init, (k, k, x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        if self.via == "xla":
            return xla_conv(x, kernel, self.stride, self.padding) + bias
        windows = _windows(x, k, self.stride, self.padding)
        return window_matmul(windows, kernel.reshape(-1, self.features)) + bias


@jax.custom_vjp
def window_matmul(windows: jax.Array, kernel: jax.Array) -> jax.Array:
    """`windows @ kernel` ([..., K] x [K, F]), with a gradient rule for the kernel's gradient.

    JAX derives it as windowsᵀ @ dy: one product whose contraction runs over every window of
    the batch (a 256-frame Atari minibatch: 102,400 of them for the Nature CNN's first conv)
    into a small [K, F] result, which XLA's CPU backend runs on about one core. Here it is
    dyᵀ @ windows over the two halves of the windows, as one batched product, summed: both
    cores busy, the Nature CNN's three kernel gradients about 2x faster on a 2-core CPU
    (docs/design.md). Same values up to float rounding (the halves add in another order)."""
    return windows @ kernel


def _window_matmul_fwd(windows, kernel):
    return windows @ kernel, (windows, kernel)


def _window_matmul_bwd(res, dy):
    windows, kernel = res
    k, f = kernel.shape
    rows = windows.reshape(-1, k)
    parts = 2 if rows.shape[0] % 2 == 0 else 1
    dk = jnp.einsum("bmf,bmk->bfk", dy.reshape(parts, -1, f), rows.reshape(parts, -1, k))
    return dy @ kernel.T, dk.sum(0).T


window_matmul.defvjp(_window_matmul_fwd, _window_matmul_bwd)


_NHWC = ("NHWC", "HWIO", "NHWC")


def xla_conv(x: jax.Array, kernel: jax.Array, stride: int = 1, padding: str = "SAME"):
    """XLA's convolution of x [N, H, W, C] with kernel [k, k, C, O] ("SAME" or "VALID").

    At stride 1 its gradients are convolutions in the one layout XLA's CPU backend runs
    with its fast (Eigen) kernels. The gradients JAX derives are convolutions in other
    layouts, which XLA rewrites into that one only outside loops: inside the update's scan
    over minibatches it ran them with its generic loops, four IMPALA CNN minibatch steps about
    16x slower (docs/design.md). Same values up to float rounding."""
    if stride != 1:
        return jax.lax.conv_general_dilated(x, kernel, (stride, stride), padding,
                                            dimension_numbers=_NHWC)
    return _conv_s1(x, kernel, _same_pads(kernel.shape[0]) if padding == "SAME" else (0, 0))


def _same_pads(k: int) -> tuple[int, int]:
    """(before, after) padding of a "SAME" conv of kernel side k at stride 1, as XLA pads."""
    return (k - 1) // 2, k - 1 - (k - 1) // 2


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv_s1(x, kernel, pads):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), [pads, pads], dimension_numbers=_NHWC)


def _conv_s1_fwd(x, kernel, pads):
    return _conv_s1(x, kernel, pads), (x, kernel)


def _conv_s1_bwd(pads, res, dy):
    x, kernel = res
    back = tuple(kernel.shape[0] - 1 - p for p in pads)
    # d/dx: dy correlated with the kernel flipped in space, its in/out channels swapped,
    # padded by what the forward conv's window reaches past each edge.
    flipped = jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2)
    dx = jax.lax.conv_general_dilated(dy, flipped, (1, 1), [back, back],
                                      dimension_numbers=_NHWC)
    # d/dkernel[a, b, c, o] = sum over n, i, j of x_padded[n, i + a, j + b, c] dy[n, i, j, o]:
    # a conv whose batch is the input channels and whose features are the examples.
    dk = jax.lax.conv_general_dilated(x.transpose(3, 1, 2, 0), dy.transpose(1, 2, 0, 3),
                                      (1, 1), [pads, pads], dimension_numbers=_NHWC)
    return dx, dk.transpose(1, 2, 0, 3)


_conv_s1.defvjp(_conv_s1_fwd, _conv_s1_bwd)


def max_pool(x: jax.Array, window: int = 3, stride: int = 2) -> jax.Array:
    """`nn.max_pool(x, (window, window), strides=(stride, stride), padding="SAME")` of x [N, H,
    W, C], with a gradient rule of its own: bit for bit the gradient JAX derives, without the
    scatter XLA's CPU backend makes of that gradient (four int32 index arrays and a scatter,
    each the size of the padded input: about 200 MB of an IMPALA CNN update's working memory
    at a 64-frame minibatch, docs/design.md)."""
    return _max_pool(x, window, stride)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _max_pool(x, window, stride):
    return nn.max_pool(x, (window, window), strides=(stride, stride), padding="SAME")


def _max_pool_fwd(x, window, stride):
    return _max_pool(x, window, stride), x


def _max_pool_bwd(window, stride, x, dy):
    """JAX's gradient of a max-pool (XLA's select-and-scatter): each window's first maximum in
    row-major order (a padding element counts as -inf) receives the window's dy, and each
    input sums what it receives in row-major order of the windows, from zero."""
    k, s = window, stride
    n, h, w, c = x.shape
    oh, ow = dy.shape[1], dy.shape[2]
    (ph, qh), (pw, qw) = jax.lax.padtype_to_pads((h, w), (k, k), (s, s), "SAME")
    padded = jnp.pad(x, ((0, 0), (ph, qh), (pw, qw), (0, 0)), constant_values=-jnp.inf)
    offsets = [(i, j) for i in range(k) for j in range(k)]
    best, chosen = None, None  # the window's maximum so far and its offset's index
    for o, (i, j) in enumerate(offsets):
        v = padded[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s, :]
        if best is None:
            best, chosen = v, jnp.zeros(v.shape, jnp.int32)
            continue
        take = ~(best >= v)  # the select keeps the current choice where current >= candidate
        best, chosen = jnp.where(take, v, best), jnp.where(take, o, chosen)
    # dx in the padded frame [N, A*s, B*s, C] is built one residue class (py % s, px % s) at a
    # time: class (r, q) holds the inputs at offsets i = r + s*m, j = q + s*n of window
    # (a - m, b - n), so it is a sum of shifted slices of the chosen-or-zero dy [N, A, B, C]
    # (XLA fuses each class into one pass; pads of the full-size frame it would keep).
    # Summing a class's offsets from the last adds each input's windows in row-major order;
    # a zero dy adds +0.0, as the scatter's sum from +0.0 leaves it.
    shift = (k - 1) // s  # the most windows an input sits in, less one, along an axis
    a_n, b_n = -(-(h + ph + qh) // s), -(-(w + pw + qw) // s)
    grow = ((0, 0), (shift, a_n - oh), (shift, b_n - ow), (0, 0))
    dy_p, chosen_p = jnp.pad(dy, grow), jnp.pad(chosen, grow, constant_values=-1)
    zero = jnp.zeros((), dy.dtype)
    rows = []
    for r in range(s):
        row = []
        for q in range(s):
            cls = None
            for o in reversed(range(len(offsets))):
                i, j = offsets[o]
                if i % s != r or j % s != q:
                    continue
                at = (slice(None), slice(shift - i // s, shift - i // s + a_n),
                      slice(shift - j // s, shift - j // s + b_n), slice(None))
                part = jnp.where((chosen_p[at] == o) & (dy_p[at] != 0), dy_p[at], zero)
                cls = part if cls is None else cls + part
            row.append(jnp.zeros((n, a_n, b_n, c), dy.dtype) if cls is None else cls)
        rows.append(jnp.stack(row, axis=3))  # [N, A, B, s, C]
    dx = jnp.stack(rows, axis=2).reshape(n, a_n * s, b_n * s, c)
    return (dx[:, ph:ph + h, pw:pw + w, :],)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def _windows(x: jax.Array, k: int, stride: int, padding: str) -> jax.Array:
    """[N, H, W, C] -> [N, H', W', k*k*C]: the k x k window of each output pixel of a conv of
    that stride, in the order of a conv kernel [k, k, C] flattened; "SAME" pads with zeros as
    XLA does (H' = ceil(H / stride)), "VALID" does not (H' = (H - k) // stride + 1)."""
    n, h, w, c = x.shape
    if padding == "SAME":
        out_h, out_w = -(-h // stride), -(-w // stride)
        pad_h, pad_w = (max((o - 1) * stride + k - d, 0) for o, d in ((out_h, h), (out_w, w)))
        x = jnp.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2),
                        (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
    else:
        out_h, out_w = (h - k) // stride + 1, (w - k) // stride + 1
    span_h, span_w = (out_h - 1) * stride + 1, (out_w - 1) * stride + 1
    views = [x[:, i:i + span_h:stride, j:j + span_w:stride, :] for i in range(k) for j in range(k)]
    return jnp.concatenate(views, axis=-1)


def _avg_pool(x: jax.Array, p: int) -> jax.Array:
    """[N, H, W, C] -> [N, H // p, W // p, C]: means of non-overlapping p x p windows (a
    remainder row or column is dropped, as a "VALID" pool drops it)."""
    n, h, w, c = x.shape
    h, w = h // p, w // p
    x = x[:, :h * p, :w * p, :].reshape(n, h, p, w, p, c)
    return jnp.mean(x, axis=(2, 4))


# Mnih et al. (2015)'s convolutions: (features, kernel, stride), "VALID" padding.
NATURE_CONVS = ((32, 8, 4), (64, 4, 2), (64, 3, 1))
NATURE_MIN_SIDE = 36  # the smallest image side its three convs leave a pixel of
IMPALA_CHANNELS = (16, 32, 32)  # Espeholt et al. (2018)'s stages, as cleanba's PPO
# How each torso computes its convolutions (`Conv.via`), the faster on a 2-core CPU
# (experiments/envpool_atari.py, docs/design.md): the Nature CNN's few large strided windows
# as matmuls; the IMPALA CNN's many 3x3 convs at full resolution (9x the activations as
# windows) with XLA's convolution.
NATURE_CONV_VIA, IMPALA_CONV_VIA = "windows", "xla"


class NatureCNN(nn.Module):
    """The DQN torso of Mnih et al. (2015), as CleanRL's ppo_atari: pixels / 255, convs of 32
    8x8 stride 4, 64 4x4 stride 2 and 64 3x3 stride 1 ("VALID"), Dense 512, each followed by
    a ReLU; orthogonal init sqrt(2), zero biases. Images [..., H, W, C] (given flat) of at
    least NATURE_MIN_SIDE pixels a side (84x84x4 frames: 1,686,693 parameters with two heads
    of 4 actions over one trunk, as CleanRL's)."""

    obs_shape: Sequence[int]

    @nn.compact
    def __call__(self, x):
        lead = x.shape[:-1]
        x = x.reshape((-1,) + tuple(self.obs_shape)) / 255.0
        for features, kernel, stride in NATURE_CONVS:
            x = nn.relu(Conv(features, kernel, stride, "VALID", NATURE_CONV_VIA,
                             kernel_init=orthogonal(float(np.sqrt(2.0))))(x))
        x = x.reshape(lead + (-1,))
        return nn.relu(_dense(512, float(np.sqrt(2.0)))(x))


class ImpalaCNN(nn.Module):
    """The IMPALA torso (Espeholt et al. 2018), as cleanba's PPO: pixels / 255, then per
    stage of IMPALA_CHANNELS a 3x3 conv, a 3x3 max-pool of stride 2 and two residual blocks
    (ReLU, 3x3 conv, ReLU, 3x3 conv, plus the input); a ReLU, Dense 256 and a ReLU. Convs
    "SAME" with flax's default (LeCun normal) init as cleanba's, the Dense orthogonal sqrt(2).
    Images [..., H, W, C] (given flat) of any size."""

    obs_shape: Sequence[int]

    @nn.compact
    def __call__(self, x):
        lead = x.shape[:-1]
        x = x.reshape((-1,) + tuple(self.obs_shape)) / 255.0
        for channels in IMPALA_CHANNELS:
            x = Conv(channels, 3, via=IMPALA_CONV_VIA)(x)
            x = max_pool(x, 3, 2)
            for _ in range(2):
                y = Conv(channels, 3, via=IMPALA_CONV_VIA)(nn.relu(x))
                x = x + Conv(channels, 3, via=IMPALA_CONV_VIA)(nn.relu(y))
        x = nn.relu(x).reshape(lead + (-1,))
        return nn.relu(_dense(256, float(np.sqrt(2.0)))(x))


def make_torso(net) -> nn.Module:
    """The torso described by a network module's fields (torso, obs_shape, conv_channels,
    conv_kernel, conv_pool, hidden_sizes, activation): the configurable CNN or MLP, or the
    fixed Nature or IMPALA CNN."""
    if net.torso == "cnn":
        return CNN(net.obs_shape, net.conv_channels, net.conv_kernel, net.hidden_sizes,
                   net.activation, net.conv_pool)
    if net.torso == "nature_cnn":
        return NatureCNN(net.obs_shape)
    if net.torso == "impala_cnn":
        return ImpalaCNN(net.obs_shape)
    return MLP(net.hidden_sizes, net.activation)


def setup_policy_heads(m) -> None:
    """Create the action-distribution heads on module `m` (called from its setup).

    `m.policy_head` gives logits / the Gaussian mean. Continuous actions add either a free
    `log_std` vector (initialised to `m.log_std_init`) or, with `m.state_dependent_std`, a
    `log_std_head` Dense layer on the same features. With `m.head_sizes`, the policy's heads
    and the value head (`value_of`) each first have MLP layers of their own over the features
    the torso (and GRU) give: `policy_layers` and `value_layers`.
    """
    if getattr(m, "head_sizes", ()):
        m.policy_layers = MLP(m.head_sizes, m.activation)
        m.value_layers = MLP(m.head_sizes, m.activation)
    m.policy_head = _dense(m.action_dim, 0.01)
    if m.discrete:
        return
    if m.state_dependent_std:
        m.log_std_head = _dense(m.action_dim, 0.01)
    else:
        m.log_std = m.param("log_std", nn.initializers.constant(m.log_std_init), (m.action_dim,))


def policy_dist(m, h: jax.Array) -> DistParams:
    """DistParams from features h [..., F] through the heads made by setup_policy_heads."""
    if getattr(m, "head_sizes", ()):
        h = m.policy_layers(h)
    loc = m.policy_head(h)
    if m.discrete:
        return DistParams(loc, jnp.zeros((m.action_dim,), loc.dtype))
    if m.state_dependent_std:
        log_std = jnp.clip(m.log_std_init + m.log_std_head(h), LOG_STD_MIN, LOG_STD_MAX)
        return DistParams(loc, log_std)
    return DistParams(loc, m.log_std)


def value_of(m, h: jax.Array) -> jax.Array:
    """The value [...] from features h [..., F]: `m.value_layers` (with `head_sizes`), then
    `m.value_head`."""
    if getattr(m, "head_sizes", ()):
        h = m.value_layers(h)
    return m.value_head(h)[..., 0]


# The built-in networks' modules that only the value reads; every other parameter is the
# policy's, or shared by both (a shared trunk, or the GRU of a critic without an input of
# its own).
CRITIC_MODULES = frozenset(("critic_torso", "critic_encoder", "critic_core", "value_layers",
                            "value_head"))


def critic_param_mask(params) -> np.ndarray:
    """bool [P] over `params` flattened as `ravel_pytree` flattens them: True for each entry
    of a parameter under one of CRITIC_MODULES (shapes only: works on tracers)."""
    parts = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        critic = any(getattr(k, "key", None) in CRITIC_MODULES for k in path)
        parts.append(np.full(int(np.prod(leaf.shape)), critic))
    return np.concatenate(parts)


class PolicyNetwork(nn.Module):
    """The fields every actor-critic shares: action head, torso (see `make_torso`), the layers
    of each head (`head_sizes`), Gaussian std options, and `carry_size` (0: feed-forward, no
    carry)."""

    action_dim: int
    discrete: bool
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"
    torso: str = "mlp"
    obs_shape: Sequence[int] = ()
    conv_channels: Sequence[int] = (16,)
    conv_kernel: int = 3
    conv_pool: int = 1
    log_std_init: float = 0.0
    state_dependent_std: bool = False
    carry_size: int = 0
    head_sizes: Sequence[int] = ()


class ActorCritic(PolicyNetwork):
    """Feed-forward policy and value heads over flat observations [..., obs_dim].

    Every network has one signature, `__call__(obs, carry=(), reset=None) -> (dist, value,
    carry)`; this one keeps no carry (it returns the empty one it was given) and ignores
    `reset`. Orthogonal init (sqrt(2) torso and head layers, 0.01 policy head, 1.0 value
    head) as in the PPO implementation-details literature; separate torsos unless
    `shared_trunk` (`head_sizes` then gives each head layers of its own). With
    `torso="cnn"` the flat observation is reshaped to `obs_shape` (H, W, C) for the convs.

    `central_critic` (MAPPO): the critic's torso reads `critic_obs` [..., C] (a multi-agent
    env's global state, or every agent's observation) instead of `obs`; a call without it
    acts only, and its value is None.
    """

    shared_trunk: bool = False
    central_critic: bool = False

    def setup(self):
        self.actor_torso = make_torso(self)
        if not self.shared_trunk:
            self.critic_torso = make_torso(self)
        setup_policy_heads(self)
        self.value_head = _dense(1, 1.0)

    def __call__(self, obs, carry=(), reset=None, critic_obs=None):
        h = self.actor_torso(obs)
        if self.central_critic:
            value = (None if critic_obs is None
                     else value_of(self, self.critic_torso(critic_obs)))
            return policy_dist(self, h), value, carry
        critic = h if self.shared_trunk else self.critic_torso(obs)
        return policy_dist(self, h), value_of(self, critic), carry


class RecurrentActorCritic(PolicyNetwork):
    """One step of a recurrent actor-critic: torso MLP (or CNN) -> GRUCell -> policy head and
    value head (each with layers of its own first, with `head_sizes`), one core shared by
    actor and critic.

    `__call__(obs [..., obs_dim], carry [..., carry_size] = zeros, reset [...] = None)`
    (carry_size >= 1) returns (dist, value [...], new carry); `reset` marks observations that start an
    episode, whose carry is zeroed first.

    `central_critic` (MAPPO with a GRU): the critic is a torso and GRU of its own over
    `critic_obs` [..., C] (the world state, or every agent's observation), with its own carry
    of the same size. A call with `critic_obs` takes and returns the carry pair (actor's,
    critic's); a call without it acts only: it takes and returns the actor's carry alone, and
    its value is None.
    """

    central_critic: bool = False

    def setup(self):
        self.encoder = make_torso(self)
        # flax's default recurrent init, made safe to vmap over seeds (see orthogonal).
        self.core = nn.GRUCell(features=self.carry_size, recurrent_kernel_init=orthogonal(1.0))
        setup_policy_heads(self)
        self.value_head = _dense(1, 1.0)
        if self.central_critic:
            self.critic_encoder = make_torso(self)
            self.critic_core = nn.GRUCell(features=self.carry_size,
                                          recurrent_kernel_init=orthogonal(1.0))

    def __call__(self, obs, carry=None, reset=None, critic_obs=None):
        central = self.central_critic and critic_obs is not None
        if carry is None or (isinstance(carry, tuple) and not carry):
            carry = initial_carry(self, obs.shape[:-1])
            carry = (carry, carry) if central else carry
        actor_carry, critic_carry = carry if central else (carry, None)
        actor_carry, y = self.core(_reset_carry(actor_carry, reset), self.encoder(obs))
        dist = policy_dist(self, y)
        if not self.central_critic:
            return dist, value_of(self, y), actor_carry
        if critic_obs is None:
            return dist, None, actor_carry
        critic_carry, z = self.critic_core(_reset_carry(critic_carry, reset),
                                           self.critic_encoder(critic_obs))
        return dist, value_of(self, z), (actor_carry, critic_carry)


def _reset_carry(carry: jax.Array, reset: jax.Array | None) -> jax.Array:
    """The carry [..., H] zeroed where `reset` [...] marks an episode's first observation."""
    if reset is None:
        return carry
    return carry * (1.0 - reset.astype(carry.dtype))[..., None]


def initial_carry(network, batch_shape: tuple[int, ...] = ()):
    """The carry at the start of an episode: () for a feed-forward network, zeros
    [*batch_shape, carry_size] for the built-in recurrent one, a user's module's own
    (`CustomNetwork.initial_carry`)."""
    if isinstance(network, PerAgentNetwork):
        network = network.inner
    if isinstance(network, CustomNetwork):
        return network.initial_carry(batch_shape)
    if not network.carry_size:
        return ()
    return jnp.zeros(tuple(batch_shape) + (network.carry_size,), jnp.float32)


def training_carry(network, batch_shape: tuple[int, ...] = ()):
    """The carry training keeps from step to step: `initial_carry`, or for the built-in GRU
    with a centralised critic the pair (actor's, critic's), both zeros."""
    inner = network.inner if isinstance(network, PerAgentNetwork) else network
    carry = initial_carry(network, batch_shape)
    if isinstance(inner, RecurrentActorCritic) and inner.central_critic:
        return (carry, carry)
    return carry


def is_recurrent(network) -> bool:
    """True when the network carries a state from step to step."""
    if isinstance(network, PerAgentNetwork):
        network = network.inner
    if isinstance(network, CustomNetwork):
        return network.recurrent
    return bool(network.carry_size)


# ---------------------------------------------------------------- a user's own network
@dataclasses.dataclass(frozen=True, eq=False)
class CustomNetwork:
    """A user's flax module under the one network contract, `init(key, obs)` and
    `apply(params, obs, carry=(), reset=None) -> (DistParams, value, carry)`.

    The module's own contract (docs/configuration.md, "Your own network"):

    * `__call__(obs, carry, reset) -> (outputs, value, new_carry)` for observations
      [..., obs_dim] (flat, normalised when the config says so) with any leading axes;
    * `outputs`: the logits [..., num_actions] of discrete actions, or `(mean, log_std)` of
      continuous ones, mean [..., D] and log_std [D] (one vector for every state) or [..., D];
    * `value`: V(obs), shape [...] (no trailing 1);
    * `carry`: () for a feed-forward module (it gets () and its returned carry is ignored);
      a recurrent one defines `initial_carry(batch_shape) -> pytree` of arrays
      [*batch_shape, ...], a pure function of the shape (no params), and returns a new carry
      of the same structure, shapes and dtypes;
    * `reset`: bool [...], true where `obs` starts an episode: a recurrent module starts
      those from `initial_carry` itself (the built-in GRU zeroes its carry there);
    * params: only the "params" collection, every leaf a float array;
    * fields `action_dim` and `discrete`, when the module declares them and leaves them None,
      are set from the env (`make_custom_network`).

    The params are the module's own variables (`module.init(key, obs, carry, reset)`), not
    nested under this adapter, so a module laid out as a built-in network initialises to the
    same numbers. `jaxppo.resolve` checks the contract
    (`jaxppo.program.user_network.check_custom_network`).
    """

    module: nn.Module
    discrete: bool
    action_dim: int
    recurrent: bool

    def initial_carry(self, batch_shape: tuple[int, ...] = ()):
        """The module's `initial_carry(batch_shape)`; () for a feed-forward module."""
        if not self.recurrent:
            return ()
        return self.module.initial_carry(tuple(batch_shape))

    def inputs(self, obs, carry=(), reset=None):
        """(obs, carry, reset) as the module takes them: the initial carry when none is given
        (a recurrent module), and reset all false when none is given."""
        batch = obs.shape[:-1]
        if not self.recurrent:
            carry = ()
        elif carry is None or (isinstance(carry, tuple) and not carry):
            carry = self.initial_carry(batch)
        if reset is None:
            reset = jnp.zeros(batch, bool)
        return obs, carry, reset

    def init(self, key, obs, carry=(), reset=None):
        return self.module.init(key, *self.inputs(obs, carry, reset))

    def apply(self, params, obs, carry=(), reset=None):
        outputs, value, carry = self.module.apply(params, *self.inputs(obs, carry, reset))
        return self.dist(outputs), value, (carry if self.recurrent else ())

    def dist(self, outputs) -> DistParams:
        """DistParams of the module's outputs: logits, or (mean, log_std)."""
        if self.discrete:
            return DistParams(outputs, jnp.zeros((self.action_dim,), outputs.dtype))
        mean, log_std = outputs
        return DistParams(mean, log_std)


# ---------------------------------------------------------------- one network per agent
def agent_groups(agents, named=None) -> tuple[int, ...]:
    """Each agent's group index. `agent_params: per_group` (`named` None): agents whose names
    differ only in a trailing "_<index>" share a group (MPE's adversary_0, adversary_1 |
    agent_0), numbered in the order the groups first appear in `agents`. `named`, a mapping
    {group: [agent, ...]} holding every agent once (program.resolved checks it): the groups
    in its order."""
    if named is None:
        kinds = [re.sub(r"_\d+$", "", str(a)) for a in agents]
        order = list(dict.fromkeys(kinds))
        return tuple(order.index(k) for k in kinds)
    group_of = {m: g for g, members in enumerate(named.values()) for m in members}
    return tuple(group_of[str(a)] for a in agents)


@dataclasses.dataclass(frozen=True, eq=False)
class PerAgentNetwork:
    """A network of its own for each agent of a multi-agent env (`agent_params: per_agent`),
    or for each group of agents (`per_group`: `groups`), under the one network contract:
    `init` gives the inner network's params with a leading axis [N, ...] (one per agent, or
    [G, ...], one per group; each from its own key), and `apply` runs each actor through its
    own agent's params (its group's: the params gathered to [N, ...] first, so a group's
    gradient is the sum over its agents').

    Inputs keep the actors on their last batch axis, env-major (actor k is agent k % N, as
    the batch folds them: [..., E*N, D], a minibatch's [B, D] of whole [T, E*N] rows, or one
    env's [..., N, D]); they are regrouped agent-major, [N, ..., K/N, D], for a vmap over the
    agent axis, and the outputs put back in the actors' order. A Gaussian's log_std shared by
    every state becomes one per agent, so it comes back per actor, like `loc` [..., K, D].
    """

    inner: object  # the network each agent runs (ActorCritic or a user's CustomNetwork)
    num_agents: int
    discrete: bool
    # Each agent's network applied in turn instead of vmapped over the agents (the same
    # numbers up to float rounding): for an ONNX export, as jax2onnx does not batch flax
    # modules under a vmap.
    unrolled: bool = False
    # Agent i's network index, groups[i] in 0..G-1 (`agent_groups`); None: one per agent.
    groups: tuple[int, ...] | None = None

    @property
    def num_networks(self) -> int:
        return self.num_agents if self.groups is None else max(self.groups) + 1

    def init(self, key, obs, critic_obs=None):
        """Params [N, ...] (or [G, ...]): the inner network's, initialised from N (G) keys
        split off `key`."""
        keys = jax.random.split(key, self.num_networks)
        if critic_obs is None:
            return jax.vmap(lambda k: self.inner.init(k, obs))(keys)
        return jax.vmap(lambda k: self.inner.init(k, obs, critic_obs=critic_obs))(keys)

    def apply(self, params, obs, carry=(), reset=None, critic_obs=None):
        """(dist, value [..., K], carry) of actors' inputs obs [..., K, D] (and a centralised
        critic's critic_obs [..., K, C]), actor k through params[k % N]; a recurrent
        network's carry (leaves [..., K, ...]) and reset [..., K] are regrouped the same way,
        a feed-forward network's carry () passes through."""
        n = self.num_agents
        if obs.ndim < 2 or obs.shape[-2] % n:
            raise ValueError(
                f"observations {tuple(obs.shape)}: a policy with a network per agent "
                f"(agent_params=per_agent) needs every agent's observation, [..., {n}, D] "
                "(agents in the env's order), to give each one its own network")
        ax = obs.ndim - 2  # the actors' axis, in the inputs and the outputs

        def by_agent(x):  # [..., K, *rest] -> [N, ..., K/N, *rest]
            x = x.reshape(x.shape[:ax] + (x.shape[ax] // n, n) + x.shape[ax + 1:])
            return jnp.moveaxis(x, ax + 1, 0)

        def by_actor(y):  # [N, ..., K/N, *rest] -> [..., K, *rest]
            y = jnp.moveaxis(y, 0, ax + 1)
            return y.reshape(y.shape[:ax] + (-1,) + y.shape[ax + 2:])

        def one(p, x, c, h, r):
            if c is None:
                return self.inner.apply(p, x, h, r)
            return self.inner.apply(p, x, h, r, critic_obs=c)

        regroup = lambda tree: jax.tree.map(by_agent, tree)  # noqa: E731
        if self.groups is not None:  # each agent's group's params, [G, ...] -> [N, ...]
            params = jax.tree.map(lambda p: p[np.asarray(self.groups)], params)
        inputs = (params, by_agent(obs), regroup(critic_obs), regroup(carry), regroup(reset))
        if self.unrolled:
            outs = [one(*jax.tree.map(lambda x: x[i], inputs)) for i in range(n)]
            dist, value, carry_out = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
        else:
            dist, value, carry_out = jax.vmap(one)(*inputs)
        loc = by_actor(dist.loc)
        if self.discrete:  # unused by a categorical: one row, as a shared network gives
            log_std = dist.log_std[0]
        elif dist.log_std.ndim == 2:  # [N, D]: each agent's vector, for each of its actors
            lead = (1,) * (ax + 1)
            shape = (n,) + obs.shape[:-2] + (obs.shape[-2] // n, loc.shape[-1])
            log_std = by_actor(jnp.broadcast_to(
                dist.log_std.reshape((n,) + lead + (loc.shape[-1],)), shape))
        else:
            log_std = by_actor(dist.log_std)
        value = None if value is None else by_actor(value)
        return DistParams(loc, log_std), value, jax.tree.map(by_actor, carry_out)

    def agent_params(self, params, agent: int):
        """Agent `agent`'s params (its group's), as the inner network takes them."""
        index = agent if self.groups is None else self.groups[agent]
        return jax.tree.map(lambda p: p[index], params)


def make_custom_network(config, spec, module: nn.Module) -> CustomNetwork:
    """The config's own module (`module`, built from `network.module` outside core/) under the
    network contract, recurrent when its `initial_carry` gives a carry with arrays
    (unchecked: `check_custom_network` checks)."""
    module = _with_env_fields(module, spec)
    recurrent = False
    if callable(getattr(module, "initial_carry", None)):
        try:
            recurrent = bool(jax.tree.leaves(jax.eval_shape(lambda: module.initial_carry((1,)))))
        except Exception as e:  # noqa: BLE001 - the user's code: any failure is the config's
            raise ConfigError(
                f"network.module={module_name(config.network.module)}: initial_carry((1,)) raised "
                f"{type(e).__name__}: {str(e)[:200]}; it must return the carry at an episode's "
                "start for the batch shape it is given (a pytree of arrays [*batch_shape, ...])"
            ) from None
    return CustomNetwork(module, spec.discrete, spec.action_dim, recurrent)


def _with_env_fields(module: nn.Module, spec) -> nn.Module:
    """The module with its fields `action_dim` and `discrete`, where it declares them and
    leaves them None, set from the env (so one module class serves every env)."""
    names = {f.name for f in dataclasses.fields(module)}
    fill = {k: v for k, v in (("action_dim", spec.action_dim), ("discrete", spec.discrete))
            if k in names and getattr(module, k) is None}
    return module.clone(**fill) if fill else module


def module_name(module) -> str:
    """A config's network.module as messages name it: "module:Class", or the class name."""
    return repr(module) if isinstance(module, str) else type(module).__name__


CNN_TORSOS = ("cnn", "nature_cnn", "impala_cnn")


def resolve_torso(config, spec) -> str:
    """The torso, "mlp" or one of CNN_TORSOS; "auto" picks "cnn" for image observations
    [H, W, C].

    Raises:
      ConfigError: a CNN torso for observations that are not images, or the Nature CNN for
        images smaller than its convolutions.
    """
    torso = config.network.torso
    if torso == "auto":
        return "cnn" if len(spec.obs_shape) == 3 else "mlp"
    if torso in CNN_TORSOS and len(spec.obs_shape) != 3:
        raise ConfigError(
            f"network.torso={torso!r} needs image observations [H, W, C], but "
            f"{config.env_name} has observation shape {spec.obs_shape}; use "
            "network.torso='mlp' or 'auto'"
        )
    if torso == "nature_cnn" and min(spec.obs_shape[:2]) < NATURE_MIN_SIDE:
        raise ConfigError(
            f"network.torso='nature_cnn' needs images of at least {NATURE_MIN_SIDE}x"
            f"{NATURE_MIN_SIDE} pixels (its 8x8/4, 4x4/2 and 3x3 convolutions leave nothing of "
            f"smaller ones), but {config.env_name}'s are {spec.obs_shape[0]}x{spec.obs_shape[1]}; "
            "use network.torso='impala_cnn' or 'cnn' (any size)"
        )
    return torso


def make_network(config, spec, module: nn.Module | None = None) -> nn.Module:
    """The config's network for an env.

    Args:
      config: the PPOConfig (its `network` fields).
      spec: the env's EnvSpec.
      module: the user's flax module that `network.module` names, built (`resolve` imports
        it); needed only when the config has one.

    Returns:
      An ActorCritic, or a RecurrentActorCritic when `network.recurrent_size > 0`, or the
      user's module (`network.module`) as a CustomNetwork.

    Raises:
      ConfigError: a CNN torso for observations that are not images, or a user's module
        whose initial_carry fails.
    """
    net = config.network
    if net.custom:
        return make_custom_network(config, spec, module)
    common = dict(
        action_dim=spec.action_dim,
        discrete=spec.discrete,
        hidden_sizes=tuple(net.hidden_sizes),
        activation=net.activation,
        torso=resolve_torso(config, spec),
        obs_shape=tuple(spec.obs_shape),
        conv_channels=tuple(net.conv_channels),
        conv_kernel=net.conv_kernel,
        conv_pool=net.conv_pool,
        log_std_init=float(net.log_std_init),
        state_dependent_std=bool(net.state_dependent_std),
        head_sizes=tuple(net.head_sizes),
    )
    if net.recurrent_size:
        return RecurrentActorCritic(carry_size=net.recurrent_size,
                                    central_critic=config.critic_input != "local", **common)
    return ActorCritic(shared_trunk=net.shared_trunk,
                       central_critic=config.critic_input != "local", **common)
