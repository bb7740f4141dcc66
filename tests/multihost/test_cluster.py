"""A cluster over several hosts (network namespaces on a bridge, each with its own address, run root
and loopback), every host started with the head's defaults: the embedded Redis stays on the head's
loopback and the other hosts reach it through the store gateway."""
import json
import os
import signal
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from troupe_testing import BUILD, eventually  # noqa: E402

TTL_MS = 1000
PORT = 6380


def start_cluster(bed, cpus=1, extra_head=(), ttl_ms=TTL_MS, extra_join=()):
    """Head on host 0 (bound to its address), every other host joined with no --node-ip-address:
    each must find its own address on the route to the head. Returns (controller, token)."""
    head = bed.hosts[0]
    out = head.troupe("start", "--head", "--node-ip-address", head.address, "--port", str(PORT), "--num-cpus",
                      str(cpus), "--resources", "host0=1", "--heartbeat-ttl-ms", str(ttl_ms), *extra_head).stdout
    assert "gateway:" in out, out
    controller = f"{head.address}:{PORT}"
    token = json.loads((Path(head.env["TROUPE_TEMP_DIR"]) / "latest" / "cluster.json").read_text())["token"]
    for host in bed.hosts[1:]:
        join(host, controller, token, cpus, extra_join)
    return controller, token


def join(host, controller, token, cpus=1, extra=()):
    p = host.troupe("start", "--address", controller, "--num-cpus", str(cpus), "--resources", f"host{host.index}=1",
                    *extra, env={"TROUPE_TOKEN": token})
    assert f"({host.address}) joined" in p.stdout, p.stdout
    return p


def status(host, controller, token):
    return json.loads(host.troupe("status", "--json", "--address", controller, env={"TROUPE_TOKEN": token}).stdout)


def alive_addresses(host, controller, token):
    nodes = status(host, controller, token)["nodes"]
    return sorted(n["address"].rsplit(":", 1)[0] for n in nodes if n["state"] == "ALIVE")


def troupe_processes(host):
    found = []
    for pid in host.pids():
        try:
            if "troupe" in Path(f"/proc/{pid}/cmdline").read_text():
                found.append(pid)
        except OSError:
            pass  # gone meanwhile
    return found


def driver(host, controller, token, code, timeout=120):
    """A Python driver script run on `host`, attached to the cluster."""
    script = "import sys; sys.path.insert(0, %r)\nimport troupe\ntroupe.init(%r, token=%r)\n" % (
        str(BUILD / "python"), controller, token) + textwrap.dedent(code)
    p = host.run(["/usr/bin/python3", "-c", script], timeout=timeout)
    assert p.returncode == 0, f"driver on {host} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_three_hosts_join_with_the_heads_defaults_and_stay_alive(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed)
    want = sorted(h.address for h in bed.hosts)
    assert alive_addresses(bed.hosts[2], controller, token) == want
    # Still all ALIVE after two TTLs: the joined agents heartbeat through the gateway.
    deadline = time.monotonic() + 2 * TTL_MS / 1000 + 0.5
    while time.monotonic() < deadline:
        assert alive_addresses(bed.hosts[1], controller, token) == want
        time.sleep(0.1)  # sampling a state that must hold throughout, not waiting for one
    # Redis never left the head's loopback, and no password reached a joined host.
    head_dir = Path(bed.hosts[0].env["TROUPE_TEMP_DIR"]) / "latest"
    redis_address = json.loads((head_dir / "cluster.json").read_text())["redis_address"]
    assert redis_address.startswith("127.0.0.1:")
    for host in bed.hosts[1:]:
        joined = json.loads((Path(host.env["TROUPE_TEMP_DIR"]) / "latest" / "cluster.json").read_text())
        assert not joined.get("redis_password"), joined
    # A controller restart on the head: the joined nodes never miss a beat (the gateway is a
    # daemon of its own) and are not registered again.
    before = {n["id"]: n for n in status(bed.hosts[0], controller, token)["nodes"]}
    bed.hosts[0].troupe("restart-controller")
    after = {n["id"]: n for n in status(bed.hosts[2], controller, token)["nodes"]}
    assert {k: v["state"] for k, v in after.items()} == {k: "ALIVE" for k in before}
    assert all(after[k]["registered_ms"] == before[k]["registered_ms"] for k in before)
    # Every server of a joined host listens on its own address, none on a wildcard.
    listening = bed.hosts[1].run(["ss", "-Htlnp"]).stdout
    assert listening and all(bed.hosts[1].address in line for line in listening.splitlines()), listening


def test_join_fails_with_the_agents_reason_when_the_head_is_unreachable(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed)
    bed.hosts[2].troupe("stop")
    bed.hosts[2].cut()
    p = bed.hosts[2].troupe("start", "--address", controller, env={"TROUPE_TOKEN": token}, check=False, timeout=60)
    assert p.returncode != 0
    assert "cannot" in p.stderr and controller in p.stderr, p.stderr
    bed.hosts[2].heal()
    # The controller answers but the store gateway is gone: the agent cannot run, and the CLI
    # says why instead of reporting a node that never worked.
    head_pids = Path(bed.hosts[0].env["TROUPE_TEMP_DIR"]) / "latest" / "pids"
    # The head's node agent would restart the gateway at once: it waits while the join looks.
    supervisor = [int(f.read_text()) for f in head_pids.glob("node-*.pid")]
    for pid in supervisor:
        os.kill(pid, signal.SIGSTOP)
    try:
        os.kill(int((head_pids / "gateway.pid").read_text()), 9)
        p = bed.hosts[2].troupe("start", "--address", controller, env={"TROUPE_TOKEN": token}, check=False,
                                timeout=60)
    finally:
        for pid in supervisor:
            os.kill(pid, signal.SIGCONT)
    assert supervisor, "no head node agent found"
    assert p.returncode != 0 and "store gateway" in p.stderr, p.stderr
    assert bed.hosts[2].address not in alive_addresses(bed.hosts[0], controller, token)
    # A wrong token is refused by both sides, and says so.
    p = bed.hosts[2].troupe("start", "--address", controller, env={"TROUPE_TOKEN": "0" * 32}, check=False)
    assert p.returncode != 0 and "token was rejected" in p.stderr, p.stderr


def test_actors_spread_over_three_hosts_are_called_and_found_from_any_host(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed)
    out = driver(bed.hosts[1], controller, token, """
        import os
        from troupe import _api
        rt = _api.runtime()
        pg = rt.create_placement_group("SPREAD", [{"CPU": 1.0}] * 3, "spread3")

        @troupe.remote(num_cpus=1)
        class Where:
            def where(self):
                return os.environ["TROUPE_NODE_IP"], os.environ["TROUPE_NODE_ID"]

        actors = [Where.options(placement_group=pg["id"], bundle_index=i, name=f"where{i}",
                                namespace="where", lifetime="detached").remote() for i in range(3)]
        print("WHERE", sorted(ip for ip, _ in troupe.get([a.where.remote() for a in actors], timeout=60)))
    """)
    seen = re.search(r"WHERE (.*)", out).group(1)
    assert seen == str(sorted(h.address for h in bed.hosts)), out
    # Named actors are found, and called, from a driver on another host.
    out = driver(bed.hosts[2], controller, token, """
        a = troupe.get_actor("where0", namespace="where")
        print("FOUND", troupe.get(a.where.remote(), timeout=60)[0])
    """)
    assert re.search(r"FOUND 10\.", out), out
    # The head's /metrics reads each actor's counters from the agent of the host it runs on.
    head = bed.hosts[0]
    run_dir = Path(head.env["TROUPE_TEMP_DIR"]) / "latest"
    url = (run_dir / "dashboard.url").read_text().strip()
    bearer = (run_dir / "dashboard.metrics-token").read_text().strip()  # as Prometheus scrapes it
    text = head.run(["/usr/bin/python3", "-c", "import sys, urllib.request; "
                     f"r = urllib.request.Request({url + '/metrics'!r}, headers={{'Authorization': 'Bearer {bearer}'}}); "
                     "sys.stdout.write(urllib.request.urlopen(r, timeout=30).read().decode())"],
                    timeout=60).stdout
    calls = re.findall(r'troupe_actor_calls_total\{node="(\w+)",actor="\w+",class="py:Where"\} (\S+)', text)
    node_ids = {n["id"] for n in status(head, controller, token)["nodes"] if n["state"] == "ALIVE"}
    assert {node for node, _ in calls} == node_ids and len(node_ids) == 3, text
    assert sum(float(v) for _, v in calls) >= 4  # three where() calls, and one more from host 2


def test_a_cut_host_is_declared_dead_and_its_stale_agent_exits_when_the_link_returns(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed)
    victim = bed.hosts[2]
    agent_pid = int(next((Path(victim.env["TROUPE_TEMP_DIR"]) / "latest" / "pids").glob("node-*.pid")).read_text())
    cut_at = time.monotonic()
    victim.cut()

    def dead():
        nodes = status(bed.hosts[0], controller, token)["nodes"]
        return [n for n in nodes if n["address"].startswith(victim.address + ":") and n["state"] == "DEAD"]

    gone = eventually(dead, 10, "the cut host to be declared DEAD")
    assert time.monotonic() - cut_at <= TTL_MS / 1000 + 1.0, "declared dead later than TTL + 1 s"
    assert "heartbeat" in gone[0]["death_reason"], gone
    # The link comes back: the stale agent learns it was declared dead and exits; it never
    # comes back as ALIVE under its old identity.
    victim.heal()
    eventually(lambda: not os.path.exists(f"/proc/{agent_pid}") or
               open(f"/proc/{agent_pid}/stat").read().split(")")[1].split()[0] == "Z",
               15, "the stale agent to exit")
    log = next((Path(victim.env["TROUPE_TEMP_DIR"]) / "latest" / "logs").glob("node-*.log")).read_text()
    assert "declared this node dead" in log, log[-2000:]
    assert victim.address not in alive_addresses(bed.hosts[0], controller, token)


TRAIN_DRIVER = """
import json, os, re, signal, sys
sys.path.insert(0, %(pkg)r)
import troupe
from troupe import _api
from troupe.train import ElasticTrainer
troupe.init(%(controller)r, token=%(token)r)
t = ElasticTrainer(model="tinylm", data="/usr/share/common-licenses/GPL-3", optimizer={"name": "adamw", "lr": 3e-3},
                   global_batch_size=12, max_micro_batch=4, min_workers=1, max_workers=3, context=32,
                   steps_per_call=2, progress=False, seed=7, checkpoint={"snapshot_every": 1}, recovery_timeout=60.0)
rt = _api.runtime()

def where():
    nodes = {n["id"]: n["address"].rsplit(":", 1)[0] for n in _api.nodes()}
    return [nodes.get(rt.actor_info(x._id)["node_id"]) for x in t.trainers]

def reply(**kw):
    print(json.dumps(kw), flush=True)

reply(ready=True, group=t.group_id, where=where())
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if cmd["op"] == "fit":
            t.fit(cmd["steps"])
        elif cmd["op"] == "kill":  # kill -9 the trainer on this host (one pid namespace for all hosts)
            victim = next(x for x, ip in zip(t.trainers, where()) if ip == cmd["host"])
            os.kill(rt.actor_info(victim._id)["pid"], signal.SIGKILL)
            continue
        elif cmd["op"] == "resize":
            t.resize(cmd["workers"])
            t.fit(cmd.get("steps", 2))
        # The controller's epoch advances for members' ends ("<ms> epoch <n>: ... ended: ...").
        advances = [e for e in rt.group(t.group_id)["events"] if re.match(r"\\d+ epoch \\d+: ", e)]
        reply(step=t.step, world=len(t.trainers), where=where(), hashes=t.parameter_hash(),
              recoveries=t.recoveries, members=[x._id for x in t.trainers], events=[e["text"] for e in t.events],
              advances=advances)
    except Exception as e:
        reply(error=repr(e), events=[e["text"] for e in t.events])
t.close()
"""


class Driver:
    """A training driver on one host, told what to do one JSON line at a time."""

    def __init__(self, host, controller, token):
        import subprocess

        code = TRAIN_DRIVER % {"pkg": str(BUILD / "python"), "controller": controller, "token": token}
        self.proc = host.popen(["/usr/bin/python3", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, bufsize=1)
        self.hello = self.read(240)

    def send(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout):
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"driver gave no answer in {timeout}s; stderr:\n{self.proc.stderr.read()[-4000:]}")
        reply = json.loads(line)
        assert "error" not in reply, json.dumps(reply, indent=1)
        return reply

    def call(self, timeout=240, **cmd):
        self.send(**cmd)
        return self.read(timeout)


@pytest.mark.skipif(not list(BUILD.glob("actors/libtroupe_train_actors.a")), reason="built without LibTorch")
def test_an_elastic_group_trains_across_hosts_through_a_kill_a_cut_link_and_a_grow(make_testbed):
    bed = make_testbed(4)
    hosts = bed.hosts[:3]
    fresh = bed.hosts[3]

    class Three:  # the first three hosts form the cluster; the fourth joins later
        pass

    three = Three()
    three.hosts = hosts
    controller, token = start_cluster(three)
    d = Driver(hosts[0], controller, token)
    assert sorted(d.hello["where"]) == sorted(h.address for h in hosts), d.hello  # one trainer per host

    r = d.call(op="fit", steps=4)
    assert r["world"] == 3 and len(set(r["hashes"])) == 1, r

    # kill -9 of one trainer on host 1: it restarts there and every rank agrees again.
    d.send(op="kill", host=hosts[1].address)
    r = d.call(op="fit", steps=4)
    assert r["world"] == 3 and len(r["recoveries"]) == 1 and len(set(r["hashes"])) == 1, r
    assert sorted(r["where"]) == sorted(h.address for h in hosts), r

    # Host 2's link is cut mid-training: it is declared dead, the group goes on with the others.
    step_before = r["step"]
    d.send(op="fit", steps=40)
    eventually(lambda: any(g["step"] >= step_before + 2 for g in status(hosts[0], controller, token)["groups"]),
               120, "training to be under way")
    stale = [m for m, ip in zip(r["members"], r["where"]) if ip == hosts[2].address]
    advanced = len(r["advances"])
    hosts[2].cut()
    r = d.read(300)
    assert r["world"] == 2 and hosts[2].address not in r["where"], r
    assert len(r["recoveries"]) == 2 and max(x["recovery_s"] for x in r["recoveries"]) < 30, r
    # One failure, one epoch advance: the host's trainer, dataloader and checkpoint actor, and the
    # driver's removal of the trainer that did not come back and of its bundle.
    assert len(r["advances"]) == advanced + 1, r["advances"][advanced:]
    print("host cut: recoveries", r["recoveries"], "events", [e for e in r["events"] if "recovered" in e or "failure" in e])
    assert len(set(r["hashes"])) == 1 and r["step"] == step_before + 40, r
    assert not set(stale) & set(r["members"]), r
    # The link returns: the stale agent and its workers exit; nothing of theirs rejoins the group.
    hosts[2].heal()
    eventually(lambda: not troupe_processes(hosts[2]), 20, "host 2's stale agent and workers to exit")

    # Grow onto a fresh host: no member runs there, so its state comes over the network.
    join(fresh, controller, token)
    r = d.call(op="resize", workers=3, steps=4)
    assert r["world"] == 3 and fresh.address in r["where"], r
    assert len(set(r["hashes"])) == 1, r
    d.proc.stdin.close()
    assert d.proc.wait(60) == 0


class Capture:
    """Every frame on the hosts' links (AF_PACKET sockets on the bridge-side veths, in the root
    namespace, so the hosts cannot hide anything from it), read on a thread until stop()."""

    def __init__(self, interfaces):
        import select
        import socket
        import threading

        self.socks = []
        for name in interfaces:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            sock.bind((name, 0))
            sock.setblocking(False)
            self.socks.append(sock)
        self.frames = []
        self.running = True

        def read():
            while self.running:
                ready, _, _ = select.select(self.socks, [], [], 0.2)
                for sock in ready:
                    try:
                        self.frames.append(sock.recv(65535))
                    except BlockingIOError:
                        pass

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def stop(self):
        self.running = False
        self.thread.join()
        for sock in self.socks:
            sock.close()
        return b"".join(self.frames)


def test_a_tls_cluster_encrypts_every_connection_across_hosts(testbed3):
    bed = testbed3
    capture = Capture([h.veth for h in bed.hosts])
    try:
        controller, token = start_cluster(bed, extra_head=("--tls",))
        marker = "troupe-plaintext-marker-5f1c"
        out = driver(bed.hosts[1], controller, token, f"""
            from troupe import _api
            pg = _api.runtime().create_placement_group("SPREAD", [{{"CPU": 1.0}}] * 3, "spread3")

            @troupe.remote(num_cpus=1)
            class Echo:
                def echo(self, text):
                    return text + "!"

                def count(self, refs):
                    return troupe.get(refs[0]).count({marker!r}.encode())

            actors = [Echo.options(placement_group=pg["id"], bundle_index=i).remote() for i in range(3)]
            print("ECHO", troupe.get([a.echo.remote({marker!r}) for a in actors], timeout=60))
            # An object pulled across hosts (chunks, then the bulk stream past 8 MiB) is encrypted too.
            blob = troupe.put({marker!r}.encode() * ((12 << 20) // len({marker!r})))
            print("PULLED", troupe.get([a.count.remote([blob]) for a in actors], timeout=60))
        """)
        assert out.count(marker + "!") == 3, out
        pulled = eval(out.split("PULLED", 1)[1].strip().splitlines()[0])
        assert pulled == [(12 << 20) // len(marker)] * 3, out
    finally:
        wire = capture.stop()
    # Calls, replies, registrations and the store traffic through the gateway crossed the bridge,
    # none of it readable: not the marker, not the token, not a Redis command.
    assert len(wire) > 10_000, "nothing was captured"
    for secret in (marker.encode(), token.encode(), b"EVALSHA", b"HGETALL"):
        assert secret not in wire, f"{secret!r} crossed the wire in plaintext"
    # The same capture on a cluster without --tls does see them: the check above means something.
    bed.hosts[0].troupe("stop")
    for host in bed.hosts[1:]:
        host.troupe("stop")
    capture = Capture([h.veth for h in bed.hosts])
    try:
        controller, token = start_cluster(bed)
        driver(bed.hosts[1], controller, token, f"""
            @troupe.remote(num_cpus=1, resources={{"host0": 1}})
            class Echo:
                def echo(self, text):
                    return text + "!"

            print(troupe.get(Echo.remote().echo.remote({marker!r}), timeout=60))
        """)
    finally:
        wire = capture.stop()
    assert marker.encode() in wire and b"EVALSHA" in wire


@pytest.mark.skipif(not list(BUILD.glob("actors/libtroupe_train_actors.a")), reason="built without LibTorch")
def test_an_elastic_group_trains_over_tls_collectives_across_hosts(testbed3):
    bed = testbed3
    capture = Capture([h.veth for h in bed.hosts])
    try:
        controller, token = start_cluster(bed, extra_head=("--tls",))
        d = Driver(bed.hosts[0], controller, token)
        r = d.call(op="fit", steps=4)
        d.proc.stdin.close()
        assert d.proc.wait(60) == 0
    finally:
        wire = capture.stop()
    assert r["world"] == 3 and len(set(r["hashes"])) == 1, r
    assert sorted(r["where"]) == sorted(h.address for h in bed.hosts), r
    # The collectives' hellos ("TRPC", version 1, a data or control connection) went through TLS.
    # (A driver's first hello is plaintext: it learns the cluster speaks TLS from the answer.)
    # The whole 8-byte header is looked for: "TRPC" alone turns up by chance in megabytes of
    # ciphertext (about once in 4 GiB of it).
    assert len(wire) > 100_000
    for hello in (b"TRPC\x01\x00\x01\x00", b"TRPC\x01\x00\x02\x00"):
        assert hello not in wire, [wire[i - 40:i + 60] for i in range(len(wire)) if wire.startswith(hello, i)][:3]
    assert token.encode() not in wire
