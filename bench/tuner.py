#!/usr/bin/env python3
"""bench/run tuner: the resource tuner end to end, 5 runs in one invocation. In each run an elastic
group of tinylm trainers starts at 4 trainers on this machine's cores (the embedded cluster
declares 4 CPUs) and the tuner resizes it from its fitted throughput model. A run ends once the
group has stayed at one size for a warm-up chunk and --settle measured chunks after its last
change (at most --max-steps steps).

The prediction error of a run is |measured - predicted| / measured for the configuration chosen
(the size the group ends at): predicted is what the decision that moved the group there predicted,
before the move; measured is the median samples/s of the settled chunks after it (the tuner's
warm-up chunks after the resize excluded), each chunk's wall time over its steps. Target <= 0.15
in every run. Throughput on a shared machine drifts with its load: the table prints the load
average before and after each run, and "others cores": the cores the rest of the machine kept
busy (/proc: the machine's busy time less this benchmark's processes') over the fitted chunks
before the last change and over the measured chunks after it. A prediction cannot foresee that
changing; "error at load" (a diagnostic, not the target) scales the prediction by the cores the
rest of the machine left free after the change against before it.

    bench/run tuner [--runs 5] [--settle 4] [--max-steps 120] [--json]
"""
import argparse
import json
import os
import sys
import time

BUILD = os.environ.get("TROUPE_BIN_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
import troupe  # noqa: E402
from troupe.train import ElasticTrainer  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
STEPS_PER_CALL = 5
WARMUP_CHUNKS = 1  # chunks after a resize that the tuner does not fit and this benchmark does not measure


def median(xs):
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def spread(xs):
    xs = [x for x in xs if x is not None]
    return (min(xs), median(xs), max(xs)) if xs else (None, None, None)


def settled_chunks(decisions, last_change):
    """Samples/s of the chunks after the last change (or from the start), warm-up excluded.
    decisions[i] is the tuner's answer to chunk i; its inputs are that chunk's measurements."""
    first = 0 if last_change is None else last_change["index"] + 1
    size = decisions[first]["inputs"]["world_size"] if first < len(decisions) else None
    chunks = [d["inputs"]["samples_per_s"] for d in decisions[first:] if d["inputs"]["world_size"] == size]
    return chunks[WARMUP_CHUNKS:]


def cpu_sample():
    """(monotonic s, CPU seconds the whole machine spent busy, {pid: CPU seconds} of this process's
    descendants and of the sessions they lead: the cluster it started)."""
    now = time.monotonic()
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    busy = (sum(ticks) - ticks[3] - ticks[4]) / TICK
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue  # gone meanwhile
        rest = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        procs[int(entry)] = (int(rest[1]), int(rest[3]), (int(rest[11]) + int(rest[12])) / TICK)
    children = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    ours, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        ours.add(pid)
        todo += children.get(pid, [])
    leaders = {pid for pid in ours if procs.get(pid, (0, 0))[1] == pid}
    ours |= {pid for pid, (_, sid, _) in procs.items() if sid in leaders}
    return now, busy, {pid: procs[pid][2] for pid in ours if pid in procs}


def others_cores(a, b):
    """Cores the rest of the machine kept busy between two samples. A process of ours that started
    meanwhile counts whole; one that ended meanwhile is lost and counted as the machine's (trainers
    end between chunks, after little work since the sample before)."""
    wall = b[0] - a[0]
    mine = sum(b[2][pid] - a[2][pid] for pid in b[2] if pid in a[2]) + sum(
        cpu for pid, cpu in b[2].items() if pid not in a[2])
    return max(0.0, (b[1] - a[1] - mine) / wall) if wall > 0 else None


def one_run(args):
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    t = ElasticTrainer(model="tinylm", data="/usr/share/common-licenses/GPL-3", global_batch_size=32,
                       max_micro_batch=8, context=64, min_workers=1, max_workers=4, workers=args.start,
                       steps_per_call=STEPS_PER_CALL, progress=False, tuner={"warmup_chunks": WARMUP_CHUNKS},
                       seed=0)
    samples = [cpu_sample()]  # around every chunk: what the rest of the machine used meanwhile
    try:
        while t.step < args.max_steps:
            t.fit(STEPS_PER_CALL)
            samples.append(cpu_sample())
            decisions = t.tuner_decisions
            changes = [d for d in decisions if d["action"] != "keep"]
            if changes and len(settled_chunks(decisions, changes[-1])) >= args.settle:
                break
        decisions = t.tuner_decisions
        chosen = len(t.trainers)
    finally:
        t.close()
    changes = [d for d in decisions if d["action"] != "keep"]
    last = changes[-1] if changes else None
    start_chunks = [d["inputs"]["samples_per_s"] for d in decisions if d["inputs"]["world_size"] == args.start]
    after = median(settled_chunks(decisions, last)) if last and last["target"] == chosen else None
    predicted = last["predicted_samples_per_s"] if last else None
    # The rest of the machine's load (cores) over the fitted chunks before the last change and over
    # the settled chunks after it; only when every fit() call was one chunk (no recovery).
    others = [others_cores(a, b) for a, b in zip(samples, samples[1:])]
    others_before = others_after = None
    if last and len(others) == len(decisions):
        first = last["index"] + 1
        settled = [i for i in range(first, len(decisions)) if decisions[i]["inputs"]["world_size"] == chosen]
        settled = settled[WARMUP_CHUNKS:]
        fitted = [i for i in range(first) if "warm-up" not in decisions[i]["reason"]]
        others_before = median([others[i] for i in fitted])
        others_after = median([others[i] for i in settled])
    error = abs(after - predicted) / after if after and predicted is not None else None
    # A diagnostic, not the target: the prediction scaled by the cores the rest of the machine left
    # free after the change against before it (compute is nearly all of a step here), i.e. the
    # error had the machine's other load stayed as it was.
    cores = len(os.sched_getaffinity(0))
    adjusted = None
    if error is not None and others_before is not None and others_after is not None:
        free_before, free_after = cores - others_before, cores - others_after
        if min(free_before, free_after) > 0.05 * cores:
            adjusted = abs(after - predicted * free_after / free_before) / after
    return {"chosen": chosen, "path": [args.start] + [d["target"] for d in changes],
            "before": median(start_chunks[WARMUP_CHUNKS:]), "after": after, "predicted": predicted,
            "basis": last.get("prediction_basis") if last else None, "error": error,
            "error_load_adjusted": adjusted,
            "chunks": len(decisions), "changes": len(changes),
            "without_prediction": sum(1 for d in changes if d["predicted_samples_per_s"] is None),
            "others_before": others_before, "others_after": others_after, "load_before": load,
            "load_after": os.getloadavg()[0], "wall_s": time.monotonic() - t0,
            "decisions": decisions, "others_cores": others}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--start", type=int, default=4)
    parser.add_argument("--settle", type=int, default=4, help="measured chunks at the chosen size that end a run")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--decisions", action="store_true", help="print every run's decisions")
    parser.add_argument("--dump", help="write every run's decisions (JSON) to this file")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    troupe.init(num_cpus=4, log_to_driver=False)
    runs = []
    try:
        for i in range(args.runs):
            runs.append(one_run(args))
            r = runs[-1]
            print(f"(run {i}: {'>'.join(map(str, r['path']))}, error {r['error']}, {r['wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
    finally:
        troupe.shutdown()
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump([{k: r[k] for k in ("decisions", "others_cores")} for r in runs], f)
    print(f"cores {len(os.sched_getaffinity(0))}, start {args.start} trainers, {STEPS_PER_CALL} steps a chunk, "
          f"{args.settle} settled chunks measured, {args.runs} runs")

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    if args.decisions:
        for i, r in enumerate(runs):
            print(f"run {i}: chunk N action target  samples/s  predicted/s  reason")
            for d in r["decisions"]:
                print(f"  {d['index']:5d} {d['world_size']} {d['action']:>6} {d['target']:6d} "
                      f"{num(d['inputs']['samples_per_s'], '10.1f')} {num(d['predicted_samples_per_s'], '12.1f')}  "
                      f"{d['reason'][:80]}")
    print(f"{'run':>3} {'path':>10} {'at start/s':>10} {'predicted/s':>11} {'basis':>13} {'measured/s':>10} "
          f"{'error':>6} {'chunks':>6} {'wall s':>6} {'load avg':>9} {'others cores':>12} {'error at load':>13}")
    for i, r in enumerate(runs):
        print(f"{i:3d} {'>'.join(map(str, r['path'])):>10} {num(r['before'], '10.1f')} {num(r['predicted'], '11.1f')} "
              f"{r['basis'] or '-':>13} {num(r['after'], '10.1f')} {num(r['error'], '6.3f')} {r['chunks']:6d} "
              f"{r['wall_s']:6.0f} {r['load_before']:4.1f}>{r['load_after']:<4.1f} "
              f"{num(r['others_before'], '7.2f')}>{num(r['others_after'], '<4.2f')} "
              f"{num(r['error_load_adjusted'], '13.3f')}")
    errors = [r["error"] for r in runs]
    lo, mid, hi = spread(errors)
    missing = sum(r["without_prediction"] for r in runs)
    unjudged = sum(1 for e in errors if e is None)
    print(f"prediction error min/median/max {num(lo, '.3f')}/{num(mid, '.3f')}/{num(hi, '.3f')} (target <= 0.15 "
          f"in every run); changes without a prediction {missing}; runs without a judged change {unjudged}")
    lo_, mid_, hi_ = spread(r["error_load_adjusted"] for r in runs)
    print(f"(diagnostic) error had the rest of the machine's load stayed as before the change, min/median/max "
          f"{num(lo_, '.3f')}/{num(mid_, '.3f')}/{num(hi_, '.3f')}")
    for key, label in (("before", "throughput at start"), ("after", "throughput at the chosen size")):
        lo_, mid_, hi_ = spread(r[key] for r in runs)
        print(f"{label} min/median/max {num(lo_, '.1f')}/{num(mid_, '.1f')}/{num(hi_, '.1f')} samples/s")
    if args.json:
        def rounded(x, nd):
            return None if x is None else round(x, nd)

        print(json.dumps({
            "start_workers": args.start, "chosen_workers": median([r["chosen"] for r in runs]),
            "throughput_before": rounded(spread(r["before"] for r in runs)[1], 2),
            "throughput_after": rounded(spread(r["after"] for r in runs)[1], 2),
            "prediction_error": rounded(mid, 4), "decisions": median([r["chunks"] for r in runs]),
            "changes": median([r["changes"] for r in runs]),
            "prediction_error_runs": [rounded(e, 4) for e in errors],
            # A run whose change went unjudged (none, or not measured) cannot meet the target: no max then.
            "prediction_error_max": rounded(hi, 4) if not unjudged else None,
            "decisions_without_prediction": missing,
            "load_avg_runs": [[round(r["load_before"], 2), round(r["load_after"], 2)] for r in runs],
            "others_cores_runs": [[rounded(r["others_before"], 2), rounded(r["others_after"], 2)] for r in runs],
            "prediction_error_load_adjusted_runs": [rounded(r["error_load_adjusted"], 4) for r in runs]}))


if __name__ == "__main__":
    main()
