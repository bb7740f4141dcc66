#!/usr/bin/env python3
"""bench/run tuner: the resource tuner end to end. An elastic group of tinylm trainers starts at
4 trainers on this machine's cores (the embedded cluster declares 4 CPUs) and the tuner resizes
it from its fitted throughput model. Prints the decisions, the throughput before and after, and
the prediction error of the chosen configuration's throughput (target <= 0.15).

    bench/run tuner [--steps 80] [--json]
"""
import argparse
import json
import os
import sys

BUILD = os.environ.get("TROUPE_BIN_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
import troupe  # noqa: E402
from troupe.train import ElasticTrainer  # noqa: E402


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--start", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    troupe.init(num_cpus=4, log_to_driver=False)
    try:
        t = ElasticTrainer(model="tinylm", data="/usr/share/common-licenses/GPL-3", global_batch_size=32,
                           max_micro_batch=8, context=64, min_workers=1, max_workers=4, workers=args.start,
                           steps_per_call=5, progress=False, tuner=True, seed=0)
        t.fit(args.steps)
        decisions = t.tuner_decisions
        chosen = len(t.trainers)
        history = t.history
        t.close()
    finally:
        troupe.shutdown()
    before = median(r["samples_per_s"] for r in history if r["world_size"] == args.start)
    after = median(r["samples_per_s"] for r in history if r["world_size"] == chosen)
    changes = [d for d in decisions if d["action"] != "keep"]
    # The chosen configuration's throughput as the tuner last predicted it (a change to it, or a
    # "keep" at it), against the median measured at it. A decision without a prediction (no model
    # fitted yet) is passed over, never read as 0.
    predictions = [(d["index"], d["predicted_samples_per_s"]) for d in changes if d["target"] == chosen]
    predictions += [(d["index"], d.get("predicted_current_samples_per_s")) for d in decisions
                    if d["action"] == "keep" and d["world_size"] == chosen]
    predictions = sorted(p for p in predictions if p[1] is not None)
    predicted = predictions[-1][1] if predictions else None
    error = abs(predicted - after) / after if after and predicted is not None else None
    print(f"cores {len(os.sched_getaffinity(0))}, start {args.start} trainers, {args.steps} steps")
    print(f"{'chunk':>5} {'N':>3} {'action':>7} {'target':>6} {'measured/s':>11} {'predicted/s':>12}  reason")
    for d in decisions:
        print(f"{d['index']:5d} {d['world_size']:3d} {d['action']:>7} {d['target']:6d} "
              f"{(d['measured_samples_per_s'] or 0):11.1f} {(d['predicted_samples_per_s'] or 0):12.1f}  {d['reason'][:70]}")
    print(f"throughput at {args.start}: {before:.1f} samples/s; at {chosen} (chosen): {after:.1f} samples/s "
          f"({after / before if before else 0:.2f}x); predicted "
          f"{'none (no decision predicted it)' if predicted is None else f'{predicted:.1f}'}, "
          f"error {error if error is None else round(error, 3)}")
    if args.json:
        print(json.dumps({"start_workers": args.start, "chosen_workers": chosen, "throughput_before": round(before, 2),
                          "throughput_after": round(after, 2), "prediction_error": None if error is None else round(error, 4),
                          "decisions": len(decisions), "changes": len(changes)}))


if __name__ == "__main__":
    main()
