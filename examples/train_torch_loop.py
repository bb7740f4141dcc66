#!/usr/bin/env python3
"""Your own eager PyTorch training loop in an elastic group of 2 trainers (TorchTrainer), on
scikit-learn's digits (8x8 images of handwritten digits; python3-sklearn). Midway, one trainer is killed with
SIGKILL; the group recovers (the survivor keeps its process and re-enters the loop) and finishes.
Prints the held-out accuracy, which must reach TARGET_ACCURACY.

    /usr/bin/python3 examples/train_torch_loop.py [--steps 120] [--no-kill]
"""
import argparse
import os
import signal
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", os.environ.get("BUILD", "build"), "python"))
import torch  # noqa: E402

import troupe  # noqa: E402
from troupe.train import ScalingConfig, TorchTrainer  # noqa: E402

TARGET_ACCURACY = 0.85  # held-out; chance is 0.10


def digits():
    """(train features, train labels, test features, test labels), 80/20, and where they are from."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    x, y = x[perm], y[perm]
    cut = len(y) * 4 // 5
    return x[:cut], y[:cut], x[cut:], y[cut:], "scikit-learn's digits (python3-sklearn)"


class Digits(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


class EagerNet(torch.nn.Module):
    """Code TorchScript cannot compile (a generator expression), with data-dependent depth."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(64, 96)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(96, 96) for _ in range(3))
        self.out = torch.nn.Linear(96, 10)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for _ in range(1 + int(h.mean().item() > 0.4)):
            h = h + sum(torch.relu(b(h)) for b in self.blocks) / len(self.blocks)
        return self.out(h)


def make_loop(test_x, test_y):
    def train_loop(ctx):
        torch.manual_seed(0)
        model = ctx.prepare(EagerNet)  # what makes the model: a rank that survives a failure keeps its own
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 400)
        ctx.track(model=model, opt=opt, sched=sched)
        for x, y in ctx.batches():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                acc = (model.module(test_x).argmax(1) == test_y).float().mean().item()
            ctx.report(loss=loss.item(), test_acc=acc, pid=os.getpid())

    return train_loop


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--no-kill", action="store_true")
    args = parser.parse_args()
    train_x, train_y, test_x, test_y, source = digits()
    print(f"data: {source}: {len(train_y)} training and {len(test_y)} held-out samples")
    troupe.init(num_cpus=2, log_to_driver=False)
    try:
        with TorchTrainer(make_loop(test_x, test_y), data=Digits(train_x, train_y), global_batch_size=64,
                          scaling=ScalingConfig(min_workers=1, max_workers=2), steps_per_call=10) as trainer:
            half = args.steps // 2
            trainer.fit(steps=half)
            if not args.no_kill:
                victim = next(m for m in trainer.members() if m["kind"] == "trainer" and m["rank"] == 1)
                print(f"kill -9 of rank 1 (pid {victim['pid']}) at step {trainer.step}")
                os.kill(victim["pid"], signal.SIGKILL)
            history = trainer.fit(steps=args.steps - half)
            for r in trainer.recoveries:
                print(f"recovered in {r['recovery_s']:.2f} s, resuming at step {r['step']}")
            acc = history[-1]["metrics"]["test_acc"]
            print(f"step {trainer.step}: loss {history[-1]['loss']:.3f}, held-out accuracy {acc:.3f} "
                  f"(target {TARGET_ACCURACY})")
            if not args.no_kill and not trainer.recoveries:
                sys.exit("the killed trainer was not recovered")
            if acc < TARGET_ACCURACY:
                sys.exit(f"held-out accuracy {acc:.3f} is below the target {TARGET_ACCURACY}")
    finally:
        troupe.shutdown()


if __name__ == "__main__":
    main()
