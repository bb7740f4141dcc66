"""troupe.optim on an ordinary torch.nn.Module, as a PyTorch user would write it: every optimizer
trains a small regression model (the loss falls well below its start) and plays with lr
schedulers and zero_grad like torch.optim's."""
import pytest

from optim_testing import optim, torch

MAKERS = {
    "AdamW": lambda ps: optim.AdamW(ps, lr=1e-2),
    "AGD": lambda ps: optim.AGD(ps, lr=1e-3, delta=1e-14),
    "LAMB": lambda ps: optim.LAMB(ps, lr=1e-2),
    "LARS": lambda ps: optim.LARS(ps, lr=1.0, momentum=0.9, eeta=1e-2),
    "WSAM(AdamW)": lambda ps: optim.WSAM(ps, optim.AdamW, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_trains_a_plain_module(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(256, 8)
    y = (x[:, :1] * x[:, 1:2]).tanh()
    opt = MAKERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)

    def closure():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with torch.no_grad():
        start = torch.nn.functional.mse_loss(model(x), y).item()
    for _ in range(150):
        opt.zero_grad()
        if name.startswith("WSAM"):
            closure()
            opt.step(closure)
        else:
            opt.step(closure)
        sched.step()
    with torch.no_grad():
        end = torch.nn.functional.mse_loss(model(x), y).item()
    assert end < 0.5 * start, (start, end)
    assert opt.param_groups[0]["lr"] == pytest.approx(MAKERS[name](model.parameters()).param_groups[0]["lr"] * 0.5)
