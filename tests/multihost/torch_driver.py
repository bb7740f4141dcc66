"""A TorchTrainer driver's small loop and data set, for the multi-host tests' driver scripts: each
step sleeps STEP_PAUSE seconds, which the script sets before it, and reports the rank's pid."""

TORCH_LOOP = """
import os, time
import torch
from troupe import _api
from troupe.train import ScalingConfig, TorchTrainer

def loop(ctx):
    torch.manual_seed(0)
    model = ctx.prepare(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, opt=opt)
    for x, y in ctx.batches():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(STEP_PAUSE)
        ctx.report(loss=loss.item(), pid=os.getpid())

g = torch.Generator().manual_seed(1)
xs, ys = torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g)
data = [(xs[i], int(ys[i])) for i in range(256)]
rt = _api.runtime()
"""
