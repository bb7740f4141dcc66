#!/usr/bin/env python3
"""bench/run actor_create (Python part): 50 Python actors created at once, from the requests to
all of them ALIVE, 5 times in one local cluster. Every actor is a new Python worker process (forked
by the node's zygote when it runs, else `python3 -m troupe._worker`)."""
import json
import os
import sys
import time

BUILD = os.environ.get("TROUPE_BIN_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
import troupe  # noqa: E402
from troupe import _api  # noqa: E402

ACTORS = 50
RUNS = 5


@troupe.remote(num_cpus=0)
class Idle:
    def pid(self):
        return os.getpid()


def ready_all(n):
    """(seconds from the first request to the last of n actors ALIVE, seconds until the last
    request was answered); kills them after. `.remote()` returns once the controller has recorded
    the actor, so the requests go one after another while the first workers start."""
    rt = _api.runtime()
    t0 = time.perf_counter()
    handles = [Idle.remote() for _ in range(n)]
    submitted = time.perf_counter() - t0
    for h in handles:
        rt.wait_ready(h._id)
    elapsed = time.perf_counter() - t0
    for h in handles:
        troupe.kill(h)
    # The next run starts from an idle node: every worker of this one has exited.
    deadline = time.monotonic() + 30
    ids = {h._id for h in handles}
    while any(a["id"] in ids and a["state"] != "DEAD" for a in troupe.actors()):
        if time.monotonic() > deadline:
            raise RuntimeError("the killed actors did not all reach DEAD within 30 s")
        time.sleep(0.05)
    return elapsed, submitted


def spread(values):
    ordered = sorted(values)
    return ordered[0], ordered[len(ordered) // 2], ordered[-1]


def main():
    as_json = "--json" in sys.argv
    troupe.init(num_cpus=2, log_to_driver=False)
    try:
        ready_all(2)  # warm the page cache and the controller's node connection
        runs = [ready_all(ACTORS) for _ in range(RUNS)]
    finally:
        troupe.shutdown()
    low, median, high = spread([r[0] for r in runs])
    print(f"{'measure (' + str(RUNS) + ' runs)':48} {'min':>8} {'median':>8} {'max':>8}")
    print(f"{str(ACTORS) + ' Python actors: request -> all ALIVE (s)':48} {low:8.3f} {median:8.3f} {high:8.3f}")
    s_low, s_median, s_high = spread([r[1] for r in runs])
    print(f"{'  of which the ' + str(ACTORS) + ' .remote() calls (s)':48} {s_low:8.3f} {s_median:8.3f} {s_high:8.3f}")
    print(f"runs: {' '.join(f'{r[0]:.3f}' for r in runs)}")
    zygote = os.environ.get("TROUPE_PYTHON_ZYGOTE") != "0"
    print(f"workers: {'forked by the node zygote' if zygote else 'new processes (TROUPE_PYTHON_ZYGOTE=0)'}")
    if as_json:
        print(json.dumps({"py_ready_50_s": round(median, 4),
                          "py_ready_50_spread_s": [round(low, 4), round(median, 4), round(high, 4)]}))


if __name__ == "__main__":
    main()
