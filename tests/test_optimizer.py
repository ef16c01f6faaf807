"""Every optimizer against its MXNet 1.9 formula, computed here in plain Python, step by step."""
import json
import math
import pathlib

import ml_dtypes
import numpy as np
import pytest

import tensorkv
from tensorkv import optimizer
from tensorkv.optimizer import (
    DCASGD, FTML, LAMB, LARS, NAG, SGD, AdaDelta, AdaGrad, Adam, Adamax, Ftrl, Nadam, RMSProp, Signum, Updater,
)
from tensorkv.lr_scheduler import FactorScheduler
from tensorkv.optimizer import adam as adam_module, sgd as sgd_module
from tensorkv.optimizer.adam import _momentum_schedule
from tensorkv.update.rowsparse import RowSparse

WEIGHT = [0.5, -1.0, 2.0, 0.0]
GRADS = [[0.1, -0.3, 2.5, 0.0], [-1.2, 0.4, 0.05, 3.0], [0.7, 0.7, -2.2, -0.1]]


def clip(x, bound):
    return x if bound is None else max(-bound, min(bound, x))


def sign(x):
    return (x > 0) - (x < 0)


def run(opt, steps=GRADS, dtype=np.float64):
    """The weights after each step, through the Updater as a store calls it."""
    updater = Updater(opt)
    weight = np.array(WEIGHT, dtype)
    out = []
    for grad in steps:
        updater(0, np.array(grad, dtype), weight)
        out.append(weight.astype(np.float64).tolist())
    return out


def expect_sgd(lr, momentum, wd, rescale, clip_at):
    w, mom, out = list(WEIGHT), [0.0] * len(WEIGHT), []
    for grad in GRADS:
        for i, g in enumerate(grad):
            g = clip(rescale * g, clip_at)
            if momentum == 0:
                w[i] = (1 - lr * wd) * w[i] - lr * g
            else:
                mom[i] = momentum * mom[i] - lr * wd * w[i] - lr * g
                w[i] += mom[i]
        out.append(list(w))
    return out


def expect_adam(lr, beta1, beta2, eps, wd, rescale, clip_at):
    w, m, v, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, []
    for t, grad in enumerate(GRADS, start=1):
        lr_t = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        for i, g in enumerate(grad):
            g = clip(rescale * g + wd * w[i], clip_at)
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            w[i] -= lr_t * m[i] / (math.sqrt(v[i]) + eps)
        out.append(list(w))
    return out


def expect_adagrad(lr, eps, wd, rescale, clip_at):
    w, h, out = list(WEIGHT), [0.0] * 4, []
    for grad in GRADS:
        for i, g in enumerate(grad):
            g = clip(rescale * g, clip_at)
            h[i] += g * g
            w[i] += (g / math.sqrt(h[i] + eps) + w[i] * wd) * -lr
        out.append(list(w))
    return out


def expect_rmsprop(lr, gamma1, gamma2, eps, centered, clip_weights, wd, rescale, clip_at):
    w, n, s, delta, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, [0.0] * 4, []
    for grad in GRADS:
        for i, g in enumerate(grad):
            g = clip(rescale * g + wd * w[i], clip_at)
            n[i] = (1 - gamma1) * g * g + gamma1 * n[i]
            if centered:
                s[i] = (1 - gamma1) * g + gamma1 * s[i]
                delta[i] = gamma2 * delta[i] - lr * g / math.sqrt(n[i] - s[i] * s[i] + eps)
                w[i] += delta[i]
            else:
                w[i] -= lr * g / math.sqrt(n[i] + eps)
            w[i] = clip(w[i], clip_weights)
        out.append(list(w))
    return out


def expect_signum(lr, momentum, wd_lh, wd, rescale, clip_at):
    w, mom, out = list(WEIGHT), [0.0] * 4, []
    for grad in GRADS:
        for i, g in enumerate(grad):
            if momentum == 0:
                w[i] = (1 - lr * wd) * w[i] - lr * sign(g)
            else:
                mom[i] = momentum * mom[i] - (1 - momentum) * wd * w[i] - (1 - momentum) * clip(rescale * g, clip_at)
                w[i] = (1 - lr * wd_lh) * w[i] + lr * sign(mom[i])
        out.append(list(w))
    return out


def expect_nag(lr, momentum, wd, rescale, clip_at):
    """MXNet 1.9's nag_mom_update, whose momentum's weight decay reads the weight it just wrote."""
    w, mom, out = list(WEIGHT), [0.0] * 4, []
    for grad in GRADS:
        for i, g in enumerate(grad):
            g = clip(rescale * g, clip_at)
            mom[i] *= momentum
            w[i] = w[i] - mom[i] + (momentum + 1) * (mom[i] - lr * (g + wd * w[i]))
            mom[i] -= lr * (g + wd * w[i])
        out.append(list(w))
    return out


def expect_adadelta(rho, eps, wd, rescale, clip_at):
    w, acc_g, acc_d, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, []
    for grad in GRADS:
        for i, g in enumerate(grad):
            g = clip(rescale * g, clip_at)
            acc_g[i] = rho * acc_g[i] + (1 - rho) * g * g
            delta = math.sqrt(acc_d[i] + eps) / math.sqrt(acc_g[i] + eps) * g
            acc_d[i] = rho * acc_d[i] + (1 - rho) * delta * delta
            w[i] -= delta + wd * w[i]
        out.append(list(w))
    return out


def expect_adamax(lr, beta1, beta2, wd, rescale, clip_at, grads):
    w, m, u, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, []
    for t, grad in enumerate(grads, start=1):
        for i, g in enumerate(grad):
            g = clip(rescale * g + wd * w[i], clip_at)
            m[i] = beta1 * m[i] + (1 - beta1) * g
            u[i] = max(beta2 * u[i], abs(g))
            w[i] -= lr / (1 - beta1 ** t) * m[i] / u[i]
        out.append(list(w))
    return out


def expect_nadam(lr, beta1, beta2, eps, decay, wd, rescale, clip_at):
    w, m, v, schedule, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, 1.0, []
    for t, grad in enumerate(GRADS, start=1):
        mu, mu_next = beta1 * (1 - 0.5 * 0.96 ** (t * decay)), beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * decay))
        schedule *= mu
        for i, g in enumerate(grad):
            g = clip(rescale * g + wd * w[i], clip_at)
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_bar = (1 - mu) * g / (1 - schedule) + mu_next * m[i] / (1 - schedule * mu_next)
            w[i] -= lr * m_bar / (math.sqrt(v[i] / (1 - beta2 ** t)) + eps)
        out.append(list(w))
    return out


def expect_ftrl(lr, lamda1, beta, wd, rescale, clip_at):
    w, z, n, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, []
    for grad in GRADS:
        for i, g in enumerate(grad):
            g = clip(rescale * g, clip_at)
            z[i] += g - (math.sqrt(n[i] + g * g) - math.sqrt(n[i])) * w[i] / lr
            n[i] += g * g
            w[i] = (sign(z[i]) * lamda1 - z[i]) / ((beta + math.sqrt(n[i])) / lr + wd) * (abs(z[i]) > lamda1)
        out.append(list(w))
    return out


def expect_ftml(lr, beta1, beta2, eps, wd, rescale, clip_at):
    """MXNet 1.9's ftml_update, whose beta**t are float32 powers of its float32 parameters."""
    w, d, v, z, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, [0.0] * 4, []
    for t, grad in enumerate(GRADS, start=1):
        beta1_t, beta2_t = (float(np.float32(beta) ** np.float32(t)) for beta in (beta1, beta2))
        for i, g in enumerate(grad):
            g = clip(rescale * g + wd * w[i], clip_at)
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            d_t = (1 - beta1_t) / lr * (math.sqrt(v[i] / (1 - beta2_t)) + eps)
            z[i] = beta1 * z[i] + (1 - beta1) * g - (d_t - beta1 * d[i]) * w[i]
            d[i] = d_t
            w[i] = -z[i] / d_t
        out.append(list(w))
    return out


@pytest.mark.parametrize("momentum, wd, rescale, clip_at", [
    (0.0, 0.0, 1.0, None), (0.0, 0.1, 0.5, 1.0), (0.9, 0.0, 1.0, None), (0.9, 0.05, 2.0, 0.8),
])
def test_nag(momentum, wd, rescale, clip_at):
    opt = NAG(learning_rate=0.1, momentum=momentum, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    expected = expect_sgd(0.1, 0.0, wd, rescale, clip_at) if momentum == 0 else \
        expect_nag(0.1, momentum, wd, rescale, clip_at)
    np.testing.assert_allclose(run(opt), expected, rtol=1e-12)


@pytest.mark.parametrize("rho, eps, wd, rescale, clip_at", [(0.9, 1e-5, 0.0, 1.0, None), (0.8, 1e-4, 0.01, 0.5, 1.5)])
def test_adadelta(rho, eps, wd, rescale, clip_at):
    opt = AdaDelta(rho=rho, epsilon=eps, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_adadelta(rho, eps, wd, rescale, clip_at), rtol=1e-12)


@pytest.mark.parametrize("wd, rescale, clip_at", [(0.0, 1.0, None), (0.01, 0.5, 1.5)])
def test_adamax(wd, rescale, clip_at):
    grads = [[g + 0.05 for g in grad] for grad in GRADS]  # a first gradient of 0 is 0 / 0 (MXNet's too)
    opt = Adamax(learning_rate=0.01, beta1=0.8, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt, grads), expect_adamax(0.01, 0.8, 0.999, wd, rescale, clip_at, grads),
                               rtol=1e-12)


@pytest.mark.parametrize("decay, wd, rescale, clip_at", [(0.004, 0.0, 1.0, None), (0.01, 0.01, 0.5, 1.5)])
def test_nadam(decay, wd, rescale, clip_at):
    opt = Nadam(learning_rate=0.01, schedule_decay=decay, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_nadam(0.01, 0.9, 0.999, 1e-8, decay, wd, rescale, clip_at),
                               rtol=1e-12)


def test_nadam_schedules_are_per_key_and_vanish():
    """Each key's schedule is the product of its own momenta (MXNet's, for a single key); far
    enough, the product is 0 and ``1 - schedule`` is 1."""
    assert _momentum_schedule(0.9, 0.004, 0) == 1.0
    assert _momentum_schedule(0.9, 0.004, 2) == \
        (0.9 * (1 - 0.5 * 0.96 ** 0.004)) * (0.9 * (1 - 0.5 * 0.96 ** 0.008))
    assert _momentum_schedule(0.9, 0.004, 10 ** 6) == 0.0
    weights = [np.array(WEIGHT), np.array(WEIGHT)]
    updater = Updater(Nadam(learning_rate=0.01))
    for step, grad in enumerate(GRADS):
        updater("a", np.array(grad), weights[0])
        if step == 0:
            updater("b", np.array(GRADS[0]), weights[1])  # b's first update after a's first
    np.testing.assert_allclose(weights[1], run(Nadam(learning_rate=0.01))[0], rtol=1e-15)


@pytest.mark.parametrize("lamda1, beta, wd, rescale, clip_at", [(0.01, 1.0, 0.0, 1.0, None), (0.5, 2.0, 0.01, 0.5, 1.5)])
def test_ftrl(lamda1, beta, wd, rescale, clip_at):
    opt = Ftrl(learning_rate=0.2, lamda1=lamda1, beta=beta, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_ftrl(0.2, lamda1, beta, wd, rescale, clip_at), rtol=1e-12)


@pytest.mark.parametrize("beta1, wd, rescale, clip_at", [(0.6, 0.0, 1.0, None), (0.5, 0.01, 0.5, 1.5)])
def test_ftml(beta1, wd, rescale, clip_at):
    opt = FTML(learning_rate=0.05, beta1=beta1, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_ftml(0.05, beta1, 0.999, 1e-8, wd, rescale, clip_at), rtol=1e-12)


def expect_lamb(lr, beta1, beta2, eps, lower, upper, bias_correction, wd, rescale, clip_at):
    """MXNet 1.9's multi_lamb_update (what its Updater runs), whose powers are float32 ones."""
    w, m, v, out = list(WEIGHT), [0.0] * 4, [0.0] * 4, []
    for t, grad in enumerate(GRADS, start=1):
        beta1_t, beta2_t = (float(np.float32(beta) ** np.float32(t)) for beta in (beta1, beta2))
        direction = []
        for i, g in enumerate(grad):
            g = clip(rescale * g, clip_at)
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            mean, var = (m[i] / (1 - beta1_t), v[i] / (1 - beta2_t)) if bias_correction else (m[i], v[i])
            direction.append(mean / (math.sqrt(var) + eps) + wd * w[i])
        r1, r2 = math.sqrt(sum(x * x for x in w)), math.sqrt(sum(x * x for x in direction))
        r1 = r1 if lower is None else max(r1, lower)
        r1 = r1 if upper is None else min(r1, upper)
        trusted = lr if r1 == 0 or r2 == 0 else lr * (r1 / r2)
        w = [x - trusted * d for x, d in zip(w, direction)]
        out.append(list(w))
    return out


def expect_lars(lr, momentum, eta, eps, wd, rescale, clip_at, schedule=None, correction=True):
    """MXNet 1.9's LARS of a single key, in float64: SGD at the rate scaled by the norms."""
    w, mom, out = list(WEIGHT), [0.0] * 4, []
    rate_at = (lambda t: schedule(t)) if schedule else (lambda t: lr)
    for t, grad in enumerate(GRADS, start=1):
        w_norm, g_norm = math.sqrt(sum(x * x for x in w)), rescale * math.sqrt(sum(g * g for g in grad))
        rate = rate_at(t) * eta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else rate_at(t)
        mu = momentum * rate_at(t) / rate_at(t - 1) if correction and t > 1 else momentum
        for i, g in enumerate(grad):
            mom[i] = mu * mom[i] - rate * wd * w[i] - rate * clip(rescale * g, clip_at)
            w[i] += mom[i]
        out.append(list(w))
    return out


def expect_dcasgd(lr, momentum, lamda, wd, rescale, clip_at):
    w, mom, previous, out = list(WEIGHT), [0.0] * 4, list(WEIGHT), []
    for grad in GRADS:
        for i, g in enumerate(grad):
            g = clip(rescale * g, clip_at)
            mom[i] = momentum * mom[i] - lr * (g + wd * w[i] + lamda * g * g * (w[i] - previous[i]))
            previous[i] = w[i]
            w[i] += mom[i]
        out.append(list(w))
    return out


@pytest.mark.parametrize("lower, upper, bias_correction, wd, rescale, clip_at", [
    (None, None, True, 0.0, 1.0, None), (0.5, 3.0, True, 0.01, 0.5, 0.8), (None, 1.0, False, 0.1, 2.0, None),
    (5.0, None, True, 0.0, 1.0, None),
])
def test_lamb(lower, upper, bias_correction, wd, rescale, clip_at):
    opt = LAMB(learning_rate=0.05, beta1=0.8, beta2=0.99, epsilon=1e-5, lower_bound=lower, upper_bound=upper,
               bias_correction=bias_correction, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    expected = expect_lamb(0.05, 0.8, 0.99, 1e-5, lower, upper, bias_correction, wd, rescale, clip_at)
    np.testing.assert_allclose(run(opt), expected, rtol=1e-12)


@pytest.mark.parametrize("momentum, eta, eps, wd, rescale, clip_at, correction", [
    (0.0, 0.001, 0.0, 0.0, 1.0, None, True), (0.9, 0.01, 1e-3, 0.05, 0.5, 0.8, True),
    (0.8, 0.02, 0.0, 0.01, 2.0, None, True), (0.8, 0.02, 0.0, 0.01, 2.0, None, False),
])
def test_lars(momentum, eta, eps, wd, rescale, clip_at, correction):
    schedule = FactorScheduler(step=1, factor=0.5, base_lr=0.4)
    opt = LARS(learning_rate=0.4, momentum=momentum, eta=eta, eps=eps, wd=wd, rescale_grad=rescale,
               clip_gradient=clip_at, momentum_correction=correction, lr_scheduler=schedule)
    expected = expect_lars(0.4, momentum, eta, eps, wd, rescale, clip_at, schedule, correction)
    np.testing.assert_allclose(run(opt), expected, rtol=1e-12)


def test_lars_keeps_the_plain_rate_of_gamma_beta_and_bias_keys():
    """MXNet's LARS does not scale the rate of a key whose name ends in gamma, beta or bias."""
    for key, scaled in (("bn_gamma", False), ("bn_beta", False), ("fc_bias", False), ("fc_weight", True), (3, True)):
        opt = LARS(learning_rate=0.1, momentum=0.9, wd=0.01)
        weight, plain = np.array(WEIGHT), np.array(WEIGHT)
        Updater(opt)(key, np.array(GRADS[0]), weight)
        Updater(SGD(learning_rate=0.1, momentum=0.9, wd=0.01))(key, np.array(GRADS[0]), plain)
        assert (weight != plain).any() == scaled, key


@pytest.mark.parametrize("momentum, lamda, wd, rescale, clip_at", [
    (0.0, 0.04, 0.0, 1.0, None), (0.0, 0.2, 0.01, 0.5, 0.8), (0.9, 0.1, 0.01, 2.0, 1.0),
])
def test_dcasgd(momentum, lamda, wd, rescale, clip_at):
    opt = DCASGD(learning_rate=0.1, momentum=momentum, lamda=lamda, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_dcasgd(0.1, momentum, lamda, wd, rescale, clip_at), rtol=1e-12)


# MXNet 1.9.1's weights (kv = mx.kv.create('local'); kv.set_optimizer(...); 8 pushes of
# MXNET_GRADS into a key initialized with MXNET_WEIGHT), recorded on 2026-11-26.
MXNET_WEIGHT = [3.0, -1.0, 2.0, 0.5, -2.5, 1.25]
MXNET_GRADS = (((np.arange(48).reshape(8, 6) * 7) % 13 - 6) / 4).tolist()
MXNET_LAMB = [
    ("lamb", dict(learning_rate=0.01), "float32",
     [3.1031830310821533, -1.0076308250427246, 2.192108392715454, 0.4905957579612732, -2.445253849029541,
      1.1122745275497437]),
    ("lamb", dict(learning_rate=0.05, wd=0.01, rescale_grad=0.5, clip_gradient=0.8, lower_bound=0.5, upper_bound=3.0),
     "float32", [3.2783141136169434, -1.0093995332717896, 2.5795505046844482, 0.4714994430541992, -2.2874131202697754,
                 0.7918434143066406]),
    ("lamb", dict(learning_rate=0.01, bias_correction=False, wd=0.1), "float32",
     [3.076376438140869, -0.9985468983650208, 2.175365924835205, 0.489958792924881, -2.422640323638916,
      1.0993177890777588]),
    ("lamb", dict(learning_rate=0.01, wd=0.01, multi_precision=True), "float16",
     [3.087890625, -1.0029296875, 2.18359375, 0.49072265625, -2.43359375, 1.1044921875]),
]
# (key, params, dtype, MXNet 1.9.1's weights): 'fc_bias' and 'bn_gamma' keep the plain rate; a
# schedule of FactorScheduler(step=2, factor=0.5) makes momentum_correction count.
MXNET_LARS = [
    (0, dict(learning_rate=0.1), "float32",
     [3.0001235008239746, -0.9999539256095886, 2.0003104209899902, 0.5002424716949463, -2.5001068115234375,
      1.249825358390808]),
    (0, dict(learning_rate=0.1, momentum=0.9, eta=0.01, wd=0.01), "float32",
     [3.011124849319458, -0.9979885220527649, 2.0176777839660645, 0.49813535809516907, -2.4941816329956055,
      1.2332394123077393]),
    (0, dict(learning_rate=0.5, momentum=0.8, eta=0.02, eps=1e-3, wd=0.05, rescale_grad=0.5, clip_gradient=0.8),
     "float32", [2.9537601470947266, -0.9541495442390442, 2.0440921783447266, 0.4800454378128052, -2.377335786819458,
                 1.102365255355835]),
    ("fc_bias", dict(learning_rate=0.1, momentum=0.9, eta=0.01, wd=0.01), "float32",
     [3.5950281620025635, -1.0130248069763184, 3.02392315864563, 0.3468601703643799, -2.0619049072265625,
      0.36100316047668457]),
    ("bn_gamma", dict(learning_rate=0.1, wd=0.01), "float32",
     [3.050112247467041, -1.0170031785964966, 2.1828088760375977, 0.5964124798774719, -2.4806182384490967,
      1.141132116317749]),
    (0, dict(learning_rate=0.5, momentum=0.9, eta=0.01, wd=0.01, lr_scheduler=FactorScheduler(step=2, factor=0.5)),
     "float32", [3.0450453758239746, -1.0023044347763062, 2.042100429534912, 0.4796563982963562, -2.4774105548858643,
                 1.205148458480835]),
    (0, dict(learning_rate=0.5, momentum=0.9, eta=0.01, wd=0.01, momentum_correction=False,
             lr_scheduler=FactorScheduler(step=2, factor=0.5)),
     "float32", [3.0924558639526367, -1.0160465240478516, 2.0769431591033936, 0.44568341970443726,
                 -2.4582364559173584, 1.1514945030212402]),
    (0, dict(learning_rate=0.1, momentum=0.9, eta=0.01, wd=0.01, multi_precision=True), "float16",
     [3.01171875, -0.998046875, 2.017578125, 0.498046875, -2.494140625, 1.2333984375]),
    (0, dict(learning_rate=0.1, eta=0.01, wd=0.01, multi_precision=True), "float16",
     [3.0, -0.99951171875, 2.001953125, 0.50244140625, -2.5, 1.248046875]),
]
MXNET_DCASGD = [
    ("dcasgd", dict(learning_rate=0.1), "float32",
     [3.0758848190307617, -1.0230680704116821, 2.2005221843719482, 0.6016131639480591, -2.4989962577819824,
      1.1521881818771362]),
    ("dcasgd", dict(learning_rate=0.1, lamda=0.2, wd=0.01, rescale_grad=0.5, clip_gradient=0.8), "float32",
     [3.0137217044830322, -1.00334894657135, 2.0838053226470947, 0.5472339391708374, -2.479776382446289,
      1.1919866800308228]),
    ("dcasgd", dict(learning_rate=0.1, wd=0.01, multi_precision=True), "float16",
     [3.05078125, -1.0146484375, 2.18359375, 0.59814453125, -2.48046875, 1.1435546875]),
]


def mxnet_cpu_norm(xp, array):
    """MXNet's CPU multi_sum_sq, under the root: each square in the value's dtype, summed in
    float32 in order (tensorkv sums them in float64)."""
    squares = (np.asarray(array).reshape(-1) ** 2).astype(np.float32)
    return float(np.sqrt(np.cumsum(squares, dtype=np.float32)[-1]))


def pushed_through(kv, name, params, dtype, key=0):
    kv.set_optimizer(optimizer.create(name, **params))
    kv.init(key, np.array(MXNET_WEIGHT, dtype))
    for grad in MXNET_GRADS:
        kv.push(key, np.array(grad, dtype))
    return kv.pull(key)


@pytest.mark.parametrize("name, params, dtype, expected", MXNET_DCASGD + MXNET_LAMB)
def test_mxnet_numbers_bit_for_bit(name, params, dtype, expected, monkeypatch):
    """DCASGD as it is, LAMB with MXNet's float32 sum of squares for its norms: every other
    operation of its two passes is MXNet's (the double arithmetic in its direction too)."""
    monkeypatch.setattr(adam_module, "l2_norm", mxnet_cpu_norm)
    with tensorkv.create("local") as kv:
        np.testing.assert_array_equal(pushed_through(kv, name, params, dtype), np.array(expected, dtype))


@pytest.mark.parametrize("name, params, dtype, expected", MXNET_LAMB)
def test_lamb_with_its_own_norms_is_within_an_ulp_of_mxnet(name, params, dtype, expected):
    """tensorkv's float64 sum of squares gives the correctly rounded norm; MXNet's float32 sum
    differs from it in the last bit here and there, and the weights by an ulp at most."""
    with tensorkv.create("local") as kv:
        got = pushed_through(kv, name, params, dtype)
    np.testing.assert_array_max_ulp(got, np.array(expected, dtype), maxulp=1)


@pytest.mark.parametrize("key, params, dtype, expected", MXNET_LARS)
def test_lars_gives_mxnets_bits_with_its_norms(key, params, dtype, expected, monkeypatch):
    """LARS with MXNet's float32 sums of squares for its norms: MXNet's multi_lars in float32,
    then its SGD kernels, bit for bit."""
    monkeypatch.setattr(sgd_module, "l2_norm", mxnet_cpu_norm)
    with tensorkv.create("local") as kv:
        got = pushed_through(kv, "lars", params, dtype, key)
    np.testing.assert_array_equal(got, np.array(expected, dtype))


@pytest.mark.parametrize("key, params, dtype, expected", MXNET_LARS)
def test_lars_with_its_own_norms_is_within_an_ulp_of_mxnet(key, params, dtype, expected):
    """tensorkv's float64 sums of squares: 8 of the 9 settings give MXNet's bits, one is an
    ulp off in one weight."""
    with tensorkv.create("local") as kv:
        got = pushed_through(kv, "lars", params, dtype, key)
    np.testing.assert_array_max_ulp(got, np.array(expected, dtype), maxulp=1)


# MXNet 1.9.1's LARS(learning_rate=0.1, momentum=0.9, eta=0.01, wd=0.1) after two pushes of a
# row-sparse gradient of ones in row 1 of [[1, 2, 3], [4, 5, 6]], by lazy_update.
MXNET_LARS_ROWS = {
    True: [[1.0, 2.0, 3.0], [3.9855852127075195, 4.984555721282959, 5.983526229858398]],
    False: [[0.9989704489707947, 1.9979408979415894, 2.99691104888916],
            [3.9855854511260986, 4.984556198120117, 5.983526229858398]],
}


@pytest.mark.parametrize("lazy", [True, False])
def test_lars_row_sparse_push_follows_lazy_update(lazy):
    """lazy_update: the pushed rows only, at the rate from the whole weight's norm; else all of
    the value, as by the dense gradient. MXNet's bits either way."""
    with tensorkv.create("local") as kv:
        kv.set_optimizer(LARS(learning_rate=0.1, momentum=0.9, eta=0.01, wd=0.1, lazy_update=lazy))
        kv.init(0, np.arange(1, 7, dtype=np.float32).reshape(2, 3))
        for _ in range(2):
            kv.push(0, RowSparse(np.ones((1, 3), np.float32), np.array([1]), (2, 3)))
        np.testing.assert_array_equal(kv.pull(0), np.array(MXNET_LARS_ROWS[lazy], np.float32))


def test_lamb_lars_and_dcasgd_through_a_server_are_the_embedded_stores(tmp_path):
    """The same pushes through a server (the optimizer sent as data, rebuilt there) and an
    embedded store: the same weights, bit for bit."""
    from cluster import Cluster

    with Cluster(tmp_path=tmp_path) as cluster:
        cases = [(name, 0, params, dtype) for name, params, dtype, _ in MXNET_LAMB + MXNET_DCASGD] \
            + [("lars", key, params, dtype) for key, params, dtype, _ in MXNET_LARS]
        for name, key, params, dtype in cases:
            with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="replace") as kv:
                remote = pushed_through(kv, name, params, dtype, key)
            with tensorkv.create("local") as kv:
                np.testing.assert_array_equal(remote, pushed_through(kv, name, params, dtype, key), err_msg=name)


def test_lamb_updates_the_whole_value_on_a_row_sparse_push():
    """MXNet's LAMB has no lazy update: a row-sparse push is its dense gradient (the norms
    are the whole value's); DCASGD's too. SGD updates the pushed rows only."""
    from tensorkv.update.rowsparse import RowSparse

    rows = RowSparse(np.ones((1, 3), np.float32), np.array([1]), (2, 3))
    dense = np.array([[0, 0, 0], [1, 1, 1]], np.float32)
    for opt in (LAMB(learning_rate=0.1, wd=0.1), DCASGD(learning_rate=0.1, wd=0.1), SGD(learning_rate=0.1, wd=0.1)):
        weights = []
        for pushed in (rows, dense):
            with tensorkv.create("local") as kv:
                kv.set_optimizer(opt)
                kv.init("w", np.arange(6, dtype=np.float32).reshape(2, 3))
                kv.push("w", pushed)
                weights.append(kv.pull("w"))
        if opt.lazy_update:
            np.testing.assert_array_equal(weights[0][0], [0, 1, 2])  # the row not pushed: unchanged
        else:
            np.testing.assert_array_equal(weights[0], weights[1])


def test_optimizers_that_divide_by_the_learning_rate_refuse_zero():
    for cls in (Ftrl, FTML):
        with pytest.raises(tensorkv.InvalidArgumentError, match="learning_rate=0 is outside"):
            cls(learning_rate=0)


@pytest.mark.parametrize("momentum, wd, rescale, clip_at", [
    (0.0, 0.0, 1.0, None), (0.0, 0.1, 0.5, 1.0), (0.9, 0.0, 1.0, None), (0.9, 0.05, 2.0, 0.8),
])
def test_sgd(momentum, wd, rescale, clip_at):
    opt = SGD(learning_rate=0.1, momentum=momentum, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_sgd(0.1, momentum, wd, rescale, clip_at), rtol=1e-12)


@pytest.mark.parametrize("wd, rescale, clip_at", [(0.0, 1.0, None), (0.1, 0.5, 0.3)])
def test_adam(wd, rescale, clip_at):
    opt = Adam(learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6, wd=wd, rescale_grad=rescale,
               clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_adam(0.01, 0.8, 0.99, 1e-6, wd, rescale, clip_at), rtol=1e-12)


@pytest.mark.parametrize("wd, rescale, clip_at", [(0.0, 1.0, None), (0.2, 3.0, 1.5)])
def test_adagrad(wd, rescale, clip_at):
    opt = AdaGrad(learning_rate=0.1, eps=1e-5, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_adagrad(0.1, 1e-5, wd, rescale, clip_at), rtol=1e-12)


@pytest.mark.parametrize("centered, clip_weights, wd, rescale, clip_at", [
    (False, None, 0.0, 1.0, None), (False, 1.2, 0.1, 0.5, 0.4), (True, None, 0.0, 1.0, None), (True, 1.9, 0.05, 2.0, 1.0),
])
def test_rmsprop(centered, clip_weights, wd, rescale, clip_at):
    opt = RMSProp(learning_rate=0.01, gamma1=0.85, gamma2=0.7, epsilon=1e-6, centered=centered,
                  clip_weights=clip_weights, wd=wd, rescale_grad=rescale, clip_gradient=clip_at)
    expected = expect_rmsprop(0.01, 0.85, 0.7, 1e-6, centered, clip_weights, wd, rescale, clip_at)
    np.testing.assert_allclose(run(opt), expected, rtol=1e-12)


@pytest.mark.parametrize("momentum, wd_lh, wd, rescale, clip_at", [
    (0.9, 0.0, 0.0, 1.0, None), (0.8, 0.1, 0.05, 2.0, 0.5), (0.0, 0.0, 0.1, 1.0, None),
])
def test_signum(momentum, wd_lh, wd, rescale, clip_at):
    opt = Signum(learning_rate=0.05, momentum=momentum, wd_lh=wd_lh, wd=wd, rescale_grad=rescale,
                 clip_gradient=clip_at)
    np.testing.assert_allclose(run(opt), expect_signum(0.05, momentum, wd_lh, wd, rescale, clip_at), rtol=1e-12)


MXNET_BITS = json.loads((pathlib.Path(__file__).parent / "data" / "mxnet_optimizer_bits.json").read_text())


def _hex_floats(hexes):
    return np.array([float.fromhex(h) for h in hexes], np.float32)


@pytest.mark.parametrize("case", MXNET_BITS["cases"],
                         ids=[f"{case['name']}-{index}" for index, case in enumerate(MXNET_BITS["cases"])])
def test_the_store_holds_mxnets_bits(case):
    """8 pushes through the 'local' store give MXNet 1.9.1's float32 bits (its kernels' order of
    operations, constants such as 1 - beta1 in float32); tests/data/mxnet_optimizer_bits.py
    wrote the numbers with MXNet."""
    with tensorkv.create("local") as kv:
        kv.set_optimizer(optimizer.create(case["name"], **case["params"]))
        kv.init(0, _hex_floats(MXNET_BITS["weight"]))
        for grad in MXNET_BITS["grads"]:
            kv.push(0, _hex_floats(grad))
        np.testing.assert_array_equal(kv.pull(0), _hex_floats(case["expected"]))


def test_mxnet_defaults():
    assert SGD().params == {"learning_rate": 0.01, "momentum": 0.0, "wd": 0.0, "rescale_grad": 1.0}
    assert Adam().params == {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
                             "wd": 0.0, "rescale_grad": 1.0}
    assert AdaGrad().params == {"learning_rate": 0.01, "eps": 1e-7, "wd": 0.0, "rescale_grad": 1.0}
    assert RMSProp().params == {"learning_rate": 0.001, "gamma1": 0.9, "gamma2": 0.9, "epsilon": 1e-8,
                                "centered": 0.0, "wd": 0.0, "rescale_grad": 1.0}
    assert Signum().params == {"learning_rate": 0.01, "momentum": 0.9, "wd_lh": 0.0, "wd": 0.0, "rescale_grad": 1.0}
    assert SGD(clip_gradient=2).params["clip_gradient"] == 2.0
    assert [cls().name for cls in (SGD, Adam, AdaGrad, RMSProp, Signum)] == ["sgd", "adam", "adagrad", "rmsprop", "signum"]
    assert LAMB().params == {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6,
                             "bias_correction": 1.0, "wd": 0.0, "rescale_grad": 1.0}
    assert DCASGD().params == {"learning_rate": 0.01, "momentum": 0.0, "lamda": 0.04, "wd": 0.0, "rescale_grad": 1.0}
    assert LARS().params == {"learning_rate": 0.01, "momentum": 0.0, "lazy_update": 1.0, "eta": 0.001, "eps": 0.0,
                             "momentum_correction": 1.0, "wd": 0.0, "rescale_grad": 1.0}


@pytest.mark.parametrize("opt", [SGD(momentum=0.9, clip_gradient=1.0), Adam(wd=0.1), AdaGrad(eps=1e-6),
                                 RMSProp(centered=True, clip_weights=3.0), Signum(wd_lh=0.01),
                                 NAG(momentum=0.9), Adamax(beta1=0.8), Nadam(schedule_decay=0.01), AdaDelta(rho=0.8),
                                 Ftrl(lamda1=0.1, beta=2.0), FTML(beta1=0.5), SGD(multi_precision=True),
                                 LAMB(lower_bound=0.1, upper_bound=10, bias_correction=False),
                                 DCASGD(momentum=0.9, lamda=0.1),
                                 LARS(momentum=0.9, lazy_update=False, eta=0.01, eps=1e-6, momentum_correction=False)])
def test_create_rebuilds_from_name_and_params(opt):
    rebuilt = optimizer.create(opt.name.upper(), **opt.params)
    assert rebuilt == opt and type(rebuilt) is type(opt)
    assert all(isinstance(v, float) for v in opt.params.values())


def test_create_rejects_unknown_names_and_bad_values():
    with pytest.raises(tensorkv.InvalidArgumentError, match="unknown optimizer 'lbsgd'"):
        optimizer.create("lbsgd")
    with pytest.raises(tensorkv.InvalidArgumentError, match="no parameter epsilon"):
        optimizer.create("adagrad", epsilon=1e-7)
    with pytest.raises(tensorkv.InvalidArgumentError, match="learning_rate='fast'"):
        SGD(learning_rate="fast")
    with pytest.raises(tensorkv.InvalidArgumentError, match="clip_gradient"):
        SGD(clip_gradient=-1)
    with pytest.raises(tensorkv.InvalidArgumentError, match="wd_lh"):
        Signum(momentum=0.0, wd_lh=0.1)
    with pytest.raises(tensorkv.InvalidArgumentError):
        Updater(lambda key, grad, weight: None)


# The probing cases of issue 10 first: each broke a job on its first push before it was refused.
@pytest.mark.parametrize("make, words", [
    (lambda: Adam(beta1=1.0), "beta1=1 is outside its range [0, 1)"),
    (lambda: Adam(beta2=-0.1), "beta2=-0.1 is outside its range [0, 1)"),
    (lambda: Adam(epsilon=0), "epsilon=0 is outside its range (0, inf)"),
    (lambda: RMSProp(gamma1=2), "gamma1=2 is outside its range [0, 1)"),
    (lambda: RMSProp(centered=True, gamma2=1), "gamma2=1 is outside its range [0, 1)"),
    (lambda: RMSProp(epsilon=-1e-8), "epsilon=-1e-08 is outside its range (0, inf)"),
    (lambda: RMSProp(clip_weights=0), "clip_weights=0 is outside its range (0, inf)"),
    (lambda: AdaGrad(eps=-1), "eps=-1 is outside its range (0, inf)"),
    (lambda: SGD(momentum=5), "momentum=5 is outside its range [0, 1)"),
    (lambda: SGD(momentum=-0.5), "momentum=-0.5 is outside its range [0, 1)"),
    (lambda: SGD(wd=-0.1), "wd=-0.1 is outside its range [0, inf)"),
    (lambda: SGD(rescale_grad=0), "rescale_grad=0 is outside its range (0, inf)"),
    (lambda: SGD(clip_gradient=-1), "clip_gradient=-1 is outside its range (0, inf)"),
    (lambda: Signum(momentum=1), "momentum=1 is outside its range [0, 1)"),
    (lambda: Signum(wd_lh=-1), "wd_lh=-1 is outside its range [0, inf)"),
    (lambda: optimizer.create("adam", beta1=1.0), "beta1=1 is outside its range [0, 1)"),
    (lambda: LAMB(lower_bound=0), "lower_bound=0 is outside its range (0, inf)"),
    (lambda: DCASGD(lamda=-0.1), "lamda=-0.1 is outside its range [0, inf)"),
    (lambda: LARS(eps=-1e-9), "eps=-1e-09 is outside its range [0, inf)"),  # 0, its default, is in
    (lambda: AdaGrad(eps=0), "eps=0 is outside its range (0, inf)"),  # LARS's range is its own
    (lambda: LARS(eta=-0.1), "eta=-0.1 is outside its range [0, inf)"),
])
def test_parameters_outside_their_range_are_refused(make, words):
    with pytest.raises(tensorkv.InvalidArgumentError) as caught:
        make()
    assert words in str(caught.value)


def test_every_parameter_has_a_range():
    names = {name for cls in optimizer.OPTIMIZERS.values() for name in cls.parameter_names()} \
        - {"centered", "multi_precision", "bias_correction", "lazy_update", "momentum_correction"}  # flags
    assert names == set(optimizer.RANGES)


def test_range_edges_are_accepted():
    """Closed ends are valid values; the learning rate may be negative (the tutorial's -2)."""
    SGD(learning_rate=-2.0, momentum=0.0, wd=0.0)
    Adam(beta1=0.0, beta2=0.0)
    RMSProp(gamma1=0.0, gamma2=0.0, centered=True)
    Signum(momentum=0.0)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_weights_are_updated_in_float32(dtype):
    opt = Adam(learning_rate=0.1, wd=0.01)
    weight = np.array(WEIGHT, dtype)
    state = opt.create_state(np, weight)
    assert all(s.dtype == np.float32 for s in state)
    wide = weight.astype(np.float32)
    wide_state = opt.create_state(np, wide)
    grad = np.array(GRADS[0], dtype)
    opt.update(np, weight, grad, state, 1, opt.learning_rate)
    opt.update(np, wide, grad.astype(np.float32), wide_state, 1, opt.learning_rate)
    assert weight.dtype == dtype
    np.testing.assert_array_equal(weight, wide.astype(dtype))


MULTI_PRECISION = [SGD(learning_rate=0.1, momentum=0.9, wd=0.01, multi_precision=True),
                   SGD(learning_rate=0.1, multi_precision=True), Adam(learning_rate=0.01, multi_precision=True),
                   AdaGrad(multi_precision=True), RMSProp(centered=True, multi_precision=True),
                   Signum(momentum=0.0, multi_precision=True), NAG(momentum=0.9, wd=0.01, multi_precision=True),
                   Adamax(multi_precision=True), Nadam(multi_precision=True), AdaDelta(multi_precision=True),
                   Ftrl(multi_precision=True), FTML(learning_rate=0.01, multi_precision=True),
                   DCASGD(momentum=0.9, wd=0.01, multi_precision=True)]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("opt", MULTI_PRECISION, ids=repr)
def test_multi_precision_updates_a_float32_master_copy(opt, dtype):
    """With multi_precision a low-precision weight is, after every step, the rounding of the
    float32 weight that the same optimizer gives a float32 value, and its master copy (the
    first state) is that float32 weight, bit for bit."""
    updater, reference = Updater(opt), Updater(optimizer.create(opt.name, **{
        name: value for name, value in opt.params.items() if name != "multi_precision"}))
    weight = np.array(WEIGHT, dtype)
    wide = weight.astype(np.float32)
    for grad in GRADS:
        grad = [g + 0.05 for g in grad]  # no gradient of 0 (Adamax's first step would be 0 / 0)
        updater(0, np.array(grad, np.float32), weight)
        reference(0, np.array(grad, np.float32), wide)
        np.testing.assert_array_equal(weight, wide.astype(dtype))
        master, *states = updater.get_states()[0][1]
        np.testing.assert_array_equal(master, wide)
        for mine, theirs in zip(states, reference.get_states()[0][1]):
            np.testing.assert_array_equal(mine, theirs)
    assert len(updater.get_states()[0][1]) == opt.states_per_value(dtype) == len(opt.state_names()) + 1
    assert opt.states_per_value(np.float32) == len(opt.state_names())  # float32 and wider keep no copy


def test_multi_precision_keeps_updates_smaller_than_float16_can_hold():
    """MXNet 1.9.1's numbers (kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1,
    multi_precision=True)) on a float16 key, 20 pushes of 1e-3): each step of 1e-4 is below
    half a float16 unit at 1.76, so without the float32 copy the weight never moves."""
    for multi_precision, expected in ((True, 1.76171875), (False, 1.763671875)):
        updater = Updater(SGD(learning_rate=0.1, multi_precision=multi_precision))
        weight = np.full(4, 1.7636, np.float16)
        for _ in range(20):
            updater(0, np.full(4, 1e-3, np.float16), weight)
        assert weight.tolist() == [expected] * 4, multi_precision


def test_multi_precision_travels_in_params_only_when_set():
    assert "multi_precision" not in SGD().params  # what an older server knows
    assert SGD(multi_precision=True).params["multi_precision"] == 1.0
    assert optimizer.create("sgd", multi_precision=1.0).multi_precision is True


def test_float32_matches_float64_formula():
    np.testing.assert_allclose(run(Adam(learning_rate=0.01), dtype=np.float32),
                               expect_adam(0.01, 0.9, 0.999, 1e-8, 0.0, 1.0, None), rtol=1e-5)


def test_updater_counts_and_states_round_trip():
    updater = Updater(Adam())
    weight = np.array(WEIGHT)
    for grad in GRADS:
        updater("w", np.array(grad), weight)
    num_update, arrays = updater.get_states()["w"]
    assert num_update == 3 and len(arrays) == 2
    other = Updater(Adam())
    other.set_states({k: (n, [a.copy() for a in arrays]) for k, (n, arrays) in updater.get_states().items()})
    w1, w2 = weight.copy(), weight.copy()
    updater("w", np.ones(4), w1)
    other("w", np.ones(4), w2)
    np.testing.assert_array_equal(w1, w2)


def test_updater_rejects_integer_weights():
    with pytest.raises(tensorkv.DtypeMismatchError, match="int32"):
        Updater(SGD()).check(1, np.zeros(2, np.int32))


@pytest.mark.parametrize("opt", [SGD(learning_rate=0.1, momentum=0.9, wd=0.01, clip_gradient=0.5),
                                 Adam(learning_rate=0.01, wd=0.1), AdaGrad(eps=1e-6),
                                 RMSProp(centered=True, clip_weights=2.0), Signum(momentum=0.8, wd_lh=0.01),
                                 SGD(learning_rate=0.1, momentum=0.9, multi_precision=True),
                                 Adam(learning_rate=0.01, multi_precision=True), NAG(momentum=0.9, wd=0.01),
                                 Adamax(), Nadam(), AdaDelta(wd=0.01), Ftrl(lamda1=0.1), FTML(learning_rate=0.01),
                                 LAMB(learning_rate=0.01, wd=0.01), LAMB(multi_precision=True),
                                 DCASGD(learning_rate=0.1, momentum=0.9),
                                 SGD(learning_rate=1.0, momentum=0.5,
                                     lr_scheduler=tensorkv.lr_scheduler.FactorScheduler(step=2, factor=0.5))])
def test_updates_made_together_equal_the_updates_made_key_by_key(opt):
    """Updater.update_each (what a server runs over a push of many keys) against one call per
    key, over 6 rounds: the same weights, states and counts, bit for bit. The keys have several
    shapes and dtypes (float16 weights with float32 gradients, as a server's sum of float16
    pushes; one too large to gather); some keys skip every other round, one is updated twice
    as often, one twice within a batch, so that the keys' t and the learning rates the
    schedule gives differ."""
    rng = np.random.default_rng(7)
    specs = [(f"k{i}", shape, dtype, grad_dtype) for i, (shape, dtype, grad_dtype) in enumerate(
        [((3,), np.float32, np.float32), ((2, 2), np.float32, np.float32), ((5,), np.float64, np.float64),
         ((4,), np.float16, np.float32), ((), np.float32, np.float32), ((0,), np.float32, np.float32),
         ((7,), np.float32, np.float32), ((3,), np.float16, np.float32),
         ((optimizer.GATHER_MAX_BYTES // 4 + 1,), np.float32, np.float32)])]  # too large to gather
    apart, together = Updater(opt), Updater(opt)
    weights = {}
    for name, shape, dtype, _ in specs:
        weight = rng.standard_normal(shape).astype(dtype)
        weights[name] = [weight, weight.copy()]
    for step in range(6):
        chosen = specs if step % 2 == 0 else specs[::2]  # every other key skips the odd rounds
        grads = [(name, rng.standard_normal(shape).astype(grad_dtype)) for name, shape, _, grad_dtype in chosen]
        twice = grads[1]  # one key updated twice in one batch: in order, as apart
        for name, grad in grads + [twice]:
            apart(name, grad, weights[name][0])
        together.update_each([(name, grad, weights[name][1]) for name, grad in grads + [twice]])
        extra = rng.standard_normal((3,)).astype(np.float32)  # k0 once more, on its own
        apart("k0", extra, weights["k0"][0])
        together.update_each([("k0", extra, weights["k0"][1])])
    for name, _, _, _ in specs:
        np.testing.assert_array_equal(weights[name][0], weights[name][1], err_msg=name)
    states_apart, states_together = apart.get_states(), together.get_states()
    assert states_apart.keys() == states_together.keys()
    for name, (count, arrays) in states_apart.items():
        assert states_together[name][0] == count
        for a, b in zip(arrays, states_together[name][1]):
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert apart.num_update == together.num_update == 12  # k0's count (k1's 9)


def test_an_engine_applies_a_push_in_order_when_some_values_go_to_the_optimizer_together():
    """Engine.apply_each with a value the optimizer takes together with others and a row-sparse
    one it applies on its own: the learning rate a schedule gives the second reads the first's
    count, as with one apply per key."""
    from tensorkv.wire.codec import Item
    from tensorkv.update.engine import Engine
    from tensorkv.update.rowsparse import RowSparse

    engines = []
    for _ in range(2):
        engine = Engine()
        engine.init([Item("a", np.zeros(2, np.float32)), Item("b", np.zeros((2, 2), np.float32))])
        engine.updater = Updater(SGD(learning_rate=1.0,
                                     lr_scheduler=tensorkv.lr_scheduler.FactorScheduler(step=2, factor=0.5)))
        for _ in range(2):
            engine.apply_each([Item("a", np.ones(2, np.float32))])
        engines.append(engine)
    pushed = [Item("a", np.ones(2, np.float32)),
              Item("b", RowSparse(np.ones((1, 2), np.float32), np.array([1]), (2, 2)))]
    for item in pushed:
        engines[0].apply(item.key, engines[0].merge([item.array]))
    engines[1].apply_each(pushed)
    for key in ("a", "b"):
        np.testing.assert_array_equal(engines[0].get(key).array, engines[1].get(key).array)
    np.testing.assert_array_equal(engines[1].get("b").array, [[0, 0], [-0.5, -0.5]])


def test_an_optimizer_takes_a_new_learning_rate_as_mxnets_does():
    """MXNet's Optimizer.set_learning_rate (an MXNet parity probe: missing): an embedded store
    updates with the object itself, so its next update takes it; refused with a schedule."""
    sgd = SGD(learning_rate=0.1)
    with tensorkv.create("local") as kv:
        kv.init("w", np.zeros(2, np.float32))
        kv.set_optimizer(sgd)
        kv.push("w", np.ones(2, np.float32))
        sgd.set_learning_rate(0.5)
        kv.push("w", np.ones(2, np.float32))
        np.testing.assert_allclose(kv.pull("w"), [-0.6, -0.6], rtol=1e-6)
    with pytest.raises(tensorkv.InvalidArgumentError, match="learning_rate=nan is not finite"):
        sgd.set_learning_rate(float("nan"))
    scheduled = SGD(lr_scheduler=tensorkv.lr_scheduler.FactorScheduler(step=2, factor=0.5))
    with pytest.raises(tensorkv.FailedPreconditionError, match="has an lr_scheduler"):
        scheduled.set_learning_rate(0.5)
