#!/usr/bin/env python3
"""bench/run dashboard [--actors N] [--json]: the dashboard of a cluster holding N actors (10,000).

A head is started with one unit of a custom resource; N actors each ask for that unit, so one is
ALIVE and the rest stay PENDING: real records in the real store and controller, without N worker
processes. While the pages poll, each endpoint is asked 20 times 100 ms apart (so background
refreshes of the cluster state run meanwhile) and its latency's median and p95 are printed, with
the controller's status call (what a refresh costs) and `troupe status --json` (all actors, and
a page of 100) beside them. Requests carry the session cookie of the login URL the start banner
prints, as a browser's do.
Target (issue 16, "fast at 10k actors"): every page under 100 ms at p95. Ray's dashboard, which
has no pagination, is reported at seconds per page at 10k actors (ray-project/ray#35202); it does
not run on this machine, so there is no same-run peer.
"""
import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

BUILD = os.environ.get("TROUPE_BIN_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
import troupe  # noqa: E402

TARGET_MS = 100


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def login(url):
    """The session cookie the login URL (printed by `troupe start --head`) sets: the dashboard
    serves nothing without it."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("GET", f"{parts.path}?{parts.query}")
        reply = conn.getresponse()
        reply.read()
        cookie = reply.getheader("Set-Cookie")
    finally:
        conn.close()
    if reply.status != 303 or not cookie:
        raise RuntimeError(f"logging in to the dashboard failed: HTTP {reply.status}")
    return cookie.split(";")[0]


def fetch_ms(url, cookie):
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Cookie": cookie}), timeout=60) as r:
        body = r.read()
    return (time.perf_counter() - t0) * 1e3, body


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--actors", type=int, default=10_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="troupe-bench-dashboard-")
    env = dict(os.environ, TROUPE_TEMP_DIR=root)
    cli = os.path.join(BUILD, "troupe")
    port = free_port()
    started = subprocess.run([cli, "start", "--head", "--port", str(free_port()), "--dashboard-port", str(port),
                              "--resources", "slot=1"], env=env, check=True, capture_output=True, text=True)
    cookie = login(re.search(r"dashboard:\s+(\S+)", started.stdout).group(1))
    os.environ["TROUPE_TEMP_DIR"] = root
    url = f"http://127.0.0.1:{port}"
    try:
        troupe.init("auto", log_to_driver=False)

        @troupe.remote(resources={"slot": 1})
        class Holder:
            pass

        created = []
        t0 = time.perf_counter()

        def create(n):
            for _ in range(n):
                created.append(Holder.options(lifetime="detached").remote())

        threads = [threading.Thread(target=create, args=(args.actors // 4 + (i < args.actors % 4),)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        create_s = time.perf_counter() - t0
        print(f"{len(created)} actors created in {create_s:.1f} s ({len(created) / create_s:.0f}/s)", file=sys.stderr)

        runtime = troupe._api.runtime()
        status_ms = []
        for _ in range(5):
            t0 = time.perf_counter()
            snap = runtime.snapshot()
            status_ms.append((time.perf_counter() - t0) * 1e3)
        assert len(snap["actors"]) >= args.actors, len(snap["actors"])
        cli_ms, cli_page_ms = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([cli, "status", "--json", "--limit", "0"], env=env, check=True, capture_output=True)
            cli_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            page = subprocess.run([cli, "status", "--json", "--limit", "100"], env=env, check=True,
                                  capture_output=True).stdout
            cli_page_ms.append((time.perf_counter() - t0) * 1e3)
        assert len(json.loads(page)["actors"]) == 100

        some = snap["actors"][len(snap["actors"]) // 2]["id"][:6]
        pages = {
            "actors, first page": "/api/actors?limit=100",
            "actors, PENDING page at the middle": f"/api/actors?state=PENDING&offset={args.actors // 2}&limit=100",
            "actors, search by id": f"/api/actors?q={some}",
            "cluster": "/api/cluster",
            "groups": "/api/groups",
            "metrics": "/metrics",
            "page": "/",
        }
        fetch_ms(url + "/api/cluster", cookie)  # the dashboard's first read of the state
        rows = []
        for name, path in pages.items():
            times = []
            for _ in range(20):
                ms, body = fetch_ms(url + path, cookie)
                times.append(ms)
                time.sleep(0.1)
            if path.startswith("/api/actors"):
                assert json.loads(body)["actors"], f"{path} returned no actors"
            rows.append((name, path, percentile(times, 0.5), percentile(times, 0.95)))
    finally:
        try:
            troupe.shutdown()
        finally:
            subprocess.run([cli, "stop"], env=env, capture_output=True)

    worst = max(p95 for _, _, _, p95 in rows)
    print(f"dashboard with {args.actors} actors (1 ALIVE, the rest PENDING), 20 requests per page, 100 ms apart")
    print(f"{'page':38} {'median ms':>10} {'p95 ms':>8}")
    for name, path, p50, p95 in rows:
        print(f"{name:38} {p50:10.1f} {p95:8.1f}")
    print(f"{'controller status call (a refresh)':38} {percentile(status_ms, 0.5):10.1f} {max(status_ms):8.1f}")
    print(f"{'troupe status --json --limit 0 (all)':38} {percentile(cli_ms, 0.5):10.1f} {max(cli_ms):8.1f}")
    print(f"{'troupe status --json --limit 100':38} {percentile(cli_page_ms, 0.5):10.1f} {max(cli_page_ms):8.1f}")
    print(f"worst page p95 {worst:.1f} ms (target < {TARGET_MS} ms); actors created at {len(created) / create_s:.0f}/s")
    if args.json:
        print(json.dumps({"actors": args.actors, "page_p95_ms": {n: round(p95, 2) for n, _, _, p95 in rows},
                          "page_median_ms": {n: round(p50, 2) for n, _, p50, _ in rows},
                          "worst_page_p95_ms": round(worst, 2), "target_ms": TARGET_MS,
                          "status_call_ms": round(percentile(status_ms, 0.5), 1),
                          "status_cli_ms": round(percentile(cli_ms, 0.5), 1),
                          "status_cli_limit_100_ms": round(percentile(cli_page_ms, 0.5), 1),
                          "actor_create_per_s": round(len(created) / create_s, 1)}))


if __name__ == "__main__":
    main()
