"""bench/run checkpoint [--json]: Flash checkpoint of a float32 state (1 GiB by default) against
torch.save / torch.load of the same state, in the same run:

  snapshot_s     the blocking part of a save: state -> shared-memory snapshot (warm segment; median)
  torch_save_s   torch.save of the state to a file on disk, then fsync
  restore_s      shared-memory snapshot -> the model's tensors, in place, CRCs checked (median)
  torch_load_s   torch.load of that file (from the page cache: it was just written)
  restart_*      the same two in a fresh process, as a restarted trainer does them: its model
                 built first, the torch file evicted from the page cache (POSIX_FADV_DONTNEED)
  persist_gbps   the snapshot written from shared memory to the checkpoint directory, as the
                 checkpoint actor does it (rank file + manifest + latest, fsyncs, renames)
  disk_write_gbps  a plain sequential write of the same bytes to the same directory, then fsync

Persist and the plain write alternate (twice each, best kept) so drifting disk speed hits both.
Targets (docs/design/checkpoints.md): snapshot under 1/20 of torch.save, restore under 1/10 of torch.load,
persist at least 0.8x the plain write.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def import_checkpoint():
    """troupe.checkpoint from the build directory: $TROUPE_BIN_DIR (set by bench/run) or ./build."""
    build = Path(os.environ.get("TROUPE_BIN_DIR", Path(__file__).resolve().parents[2] / "build"))
    sys.path.insert(0, str(build / "python"))
    try:
        import troupe.checkpoint
    except ImportError as e:
        sys.exit(f"bench: troupe.checkpoint is not built under {build / 'python'} ({e}); run `make build`")
    return troupe.checkpoint


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plain_write(path, tensors):
    """The floor for persisting: the same bytes, sequential 16 MiB writes, one fsync."""
    chunk = 16 << 20
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")
            for off in range(0, len(view), chunk):
                f.write(view[off:off + chunk])
        os.fsync(f.fileno())


RESTART_RESTORE = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
import troupe.checkpoint as ckpt
numel, count = int(sys.argv[4]), int(sys.argv[5])
model = {f"layer{i}.weight": torch.randn(numel) for i in range(count)}  # built before the restore
start = time.perf_counter()
restored = ckpt.FlashCheckpoint(sys.argv[3], shm_dir=sys.argv[2]).restore(model)
print(json.dumps({"seconds": time.perf_counter() - start, "step": restored.step}))
"""

RESTART_TORCH_LOAD = """
import json, sys, time, torch
start = time.perf_counter()
state = torch.load(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - start, "tensors": len(state)}))
"""


def in_fresh_process(code, *args):
    import subprocess

    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--tensors", type=int, default=64, help="number of tensors the state is split into")
    parser.add_argument("--repeat", type=int, default=3, help="warm snapshots and restores timed")
    parser.add_argument("--dir", default=None, help="directory on the disk to test (default: under /var/tmp)")
    args = parser.parse_args()

    ckpt = import_checkpoint()
    import torch

    torch.set_num_threads(2)
    numel = int(args.gib * (1 << 30)) // 4 // args.tensors
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(args.tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    work = Path(tempfile.mkdtemp(prefix="troupe-ckpt-bench-", dir=args.dir or "/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="troupe_ckpt_bench_", dir="/dev/shm"))
    try:
        # torch.save + fsync, torch.load.
        torch_file = work / "state.pt"

        def torch_save():
            with open(torch_file, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(work)

        torch_save_s = timed(torch_save)
        loaded = {}
        torch_load_s = timed(lambda: loaded.update(torch.load(torch_file)))
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        del loaded
        evict(torch_file)
        restart_torch_load_s = in_fresh_process(RESTART_TORCH_LOAD, torch_file)
        torch_file.unlink()

        # Snapshots: the first one allocates and pre-faults the segment; the later ones reuse it.
        flash = ckpt.FlashCheckpoint("troupe_ckpt.bench.local.r0", shm_dir=shm)
        first_snapshot_s = timed(lambda: flash.save(0, state))
        snapshot_times = [timed(lambda s=step: flash.save(s, state)) for step in range(1, args.repeat + 1)]
        snapshot_s = statistics.median(snapshot_times)

        # Restores: into the model's own tensors (what a restarted trainer does after building its
        # model), and into new tensors (pays first-touch page faults for fresh memory).
        model = {k: torch.empty_like(v) for k, v in state.items()}
        restore_times = [timed(lambda: flash.restore(model)) for _ in range(args.repeat)]
        restore_s = statistics.median(restore_times)
        assert all(torch.equal(model[k], v) for k, v in state.items())
        fresh = []
        restore_new_s = timed(lambda: fresh.append(flash.restore()))
        del fresh, model
        build_python = Path(ckpt.__file__).resolve().parents[1]
        restart_restore_s = in_fresh_process(RESTART_RESTORE, build_python, shm, flash.segment_name, numel,
                                             args.tensors)

        # Persist vs a plain write, alternating.
        reader = ckpt._checkpoint.Segment.open_existing(str(shm), flash.segment_name)
        persist, plain = [], []
        for round_ in range(2):
            target = work / f"ckpt{round_}"
            result = {}
            seconds = timed(lambda: result.update(reader.persist(str(target), 1)))
            assert result["bytes"] >= nbytes
            persist.append(result["bytes"] / seconds / 1e9)
            shutil.rmtree(target)
            path = work / f"plain{round_}"
            plain.append(nbytes / timed(lambda: plain_write(path, state.values())) / 1e9)
            path.unlink()
        reader.close()
        flash.close()
        persist_gbps, disk_write_gbps = max(persist), max(plain)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    rows = [
        ("blocking save, s", f"{snapshot_s:.3f}", f"{torch_save_s:.3f}", f"{snapshot_s / torch_save_s:.3f}", "< 0.05"),
        ("restore, s", f"{restore_s:.3f}", f"{torch_load_s:.3f}", f"{restore_s / torch_load_s:.3f}", "< 0.10"),
        ("restore after a restart, s", f"{restart_restore_s:.3f}", f"{restart_torch_load_s:.3f}",
         f"{restart_restore_s / restart_torch_load_s:.3f}", ""),
        ("persist, GB/s", f"{persist_gbps:.3f}", f"{disk_write_gbps:.3f}", f"{persist_gbps / disk_write_gbps:.2f}",
         ">= 0.8"),
    ]
    print(f"Flash checkpoint of {nbytes / (1 << 30):.2f} GiB ({args.tensors} float32 tensors) vs torch, "
          f"one run on {os.cpu_count()} CPUs")
    header = ("", "troupe", "torch / plain write", "ratio", "target")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"  first snapshot (allocates the segment): {first_snapshot_s:.3f} s; restore into new tensors: "
          f"{restore_new_s:.3f} s; snapshots {', '.join(f'{t:.3f}' for t in snapshot_times)} s")
    if args.json:
        print(json.dumps({
            "bytes": nbytes, "snapshot_s": snapshot_s, "torch_save_s": torch_save_s, "restore_s": restore_s,
            "torch_load_s": torch_load_s, "persist_gbps": persist_gbps, "disk_write_gbps": disk_write_gbps,
            "first_snapshot_s": first_snapshot_s, "restore_new_s": restore_new_s,
            "restart_restore_s": restart_restore_s, "restart_torch_load_s": restart_torch_load_s,
        }), flush=True)


if __name__ == "__main__":
    main()
