"""Troupe's optimizers for PyTorch: AGD, WSAM, LAMB, LARS and AdamW on fused C++ kernels.

Each class is a ``torch.optim.Optimizer`` (param groups, ``state_dict``/``load_state_dict``,
``zero_grad``, lr schedulers) whose ``step`` runs one fused, vectorised, in-place CPU pass per
parameter (two for LAMB and LARS, whose trust ratios need whole-tensor norms first), each pass
over a whole param group in one parallel region of ``threads`` OpenMP threads (default: every
CPU this process may use). Parameters must be
contiguous float32 or float64 CPU tensors. The update rules and defaults are those of
``shared/REFERENCE.md``; the C++ library is ``optimizers/`` in the Troupe repository.

    import torch, troupe.optim
    model = torch.nn.Linear(10, 1)
    opt = troupe.optim.AGD(model.parameters(), lr=1e-4, delta=1e-14)
    model(torch.randn(4, 10)).sum().backward()
    opt.step()

Bad hyper-parameters raise ``ValueError`` (``TypeError`` for a value of the wrong type), at
construction, in ``add_param_group`` and, if a group was edited since, at the next ``step``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from troupe import _optim
from .exceptions import ArgumentTypeError, InvalidArgumentError

__all__ = ["AGD", "AdamW", "LAMB", "LARS", "WSAM", "all_reduce_mean", "all_reduce_sum"]

# What the constructors take as params: tensors, or param groups (dicts with "params").
Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
# A closure re-evaluates the model and returns the loss.
Closure = Callable[[], Any]
# A grad_reduce / norm_reduce callback (see all_reduce_mean, all_reduce_sum).
Reduce = Callable[[Any], None]


def _check_threads(threads):
    if threads is None:
        return _optim.default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive int or None, got {threads!r}")
    return threads


class _Fused(Optimizer):
    """An Optimizer whose groups are validated by troupe._optim and whose kernels use `threads`."""

    def _norm_scaled_step(self, closure, norms, apply):
        """LAMB and LARS: per-group norms first (summed over the shard group by norm_reduce, when
        set), then the update scaled by them."""
        loss = _evaluate(closure)
        work, sums = [], []
        for group in self.param_groups:
            params, grads, states = self._with_grads(group)
            work.append((group, params, grads, states))
            sums.append(norms(group, params, grads, states))
        if self.norm_reduce is not None:
            sums = _reduce_norms(self.norm_reduce, sums, type(self).__name__)
        for (group, params, grads, states), s in zip(work, sums):
            if params:
                apply(group, params, grads, states, s)
        return loss

    _validate: Callable[[dict[str, Any]], None]  # troupe._optim.validate_<name>, set by each subclass

    def __init__(self, params, defaults, threads):
        self.threads = _check_threads(threads)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        type(self)._validate(self.param_groups[-1])

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("threads", _optim.default_threads())

    def _with_grads(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        return params, [p.grad for p in params], [self.state[p] for p in params]


def _evaluate(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class AdamW(_Fused):
    """AdamW (decoupled weight decay) in one fused pass per parameter:
    ``p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
    p -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)``. Defaults as torch.optim.AdamW.
    """

    _validate = _optim.validate_adamw

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, threads: int | None = None) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), threads)

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Any:
        loss = _evaluate(closure)
        for group in self.param_groups:
            params, grads, states = self._with_grads(group)
            if params:
                _optim.adamw_step(group, params, grads, states, self.threads)
        return loss


class AGD(_Fused):
    """AGD: preconditioning by the step-wise gradient difference, switching to SGD with
    momentum where it falls below ``delta`` (Yue et al., NeurIPS 2023), in one fused pass.

    Options: ``weight_decay`` with ``weight_decouple`` (``p *= 1 - lr*wd``; otherwise
    ``g += wd*p``, on a local copy: ``p.grad`` is not modified) and ``fixed_decay``
    (``p *= 1 - wd``); ``amsgrad`` (running max of the second moment); ``win`` (the Win
    variant, with its ``z`` sequence); ``clip`` (bound on each element of the update, or None).
    For transformers the authors suggest ``delta=1e-14`` and a tenth of AdamW's lr.
    """

    _validate = _optim.validate_agd

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 delta: float = 1e-5, weight_decay: float = 0.0, weight_decouple: bool = True,
                 fixed_decay: bool = False, amsgrad: bool = False, win: bool = False, clip: float | None = None, *,
                 threads: int | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, delta=delta, weight_decay=weight_decay, weight_decouple=weight_decouple,
                        fixed_decay=fixed_decay, amsgrad=amsgrad, win=win, clip=clip)
        super().__init__(params, defaults, threads)

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Any:
        loss = _evaluate(closure)
        for group in self.param_groups:
            params, grads, states = self._with_grads(group)
            if params:
                _optim.agd_step(group, params, grads, states, self.threads)
        return loss


def _reduce_norms(norm_reduce, sums_per_group, name):
    """Sums every group's squared norms across shards with one norm_reduce call."""
    flat = torch.cat(sums_per_group) if sums_per_group else torch.zeros(0, dtype=torch.float64)
    norm_reduce(flat)
    if flat.dtype != torch.float64 or flat.dim() != 1:
        raise InvalidArgumentError(f"{name}: norm_reduce must sum the float64 tensor in place, not replace it")
    return list(torch.split(flat, [len(s) for s in sums_per_group]))


class LAMB(_Fused):
    """LAMB: Adam moments with a layer-wise trust ratio ``||p|| / ||u||``.

    ``bias_correction`` scales lr by ``sqrt(1-b2^t)/(1-b1^t)``. ``norm_reduce``: for a sharded
    (ZeRO-style) group whose members each hold a shard of the same parameters in the same
    order, a callable that sums a float64 tensor in place across the shard group, e.g.
    ``troupe.optim.all_reduce_sum(group)``; every member must call step() together.
    """

    _validate = _optim.validate_lamb
    norm_reduce = None  # also the value after unpickling: torch.optim pickles defaults, state and groups only

    def __init__(self, params: Params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = False, *, norm_reduce: Reduce | None = None,
                 threads: int | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, threads)
        self.norm_reduce = norm_reduce

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Any:
        return self._norm_scaled_step(
            closure, lambda group, params, grads, states: _optim.lamb_moments(group, params, grads, states, self.threads),
            lambda group, params, grads, states, s: _optim.lamb_apply(group, params, states, s, self.threads))


class LARS(_Fused):
    """LARS: SGD (with optional ``momentum``) scaled by the layer-wise trust ratio
    ``eeta*||p|| / (||g|| + wd*||p|| + epsilon)``, clamped to [0, 50], with the update
    clamped to [-10, 10] elementwise. ``norm_reduce`` as for LAMB.
    """

    _validate = _optim.validate_lars
    norm_reduce = None  # also the value after unpickling: torch.optim pickles defaults, state and groups only

    def __init__(self, params: Params, lr: float = 1e-3, momentum: float = 0.0, eeta: float = 1e-3,
                 weight_decay: float = 0.0, epsilon: float = 0.0, *, norm_reduce: Reduce | None = None,
                 threads: int | None = None) -> None:
        defaults = dict(lr=lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon)
        super().__init__(params, defaults, threads)
        self.norm_reduce = norm_reduce

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> Any:
        return self._norm_scaled_step(
            closure, lambda group, params, grads, states: _optim.lars_norms(params, grads, self.threads),
            lambda group, params, grads, states, s: _optim.lars_apply(group, params, grads, states, s, self.threads))


class WSAM(Optimizer):
    """Weighted sharpness-aware minimisation around any base optimizer (two forward/backward
    passes per step):

        first_step:  n = ||(|w| if adaptive else 1) * g||; e = (w^2 if adaptive else 1)*g*rho/(n+sam_eps)
                     w += e; g0 = grad_reduce(g); g = 0
        (forward/backward again at w + e)
        second_step: g1 = grad_reduce(g); w -= e
                     decouple: g = g0; base.step(); w -= lr*alpha*(g1 - g0)
                     otherwise: g = alpha*g1 + (1-alpha)*g0; base.step()

    with ``alpha = gamma/(1-gamma)`` and ``lr`` each group's current lr. ``base_optimizer`` is
    an optimizer instance over the same parameters (``params`` may then be None), or an
    optimizer class built as ``base_optimizer(params, **base_kwargs)``. WSAM shares the base's
    param groups (its keys rho, gamma, sam_eps, adaptive, decouple are added to them), so lr
    schedulers may drive either. ``sam_eps`` is the epsilon of the rule (named so it cannot be
    confused with the base's ``eps``).

    ``grad_reduce``: where the rule all-reduces gradients (mean over data-parallel ranks): a
    callable that averages a list of gradients in place, e.g. ``troupe.optim.all_reduce_mean()``
    when each rank runs its own backward without DistributedDataParallel. None: use the
    gradients as they are (single process, or DDP already averaged them). ``norm_reduce``:
    sums the squared gradient norm across a sharded group, as for LAMB.

    ``step(closure)`` needs a closure that runs the forward and backward pass again and returns
    the loss; ``first_step()`` and ``second_step()`` may be called directly instead.
    ``state_dict()`` is the base optimizer's (with WSAM's group keys); e and g0 are per-step
    buffers and are not saved.
    """

    def __init__(self, params: Params | None, base_optimizer: Optimizer | type[Optimizer], rho: float = 0.05,
                 gamma: float = 0.9, sam_eps: float = 1e-12, adaptive: bool = False, decouple: bool = True, *,
                 grad_reduce: Reduce | None = None, norm_reduce: Reduce | None = None, threads: int | None = None,
                 **base_kwargs: Any) -> None:
        if isinstance(base_optimizer, Optimizer):
            if base_kwargs:
                raise ArgumentTypeError(f"WSAM: unexpected keyword arguments {sorted(base_kwargs)} (they are only for "
                                "building base_optimizer from a class)")
            base = base_optimizer
            if params is not None:
                listed: list[Any] = list(params)
                given = {id(p) for p in listed} if listed and isinstance(listed[0], torch.Tensor) else \
                    {id(p) for g in listed for p in g["params"]}
                held = {id(p) for g in base.param_groups for p in g["params"]}
                if given != held:
                    raise InvalidArgumentError("WSAM: params must be the base optimizer's parameters (or None)")
        elif isinstance(base_optimizer, type) and issubclass(base_optimizer, Optimizer):
            if params is None:
                raise InvalidArgumentError("WSAM: params are needed to build the base optimizer from a class")
            base = base_optimizer(params, **base_kwargs)
        else:
            raise ArgumentTypeError(f"WSAM: base_optimizer must be a torch.optim.Optimizer or its class, "
                            f"got {type(base_optimizer).__name__}")
        self.base_optimizer = base
        self.threads = _check_threads(threads)
        self.grad_reduce = grad_reduce
        self.norm_reduce = norm_reduce
        self._pending: list[tuple[dict[str, Any], list[Any], list[Any]]] | None = None  # perturbed by first_step
        defaults = dict(rho=rho, gamma=gamma, sam_eps=sam_eps, adaptive=adaptive, decouple=decouple)
        super().__init__(base.param_groups, defaults)
        # The same dicts in the same list: the base's lr (and schedulers on either) are shared.
        self.param_groups = base.param_groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _optim.validate_wsam(self.param_groups[-1])

    def _reduce_grads(self, params):
        if self.grad_reduce is None:
            return
        grads = [p.grad for p in params]
        self.grad_reduce(grads)
        for p, g in zip(params, grads):
            if g is not p.grad:
                p.grad.copy_(g)

    @torch.no_grad()
    def first_step(self) -> None:
        if self._pending is not None:
            raise RuntimeError("WSAM: first_step called twice; call second_step after the second backward pass")
        work = []
        for group in self.param_groups:
            _optim.validate_wsam(group)
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                work.append((group, params, [self.state[p] for p in params]))
        squared = sum(_optim.wsam_grad_sq(params, [p.grad for p in params], group["adaptive"], self.threads)
                      for group, params, _ in work)
        if self.norm_reduce is not None:
            total = torch.tensor([squared], dtype=torch.float64)
            self.norm_reduce(total)
            squared = total.item()
        norm = math.sqrt(squared)
        for group, params, states in work:
            scale = group["rho"] / (norm + group["sam_eps"])
            _optim.wsam_perturb(params, [p.grad for p in params], states, group["adaptive"], scale, self.threads)
        self._pending = work
        self._reduce_grads([p for _, params, _ in work for p in params])
        for _, params, states in work:
            _optim.wsam_save_grad(params, [p.grad for p in params], states, self.threads)

    @torch.no_grad()
    def second_step(self) -> None:
        if self._pending is None:
            raise RuntimeError("WSAM: second_step without first_step")
        work, self._pending = self._pending, None
        for _, params, _ in work:
            if any(p.grad is None for p in params):
                raise RuntimeError("WSAM: a parameter had a gradient in the first backward pass but none in the "
                                   "second")
        self._reduce_grads([p for _, params, _ in work for p in params])
        for group, params, states in work:
            alpha = group["gamma"] / (1 - group["gamma"])
            _optim.wsam_restore(params, [p.grad for p in params], states, group["decouple"], alpha, self.threads)
        self.base_optimizer.step()
        for group, params, states in work:
            if group["decouple"]:
                alpha = group["gamma"] / (1 - group["gamma"])
                _optim.wsam_correct(params, states, group["lr"] * alpha, self.threads)

    def step(self, closure: Closure | None = None) -> Any:
        if closure is None:
            raise RuntimeError("WSAM: step needs a closure that runs the forward and backward pass again (it is "
                               "evaluated at the perturbed weights w + e)")
        self.first_step()
        with torch.enable_grad():
            loss = closure()
        self.second_step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            raise RuntimeError("WSAM: cannot save between first_step and second_step: the weights are perturbed")
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._pending is not None:
            raise RuntimeError("WSAM: cannot load between first_step and second_step: the weights are perturbed")
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            _optim.validate_wsam(group)

    def __getstate__(self):
        if self._pending is not None:
            raise RuntimeError("WSAM: cannot copy between first_step and second_step: the weights are perturbed")
        return dict(self.__dict__)  # with the base optimizer, whose param_groups list WSAM shares

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("threads", _optim.default_threads())
        self.__dict__.setdefault("_pending", None)


def all_reduce_mean(group: Any = None) -> Reduce:
    """A WSAM ``grad_reduce``: averages each gradient over ``group`` with torch.distributed."""
    import torch.distributed as dist

    def reduce(grads):
        world = dist.get_world_size(group)
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
            g.div_(world)

    return reduce


def all_reduce_sum(group: Any = None) -> Reduce:
    """A ``norm_reduce`` for LAMB, LARS and WSAM: sums squared norms over a shard ``group``."""
    import torch.distributed as dist

    def reduce(sums):
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)

    return reduce
