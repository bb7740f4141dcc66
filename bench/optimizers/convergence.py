#!/usr/bin/python3
"""bench/run convergence [--json]: steps to the same loss, AGD (and LAMB at 4x batch) vs AdamW.

A small character-level transformer trained on the licence texts under /usr/share/common-licenses
(read at run time; every Debian machine has them). AdamW (torch.optim.AdamW) trains --steps steps;
its held-out loss there is the target. AGD (troupe.optim.AGD, lr a tenth of AdamW's, delta=1e-14 as
its authors suggest for transformers) and LAMB (troupe.optim.LAMB) with a 4x larger batch then train
from the same initial weights on the same data stream (each batch of the 4x run begins with the
sequences of the 1x batch) until their held-out loss reaches the target, or --max-factor times
--steps. The held-out loss is measured every --eval-every steps on fixed sequences. About 3-4 minutes
on 2 cores with the defaults. With --json the last line is one JSON object: adamw_steps,
agd_steps_to_same_loss, target_loss, and the LAMB figures (null where the target was not reached).
"""
import argparse
import time
from pathlib import Path

import numpy as np
import torch

from common import emit_json, import_troupe_optim, print_table

LICENSES = Path("/usr/share/common-licenses")


def load_text():
    files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise SystemExit(f"bench: no licence texts under {LICENSES}")
    return "\n".join(p.read_text(errors="replace") for p in files), len(files)


class CharTransformer(torch.nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True, activation="gelu")
        self.blocks = torch.nn.TransformerEncoder(layer, layers)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), diagonal=1))

    def forward(self, x):
        h = self.embed(x) + self.position[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]])
        return self.head(self.norm(h))


def run(make_opt, batch_of, steps_cap, target, args, init_state, eval_x, eval_y):
    """Trains until the held-out loss is <= target (checked every eval_every steps) or steps_cap.
    Returns (steps to target or None, held-out loss at the last evaluation, curve, seconds)."""
    model = CharTransformer(args.vocab, args.context, args.width, args.layers, args.heads)
    model.load_state_dict(init_state)
    opt = make_opt(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    curve = []
    started = time.perf_counter()
    reached = None
    for step in range(1, steps_cap + 1):
        x, y = batch_of(step)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x).reshape(-1, args.vocab), y.reshape(-1)).backward()
        opt.step()
        if step % args.eval_every == 0:
            with torch.no_grad():
                held_out = float(np.mean([loss_fn(model(ex).reshape(-1, args.vocab), ey.reshape(-1)).item()
                                          for ex, ey in zip(eval_x, eval_y)]))
            curve.append((step, held_out))
            if target is not None and held_out <= target:
                reached = step
                break
    return reached, curve[-1][1], curve, time.perf_counter() - started


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=400, help="AdamW steps N; the target is its loss there")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on 2 shared cores a second intra-op thread slowed this small model)")
    ap.add_argument("--curves", action="store_true", help="also print each run's held-out loss curve")
    ap.add_argument("--max-factor", type=float, default=1.5, help="AGD gives up after this many times N steps "
                    "(LAMB, whose 4x batch makes each step 4x dearer, after N)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW lr; AGD uses a tenth of it")
    ap.add_argument("--agd-lr", type=float, default=None, help="default: a tenth of --lr (the authors' advice)")
    ap.add_argument("--lamb-lr", type=float, default=1e-2)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.agd_lr is None:
        args.agd_lr = args.lr / 10
    optim = import_troupe_optim()
    torch.set_num_threads(args.threads)

    text, files = load_text()
    chars = sorted(set(text))
    args.vocab = len(chars)
    index = {c: i for i, c in enumerate(chars)}
    encoded = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(encoded))
    train, held = encoded[:split], encoded[split:]

    def windows(source, starts):
        x = torch.stack([source[s: s + args.context] for s in starts])
        y = torch.stack([source[s + 1: s + 1 + args.context] for s in starts])
        return x, y

    # The data stream: step k draws 4*batch windows; the 1x runs use the first `batch` of them.
    rng = np.random.default_rng(args.seed)
    steps_cap = int(args.steps * args.max_factor)
    stream = rng.integers(0, len(train) - args.context - 1, size=(steps_cap + 1, 4 * args.batch))
    eval_starts = np.random.default_rng(args.seed + 1).integers(0, len(held) - args.context - 1,
                                                                size=8 * args.batch)
    eval_x, eval_y = zip(*[windows(held, eval_starts[i: i + args.batch])
                           for i in range(0, len(eval_starts), args.batch)])

    torch.manual_seed(args.seed)
    init_state = CharTransformer(args.vocab, args.context, args.width, args.layers, args.heads).state_dict()
    n_params = sum(t.numel() for k, t in init_state.items() if k != "mask")
    print(f"convergence: char-level transformer ({n_params:,} parameters, {args.layers} layers, width {args.width}, "
          f"context {args.context}) on {len(text):,} characters of {files} licence texts from {LICENSES}; "
          f"{args.threads} torch thread(s); held-out loss every {args.eval_every} steps. Takes about 3 minutes.",
          flush=True)

    batch1 = lambda step: windows(train, stream[step, : args.batch])  # noqa: E731
    batch4 = lambda step: windows(train, stream[step])  # noqa: E731
    wd = args.weight_decay

    _, target, adamw_curve, adamw_s = run(
        lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=wd), batch1, args.steps, None, args, init_state,
        eval_x, eval_y)
    print(f"  AdamW: held-out loss {target:.4f} after {args.steps} steps ({adamw_s:.0f} s)", flush=True)
    agd_steps, agd_loss, agd_curve, agd_s = run(
        lambda ps: optim.AGD(ps, lr=args.agd_lr, delta=1e-14, weight_decay=wd), batch1, steps_cap, target, args,
        init_state, eval_x, eval_y)
    print(f"  AGD:   {'reached it at step ' + str(agd_steps) if agd_steps else 'did not reach it'} "
          f"({agd_s:.0f} s)", flush=True)
    lamb_steps, lamb_loss, lamb_curve, lamb_s = run(
        lambda ps: optim.LAMB(ps, lr=args.lamb_lr, weight_decay=wd, bias_correction=True), batch4, args.steps,
        target, args, init_state, eval_x, eval_y)
    print(f"  LAMB (4x batch): {'reached it at step ' + str(lamb_steps) if lamb_steps else 'did not reach it'} "
          f"({lamb_s:.0f} s)", flush=True)

    if args.curves:
        for name, curve in (("AdamW", adamw_curve), ("AGD", agd_curve), ("LAMB 4x", lamb_curve)):
            print(f"  {name:8} " + " ".join(f"{step}:{loss:.3f}" for step, loss in curve))

    def ratio(steps):
        return round(args.steps / steps, 3) if steps else None

    def shown(steps, cap):
        return str(steps) if steps else f"> {cap}"

    rows = [
        [f"torch.optim.AdamW lr={args.lr:g}", args.batch, args.steps, "1.00x", f"{adamw_s:.0f}"],
        [f"troupe.optim.AGD lr={args.agd_lr:g} delta=1e-14", args.batch, shown(agd_steps, steps_cap),
         f"{ratio(agd_steps):.2f}x" if agd_steps else "-", f"{agd_s:.0f}"],
        [f"troupe.optim.LAMB lr={args.lamb_lr:g} (4x batch)", 4 * args.batch, shown(lamb_steps, args.steps),
         f"{ratio(lamb_steps):.2f}x" if lamb_steps else "-", f"{lamb_s:.0f}"],
    ]
    print_table(f"steps to AdamW's held-out loss at step {args.steps}: {target:.4f} "
                f"(AGD paper: about 1.5x fewer steps than AdamW on GPT-2)",
                ["optimizer", "batch", "steps", "fewer steps", "seconds"], rows)
    emit_json(args.json, {
        "adamw_steps": args.steps,
        "agd_steps_to_same_loss": agd_steps,
        "target_loss": round(target, 5),
        "agd_step_ratio": ratio(agd_steps),
        "lamb_4x_batch_steps_to_same_loss": lamb_steps,
        "lamb_4x_step_ratio": ratio(lamb_steps),
        "agd_max_steps": steps_cap,
        "lamb_max_steps": args.steps,
        "batch": args.batch,
        "params": n_params,
        "eval_every": args.eval_every,
        "seconds": round(adamw_s + agd_s + lamb_s, 1),
    })


if __name__ == "__main__":
    main()
