"""Bad hyper-parameters raise ValueError (TypeError for the wrong type) with a message that names
the option and the value; unsupported tensors are refused clearly."""
import math

import pytest

from optim_testing import optim, torch


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


BAD = [
    (optim.AdamW, dict(lr=-1e-3), "AdamW: lr must be a finite number >= 0, got -0.001"),
    (optim.AdamW, dict(lr=math.nan), "AdamW: lr must be a finite number >= 0, got nan"),
    (optim.AdamW, dict(betas=(1.0, 0.999)), r"AdamW: betas\[0\] must be in \[0, 1\), got 1"),
    (optim.AdamW, dict(betas=(0.9, -0.1)), r"AdamW: betas\[1\] must be in \[0, 1\), got -0.1"),
    (optim.AdamW, dict(eps=-1e-8), "AdamW: eps must be a finite number >= 0"),
    (optim.AdamW, dict(weight_decay=-0.1), "AdamW: weight_decay must be a finite number >= 0"),
    (optim.AGD, dict(lr=-1.0), "AGD: lr must be"),
    (optim.AGD, dict(betas=(0.9, 1.5)), r"AGD: betas\[1\]"),
    (optim.AGD, dict(delta=-1e-5), "AGD: delta must be"),
    (optim.AGD, dict(weight_decay=-1.0), "AGD: weight_decay must be"),
    (optim.AGD, dict(clip=0.0), "AGD: clip must be a finite number > 0 or None, got 0"),
    (optim.AGD, dict(clip=-1.0), "AGD: clip must be"),
    (optim.AGD, dict(weight_decay=2.0, fixed_decay=True), "AGD: with fixed_decay"),
    (optim.AGD, dict(betas=0.9), "AGD: betas must be a pair"),
    (optim.AGD, dict(betas=(0.9, 0.99, 0.999)), "AGD: betas must be a pair"),
    (optim.LAMB, dict(lr=-1.0), "LAMB: lr must be"),
    (optim.LAMB, dict(eps=-1.0), "LAMB: eps must be"),
    (optim.LAMB, dict(betas=(-0.5, 0.9)), r"LAMB: betas\[0\]"),
    (optim.LAMB, dict(weight_decay=-0.01), "LAMB: weight_decay must be"),
    (optim.LARS, dict(lr=-0.1), "LARS: lr must be"),
    (optim.LARS, dict(momentum=-0.9), "LARS: momentum must be"),
    (optim.LARS, dict(eeta=-1e-3), "LARS: eeta must be"),
    (optim.LARS, dict(weight_decay=-1.0), "LARS: weight_decay must be"),
    (optim.LARS, dict(epsilon=-1.0), "LARS: epsilon must be"),
    (optim.AGD, dict(threads=0), "threads must be a positive int"),
]


@pytest.mark.parametrize("cls,kwargs,message", BAD, ids=[f"{c.__name__}-{sorted(k)[0]}" for c, k, _ in BAD])
def test_bad_hyper_parameter_raises_value_error(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(params(), **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(rho=-0.05), "WSAM: rho must be a finite number >= 0"),
    (dict(gamma=1.0), r"WSAM: gamma must be in \[0, 1\)"),
    (dict(gamma=-0.1), r"WSAM: gamma must be in \[0, 1\)"),
    (dict(sam_eps=-1.0), "WSAM: sam_eps must be a finite number >= 0, got -1.0"),
])
def test_bad_wsam_hyper_parameter_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        optim.WSAM(params(), torch.optim.SGD, lr=0.1, **kwargs)


def test_wrong_types_raise_type_error():
    with pytest.raises(TypeError, match="AGD: lr must be a number, got str"):
        optim.AGD(params(), lr="fast")
    with pytest.raises(TypeError, match="AGD: amsgrad must be True or False, got str"):
        optim.AGD(params(), amsgrad="yes")
    with pytest.raises(TypeError, match="base_optimizer must be"):
        optim.WSAM(params(), "sgd")


def test_edited_group_is_checked_at_the_next_step():
    p = params()
    opt = optim.AGD(p)
    p[0].grad = torch.ones(3)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="AGD: lr must be"):
        opt.step()
    assert torch.equal(p[0].detach(), torch.zeros(3))
    with pytest.raises(ValueError, match="LAMB: weight_decay must be"):
        optim.LAMB(params()).add_param_group({"params": params(), "weight_decay": -1.0})


def test_unsupported_tensors_are_refused():
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    half.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(TypeError, match="AdamW: parameters must be float32 or float64, got Half"):
        optim.AdamW([half]).step()
    strided = torch.nn.Parameter(torch.zeros(4, 4).t())
    strided.grad = torch.ones(4, 4)
    with pytest.raises(RuntimeError, match="AGD: parameters must be contiguous"):
        optim.AGD([strided]).step()
    sparse = torch.nn.Parameter(torch.zeros(3))
    sparse.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients are not supported"):
        optim.LAMB([sparse]).step()
