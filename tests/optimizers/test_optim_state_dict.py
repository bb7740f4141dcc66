"""state_dict round trips on a plain torch.nn.Module: a fresh model and optimizer that load the
saved state (through torch.save/torch.load) continue the same trajectory bit for bit."""
import copy
import io

import pytest

from optim_testing import optim, torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                          torch.nn.Linear(64, 1))

    def forward(self, x):
        return self.layers(x)


def data(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(model, opt, steps, first, two_pass):
    for step in range(first, first + steps):
        x, y = data(step)

        def closure():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.zero_grad()
        closure()
        if two_pass:
            opt.step(closure)
        else:
            opt.step()


CASES = {
    "adamw": (lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1), lambda ps: optim.AdamW(ps)),
    "agd": (lambda ps: optim.AGD(ps, lr=1e-3, weight_decay=0.01, amsgrad=True, win=True, clip=1.0),
            lambda ps: optim.AGD(ps)),
    "agd_coupled": (lambda ps: optim.AGD(ps, lr=1e-3, weight_decay=0.01, weight_decouple=False),
                    lambda ps: optim.AGD(ps)),
    "lamb": (lambda ps: optim.LAMB(ps, lr=1e-2, weight_decay=0.01, bias_correction=True), lambda ps: optim.LAMB(ps)),
    "lars": (lambda ps: optim.LARS(ps, lr=0.5, momentum=0.9, eeta=0.01, weight_decay=1e-4),
             lambda ps: optim.LARS(ps)),
    "wsam_agd": (lambda ps: optim.WSAM(ps, optim.AGD, rho=0.1, adaptive=True, lr=1e-3),
                 lambda ps: optim.WSAM(ps, optim.AGD)),
    "wsam_sgd": (lambda ps: optim.WSAM(ps, torch.optim.SGD, decouple=False, lr=0.05, momentum=0.9),
                 lambda ps: optim.WSAM(ps, torch.optim.SGD, lr=1.0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_continues_bit_for_bit(name):
    make, make_default = CASES[name]
    two_pass = name.startswith("wsam")
    torch.manual_seed(0)
    model = Net()
    opt = make(model.parameters())
    train(model, opt, 3, 0, two_pass)

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    train(model, opt, 4, 3, two_pass)

    # A fresh model and an optimizer built with other hyper-parameters: the state dict brings them.
    torch.manual_seed(1)
    model2 = Net()
    model2.load_state_dict(saved["model"])
    opt2 = make_default(model2.parameters())
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, 4, 3, two_pass)

    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt.state_dict()["param_groups"] == opt2.state_dict()["param_groups"]


def test_state_dict_holds_the_expected_buffers():
    p = torch.nn.Parameter(torch.randn(4))
    opt = optim.AGD([p], amsgrad=True, win=True)
    p.grad = torch.ones(4)
    opt.step()
    state = opt.state_dict()["state"][0]
    assert state["step"] == 1
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "z"}


def test_wsam_refuses_to_save_between_its_passes():
    p = torch.nn.Parameter(torch.randn(4))
    opt = optim.WSAM([p], optim.AdamW)
    p.grad = torch.ones(4)
    opt.first_step()
    with pytest.raises(RuntimeError, match="between first_step and second_step"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match="called twice"):
        opt.first_step()
    p.grad = torch.ones(4)
    opt.second_step()
    opt.state_dict()
    with pytest.raises(RuntimeError, match="needs a closure"):
        opt.step()


@pytest.mark.parametrize("cls", [optim.AdamW, optim.AGD, optim.LAMB, optim.LARS])
def test_kernel_thread_count_does_not_change_results(cls):
    torch.manual_seed(0)
    one, two = Net(), Net()
    two.load_state_dict(one.state_dict())
    extra = dict(momentum=0.9) if cls is optim.LARS else {}
    opt1 = cls(one.parameters(), lr=1e-2, threads=1, **extra)
    opt2 = cls(two.parameters(), lr=1e-2, threads=2, **extra)
    # A parameter large enough for the kernels to split it over the threads.
    big1 = torch.nn.Parameter(torch.randn(100_000))
    big2 = torch.nn.Parameter(big1.detach().clone())
    opt1.add_param_group({"params": [big1]})
    opt2.add_param_group({"params": [big2]})
    for step in range(3):
        for model, big in ((one, big1), (two, big2)):
            x, y = data(step)
            model.zero_grad()
            big.grad = torch.sin(big.detach() * (step + 1))
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt1.step()
        opt2.step()
    assert torch.equal(big1, big2)
    for a, b in zip(one.parameters(), two.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_deepcopy_of_model_and_optimizer_continues_bit_for_bit(name):
    make, _ = CASES[name]
    two_pass = name.startswith("wsam")
    torch.manual_seed(0)
    model = Net()
    opt = make(model.parameters())
    train(model, opt, 2, 0, two_pass)
    model2, opt2 = copy.deepcopy((model, opt))
    train(model, opt, 2, 2, two_pass)
    train(model2, opt2, 2, 2, two_pass)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
