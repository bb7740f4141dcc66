#!/usr/bin/env python3
"""bench/run multihost: Troupe across hosts (network namespaces on a bridge, tests/multihost/testbed.py;
needs root), each figure next to its peer measured in the same run between the same namespaces:
- actor 1:1 synchronous calls/s (a Python driver on host 1, a Python actor on host 0) against a raw
  64-byte TCP ping-pong between the two hosts, in alternating slices (median ratio), with and
  without --tls;
- a 64 MB float32 all-reduce's bus bandwidth, one rank per host (2 and 4 hosts), against
  torch.distributed's gloo across the same hosts, and with TLS;
- the same all-reduce over 4 ranks on 2 hosts, 2 ranks per host (ranks 0, 1 on host 0 and 2, 3 on
  host 1, so the ring crosses between hosts twice and each host's other hop uses its shared-memory
  pipes), against gloo in the same layout; min / median / max of 5 timed all-reduces, each timed
  as its slowest rank (issue 18's target: at least 1x gloo), and beside it the floor of its cross-host
  links: the bytes the ring sends between the hosts (96 MiB each way) as two raw TCP streams at once.
With --json the last line is one JSON object: hosts, sync_vs_floor, allreduce_vs_gloo (per world
size), allreduce_2x2_64mb_vs_gloo (gloo ms / Troupe ms in the 2x2 layout) and allreduce_2x2 (its
figures, with tcp_floor_ms), tls_call_cost, tls_busbw_cost (the fraction of calls/s and bus bandwidth
TLS costs).
"""
import json
import os
import secrets
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("TROUPE_BIN_DIR", HERE.parent / "build")).resolve()
sys.path.insert(0, str(HERE.parent / "tests" / "multihost"))
from testbed import Testbed  # noqa: E402

BYTES = 64 << 20
SLICES = 5
PORT = 6380


def log(text):
    print(f"multihost: {text}", file=sys.stderr, flush=True)


PINGPONG = textwrap.dedent("""
    import socket, sys, time
    role, host, port, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    if role == "serve":
        with socket.create_server((host, port)) as listener:
            print("ready", flush=True)
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                data = conn.recv(64, socket.MSG_WAITALL)
                if len(data) < 64:
                    break
                conn.sendall(data)
    else:
        conn = socket.create_connection((host, port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = b"x" * 64
        def rounds(limit):
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < limit:
                conn.sendall(msg); conn.recv(64, socket.MSG_WAITALL); n += 1
            return n / (time.perf_counter() - start)
        rounds(0.2)
        for _ in range(int(sys.argv[5])):
            sys.stdin.readline()
            print(rounds(seconds), flush=True)
""")

# One raw TCP stream of `size` bytes per round (a 1-byte answer marks it received): the floor of a link.
STREAM = textwrap.dedent("""
    import socket, sys, time
    role, host, port, size, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    view = memoryview(bytearray(size))
    if role == "serve":
        with socket.create_server((host, port)) as listener:
            print("ready", flush=True)
            conn, _ = listener.accept()
            for _ in range(rounds):
                got = 0
                while got < size:
                    got += conn.recv_into(view[got:], size - got)
                conn.sendall(b"k")
    else:
        conn = socket.create_connection((host, port))
        for _ in range(rounds):
            sys.stdin.readline()
            start = time.perf_counter()
            conn.sendall(view)
            conn.recv(1)
            print((time.perf_counter() - start) * 1e3, flush=True)
""")

CALLS = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, %(pkg)r)
    import troupe
    troupe.init(%(controller)r, token=%(token)r, log_to_driver=False)

    @troupe.remote(num_cpus=0, resources={"h0": 1})
    class Echo:
        def echo(self, x):
            return x

    a = Echo.remote()
    payload = b"x" * 64
    for _ in range(300):
        troupe.get(a.echo.remote(payload))
    print("ready", flush=True)
    for _ in range(%(slices)d):
        sys.stdin.readline()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < %(seconds)f:
            troupe.get(a.echo.remote(payload)); n += 1
        print(n / (time.perf_counter() - start), flush=True)
    troupe.shutdown()
""")


def start_cluster(hosts, tls):
    head = hosts[0]
    args = ["start", "--head", "--node-ip-address", head.address, "--port", str(PORT), "--num-cpus", "1",
            "--resources", "h0=1"] + (["--tls"] if tls else [])
    head.troupe(*args)
    token = json.loads((Path(head.env["TROUPE_TEMP_DIR"]) / "latest" / "cluster.json").read_text())["token"]
    for host in hosts[1:]:
        host.troupe("start", "--address", f"{head.address}:{PORT}", "--num-cpus", "1", env={"TROUPE_TOKEN": token})
    return f"{head.address}:{PORT}", token


def stop_cluster(hosts):
    for host in hosts:
        host.troupe("stop", check=False)


def calls_vs_floor(bed, tls):
    """Median over slices of (sync calls/s) / (ping-pong rounds/s), slices alternating."""
    a, b = bed.hosts[0], bed.hosts[1]
    controller, token = start_cluster([a, b], tls)
    try:
        pp_port = PORT + 1
        server = a.popen(["/usr/bin/python3", "-c", PINGPONG, "serve", a.address, str(pp_port), "0", "0"],
                         stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        client = b.popen(["/usr/bin/python3", "-c", PINGPONG, "client", a.address, str(pp_port), "1.0", str(SLICES)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        code = CALLS % {"pkg": str(BUILD / "python"), "controller": controller, "token": token, "slices": SLICES,
                        "seconds": 1.0}
        driver = b.popen(["/usr/bin/python3", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         bufsize=1)
        assert driver.stdout.readline().strip() == "ready", "the calls driver did not start"
        floors, syncs = [], []
        for _ in range(SLICES):
            client.stdin.write("\n")
            client.stdin.flush()
            floors.append(float(client.stdout.readline()))
            driver.stdin.write("\n")
            driver.stdin.flush()
            syncs.append(float(driver.stdout.readline()))
        for p in (client, driver):
            p.stdin.close()
            p.wait(30)
        server.wait(30)
        ratios = [s / f for s, f in zip(syncs, floors)]
        return {"floor_per_s": statistics.median(floors), "sync_per_s": statistics.median(syncs),
                "ratio": statistics.median(ratios)}
    finally:
        stop_cluster([a, b])


def busbw(world, ms):
    return 2 * (world - 1) / world * BYTES / (ms / 1e3) / 1e9


def troupe_allreduce(placement, tls_token):
    """{ms, min_ms, max_ms} of 5 timed 64 MB all-reduces (the median, fastest and slowest of each one's
    slowest rank); placement[r] is the host of rank r, and each rank binds its host's address."""
    head = placement[0]
    password = secrets.token_hex(16)
    redis_port = PORT + 2
    redis = head.popen(["redis-server", "--bind", head.address, "--port", str(redis_port), "--requirepass", password,
                        "--save", "", "--appendonly", "no", "--dir", str(head.root)], stdout=subprocess.DEVNULL)
    try:
        ready = False
        for _ in range(200):
            if head.run(["redis-cli", "-h", head.address, "-p", str(redis_port), "-a", password, "--no-auth-warning",
                         "ping"]).stdout.strip() == "PONG":
                ready = True
                break
        assert ready, "the benchmark's redis-server did not start"
        world = len(placement)
        group = f"mh-{world}-{secrets.token_hex(3)}"
        ranks = []
        for r, host in enumerate(placement):
            rank_env = {"TROUPE_BENCH_REDIS_HOST": head.address, "TROUPE_BENCH_REDIS_PORT": str(redis_port),
                        "TROUPE_BENCH_REDIS_PASSWORD": password, "TROUPE_BENCH_HOST": host.address}
            if tls_token:
                rank_env["TROUPE_BENCH_TLS_TOKEN"] = tls_token
            ranks.append(host.popen([str(BUILD / "collectives" / "allreduce_bench"), "--serve-rank", str(r), "--world",
                                     str(world), "--group", group, "--sizes",
                                     f"{BYTES}:5"], env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True))
        outs = [p.communicate(timeout=300) for p in ranks]
        for p, (out, err) in zip(ranks, outs):
            assert p.returncode == 0, f"a Troupe rank failed ({p.returncode}): {err[-2000:]}"
        return json.loads(outs[0][0].strip().splitlines()[-1])
    finally:
        redis.kill()
        redis.wait()


def gloo_allreduce(placement):
    """gloo_peer.py's {ms, min_ms, max_ms}, measured as troupe_allreduce measures, placement[r] hosting rank r."""
    head = placement[0]
    world = len(placement)
    procs = []
    for r, host in enumerate(placement):
        env = {"MASTER_ADDR": head.address, "MASTER_PORT": str(PORT + 3), "RANK": str(r), "WORLD_SIZE": str(world),
               "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        procs.append(host.popen(["/usr/bin/python3", str(HERE / "allreduce" / "gloo_peer.py"), f"{BYTES}:5"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"a gloo rank failed: {err[-2000:]}"
    return json.loads(outs[0][0].strip().splitlines()[-1])


def streams_floor(a, b, size, rounds=SLICES):
    """Median over rounds of the ms for `size` bytes sent a -> b and b -> a at once over raw TCP (each round
    as slow as its slower stream)."""
    servers, clients = [], []
    for i, (src, dst) in enumerate(((a, b), (b, a))):
        port = str(PORT + 4 + i)
        servers.append(dst.popen(["/usr/bin/python3", "-c", STREAM, "serve", dst.address, port, str(size), str(rounds)],
                                 stdout=subprocess.PIPE, text=True))
        assert servers[-1].stdout.readline().strip() == "ready", "the stream server did not start"
        clients.append(src.popen(["/usr/bin/python3", "-c", STREAM, "client", dst.address, port, str(size),
                                  str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1))
    times = []
    for _ in range(rounds):
        for c in clients:
            c.stdin.write("\n")
            c.stdin.flush()
        times.append(max(float(c.stdout.readline()) for c in clients))
    for p in clients + servers:
        if p.stdin:
            p.stdin.close()
        p.wait(30)
    return statistics.median(times)


def allreduce_2x2(bed):
    """4 ranks, 2 per host on 2 hosts: Troupe (shared memory within each host, TCP between them) against
    gloo in the same layout."""
    a, b = bed.hosts[0], bed.hosts[1]
    placement = [a, a, b, b]
    t = troupe_allreduce(placement, None)
    g = gloo_allreduce(placement)
    # The ring 0 -> 1 -> 2 -> 3 -> 0 crosses between the hosts at 1 -> 2 and 3 -> 0, each carrying
    # 2 (n - 1) / n of the buffer.
    floor = streams_floor(a, b, 2 * 3 * BYTES // 4)
    spread = lambda x: [x["min_ms"], x["ms"], x["max_ms"]]  # noqa: E731
    return {"world": 4, "hosts": 2, "ranks_per_host": 2, "troupe_ms": t["ms"], "gloo_ms": g["ms"],
            "troupe_spread_ms": spread(t), "gloo_spread_ms": spread(g), "troupe_busbw_gbs": busbw(4, t["ms"]),
            "gloo_busbw_gbs": busbw(4, g["ms"]), "ratio": g["ms"] / t["ms"], "tcp_floor_ms": floor}


def main():
    as_json = "--json" in sys.argv
    ok, why = Testbed.available()
    if not ok:
        print(f"multihost: skipped: {why}", file=sys.stderr)
        if as_json:
            print(json.dumps({"skipped": why}))
        return
    bed = Testbed(4, name_prefix="bm")
    try:
        log("sync calls across two hosts, plain and --tls...")
        plain = calls_vs_floor(bed, tls=False)
        tls = calls_vs_floor(bed, tls=True)
        token = secrets.token_hex(16)
        rows = []
        for world in (2, 4):
            hosts = bed.hosts[:world]
            log(f"64 MB all-reduce, {world} hosts: troupe, troupe --tls, gloo...")
            t = troupe_allreduce(hosts, None)["ms"]
            s = troupe_allreduce(hosts, token)["ms"]
            g = gloo_allreduce(hosts)["ms"]
            rows.append({"world": world, "troupe_ms": t, "troupe_tls_ms": s, "gloo_ms": g,
                         "troupe_busbw_gbs": busbw(world, t), "troupe_tls_busbw_gbs": busbw(world, s),
                         "gloo_busbw_gbs": busbw(world, g), "ratio": g / t})
        log("64 MB all-reduce, 4 ranks on 2 hosts (2 per host): troupe, gloo...")
        two_by_two = allreduce_2x2(bed)
    finally:
        bed.close()

    print("| measure (across hosts) | Troupe | peer | ratio |")
    print("|---|---|---|---|")
    print(f"| 1:1 sync calls/s (driver host 1, actor host 0) | {plain['sync_per_s']:,.0f} | "
          f"ping-pong {plain['floor_per_s']:,.0f} | {plain['ratio']:.2f} |")
    print(f"| the same with --tls | {tls['sync_per_s']:,.0f} | ping-pong {tls['floor_per_s']:,.0f} | "
          f"{tls['ratio']:.2f} |")
    for r in rows:
        print(f"| 64 MB all-reduce busbw, {r['world']} hosts | {r['troupe_busbw_gbs']:.2f} GB/s | "
              f"gloo {r['gloo_busbw_gbs']:.2f} GB/s | {r['ratio']:.2f} |")
        print(f"| the same with TLS | {r['troupe_tls_busbw_gbs']:.2f} GB/s | | "
              f"{r['troupe_tls_busbw_gbs'] / r['troupe_busbw_gbs']:.2f} of plain |")
    r = two_by_two
    print(f"| 64 MB all-reduce busbw, 4 ranks on 2 hosts (2 per host) | {r['troupe_busbw_gbs']:.2f} GB/s | "
          f"gloo {r['gloo_busbw_gbs']:.2f} GB/s | {r['ratio']:.2f} |")
    line = lambda x: " / ".join(f"{v:.1f}" for v in x)  # noqa: E731
    print(f"4 ranks on 2 hosts, ms of 5 all-reduces (min / median / max): Troupe {line(r['troupe_spread_ms'])}, "
          f"gloo {line(r['gloo_spread_ms'])}; the ring's cross-host bytes as raw TCP (96 MiB each way at once): "
          f"{r['tcp_floor_ms']:.1f} ms (Troupe at {r['tcp_floor_ms'] / r['troupe_ms']:.2f} of that floor's speed)")
    tls_call_cost = 1 - tls["ratio"] / plain["ratio"]
    tls_busbw_cost = statistics.mean(1 - r["troupe_tls_busbw_gbs"] / r["troupe_busbw_gbs"] for r in rows)
    print(f"TLS costs {tls_call_cost:.0%} of sync calls/s (relative to the floor) and {tls_busbw_cost:.0%} "
          f"of all-reduce bus bandwidth")
    if as_json:
        print(json.dumps({"hosts": [2, 4], "sync_vs_floor": plain["ratio"], "sync_per_s": plain["sync_per_s"],
                          "floor_per_s": plain["floor_per_s"], "tls_sync_vs_floor": tls["ratio"],
                          "allreduce_vs_gloo": rows, "allreduce_2x2_64mb_vs_gloo": two_by_two["ratio"],
                          "allreduce_2x2": two_by_two, "tls_call_cost": tls_call_cost,
                          "tls_busbw_cost": tls_busbw_cost}))


if __name__ == "__main__":
    main()
