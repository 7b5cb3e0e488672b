"""The PPO loss terms, the KL-coefficient rule and the action distributions, against numpy.

The references below are written from the textbook formulas (softmax probabilities, the
Gaussian density, numerical integration), not from the code under test.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.core import networks
from jaxppo.core.losses import Batch, ppo_loss_terms, update_kl_coeff
from jaxppo.core.networks import DistParams

CLIP = 0.2
VF_CLIP = 0.3
VF_COEFF = 0.5
ENT_COEFF = 0.01
KL_COEFF = 0.7


# ------------------------------------------------------------------ numpy references
def np_softmax(logits):
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def np_gauss_pdf(x, mu, sigma):
    return np.exp(-((x - mu) ** 2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))


def reference_terms(logp_new, logp_old, adv, new_v, old_v, targets, entropy, kl, vf_clip):
    """Every loss term from per-sample quantities, by explicit loops."""
    n = len(adv)
    pol, vl, vlc, akl, clipped = [], [], [], [], 0
    for i in range(n):
        r = math.exp(logp_new[i] - logp_old[i])
        r_clip = min(max(r, 1 - CLIP), 1 + CLIP)
        pol.append(-min(r * adv[i], r_clip * adv[i]))
        akl.append((r - 1) - math.log(r))
        clipped += abs(r - 1) > CLIP
        err = (new_v[i] - targets[i]) ** 2
        vl.append(0.5 * err)
        v_c = old_v[i] + min(max(new_v[i] - old_v[i], -vf_clip), vf_clip)
        vlc.append(0.5 * max(err, (v_c - targets[i]) ** 2))
    out = dict(
        policy_loss=np.mean(pol), value_loss=np.mean(vl), value_loss_clipped=np.mean(vlc),
        entropy=np.mean(entropy), kl=np.mean(kl), approx_kl=np.mean(akl),
        clip_fraction=clipped / n,
    )
    return out


def _terms(discrete, new_dist, new_values, batch, *, use_kl_loss, use_vf_clip):
    return ppo_loss_terms(
        discrete, new_dist, jnp.asarray(new_values), batch,
        clip_param=CLIP, vf_clip_param=VF_CLIP, vf_coeff=VF_COEFF, entropy_coeff=ENT_COEFF,
        kl_coeff=KL_COEFF, use_kl_loss=use_kl_loss, use_vf_clip=use_vf_clip,
    )


def _value_data(rng, B):
    old_v = rng.normal(size=B).astype(np.float32)
    # Moves of the value both inside and well outside the +-VF_CLIP band, in both directions.
    new_v = (old_v + rng.choice([-1.0, -0.1, 0.05, 0.6], size=B)).astype(np.float32)
    targets = (old_v + rng.normal(scale=1.0, size=B)).astype(np.float32)
    return old_v, new_v, targets


# ------------------------------------------------------------------ discrete batch
@pytest.fixture(scope="module")
def discrete_case():
    rng = np.random.default_rng(0)
    B, A = 12, 4
    old_logits = rng.normal(size=(B, A)).astype(np.float32)
    new_logits = (old_logits + rng.normal(scale=0.2, size=(B, A))).astype(np.float32)
    actions = rng.integers(0, A, size=B)
    adv = rng.normal(size=B).astype(np.float32)
    old_v, new_v, targets = _value_data(rng, B)

    p_old, p_new = np_softmax(old_logits.astype(np.float64)), np_softmax(new_logits.astype(np.float64))
    logp_old = np.log(p_old[np.arange(B), actions])
    logp_new = np.log(p_new[np.arange(B), actions])
    ent = [-sum(p * math.log(p) for p in row) for row in p_new]
    kl = [sum(po * math.log(po / pn) for po, pn in zip(ro, rn)) for ro, rn in zip(p_old, p_new)]
    ref = reference_terms(logp_new, logp_old, adv, new_v, old_v, targets, ent, kl, VF_CLIP)

    batch = Batch(
        obs=jnp.zeros((B, 3)), actions=jnp.asarray(actions, jnp.int32),
        old_log_probs=jnp.asarray(logp_old, jnp.float32),
        old_dist=DistParams(jnp.asarray(old_logits), jnp.zeros((A,))),
        old_values=jnp.asarray(old_v), advantages=jnp.asarray(adv),
        value_targets=jnp.asarray(targets),
    )
    new_dist = DistParams(jnp.asarray(new_logits), jnp.zeros((A,)))
    return new_dist, new_v, batch, ref


# ------------------------------------------------------------------ continuous batch
@pytest.fixture(scope="module")
def continuous_case():
    rng = np.random.default_rng(1)
    B, D = 10, 2
    old_mu = rng.normal(size=(B, D)).astype(np.float32)
    old_log_std = np.array([-0.3, 0.2], np.float32)
    new_mu = (old_mu + rng.normal(scale=0.4, size=(B, D))).astype(np.float32)
    new_log_std = np.array([-0.1, 0.05], np.float32)
    actions = (old_mu + np.exp(old_log_std) * rng.normal(size=(B, D))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    old_v, new_v, targets = _value_data(rng, B)

    s_old, s_new = np.exp(old_log_std.astype(np.float64)), np.exp(new_log_std.astype(np.float64))
    logp_old = np.log(np_gauss_pdf(actions, old_mu, s_old)).sum(axis=1)
    logp_new = np.log(np_gauss_pdf(actions, new_mu, s_new)).sum(axis=1)
    ent_per_dim = 0.5 * np.log(2 * math.pi * math.e * s_new**2)
    ent = np.full(B, ent_per_dim.sum())
    kl = (np.log(s_new / s_old) + (s_old**2 + (old_mu - new_mu) ** 2) / (2 * s_new**2) - 0.5).sum(1)
    ref = reference_terms(logp_new, logp_old, adv, new_v, old_v, targets, ent, kl, VF_CLIP)

    batch = Batch(
        obs=jnp.zeros((B, 3)), actions=jnp.asarray(actions),
        old_log_probs=jnp.asarray(logp_old, jnp.float32),
        old_dist=DistParams(jnp.asarray(old_mu), jnp.asarray(old_log_std)),
        old_values=jnp.asarray(old_v), advantages=jnp.asarray(adv),
        value_targets=jnp.asarray(targets),
    )
    new_dist = DistParams(jnp.asarray(new_mu), jnp.asarray(new_log_std))
    return new_dist, new_v, batch, ref


CASES = ["discrete_case", "continuous_case"]


@pytest.mark.parametrize("case", CASES)
def test_batch_exercises_clipping(case, request):
    """Sanity of the fixtures: some ratios and some values are clipped, some are not."""
    *_, ref = request.getfixturevalue(case)
    assert 0.0 < ref["clip_fraction"] < 1.0
    assert ref["value_loss_clipped"] > ref["value_loss"]


@pytest.mark.parametrize("case", CASES)
def test_each_term(case, request):
    new_dist, new_v, batch, ref = request.getfixturevalue(case)
    discrete = case == "discrete_case"
    t = _terms(discrete, new_dist, new_v, batch, use_kl_loss=False, use_vf_clip=False)
    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(t.policy_loss), ref["policy_loss"], **tol)
    np.testing.assert_allclose(float(t.value_loss), ref["value_loss"], **tol)
    np.testing.assert_allclose(float(t.entropy), ref["entropy"], **tol)
    np.testing.assert_allclose(float(t.kl), ref["kl"], **tol)
    np.testing.assert_allclose(float(t.approx_kl), ref["approx_kl"], rtol=1e-4, atol=1e-6)
    assert float(t.clip_fraction) == pytest.approx(ref["clip_fraction"], abs=1e-7)


@pytest.mark.parametrize("case", CASES)
def test_clipped_value_loss(case, request):
    new_dist, new_v, batch, ref = request.getfixturevalue(case)
    t = _terms(case == "discrete_case", new_dist, new_v, batch, use_kl_loss=False, use_vf_clip=True)
    np.testing.assert_allclose(float(t.value_loss), ref["value_loss_clipped"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("use_kl_loss", [False, True])
@pytest.mark.parametrize("use_vf_clip", [False, True])
def test_total(case, use_kl_loss, use_vf_clip, request):
    new_dist, new_v, batch, ref = request.getfixturevalue(case)
    t = _terms(case == "discrete_case", new_dist, new_v, batch,
               use_kl_loss=use_kl_loss, use_vf_clip=use_vf_clip)
    vl = ref["value_loss_clipped"] if use_vf_clip else ref["value_loss"]
    expected = ref["policy_loss"] + VF_COEFF * vl - ENT_COEFF * ref["entropy"]
    if use_kl_loss:
        expected += KL_COEFF * ref["kl"]
    np.testing.assert_allclose(float(t.total), expected, rtol=1e-5, atol=1e-6)


def test_value_clipping_by_hand():
    """Two samples with explicit numbers, vf_clip = 0.3.

    sample 0: V_old=0, V=1, target=1: unclipped err 0; clipped V = 0.3, err 0.49 -> max 0.49
    sample 1: V_old=0, V=0.1, target=-1: err 1.21; clipped V = 0.1, same -> 1.21
    value_loss = 0.5 * mean(0.49, 1.21) = 0.425 (unclipped: 0.5 * mean(0, 1.21) = 0.3025)
    """
    batch = Batch(
        obs=jnp.zeros((2, 1)), actions=jnp.zeros((2,), jnp.int32),
        old_log_probs=jnp.log(jnp.full((2,), 0.5)),
        old_dist=DistParams(jnp.zeros((2, 2)), jnp.zeros((2,))),
        old_values=jnp.array([0.0, 0.0]), advantages=jnp.array([1.0, -1.0]),
        value_targets=jnp.array([1.0, -1.0]),
    )
    dist = DistParams(jnp.zeros((2, 2)), jnp.zeros((2,)))
    clipped = _terms(True, dist, [1.0, 0.1], batch, use_kl_loss=False, use_vf_clip=True)
    plain = _terms(True, dist, [1.0, 0.1], batch, use_kl_loss=False, use_vf_clip=False)
    assert float(clipped.value_loss) == pytest.approx(0.425, rel=1e-6)
    assert float(plain.value_loss) == pytest.approx(0.3025, rel=1e-6)
    # Same policy: ratio 1, no clipping, KL 0, policy loss -mean(A) = 0, entropy log 2.
    assert float(plain.policy_loss) == pytest.approx(0.0, abs=1e-7)
    assert float(plain.kl) == pytest.approx(0.0, abs=1e-7)
    assert float(plain.approx_kl) == pytest.approx(0.0, abs=1e-7)
    assert float(plain.clip_fraction) == 0.0
    assert float(plain.entropy) == pytest.approx(math.log(2), rel=1e-6)


def test_policy_clipping_by_hand():
    """Ratios 2 (A>0: clipped to 1.2), 2 (A<0: unclipped -2), 0.5 (A>0: 0.5), 0.5 (A<0: -0.8).

    surrogate = [1.2, -2.0, 0.5, -0.8]; policy_loss = -mean = 0.275; clip fraction 1.
    """
    logp_old = jnp.log(jnp.array([0.25, 0.25, 0.5, 0.5]))
    # new probabilities of the taken action 0: 0.5, 0.5, 0.25, 0.25 (two actions)
    p_new = jnp.array([0.5, 0.5, 0.25, 0.25])
    new_logits = jnp.stack([jnp.log(p_new), jnp.log(1 - p_new)], axis=1)
    old_p = jnp.exp(logp_old)
    old_logits = jnp.stack([jnp.log(old_p), jnp.log(1 - old_p)], axis=1)
    batch = Batch(
        obs=jnp.zeros((4, 1)), actions=jnp.zeros((4,), jnp.int32), old_log_probs=logp_old,
        old_dist=DistParams(old_logits, jnp.zeros((2,))), old_values=jnp.zeros(4),
        advantages=jnp.array([1.0, -1.0, 1.0, -1.0]), value_targets=jnp.zeros(4),
    )
    t = _terms(True, DistParams(new_logits, jnp.zeros((2,))), jnp.zeros(4), batch,
               use_kl_loss=False, use_vf_clip=False)
    assert float(t.policy_loss) == pytest.approx(0.275, rel=1e-5)
    assert float(t.clip_fraction) == 1.0
    # approx_kl: (r - 1) - log r for r = 2, 2, 0.5, 0.5
    expected = np.mean([1 - math.log(2)] * 2 + [-0.5 + math.log(2)] * 2)
    assert float(t.approx_kl) == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------ KL coefficient
@pytest.mark.parametrize("target", [0.01, 0.25])
@pytest.mark.parametrize(
    "kl_over_target,factor",
    [
        (10.0, 1.5), (2.0001, 1.5),  # above 2*target: x1.5
        (2.0, 1.0), (1.0, 1.0), (0.5, 1.0), (1.9, 1.0), (0.6, 1.0),  # in between, boundaries
        (0.4999, 0.5), (0.1, 0.5), (0.0, 0.5),  # below target/2: x0.5
    ],
)
def test_update_kl_coeff(target, kl_over_target, factor):
    t32 = np.float32(target)
    kl = np.float32(kl_over_target) * t32  # exact at the boundaries (x2 and x0.5 are exact)
    if kl_over_target in (2.0, 0.5):
        assert kl == np.float32(kl_over_target * target)
    out = update_kl_coeff(jnp.float32(0.2), jnp.float32(kl), jnp.float32(t32))
    assert float(out) == pytest.approx(0.2 * factor, rel=1e-6)


def test_update_kl_coeff_is_elementwise():
    out = update_kl_coeff(jnp.array([1.0, 1.0, 1.0]), jnp.array([0.05, 0.01, 0.001]), 0.01)
    np.testing.assert_allclose(np.asarray(out), [1.5, 1.0, 0.5])


# ------------------------------------------------------------------ distributions
def test_gaussian_log_prob_entropy_kl():
    rng = np.random.default_rng(3)
    B, D = 6, 3
    mu_p = rng.normal(size=(B, D)).astype(np.float32)
    mu_q = rng.normal(size=(B, D)).astype(np.float32)
    ls_p = rng.normal(scale=0.5, size=D).astype(np.float32)
    ls_q = rng.normal(scale=0.5, size=D).astype(np.float32)
    x = rng.normal(size=(B, D)).astype(np.float32)
    p, q = DistParams(jnp.asarray(mu_p), jnp.asarray(ls_p)), DistParams(jnp.asarray(mu_q), jnp.asarray(ls_q))
    sp, sq = np.exp(ls_p.astype(np.float64)), np.exp(ls_q.astype(np.float64))

    lp = networks.log_prob(False, p, jnp.asarray(x))
    assert lp.shape == (B,)
    np.testing.assert_allclose(np.asarray(lp), np.log(np_gauss_pdf(x, mu_p, sp)).sum(1), rtol=1e-5)

    ent = networks.entropy(False, p)
    assert ent.shape == (B,)
    np.testing.assert_allclose(np.asarray(ent), np.full(B, (0.5 * np.log(2 * np.pi * np.e * sp**2)).sum()),
                               rtol=1e-5)

    kl = networks.kl_divergence(False, p, q)
    assert kl.shape == (B,)
    ref = (np.log(sq / sp) + (sp**2 + (mu_p - mu_q) ** 2) / (2 * sq**2) - 0.5).sum(1)
    np.testing.assert_allclose(np.asarray(kl), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(networks.kl_divergence(False, p, p)), 0.0, atol=1e-6)


def test_gaussian_entropy_and_kl_by_numerical_integration():
    """One dimension, integrals on a fine grid: entropy = -int p log p, KL = int p log(p/q)."""
    mu_p, ls_p, mu_q, ls_q = 0.3, -0.4, -0.5, 0.2
    xs = np.linspace(-12, 12, 200_001)
    p = np_gauss_pdf(xs, mu_p, math.exp(ls_p))
    q = np_gauss_pdf(xs, mu_q, math.exp(ls_q))
    ent_num = -np.trapezoid(p * np.log(p), xs)
    kl_num = np.trapezoid(p * (np.log(p) - np.log(q)), xs)
    P = DistParams(jnp.array([[mu_p]]), jnp.array([ls_p]))
    Q = DistParams(jnp.array([[mu_q]]), jnp.array([ls_q]))
    assert float(networks.entropy(False, P)[0]) == pytest.approx(ent_num, rel=1e-5)
    assert float(networks.kl_divergence(False, P, Q)[0]) == pytest.approx(kl_num, rel=1e-4)
    # log_prob of a point equals log of the density
    assert float(networks.log_prob(False, P, jnp.array([[1.1]]))[0]) == pytest.approx(
        math.log(np_gauss_pdf(1.1, mu_p, math.exp(ls_p))), rel=1e-5)


def test_gaussian_per_sample_log_std():
    """log_std broadcast to [B, D] (as the rollout stores it) gives the same numbers."""
    mu = jnp.array([[0.0, 1.0], [2.0, -1.0]])
    ls = jnp.array([0.1, -0.2])
    x = jnp.array([[0.5, 0.5], [1.0, 1.0]])
    a = networks.log_prob(False, DistParams(mu, ls), x)
    b = networks.log_prob(False, DistParams(mu, jnp.broadcast_to(ls, mu.shape)), x)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(networks.entropy(False, DistParams(mu, ls))),
                               np.asarray(networks.entropy(False, DistParams(mu, jnp.broadcast_to(ls, mu.shape)))))


def test_categorical_log_prob_entropy_kl():
    rng = np.random.default_rng(4)
    lp_, lq_ = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(5, 3)).astype(np.float32)
    a = rng.integers(0, 3, size=5)
    P, Q = np_softmax(lp_.astype(np.float64)), np_softmax(lq_.astype(np.float64))
    p, q = DistParams(jnp.asarray(lp_), jnp.zeros(3)), DistParams(jnp.asarray(lq_), jnp.zeros(3))
    np.testing.assert_allclose(np.asarray(networks.log_prob(True, p, jnp.asarray(a))),
                               np.log(P[np.arange(5), a]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(networks.entropy(True, p)), -(P * np.log(P)).sum(1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(networks.kl_divergence(True, p, q)),
                               (P * np.log(P / Q)).sum(1), rtol=1e-5, atol=1e-6)


def test_gaussian_sample_statistics():
    """Samples have the distribution's mean and std (loose statistical check)."""
    import jax

    dist = DistParams(jnp.full((20_000, 2), jnp.array([1.0, -2.0])), jnp.array([0.0, math.log(0.5)]))
    x = np.asarray(networks.sample(False, dist, jax.random.PRNGKey(0)))
    np.testing.assert_allclose(x.mean(0), [1.0, -2.0], atol=0.03)
    np.testing.assert_allclose(x.std(0), [1.0, 0.5], rtol=0.03)
    np.testing.assert_array_equal(np.asarray(networks.mode(False, dist)), np.asarray(dist.loc))
