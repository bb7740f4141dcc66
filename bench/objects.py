#!/usr/bin/env python3
"""bench/run objects: Troupe's objects across hosts (network namespaces on a bridge,
tests/multihost/testbed.py; needs root), each figure beside its peer from the same run:
- pull_vs_tcp: a 1 GiB object put on host 0 and got by a driver on host 1 (pulled from host 0's node
  agent into host 1's object directory, then mapped), bytes/s against one raw TCP stream of 1 GiB
  between the same hosts; slices alternate, the ratio is the median's. The first slice warms up
  and is left out: its pull goes into fresh memory (the kernel zeroes each page first), the
  later ones into the file the previous pull left for reuse, as a process that pulls again and
  again does; first_pull_vs_tcp is that first slice's ratio;
- broadcast_4_vs_single: drivers on 4 hosts get one 512 MB object of host 0 at once, the slowest
  one's time against one host's pull alone, every host's link capped at 1 Gbit/s each way (tc tbf,
  as a NIC caps it), beside the same with relays off (TROUPE_OBJECT_RELAY=0: the owner's node
  serves every host); the same uncapped is shown too, where this machine's two cores (which every
  host shares) bound the ratio rather than the owner's link;
- spill_restore_vs_disk (one host, no test bed): a driver whose cluster's store holds 256 MiB
  puts 1 GiB in 64 MiB objects (most spill to disk), then gets the spilled ones and reads a byte
  of every page, against a plain sequential read() of the same spill files into one buffer; the
  page cache is dropped for those files before each, so both read from the disk.
With --json the last line is one JSON object with those figures (and their parts).
"""
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("TROUPE_BIN_DIR", HERE.parent / "build")).resolve()
sys.path.insert(0, str(HERE.parent / "tests" / "multihost"))
sys.path.insert(0, str(HERE))
from testbed import Testbed  # noqa: E402
from multihost import STREAM, start_cluster, stop_cluster  # noqa: E402

PORT = 6380
GIB = 1 << 30
SLICES = 3
LINK = "1gbit"  # each host's link in the capped broadcast


def log(text):
    print(f"objects: {text}", file=sys.stderr, flush=True)


# A driver that, per line on stdin naming an object size, has an actor on host 0 put a fresh object of
# that size and times its own get() of it (the pull and the mapping), in seconds.
PULLER = textwrap.dedent("""
    import gc, sys, time
    sys.path.insert(0, %(pkg)r)
    import numpy as np
    import troupe
    troupe.init(%(controller)r, token=%(token)r, log_to_driver=False)

    @troupe.remote(num_cpus=0, resources={"h0": 0.01})
    class Owner:
        def __init__(self):
            self.refs = []
        def put(self, n):
            self.refs = [troupe.put(np.full(n, 7, dtype=np.uint8))]
            return self.refs

    owner = Owner.remote()
    print("ready", flush=True)
    for line in sys.stdin:
        size = int(line)
        # The owner's last round's object goes now: it drops its ref, and this driver dropped its own.
        [ref] = troupe.get(owner.put.remote(size))
        print("made", flush=True)
        sys.stdin.readline()  # go
        start = time.perf_counter()
        value = troupe.get(ref)
        took = time.perf_counter() - start
        assert value.nbytes == size and value[0] == 7 and value[-1] == 7
        del value, ref
        gc.collect()
        print(took, flush=True)
    troupe.shutdown()
""")

# A driver that gets the object whose ref a file holds (put by an actor on host 0) when told to.
GETTER = textwrap.dedent("""
    import pickle, sys, time
    sys.path.insert(0, %(pkg)r)
    import troupe
    troupe.init(%(controller)r, token=%(token)r, log_to_driver=False)
    ref = troupe.get_actor(%(name)r, namespace="bench").ref.remote()
    [ref] = troupe.get(ref)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    value = troupe.get(ref)
    print(time.perf_counter() - start, flush=True)
    assert value.nbytes == %(size)d
    sys.stdin.readline()
    troupe.shutdown()
""")

OWNER = textwrap.dedent("""
    import sys
    sys.path.insert(0, %(pkg)r)
    import numpy as np
    import troupe
    troupe.init(%(controller)r, token=%(token)r, log_to_driver=False)

    @troupe.remote(num_cpus=0, resources={"h0": 0.01})
    class Owner:
        def __init__(self, n):
            self.refs = [troupe.put(np.full(n, 7, dtype=np.uint8))]
        def ref(self):
            return self.refs

    owner = Owner.options(name=%(name)r, namespace="bench", lifetime="detached").remote(%(size)d)
    troupe.get(owner.ref.remote())
    print("ready", flush=True)
""")


SPILL = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, %(pkg)r)
    import numpy as np
    import troupe
    troupe.init(num_cpus=1, object_store_memory=256 << 20, log_to_driver=False)
    from troupe import _objects
    store = _objects.store()
    size = 64 << 20

    def drop_cache(paths):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    rounds = []
    buffer = bytearray(8 << 20)
    for _ in range(3):  # fresh objects each round: a get() maps the files, which keeps them cached
        refs = None
        start = time.perf_counter()
        refs = [troupe.put(np.full(size, i, dtype=np.uint8)) for i in range(16)]
        put_s = time.perf_counter() - start
        spilled = [(i, r) for i, r in enumerate(refs) if not os.path.exists(store.path(r.hex()))]
        paths = [store.spilled(r.hex()) for _, r in spilled]
        drop_cache(paths)
        start = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
        plain = time.perf_counter() - start
        drop_cache(paths)
        start = time.perf_counter()
        for i, r in spilled:
            value = troupe.get(r)
            assert int(value[::4096].sum()) == (size // 4096) * i
            del value
        restore = time.perf_counter() - start
        nbytes = sum(os.path.getsize(p) for p in paths)
        rounds.append((plain, restore, put_s, nbytes, len(paths)))
    plain, restore, put_s, nbytes, count = sorted(rounds, key=lambda r: r[0] / r[1])[1]  # the median round
    print(json.dumps({"objects": count, "bytes": nbytes, "put_s": put_s, "plain_s": plain,
                      "restore_s": restore}), flush=True)
    troupe.shutdown()
""")


def spill_restore():
    code = SPILL % {"pkg": str(BUILD / "python")}
    p = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["ratio"] = out["plain_s"] / out["restore_s"]
    log(f"spill: {out['objects']} objects spilled ({out['bytes'] / GIB:.2f} GiB); restore {out['restore_s']:.2f} s, "
        f"plain read {out['plain_s']:.2f} s")
    return out


def stream_seconds(sender, receiver, size, rounds, port):
    """Seconds per round of a raw TCP stream of `size` bytes, sender -> receiver."""
    server = receiver.popen(["/usr/bin/python3", "-c", STREAM, "serve", receiver.address, str(port), str(size),
                             str(rounds)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    client = sender.popen(["/usr/bin/python3", "-c", STREAM, "client", receiver.address, str(port), str(size),
                           str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    return server, client


def pull_vs_tcp(bed, controller, token):
    a, b = bed.hosts[0], bed.hosts[1]
    code = PULLER % {"pkg": str(BUILD / "python"), "controller": controller, "token": token}
    puller = b.popen(["/usr/bin/python3", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                     bufsize=1)
    assert puller.stdout.readline().strip() == "ready", "the pulling driver did not start"
    server, client = stream_seconds(a, b, GIB, SLICES + 1, PORT + 3)
    pulls, streams, first = [], [], None
    for i in range(SLICES + 1):  # the first of each warms up
        puller.stdin.write(f"{GIB}\n")
        puller.stdin.flush()
        assert puller.stdout.readline().strip() == "made"
        puller.stdin.write("\n")
        puller.stdin.flush()
        pull = float(puller.stdout.readline())
        client.stdin.write("\n")
        client.stdin.flush()
        stream = float(client.stdout.readline()) / 1e3
        log(f"slice {i}: pull {GIB / pull / 1e9:.2f} GB/s, raw TCP {GIB / stream / 1e9:.2f} GB/s")
        if i:
            pulls.append(pull)
            streams.append(stream)
        else:
            first = stream / pull
    for p in (puller, client):
        p.stdin.close()
        p.wait(60)
    server.wait(60)
    ratios = [s / p for s, p in zip(streams, pulls)]
    return {"pull_gb_s": GIB / statistics.median(pulls) / 1e9, "tcp_gb_s": GIB / statistics.median(streams) / 1e9,
            "ratio": statistics.median(ratios), "first_ratio": first}


def busy_seconds():
    """CPU seconds this machine has been busy (every core, every test-bed host: they share it)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def broadcast(bed, controller, token, name, size=512 << 20, relay=True):
    """(seconds of one host's pull alone, seconds of the slowest of 4 hosts pulling at once, the
    CPU seconds each took), for a fresh object of actor `name` on host 0; relay=False: the pullers
    do not serve each other (the owner's node serves all)."""
    env = None if relay else {"TROUPE_OBJECT_RELAY": "0"}
    fill = {"pkg": str(BUILD / "python"), "controller": controller, "token": token, "size": size, "name": name}
    owner = bed.hosts[0].run(["/usr/bin/python3", "-c", OWNER % fill], timeout=120)
    assert "ready" in owner.stdout, owner.stderr

    def together(hosts):
        getters = [h.popen(["/usr/bin/python3", "-c", GETTER % fill], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, bufsize=1) for h in hosts]
        for g in getters:
            assert g.stdout.readline().strip() == "ready", "a getter did not start"
        busy = busy_seconds()
        for g in getters:
            g.stdin.write("\n")
            g.stdin.flush()
        took = [float(g.stdout.readline()) for g in getters]
        busy = busy_seconds() - busy
        for g in getters:
            g.stdin.write("\n")
            g.stdin.close()
            g.wait(60)
        return max(took), busy

    single, single_cpu = together(bed.hosts[1:2])
    four, four_cpu = together(bed.hosts[1:5])
    return single, four, single_cpu, four_cpu


def main():
    as_json = "--json" in sys.argv
    spill = spill_restore()
    spill_row = ("restore spilled objects", f"{spill['bytes'] / spill['restore_s'] / 1e9:.2f} GB/s",
                 f"read() {spill['bytes'] / spill['plain_s'] / 1e9:.2f} GB/s", f"{spill['ratio']:.2f} (target >= 0.7)")
    ok, why = Testbed.available()
    if not ok:
        log(f"cross-host rows skipped: {why}")
        print(f"{'figure':<28} {'troupe':>12} {'peer':>22} {'ratio':>22}")
        print(f"{spill_row[0]:<28} {spill_row[1]:>12} {spill_row[2]:>22} {spill_row[3]:>22}")
        if as_json:
            print(json.dumps({"skipped": why, "spill_restore_vs_disk": spill["ratio"], "spill": spill}))
        return 0
    with Testbed(5) as bed:
        controller, token = start_cluster(bed.hosts, tls=False)
        try:
            pull = pull_vs_tcp(bed, controller, token)
            single, four, single_cpu, four_cpu = broadcast(bed, controller, token, "bcast-free")
            # Unlimited, every copy costs this machine's 2 cores, which all hosts share: CPU bounds
            # the ratio, not the owner's link. Capped as NICs are, the owner's link is the limit
            # the relays must get around (a naive owner-serves-all takes ~4x there).
            for host in bed.hosts:
                host.limit(LINK)
            capped, capped_four, _, _ = broadcast(bed, controller, token, "bcast-capped")
            naive, naive_four, _, _ = broadcast(bed, controller, token, "bcast-naive", relay=False)
        finally:
            stop_cluster(bed.hosts)
    rows = [("pull 1 GiB across hosts", f"{pull['pull_gb_s']:.2f} GB/s",
             f"raw TCP {pull['tcp_gb_s']:.2f} GB/s", f"{pull['ratio']:.2f} (target >= 0.8)"),
            (f"512 MB to 4 hosts, {LINK} links", f"{capped_four:.2f} s", f"1 host alone {capped:.2f} s",
             f"{capped_four / capped:.2f} (target <= 1.5)"),
            (f"  owner serves all, {LINK}", f"{naive_four:.2f} s", f"1 host alone {naive:.2f} s",
             f"{naive_four / naive:.2f}"),
            ("512 MB to 4 hosts, no cap", f"{four:.2f} s", f"1 host alone {single:.2f} s",
             f"{four / single:.2f} (CPU-bound >= {max(single, 4 * single_cpu / os.cpu_count()) / single:.2f})"),
            spill_row]
    # Every host of the bed runs on this machine's cores: four receivers need four times one's CPU.
    cores = os.cpu_count()
    bound = max(single, 4 * single_cpu / cores) / single
    log(f"broadcast CPU: one pull {single_cpu:.2f} CPU-s in {single:.2f} s, four {four_cpu:.2f} CPU-s in {four:.2f} s "
        f"on {cores} cores: four copies of one pull's CPU bound the ratio at >= {bound:.2f} here")
    print(f"{'figure':<28} {'troupe':>12} {'peer':>22} {'ratio':>22}")
    for row in rows:
        print(f"{row[0]:<28} {row[1]:>12} {row[2]:>22} {row[3]:>22}")
    if as_json:
        print(json.dumps({"pull_vs_tcp": pull["ratio"], "first_pull_vs_tcp": pull["first_ratio"], "pull": pull, "broadcast_4_vs_single": capped_four / capped,
                          "broadcast_link": LINK, "broadcast_single_s": capped, "broadcast_4_s": capped_four,
                          "broadcast_owner_serves_all_4_vs_single": naive_four / naive,
                          "broadcast_owner_serves_all_4_s": naive_four,
                          "broadcast_uncapped_4_vs_single": four / single,
                          "broadcast_uncapped_single_s": single, "broadcast_uncapped_4_s": four,
                          "broadcast_single_cpu_s": single_cpu, "broadcast_4_cpu_s": four_cpu,
                          "broadcast_cpu_bound": bound,
                          "spill_restore_vs_disk": spill["ratio"], "spill": spill}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
