"""A TorchTrainer group whose two trainers run on two hosts (network namespaces, each with its own
address and loopback), training a few steps, then again after a kill -9 of the trainer that is
not on the head's host. The ranks meet through the cluster's store (troupe.dist.group_store,
reached through the head's store gateway from the other host), not a FileStore: the hosts of the
bed share one file system, so the test checks that each join raised the group's epoch in the
cluster, and the ranks reach each other on their nodes' addresses, and each node is sent the
Dataset's files through the cluster (about 4 s)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_cluster import driver, start_cluster  # noqa: E402
from torch_driver import TORCH_LOOP  # noqa: E402
from troupe_testing import BUILD  # noqa: E402

pytest.importorskip("torch", reason="TorchTrainer needs Debian's python3-torch")
if not list((BUILD / "python" / "troupe").glob("_dist.*.so")):
    pytest.skip(f"troupe._dist is not built under {BUILD / 'python'}; run `make build`", allow_module_level=True)

DRIVER = "import json, signal\nSTEP_PAUSE = 0\n" + TORCH_LOOP.replace("%", "%%") + """

def where(t):
    nodes = {n["id"]: n["address"].rsplit(":", 1)[0] for n in _api.nodes()}
    return [nodes.get(rt.actor_info(x._id)["node_id"]) for x in t.trainers]

# copy_data: each node is sent the Dataset's files, as a host that does not share the driver's
# file system is (the bed's hosts share one).
with TorchTrainer(loop, data=data, global_batch_size=16, steps_per_call=3, progress=False,
                  scaling=ScalingConfig(min_workers=2, max_workers=2), _fault={"copy_data": True}) as t:
    t.fit(steps=3)
    first = {"where": where(t), "hashes": t.parameter_hash(), "epoch": rt.group(t.group_id)["epoch"]}
    remote = [x for x, ip in zip(t.trainers, first["where"]) if ip != %(head)r][0]
    os.kill(rt.actor_info(remote._id)["pid"], signal.SIGKILL)
    t.fit(steps=3)
    print("RESULT", json.dumps({"first": first, "where": where(t), "hashes": t.parameter_hash(),
                                "steps": [r["step"] for r in t.history],
                                "worlds": [r["world_size"] for r in t.history],
                                "recoveries": len(t.recoveries), "epoch": rt.group(t.group_id)["epoch"],
                                "staged": [e["text"] for e in t.events if e["text"].startswith("data: staged")]}))
"""


def test_a_torch_trainer_group_trains_with_its_two_ranks_on_two_hosts(make_testbed):
    bed = make_testbed(2)
    head, other = bed.hosts
    controller, token = start_cluster(bed, cpus=1)  # one trainer (1 CPU) fits each host
    out = driver(head, controller, token, DRIVER % {"head": head.address}, timeout=240)
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    print(result)
    first = result["first"]
    assert sorted(first["where"]) == sorted([head.address, other.address]), result  # one rank per host
    assert len(set(first["hashes"])) == 1, result  # both ranks hold the same parameters: DDP all-reduced
    assert first["epoch"] >= 1, result  # the join raised the group's epoch in the cluster
    assert result["recoveries"] == 1, result
    assert result["epoch"] > first["epoch"], result  # the re-formed group met in a new epoch
    assert sorted(result["where"]) == sorted([head.address, other.address]), result
    assert result["steps"] == list(range(1, 7)) and result["worlds"] == [2] * 6, result
    assert len(set(result["hashes"])) == 1, result
    assert len(result["staged"]) == 2, result  # the Dataset's files went to each host's node
