"""An independent numpy (float64) reference for Troupe's optimizers, written from the update rules
in shared/REFERENCE.md and nothing else: one plain function per rule, whole arrays, no fusion.

Each step function takes lists of parameters and gradients (numpy arrays, updated in place) and
a list of per-parameter state dicts, and applies one step with the given hyper-parameters.
"""

import numpy as np


def _state(s, key, like):
    if key not in s:
        s[key] = np.zeros_like(like)
    return s[key]


def adamw(params, grads, states, lr, betas, eps, weight_decay):
    b1, b2 = betas
    for p, g, s in zip(params, grads, states):
        s["step"] = t = s.get("step", 0) + 1
        m, v = _state(s, "m", p), _state(s, "v", p)
        p *= 1 - lr * weight_decay
        m[:] = b1 * m + (1 - b1) * g
        v[:] = b2 * v + (1 - b2) * g ** 2
        p -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


def agd(params, grads, states, lr, betas, delta, weight_decay, weight_decouple, fixed_decay, amsgrad, win, clip):
    b1, b2 = betas
    wd = weight_decay
    for p, g, s in zip(params, grads, states):
        g = g.copy()
        s["step"] = t = s.get("step", 0) + 1
        m, b = _state(s, "m", p), _state(s, "b", p)
        if not win:
            if weight_decouple:
                p *= 1 - (wd if fixed_decay else lr * wd)
            else:
                g += wd * p
        m_prev = m.copy()
        m[:] = b1 * m + (1 - b1) * g
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        if t == 1:
            step_diff = m / bc1
        else:
            step_diff = m / bc1 - m_prev / (1 - b1 ** (t - 1))
        b[:] = b2 * b + (1 - b2) * step_diff ** 2
        if amsgrad:
            max_b = _state(s, "max_b", p)
            max_b[:] = np.maximum(max_b, b)
            d = np.sqrt(max_b)
        else:
            d = np.sqrt(b)
        d = np.maximum(d, delta * np.sqrt(bc2))
        lr_t = lr * np.sqrt(bc2) / bc1
        u = m / d
        if clip:
            u = np.clip(u, -clip, clip)
        if not win:
            p -= lr_t * u
        else:
            z = _state(s, "z", p)
            z[:] = (z - lr_t * u) / (1 + wd * lr_t)
            tau = 1 / (3 + 2 * lr_t * wd)
            p[:] = tau * p - 2 * tau * lr_t * u + 2 * tau * z


def lamb(params, grads, states, lr, betas, eps, weight_decay, bias_correction):
    b1, b2 = betas
    for p, g, s in zip(params, grads, states):
        s["step"] = t = s.get("step", 0) + 1
        m, v = _state(s, "m", p), _state(s, "v", p)
        m[:] = b1 * m + (1 - b1) * g
        v[:] = b2 * v + (1 - b2) * g ** 2
        lr_t = lr * (np.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else 1)
        u = m / (np.sqrt(v) + eps) + weight_decay * p
        p_norm, u_norm = np.linalg.norm(p), np.linalg.norm(u)
        r = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
        p -= lr_t * r * u


def lars(params, grads, states, lr, momentum, eeta, weight_decay, epsilon):
    for p, g, s in zip(params, grads, states):
        p_norm, g_norm = np.linalg.norm(p), np.linalg.norm(g)
        if p_norm > 0 and g_norm > 0:
            r = eeta * p_norm / (g_norm + weight_decay * p_norm + epsilon)
        else:
            r = 1.0
        r = min(max(r, 0.0), 50.0)
        d = np.clip(g + weight_decay * p, -10, 10)
        if momentum:
            if "buf" not in s:
                s["buf"] = d.copy()
            else:
                s["buf"] = momentum * s["buf"] + d
            d = s["buf"]
        p -= lr * r * d


def sgd(params, grads, states, lr):
    for p, g in zip(params, grads):
        p -= lr * g


def wsam(params, grad_fn, base_step, rho, gamma, eps, adaptive, decouple, lr):
    """One WSAM step. grad_fn(params) -> gradients at those weights; base_step(grads) applies
    the base optimizer to `params` in place."""
    alpha = gamma / (1 - gamma)
    g = grad_fn(params)
    n = np.sqrt(sum(np.sum(((np.abs(w) if adaptive else 1.0) * gi) ** 2) for w, gi in zip(params, g)))
    e = [(w ** 2 if adaptive else 1.0) * gi * rho / (n + eps) for w, gi in zip(params, g)]
    for w, ei in zip(params, e):
        w += ei
    g0 = [gi.copy() for gi in g]
    g1 = grad_fn(params)
    for w, ei in zip(params, e):
        w -= ei
    if decouple:
        base_step(g0)
        for w, a, b in zip(params, g1, g0):
            w -= lr * alpha * (a - b)
    else:
        base_step([alpha * a + (1 - alpha) * b for a, b in zip(g1, g0)])
