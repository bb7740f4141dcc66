"""The test bed itself: isolated hosts that reach each other only by their bed addresses, a cut
that partitions one host while its processes live on, and a close() that leaves nothing."""
import json
import os
import select
import socket
import stat
import subprocess
import sys
import time

from testbed import Testbed, _alive, _netns_names
from troupe_testing import eventually

# Listens on port 0 of each address in argv, prints the ports as one JSON line, and answers
# every connection with the address it was reached on.
SERVER = r"""
import json, socket, sys, threading
def serve(s, tag):
    while True:
        c, _ = s.accept()
        c.sendall(tag.encode())
        c.close()
ports = []
for host in sys.argv[1:]:
    s = socket.socket()
    s.bind((host, 0))
    s.listen(16)
    ports.append(s.getsockname()[1])
    threading.Thread(target=serve, args=(s, host), daemon=True).start()
print(json.dumps(ports), flush=True)
threading.Event().wait()
"""

CLIENT = r"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        print("ok", s.recv(100).decode())
except OSError as e:
    print("error", type(e).__name__)
"""


def start_server(host, *addresses):
    proc = host.popen([sys.executable, "-c", SERVER, *addresses], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 10)
    assert ready, f"the test server in {host} did not start"
    return proc, json.loads(proc.stdout.readline())


def connect(host, address, port, timeout=1.0):
    return host.run([sys.executable, "-c", CLIENT, address, port, timeout], timeout=timeout + 20).stdout.strip()


def test_hosts_have_distinct_addresses_and_private_roots(testbed3):
    bed = testbed3
    addresses = [h.address for h in bed.hosts]
    assert len(set(addresses)) == 3
    assert all(h.address in {str(a) for a in bed.subnet.hosts()} for h in bed.hosts)
    assert len({h.netns for h in bed.hosts}) == 3 and len({h.root for h in bed.hosts}) == 3
    for h in bed.hosts:
        assert f"inet {h.address}/24" in h.run(["ip", "-o", "-4", "addr", "show", "dev", "eth0"], check=True).stdout
        assert stat.S_IMODE(os.stat(h.root).st_mode) == 0o700
        assert h.run(["sh", "-c", "echo $TROUPE_TEMP_DIR"]).stdout.strip() == str(h.root / "troupe")
    bridge = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", bed.bridge], capture_output=True, text=True)
    assert bridge.returncode == 0 and bridge.stdout.strip() == "", "the bridge must carry no address by default"


def test_hosts_reach_each_other_by_address_but_not_each_others_loopback(testbed3):
    h0, h1, _ = testbed3.hosts
    _, (public, loopback) = start_server(h0, h0.address, "127.0.0.1")
    assert connect(h1, h0.address, public) == f"ok {h0.address}"
    assert connect(h0, "127.0.0.1", loopback) == "ok 127.0.0.1"  # the loopback server is there...
    assert connect(h1, "127.0.0.1", loopback) == "error ConnectionRefusedError"  # ...but not in host 1


def test_cut_partitions_one_host_and_heal_restores_it(testbed3):
    h0, h1, h2 = testbed3.hosts
    server0, (port0,) = start_server(h0, h0.address)
    _, (port2,) = start_server(h2, h2.address)
    assert connect(h1, h0.address, port0) == f"ok {h0.address}"

    h0.cut()
    started = time.monotonic()
    assert connect(h1, h0.address, port0, timeout=0.5).startswith("error")
    assert time.monotonic() - started < 10
    assert connect(h0, h2.address, port2, timeout=0.5).startswith("error")  # both directions
    assert connect(h1, h2.address, port2) == f"ok {h2.address}"  # the rest of the bed is untouched
    assert server0.poll() is None, "a cut host's processes keep running"

    h0.heal()
    eventually(lambda: connect(h1, h0.address, port0) == f"ok {h0.address}", 10, "host 0 reachable after heal")
    assert connect(h0, h2.address, port2) == f"ok {h2.address}"


def test_root_address_lets_the_root_namespace_reach_hosts(make_testbed):
    bed = make_testbed(1, root_address=True)
    h0 = bed.hosts[0]
    assert bed.root_address == str(list(bed.subnet.hosts())[-1])
    _, (port,) = start_server(h0, h0.address)
    with socket.create_connection((h0.address, port), timeout=5) as s:
        assert s.recv(100).decode() == h0.address


def test_close_kills_everything_and_removes_only_what_it_made(make_testbed):
    foreign = "tbforeign" + os.urandom(3).hex()  # someone else's namespace, named like ours
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        bed = make_testbed(2)
        child = bed.hosts[0].popen(["sleep", "1000"])
        # A daemon that is not our child (reparented to init), as `troupe start` makes.
        bed.hosts[1].run(["sh", "-c", "setsid sleep 1000 </dev/null >/dev/null 2>&1 &"], check=True)
        pids = eventually(lambda: len(bed.pids()) >= 2 and bed.pids(), 10, "both sleepers to run")
        roots, claim = [h.root for h in bed.hosts], bed._claim
        assert claim.exists()

        bed.close()
        assert child.poll() is not None
        assert [p for p in pids if _alive(p)] == []
        netns = _netns_names()
        assert not any(n.startswith(bed.tag) for n in netns)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert bed.tag not in links
        assert not any(r.exists() for r in roots) and not claim.exists()
        bed.close()  # idempotent
        assert foreign in netns, "close() must not touch namespaces it did not create"
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=False)


def test_a_bed_is_refused_cleanly_when_names_do_not_fit():
    for bad in ("toolongprefix", "a-b"):
        try:
            Testbed(1, name_prefix=bad)
        except ValueError as e:
            assert "name_prefix" in str(e)
        else:
            raise AssertionError(f"name_prefix={bad!r} was accepted")
