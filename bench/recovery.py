#!/usr/bin/env python3
"""bench/run recovery: an elastic group of 2 tinylm trainers on an embedded cluster. First a
fault-free phase (step time), then a run of --duration seconds in which a trainer is killed
with SIGKILL every --kill-every seconds: recovery time per kill (failure noticed -> training
resumed) and goodput (time in steps that count / wall time; target >= 0.95).

    bench/run recovery [--duration 180] [--kill-every 60] [--json]
"""
import argparse
import json
import os
import signal
import sys
import threading
import time

BUILD = os.environ.get("TROUPE_BIN_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
import troupe  # noqa: E402
from troupe.train import ElasticTrainer  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    troupe.init(num_cpus=2, log_to_driver=False)
    try:
        t = ElasticTrainer(model="tinylm", data="/usr/share/common-licenses/GPL-3", optimizer="adamw",
                           global_batch_size=16, max_micro_batch=8, context=64, min_workers=1, max_workers=2,
                           steps_per_call=10, progress=False, seed=0)
        t.fit(20)  # warm-up
        clean = t.fit(30)[-30:]
        step_time = sorted(r["step_s"] for r in clean)[len(clean) // 2]

        stop = threading.Event()
        kills = []

        def killer():
            while not stop.wait(args.kill_every):
                victim = [a for a in troupe.actors() if a["id"] == t.trainers[-1]._id][0]
                kills.append({"time": time.monotonic(), "step": t.step})
                os.kill(victim["pid"], signal.SIGKILL)

        start_step, history_from = t.step, len(t.history)
        threading.Thread(target=killer, daemon=True).start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.duration:
            t.fit(10)
        wall = time.monotonic() - t0
        stop.set()
        useful = sum(r["step_s"] for r in t.history[history_from:])
        faulty_steps = t.history[history_from:]
        faulty_step_time = sorted(r["step_s"] for r in faulty_steps)[len(faulty_steps) // 2]
        recoveries = [round(r["recovery_s"], 3) for r in t.recoveries]
        t.close()
    finally:
        troupe.shutdown()
    goodput = useful / wall
    print(f"{'measure':46} {'value':>12}")
    print(f"{'step time, no faults (median, s)':46} {step_time:12.3f}")
    print(f"{'step time, with faults (median, s)':46} {faulty_step_time:12.3f}")
    print(f"{'run with faults (s)':46} {wall:12.1f}")
    print(f"{'kills (one every %.0f s)' % args.kill_every:46} {len(kills):12d}")
    print(f"{'recoveries (s, failure noticed -> resumed)':46} {' '.join(f'{r:.2f}' for r in recoveries):>12}")
    print(f"{'steps trained during the run':46} {t.step - start_step:12d}")
    print(f"{'goodput (step time that counts / wall)':46} {goodput:12.3f}")
    if args.json:
        print(json.dumps({"recovery_s": recoveries, "goodput": round(goodput, 4), "step_time_s": round(step_time, 4),
                          "step_time_with_faults_s": round(faulty_step_time, 4), "kills": len(kills),
                          "duration_s": round(wall, 1)}))


if __name__ == "__main__":
    main()
