"""`troupe timeline [--group NAME] [-o FILE]`: a training group's recent steps as a Chrome trace.

Every trainer keeps its newest spans in a ring (TrainerEngine::timeline, 4096 spans, always on):
forward and backward per micro-batch, each gradient bucket's all-reduce from its launch to its
finish, the loss all-reduce, the optimizer, the data wait and the snapshot. A TorchTrainer's rank
runs the user's loop, whose insides it does not see: its spans are the data wait, the step (from
the batch to report()) and the snapshot. This collects the
rings of the group's ranks (the Trainer's typed `timeline` call, answered at once, also during a
chunk) and writes the Trace Event Format JSON that https://ui.perfetto.dev and chrome://tracing
open: a process per rank, a thread for compute, one for communication and one for data and
snapshots.
"""
import argparse
import json
import os
import sys

from . import _api, _typed

# Which track a span goes on.
_TRACKS = {"forward": (0, "compute"), "backward": (0, "compute"), "optimizer": (0, "compute"),
           "step": (0, "compute"),
           "allreduce": (1, "communication"), "allreduce loss": (1, "communication"),
           "data wait": (2, "data and snapshots"), "snapshot": (2, "data and snapshots")}


def _find(rt, group):
    groups = []
    for record in rt.groups():
        try:
            doc = json.loads(record["doc"]) if record["doc"] else {}
        except ValueError:
            continue
        groups.append((doc.get("name", record["id"]), record, doc))
    if group is None:
        if len(groups) != 1:
            names = ", ".join(sorted(n for n, _, _ in groups)) or "none"
            raise _api.TroupeError(f"name the group with --group (groups: {names})")
        return groups[0]
    for name, record, doc in groups:
        if group in (name, record["id"]):
            return name, record, doc
    raise _api.TroupeError(f"no training group named {group!r} (groups: "
                           f"{', '.join(sorted(n for n, _, _ in groups)) or 'none'})")


def collect(group=None, timeout=60):
    """The trace (a dict) of the group's ranks; `group` may be omitted when there is one."""
    rt = _api.runtime()
    name, record, doc = _find(rt, group)
    members = doc.get("members", [])
    torch_loop = doc.get("engine", {}).get("kind") == "torch"  # TorchTrainer's ranks: Python actors
    refs = [_api.ActorHandle(m, "py:_TorchTrainerActor").timeline.remote() if torch_loop
            else _typed.call(_api.ActorHandle(m, "Trainer"), "Trainer", "timeline") for m in members]
    events = []
    for member, ref in zip(members, refs):
        try:
            ring = _api.get(ref, timeout=timeout)
            ring = ring if torch_loop else _typed.reply("Trainer", "timeline", ring)
        except _api.TroupeError as e:  # a rank that died meanwhile: the trace says so
            events.append({"name": f"trainer {member} did not answer: {e}", "ph": "i", "s": "g", "ts": 0,
                           "pid": 0, "tid": 0})
            continue
        rank = ring["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank} (Trainer {member}, pid {ring['pid']})"}})
        for tid, label in sorted(set(_TRACKS.values())):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
        for span in ring["spans"]:
            tid = _TRACKS.get(span["name"], (0, ""))[0]
            label = span["name"] + (f" bucket {span['bucket']}" if span["bucket"] >= 0 else "")
            events.append({"name": label, "ph": "X", "ts": span["startUs"], "dur": max(span["durUs"], 0), "pid": rank,
                           "tid": tid, "args": {"step": span["step"], "bytes": span["bytes"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"group": name, "epoch": record["epoch"], "world_size": len(members)}}


def main(argv=None):
    p = argparse.ArgumentParser(prog="troupe timeline",
                                description="Write a training group's recent steps as a Chrome trace (Perfetto, "
                                            "chrome://tracing)")
    p.add_argument("--address", default=os.environ.get("TROUPE_ADDRESS", "auto"),
                   help="controller HOST:PORT (default: this machine's cluster)")
    p.add_argument("--group", help="the group's name (needed when there are several)")
    p.add_argument("-o", "--output", help="the trace file (default: timeline-GROUP.json)")
    a = p.parse_args(argv)
    try:
        _api.init(address=a.address, log_to_driver=False)
    except (ConnectionError, ValueError, _api.TroupeError) as e:
        print(f"troupe timeline: {e}", file=sys.stderr)
        return 1
    try:
        trace = collect(a.group)
    except _api.TroupeError as e:
        print(f"troupe timeline: {e}", file=sys.stderr)
        return 1
    finally:
        _api.shutdown()
    out = a.output or f"timeline-{trace['otherData']['group']}.json"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(trace, f)
    spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"wrote {spans} spans of {trace['otherData']['world_size']} rank(s) to {out} "
          "(open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
