#!/usr/bin/env python3
"""bench/run py_tasks: remote functions and objects next to their floors, in the same run.

- task latency (submit -> get of a no-op task, one at a time) vs a Python actor's sync call;
- 1,000 no-op tasks submitted at once, submit-to-all-done, vs pipelined actor calls;
- put + get of a 100 MB numpy array vs a memcpy of it into memory already in use (np.copyto; a
  copy into fresh memory, np.copy, costs the page faults too and is shown beside it).
Each figure is the median of 5 rounds; rounds of a measure and its floor alternate. Targets
(issue 15): latency within 2x the actor call, throughput at least half the pipelined actor call
rate, put+get within 3x the memcpy.
"""
import json
import os
import sys
import time

import numpy as np

BUILD = os.environ.get("TROUPE_BIN_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
import troupe  # noqa: E402

ROUNDS = 5


@troupe.remote
def noop(x=None):
    return x


@troupe.remote
class Echo:
    def echo(self, x=None):
        return x


def median(values):
    return sorted(values)[len(values) // 2]


def spread(values):
    return f"{min(values):.3g}..{max(values):.3g}"


def main():
    as_json = "--json" in sys.argv
    troupe.init(num_cpus=2, log_to_driver=False)
    try:
        actor = Echo.remote()
        troupe.get([noop.remote() for _ in range(200)])  # the pool is up and warm
        for _ in range(300):
            troupe.get(actor.echo.remote())
            troupe.get(noop.remote())
        task_us, call_us, tasks_s, calls_s, put_get_s, memcpy_s, fresh_s = [], [], [], [], [], [], []
        array = np.random.default_rng(0).random(100 * 1024 * 1024 // 8)
        target = np.empty_like(array)
        np.copyto(target, array)
        for _ in range(ROUNDS):
            n = 500
            t0 = time.perf_counter()
            for _ in range(n):
                troupe.get(actor.echo.remote())
            call_us.append((time.perf_counter() - t0) / n * 1e6)
            t0 = time.perf_counter()
            for _ in range(n):
                troupe.get(noop.remote())
            task_us.append((time.perf_counter() - t0) / n * 1e6)

            t0 = time.perf_counter()
            troupe.get([actor.echo.remote() for _ in range(1000)])
            calls_s.append(1000 / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            troupe.get([noop.remote() for _ in range(1000)])
            tasks_s.append(1000 / (time.perf_counter() - t0))

            t0 = time.perf_counter()
            np.copyto(target, array)
            memcpy_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            copy = np.copy(array)
            fresh_s.append(time.perf_counter() - t0)
            del copy
            t0 = time.perf_counter()
            ref = troupe.put(array)
            value = troupe.get(ref)
            put_get_s.append(time.perf_counter() - t0)
            assert value.shape == array.shape and value[-1] == array[-1]
            del value, ref
    finally:
        troupe.shutdown()
    lat, floor_lat = median(task_us), median(call_us)
    rate, floor_rate = median(tasks_s), median(calls_s)
    pg, mc, fresh = median(put_get_s), median(memcpy_s), median(fresh_s)
    print(f"{'measure (median of 5; min..max)':46} {'value':>12} {'floor':>12} {'ratio':>7}  target")
    print(f"{'task latency, us (floor: actor sync call)':46} {lat:12.1f} {floor_lat:12.1f} {lat / floor_lat:7.2f}  <= 2")
    print(f"{'1,000 tasks, tasks/s (floor: pipelined calls)':46} {rate:12.0f} {floor_rate:12.0f} "
          f"{rate / floor_rate:7.2f}  >= 0.5")
    print(f"{'put+get 100 MB, s (floor: memcpy)':46} {pg:12.4f} {mc:12.4f} {pg / mc:7.2f}  <= 3")
    print(f"{'  (floor: copy into fresh memory, np.copy)':46} {pg:12.4f} {fresh:12.4f} {pg / fresh:7.2f}")
    print(f"spread: task us {spread(task_us)}, call us {spread(call_us)}, tasks/s {spread(tasks_s)}, "
          f"calls/s {spread(calls_s)}, put+get s {spread(put_get_s)}, memcpy s {spread(memcpy_s)}, "
          f"np.copy s {spread(fresh_s)}")
    if as_json:
        print(json.dumps({"tasks_per_s": round(rate), "task_latency_us": round(lat, 1),
                          "actor_call_latency_us": round(floor_lat, 1), "actor_calls_per_s": round(floor_rate),
                          "put_get_100mb_s": round(pg, 4), "memcpy_100mb_s": round(mc, 4),
                          "copy_fresh_100mb_s": round(fresh, 4),
                          "latency_ratio": round(lat / floor_lat, 3), "throughput_ratio": round(rate / floor_rate, 3),
                          "put_get_ratio": round(pg / mc, 3)}))


if __name__ == "__main__":
    main()
