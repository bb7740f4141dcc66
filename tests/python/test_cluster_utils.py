"""troupe.cluster_utils.Cluster: real node agents on one machine, actors placed on a chosen node by
custom resources, nodes removed (SIGKILL and SIGTERM) and seen DEAD, and a shutdown that leaves
no process behind."""
import os
import signal
import time

import pytest

from troupe_testing import eventually, import_troupe, processes_under

troupe = import_troupe()
from troupe.cluster_utils import Cluster  # noqa: E402

TTL_S = 1.0


@troupe.remote(num_cpus=1)
class Where:
    def node(self):
        return os.environ["TROUPE_NODE_ID"]

    def pid(self):
        return os.getpid()


def node_state(cluster, node):
    return next(n for n in cluster.status()["nodes"] if n["id"] == node.node_id)


def alive(pid):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def test_nodes_placement_removal_and_shutdown():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "heartbeat_ttl_ms": int(TTL_S * 1000)})
    root = cluster.temp_dir
    try:
        a = cluster.add_node(num_cpus=2, resources={"slot_a": 1})
        b = cluster.add_node(num_cpus=2, resources={"slot_b": 1})
        cluster.wait_for_nodes(timeout=10)
        assert cluster.address.startswith("127.0.0.1:") and len(cluster.token) >= 16
        assert cluster.list_all_nodes() == [cluster.head_node, a, b]
        nodes = {n["id"]: n for n in cluster.status()["nodes"]}
        assert set(nodes) == {cluster.head_node.node_id, a.node_id, b.node_id}
        assert all(n["state"] == "ALIVE" for n in nodes.values())
        assert nodes[a.node_id]["resources"]["slot_a"] == 1 and nodes[a.node_id]["pid"] == a.pid
        assert "slot_a" not in nodes[b.node_id]["resources"]

        troupe.init(cluster.address, token=cluster.token)
        on_a = Where.options(resources={"slot_a": 1}).remote()
        on_b = Where.options(resources={"slot_b": 1}).remote()
        assert troupe.get(on_a.node.remote(), timeout=30) == a.node_id
        assert troupe.get(on_b.node.remote(), timeout=30) == b.node_id
        worker_on_b = troupe.get(on_b.pid.remote())

        cluster.remove_node(b, allow_graceful=False)
        killed_at = time.monotonic()
        assert not alive(b.pid) and b not in cluster.list_all_nodes()
        eventually(lambda: node_state(cluster, b)["state"] == "DEAD", TTL_S + 1.0, "the killed node to be DEAD")
        assert time.monotonic() - killed_at <= TTL_S + 1.0
        assert "heartbeat" in node_state(cluster, b)["death_reason"]
        eventually(lambda: not alive(worker_on_b), 5, "the killed node's actor worker to die with it")
        assert troupe.get(on_a.node.remote(), timeout=10) == a.node_id  # the rest of the cluster works

        cluster.remove_node(a)  # SIGTERM: the agent records its own death
        eventually(lambda: node_state(cluster, a)["state"] == "DEAD", 2, "the stopped node to be DEAD")
        assert node_state(cluster, cluster.head_node)["state"] == "ALIVE"
        troupe.shutdown()
    finally:
        troupe.shutdown()
        cluster.shutdown()
    assert processes_under(root) == [], "shutdown() left processes behind"
    assert not os.path.exists(root), "shutdown() removes the temp dir it made"
    cluster.shutdown()  # idempotent


def test_wait_for_nodes_names_a_dead_node_and_connect_is_undone_by_shutdown(tmp_path):
    temp_dir = tmp_path / "cluster"
    with Cluster(initialize_head=True, head_node_args={"heartbeat_ttl_ms": int(TTL_S * 1000)},
                 temp_dir=str(temp_dir)) as cluster:
        with pytest.raises(TypeError, match="unknown node argument"):
            cluster.add_node(port=1234)  # only the head takes a port
        node = cluster.add_node(num_cpus=1)
        cluster.connect()
        assert troupe.is_initialized() and len(troupe.nodes()) == 2
        os.kill(node.pid, signal.SIGKILL)  # behind the Cluster's back
        eventually(lambda: node_state(cluster, node)["state"] == "DEAD", TTL_S + 1.0, "the node to be DEAD")
        with pytest.raises(TimeoutError, match=f"{node.node_id}: DEAD"):
            cluster.wait_for_nodes(timeout=0.2)
    assert not troupe.is_initialized(), "shutdown() disconnects the driver connect() made"
    assert processes_under(temp_dir) == []
    assert (temp_dir / "latest" / "logs").is_dir(), "a temp_dir given by the caller is kept, with its logs"
