"""Objects across hosts: each test-bed host's node has an object directory of its own, and a get()
of an object that lives on another host pulls it from that host's node agent over the network
(the hosts share /dev/shm, but nothing reaches another host's directory except through its agent)."""
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_cluster import driver, start_cluster  # noqa: E402
from troupe_testing import BUILD  # noqa: E402

# A driver's digest of an array's bytes (these tests' drivers and test_ray_object_manager's).
DIGEST = textwrap.dedent("""
    import hashlib, os
    import numpy as np
    from troupe import _api, _objects

    def digest(a):
        return hashlib.sha256(memoryview(np.ascontiguousarray(a)).cast("B")).hexdigest()
""")

# Shared by the drivers below: an actor pinned to host i (its custom resource), which reports
# where its objects live and what it got.
ACTORS = DIGEST + textwrap.dedent("""
    import signal

    @troupe.remote
    class Host:
        def node(self):
            return _objects.host_id(), _objects.store().root
        def digest(self, refs):
            return digest(troupe.get(refs[0]))
        def digest_value(self, a):
            return digest(a)
        def put(self, n):
            return [troupe.put(np.arange(n, dtype=np.int64))]
        def make(self, n):
            return np.arange(n, dtype=np.int64)
        def files(self):
            return sorted(os.listdir(_objects.store().root))
        def pid(self):
            return os.getpid()
        def keep(self, box):
            self.kept = box[0]
            return True
        def pass_on(self, other):
            return troupe.get(other.keep.remote([self.kept]))
        def drop(self):
            self.kept = None
            return True
        def digest_kept(self):
            return digest(troupe.get(self.kept))

    def on(i):
        return Host.options(resources={f"host{i}": 0.1}).remote()
""")


def test_objects_cross_hosts(testbed3):
    controller, token = start_cluster(testbed3)
    setting = f"import json, subprocess\nTROUPE, CONTROLLER, TOKEN = {str(BUILD / 'troupe')!r}, {controller!r}, {token!r}\n"
    out = driver(testbed3.hosts[0], controller, token, setting + ACTORS + textwrap.dedent("""
        b, c = on(1), on(2)
        here = (_objects.host_id(), _objects.store().root)
        nodes = troupe.get([b.node.remote(), c.node.remote()])
        # Every host's node has its own directory, and the driver uses its host's.
        assert len({here[0], nodes[0][0], nodes[1][0]}) == 3, (here, nodes)
        assert len({here[1], nodes[0][1], nodes[1][1]}) == 3, (here, nodes)
        assert here[0] == [n["id"] for n in troupe.nodes() if n["is_head"]][0], here  # the head is on this host

        # put on A, get on B and C at once (two hosts pulling one object together): A sends it
        # about once, as the second puller reads the rest from the first one's copy.
        from troupe import _api
        head_address = [n["address"] for n in troupe.nodes() if n["is_head"]][0]
        served = _api.runtime().object_store(head_address)["served_bytes"]
        x = np.random.default_rng(1).integers(0, 1 << 40, size=(40 << 20) // 8)
        ref = troupe.put(x)
        assert troupe.get([b.digest.remote([ref]), c.digest.remote([ref])]) == [digest(x)] * 2
        served = _api.runtime().object_store(head_address)["served_bytes"] - served
        assert served < 1.5 * x.nbytes, f"A sent {served} bytes for two pulls of {x.nbytes}"
        # troupe status shows each node's store: this host's holds the object.
        status = json.loads(subprocess.run([TROUPE, "status", "--json", "--address", CONTROLLER], check=True,
                                           env={**os.environ, "TROUPE_TOKEN": TOKEN}, capture_output=True,
                                           text=True).stdout)
        stores = {n["id"]: n["object_store"] for n in status["nodes"]}
        assert stores[here[0]]["objects"] >= 1 and stores[here[0]]["bytes"] >= x.nbytes, stores

        # An object put on B, got here (the ref came back in a list: its owner stays B).
        [on_b] = troupe.get(b.put.remote(5 << 20))
        assert digest(troupe.get(on_b)) == digest(np.arange(5 << 20, dtype=np.int64))
        # ... and passed on to C.
        assert troupe.get(c.digest.remote([on_b])) == digest(np.arange(5 << 20, dtype=np.int64))

        # A 200 MB result of an actor on C returned here: pulled, and C's handed-over file deleted.
        big = troupe.get(c.make.remote(25 << 20))
        assert big.nbytes == 200 << 20 and digest(big) == digest(np.arange(25 << 20, dtype=np.int64))
        assert not [f for f in troupe.get(c.files.remote()) if "-h" in f], troupe.get(c.files.remote())

        # A 64 MB argument from here to C (pulled by C from this host's node).
        arg = np.arange(8 << 20, dtype=np.int64)
        assert troupe.get(c.digest_value.remote(arg)) == digest(arg)

        # Borrowers on other hosts: a ref passed here -> B -> C lives while C keeps it, and the
        # object is freed on this host's store once C drops it.
        import time
        def freed(name, what):
            deadline = time.monotonic() + 30
            while os.path.exists(os.path.join(_objects.store().root, name)):
                assert time.monotonic() < deadline, what
                time.sleep(0.05)
        lent = troupe.put(np.arange(1 << 20, dtype=np.int64))
        name = lent.hex()
        b2, c2 = on(1), on(2)
        assert troupe.get(b2.keep.remote([lent])) and troupe.get(b2.pass_on.remote(c2))
        del lent
        troupe.get(b2.drop.remote())
        assert troupe.get(c2.digest_kept.remote()) == digest(np.arange(1 << 20, dtype=np.int64))  # C's keeps it
        troupe.get(c2.drop.remote())
        freed(name, "the object freed once the last borrower (on C) dropped it")
        # A borrower on B killed with -9 does not keep the object: A's agent asks B's about it.
        lent = troupe.put(np.arange(1 << 20, dtype=np.int64))
        name = lent.hex()
        assert troupe.get(b2.keep.remote([lent]))
        del lent
        os.kill(troupe.get(b2.pid.remote()), signal.SIGKILL)
        freed(name, "the dead borrower's hold dropped and the object freed")

        # Owner killed with -9: a get elsewhere raises ObjectLostError naming the death.
        owner = on(1)
        [lost] = troupe.get(owner.put.remote(1 << 20))
        os.kill(troupe.get(owner.pid.remote()), signal.SIGKILL)
        for _ in range(100):
            try:
                troupe.get(lost)
            except troupe.ObjectLostError as e:
                assert "died" in str(e), e
                break
        else:
            raise AssertionError("the object outlived its owner's kill")
        print("OBJECTS OK")
    """), timeout=240)
    assert "OBJECTS OK" in out
