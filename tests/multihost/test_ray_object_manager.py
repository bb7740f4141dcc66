"""Ray's test_object_manager.py public cases, rewritten for Troupe's test bed (3 hosts, each a
node with an object directory of its own): one object passed to actors on every host, many small
objects between every pair of hosts, an object made by an actor and read by tasks on the other
hosts, and pulls into a host whose store is full or smaller than the object."""
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_cluster import driver, start_cluster  # noqa: E402
from test_objects import DIGEST  # noqa: E402

COMMON = DIGEST + textwrap.dedent("""
    @troupe.remote
    class Weights:
        def __init__(self):
            self.seen = {}
        def set_weights(self, w):  # a top-level ref argument: its value arrives
            # Kept, as weights are: a pulled copy lives while its value does (a copy freed
            # between two calls is pulled again: pulled copies are per process and not cached).
            self.w = w
            self.seen[digest(w)] = self.seen.get(digest(w), 0) + 1
            return digest(w)
        def make(self, n, seed):
            self.kept = [troupe.put(np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8))
                         for _ in range(1)]
            return self.kept
        def many(self, count, n):
            return [troupe.put(np.full(n, i % 251, dtype=np.uint8)) for i in range(count)]
        def sums(self, refs):
            values = troupe.get(refs)
            return [int(v[0]) for v in values], len(os.listdir("/proc/self/fd"))
        def store(self):
            return _objects.store().root

    def on(i, **options):
        return Weights.options(resources={f"host{i}": 0.1}, **options).remote()

    @troupe.remote
    def digest_of(w):
        return digest(w)

    def served(address):
        return _api.runtime().object_store(address)["served_bytes"]

    head = [n["address"] for n in troupe.nodes() if n["is_head"]][0]
""")


def test_objects_to_actors_on_every_host_many_small_ones_and_an_actor_s_to_tasks(testbed3):
    controller, token = start_cluster(testbed3)
    out = driver(testbed3.hosts[0], controller, token, COMMON + textwrap.dedent("""
        # One object to 4 actors on the two other hosts, each call twice: every actor's process
        # pulls it once (a second call maps its copy), and the owner's node sends at most a copy
        # per pulling process (relays may send some of them instead).
        actors = [on(1), on(1), on(2), on(2)]
        for round in range(3):
            w = np.random.default_rng(round).integers(0, 255, 24 << 20, dtype=np.uint8)
            ref = troupe.put(w)
            before = served(head)
            for _ in range(2):
                assert troupe.get([a.set_weights.remote(ref) for a in actors], timeout=120) == [digest(w)] * 4
            sent = served(head) - before
            assert sent < 4.5 * w.nbytes, f"round {round}: the head sent {sent} bytes for 4 pullers of {w.nbytes}"
            del ref

        # Many small objects between every pair of hosts: 300 made on each, read on each other
        # one; the readers' open files stay few while they hold the values (small objects are
        # read, not mapped: a mapping holds a file descriptor).
        makers = [on(i) for i in range(3)]
        made = troupe.get([m.many.remote(300, 4096) for m in makers], timeout=120)
        for i, reader in enumerate(makers):
            for j in range(3):
                if i != j:
                    got, fds = troupe.get(reader.sums.remote(made[j]), timeout=120)
                    assert got == [k % 251 for k in range(300)], (i, j)
                    assert fds < 200, f"the reader on host {i} has {fds} files open after 300 pulls"

        # An object an actor on host 1 made, read by tasks on hosts 0 and 2 (found by its owner).
        holder = on(1)
        [obj] = troupe.get(holder.make.remote(6 << 20, 7))
        want = digest(np.random.default_rng(7).integers(0, 255, 6 << 20, dtype=np.uint8))
        reads = [digest_of.options(resources={f"host{i}": 0.5}).remote(obj) for i in (0, 2, 0, 2)]
        assert troupe.get(reads, timeout=120) == [want] * 4
        print("OBJECT MANAGER OK")
    """), timeout=400)
    assert "OBJECT MANAGER OK" in out


def test_pulls_into_a_full_store_and_an_argument_larger_than_the_store(testbed3):
    # Every node's store holds 64 MiB: host 1's is filled by objects its actor keeps, then gets a
    # 40 MB object from host 0 (its own spill to make room), and an 80 MB argument, larger than
    # the whole store, reaches host 2.
    limit = str(64 << 20)
    controller, token = start_cluster(testbed3, extra_head=("--object-store-memory", limit),
                                      extra_join=("--object-store-memory", limit))
    out = driver(testbed3.hosts[0], controller, token, COMMON + textwrap.dedent("""
        full = on(1)
        kept = troupe.get([full.make.remote(20 << 20, s) for s in range(3)])  # 60 MB kept on host 1
        x = np.random.default_rng(1).integers(0, 255, 40 << 20, dtype=np.uint8)
        assert troupe.get(full.set_weights.remote(troupe.put(x)), timeout=120) == digest(x)
        stores = {n["address"]: _api.runtime().object_store(n["address"]) for n in troupe.nodes()}
        assert any(s["spilled_objects"] >= 1 for s in stores.values()), stores  # room was made by spilling
        for i, s in enumerate(range(3)):  # what was spilled is still there
            assert digest(troupe.get(kept[i][0])) == digest(
                np.random.default_rng(s).integers(0, 255, 20 << 20, dtype=np.uint8))
        big = np.random.default_rng(2).integers(0, 255, 80 << 20, dtype=np.uint8)
        assert troupe.get(on(2).set_weights.remote(big), timeout=120) == digest(big)
        print("FULL STORES OK")
    """), timeout=400)
    assert "FULL STORES OK" in out
