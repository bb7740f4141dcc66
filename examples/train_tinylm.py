#!/usr/bin/env python3
"""Trains a small character-level transformer on the licence texts every Debian machine has,
as one elastic group of 2 trainers on an embedded local cluster. Midway, one trainer is killed
with SIGKILL; the group recovers from its memory snapshots and finishes. Writes the loss curve
(with the failure and the recovery marked) to tinylm_loss.png.

    /usr/bin/python3 examples/train_tinylm.py [--steps 300] [--no-kill] [--out tinylm_loss.png]
"""
import argparse
import glob
import os
import signal
import sys
import threading
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", os.environ.get("BUILD", "build"), "python"))
import troupe  # noqa: E402
from troupe.train import ElasticTrainer  # noqa: E402

# The loss the run must reach: a model that only learned character frequencies sits near 3.0
# nats; one that learned common words and spacing goes well below.
TARGET_LOSS = 2.5


def corpus(path):
    """All licence texts in one file: about 1 MB of real English."""
    with open(path, "wb") as out:
        for name in sorted(glob.glob("/usr/share/common-licenses/*")):
            if os.path.isfile(name):
                with open(name, "rb") as f:
                    out.write(f.read())
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-kill", action="store_true", help="do not kill a trainer midway")
    parser.add_argument("--out", default="tinylm_loss.png")
    args = parser.parse_args()

    troupe.init(num_cpus=2, log_to_driver=False)
    try:
        text = corpus(os.path.join(troupe._session.current.run_root or "/tmp", "licences.txt"))
        trainer = ElasticTrainer(model="tinylm", data=text, optimizer={"name": "adamw", "lr": 3e-3},
                                 global_batch_size=32, max_micro_batch=16, context=64, min_workers=1,
                                 max_workers=2, steps_per_call=10, seed=0)
        print(f"group {trainer.group_id}: {len(trainer.trainers)} trainers, global batch 32, "
              f"{args.steps} steps on {os.path.getsize(text)} bytes of licence text")
        killed = {}
        if not args.no_kill:
            def kill_midway():
                while trainer.step < args.steps // 2 and not trainer._closed:
                    time.sleep(0.05)
                victim = [a for a in troupe.actors() if a["id"] == trainer.trainers[-1]._id][0]
                killed.update(step=trainer.step, pid=victim["pid"], time=time.time())
                os.kill(victim["pid"], signal.SIGKILL)
            threading.Thread(target=kill_midway, daemon=True).start()
        history = trainer.fit(args.steps)
        final = sum(row["loss"] for row in history[-10:]) / min(10, len(history))
        for r in trainer.recoveries:
            print(f"recovered from the failure in {r['recovery_s']:.2f} s, resumed at step {r['step']}")
        if killed:
            print(f"killed trainer pid {killed['pid']} at step {killed['step']}")
        plot(history, trainer.recoveries, killed, args.out)
        print(f"final loss {final:.3f} (target < {TARGET_LOSS}); loss curve in {args.out}")
        trainer.close()
        if final >= TARGET_LOSS:
            print("the loss did not reach the target", file=sys.stderr)
            return 1
        if not args.no_kill and not trainer.recoveries:
            print("the kill was not noticed", file=sys.stderr)
            return 1
        return 0
    finally:
        troupe.shutdown()


def plot(history, recoveries, killed, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], lw=1, label="training loss")
    if killed:
        ax.axvline(killed["step"], color="red", ls="--", label=f"trainer killed (step {killed['step']})")
    for r in recoveries:
        ax.axvline(r["step"], color="green", ls=":", label=f"recovered in {r['recovery_s']:.2f} s (step {r['step']})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per character)")
    ax.set_title("tinylm on Debian's licence texts: 2 elastic trainers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
