"""Every optimizer and every option combination against the numpy reference (optim_reference.py,
written from REFERENCE.md): several steps on random tensors, max relative difference <= 1e-5 in
float32 (1e-11 in float64, which checks the arithmetic itself)."""
import itertools

import numpy as np
import pytest

import optim_reference as ref
from optim_testing import (make_problem, max_rel_diff, optim, random_grads, set_grads, tolerance,  # noqa: F401
                           torch)

STEPS = 5
DTYPES = [np.float32, np.float64]


def run_both(make_ours, ref_step, dtype, grad_scale=1.0, steps=STEPS):
    params, expected = make_problem(dtype)
    opt = make_ours(params)
    states = [{} for _ in params]
    for step in range(steps):
        grads = random_grads(step, dtype=dtype, scale=grad_scale)
        set_grads(params, grads)
        opt.step()
        ref_step(expected, [g.astype(np.float64) for g in grads], states)
    return max_rel_diff(params, expected), opt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lr,betas,eps,weight_decay", [
    (1e-3, (0.9, 0.999), 1e-8, 1e-2),  # torch's defaults
    (1e-2, (0.8, 0.99), 1e-6, 0.0),
    (3e-2, (0.0, 0.5), 1e-3, 0.3),
])
def test_adamw(dtype, lr, betas, eps, weight_decay):
    diff, _ = run_both(lambda p: optim.AdamW(p, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                       lambda p, g, s: ref.adamw(p, g, s, lr, betas, eps, weight_decay), dtype)
    assert diff <= tolerance(dtype)


AGD_FLAGS = list(itertools.product([True, False], repeat=4))  # weight_decouple, fixed_decay, amsgrad, win


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("weight_decouple,fixed_decay,amsgrad,win", AGD_FLAGS)
def test_agd_every_option(dtype, weight_decouple, fixed_decay, amsgrad, win, clip):
    kw = dict(lr=1e-2, betas=(0.9, 0.999), delta=1e-5, weight_decay=0.05, weight_decouple=weight_decouple,
              fixed_decay=fixed_decay, amsgrad=amsgrad, win=win, clip=clip)
    diff, opt = run_both(lambda p: optim.AGD(p, **kw), lambda p, g, s: ref.agd(p, g, s, **kw), dtype)
    assert diff <= tolerance(dtype)
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert ("max_exp_avg_sq" in state) == amsgrad and ("z" in state) == win


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta,grad_scale", [
    (1e-5, 1e-9),   # sqrt(b) below the floor: AGD behaves like SGD with momentum
    (1e-14, 1.0),   # the transformer setting
    (1e-5, 1e3),
])
def test_agd_delta_regimes(dtype, delta, grad_scale):
    kw = dict(lr=1e-3, betas=(0.9, 0.999), delta=delta, weight_decay=0.0, weight_decouple=True, fixed_decay=False,
              amsgrad=False, win=False, clip=None)
    diff, _ = run_both(lambda p: optim.AGD(p, **kw), lambda p, g, s: ref.agd(p, g, s, **kw), dtype, grad_scale)
    assert diff <= tolerance(dtype)


def test_agd_defaults_are_reference_defaults():
    opt = optim.AGD([torch.zeros(1, requires_grad=True)])
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert group == dict(lr=1e-3, betas=(0.9, 0.999), delta=1e-5, weight_decay=0.0, weight_decouple=True,
                         fixed_decay=False, amsgrad=False, win=False, clip=None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb(dtype, bias_correction, weight_decay):
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay, bias_correction=bias_correction)
    diff, _ = run_both(lambda p: optim.LAMB(p, **kw), lambda p, g, s: ref.lamb(p, g, s, **kw), dtype)
    assert diff <= tolerance(dtype)


def test_lamb_defaults_are_reference_defaults():
    opt = optim.LAMB([torch.zeros(1, requires_grad=True)])
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert group == dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-3])
@pytest.mark.parametrize("epsilon", [0.0, 1e-4])
@pytest.mark.parametrize("eeta,grad_scale", [
    (1e-3, 1.0),
    (1.0, 1e-3),   # trust ratio above 50: clamped
    (1e-3, 30.0),  # updates beyond +-10: clamped
])
def test_lars(dtype, momentum, weight_decay, epsilon, eeta, grad_scale):
    kw = dict(lr=0.1, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon)
    diff, _ = run_both(lambda p: optim.LARS(p, **kw), lambda p, g, s: ref.lars(p, g, s, **kw), dtype, grad_scale)
    assert diff <= tolerance(dtype)


def test_lars_defaults_are_reference_defaults():
    opt = optim.LARS([torch.zeros(1, requires_grad=True)])
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert group == dict(lr=1e-3, momentum=0.0, eeta=1e-3, weight_decay=0.0, epsilon=0.0)


# WSAM on a loss with a known, non-linear gradient: sum over tensors of w^3/30 + 0.5*c*w^2 + a*w.
def _wsam_loss_terms(shapes, seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.uniform(0.5, 2.0, s), rng.standard_normal(s)) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("decouple", [True, False])
@pytest.mark.parametrize("base", ["sgd", "troupe_adamw"])
def test_wsam(dtype, adaptive, decouple, base):
    shapes = [(13, 7), (7,), (40000,)]
    terms = _wsam_loss_terms(shapes)
    params, expected = make_problem(dtype, shapes=shapes)
    lr, rho, gamma = 0.01, 0.05, 0.9
    torch_terms = [(torch.from_numpy(c.astype(dtype)), torch.from_numpy(a.astype(dtype))) for c, a in terms]

    def closure():
        loss = sum((w ** 3 / 30 + 0.5 * c * w ** 2 + a * w).sum() for w, (c, a) in zip(params, torch_terms))
        loss.backward()
        return loss

    if base == "sgd":
        opt = optim.WSAM(params, torch.optim.SGD, rho=rho, gamma=gamma, adaptive=adaptive, decouple=decouple, lr=lr)
        base_states = None

        def base_step(g):
            ref.sgd(expected, g, None, lr)
    else:
        opt = optim.WSAM(None, optim.AdamW(params, lr=lr, weight_decay=0.1), rho=rho, gamma=gamma, adaptive=adaptive,
                         decouple=decouple)
        base_states = [{} for _ in params]

        def base_step(g):
            ref.adamw(expected, g, base_states, lr, (0.9, 0.999), 1e-8, 0.1)

    def grad_fn(ws):
        return [w ** 2 / 10 + c * w + a for w, (c, a) in zip(ws, terms)]

    for _ in range(4):
        opt.zero_grad()
        closure()
        opt.step(closure)
        ref.wsam(expected, grad_fn, base_step, rho, gamma, 1e-12, adaptive, decouple, lr)
    assert max_rel_diff(params, expected) <= tolerance(dtype)


def test_wsam_defaults_are_reference_defaults():
    opt = optim.WSAM([torch.zeros(1, requires_grad=True)], torch.optim.SGD, lr=0.1)
    group = opt.param_groups[0]
    assert (group["rho"], group["gamma"], group["sam_eps"], group["adaptive"], group["decouple"]) == \
        (0.05, 0.9, 1e-12, False, True)


def test_parameters_without_grad_are_left_alone():
    for cls in (optim.AdamW, optim.AGD, optim.LAMB, optim.LARS):
        a = torch.randn(5, requires_grad=True)
        b = torch.randn(5, requires_grad=True)
        a_before, before = a.detach().clone(), b.detach().clone()
        opt = cls([a, b], lr=0.1)
        a.grad = torch.ones(5)
        opt.step()
        assert torch.equal(b.detach(), before) and len(opt.state[b]) == 0
        assert not torch.equal(a.detach(), a_before)
