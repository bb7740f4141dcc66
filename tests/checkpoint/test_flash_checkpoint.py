"""troupe.checkpoint.FlashCheckpoint: a rank's snapshots in shared memory from Python, alone and with
the node's Checkpoint actors in a real cluster (two node agents on this machine are two nodes)."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_testing import assert_state, make_state, needs_mount_namespace, run_python
from troupe_testing import PYTHON_PACKAGE, eventually, free_port, import_troupe, run_driver

troupe_api = import_troupe()
ckpt = troupe_api.checkpoint


@pytest.fixture
def shm_dir():
    d = Path(tempfile.mkdtemp(prefix="troupe_ckpt_test_", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_snapshots_round_trip_in_place_and_keep_the_previous_one(shm_dir):
    flash = ckpt.FlashCheckpoint("troupe_ckpt.t.n.r0", shm_dir=shm_dir)
    assert flash.restore() is None  # nothing saved yet
    flash.save(10, make_state(10), metadata=b"ten")
    flash.save(20, make_state(20))
    # In place, into a model of the same shapes (tensors keep their identity).
    model = make_state(0)
    weight = model["linear.weight"]
    restored = flash.restore(model)
    assert restored.step == 20 and restored.metadata == b""
    assert restored.state_dict is model and model["linear.weight"] is weight
    assert_state(model, make_state(20))
    # The previous snapshot is intact next to the newest.
    older = flash.restore(max_step=19)
    assert older.step == 10 and older.metadata == b"ten"
    assert_state(older.state_dict, make_state(10))
    flash.close()
    # Another reader (as after a restart) sees the same.
    again = ckpt.FlashCheckpoint("troupe_ckpt.t.n.r0", shm_dir=shm_dir).restore(as_numpy=True)
    assert again.step == 20 and np.array_equal(again.state_dict["np.f32"], make_state(20)["np.f32"])
    # A model of other shapes is refused, not half-filled.
    wrong = make_state(0)
    wrong["linear.weight"] = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="linear.weight"):
        ckpt.FlashCheckpoint("troupe_ckpt.t.n.r0", shm_dir=shm_dir).restore(wrong)


WRITER = """
import sys, torch, troupe.checkpoint as ckpt
sys.path[:0] = sys.argv[2:4]
from checkpoint_testing import make_state
flash = ckpt.FlashCheckpoint("troupe_ckpt.t.n.r0", shm_dir=sys.argv[1])
flash.save(10, make_state(10, large=8 << 20))
print("saved 10", flush=True)
flash.save(20, make_state(20, large=8 << 20))   # stopped half-way by TROUPE_CHECKPOINT_FAULT
print("saved 20", flush=True)
"""


def test_kill_9_of_the_writer_in_the_middle_of_a_snapshot_restores_the_previous_step(shm_dir, tmp_path):
    log = tmp_path / "writer.err"
    env = dict(os.environ, PYTHONPATH=str(PYTHON_PACKAGE), TROUPE_CHECKPOINT_FAULT="snapshot:step=20:after=4194304")
    with open(log, "w") as err:
        here = Path(__file__).parent
        writer = subprocess.Popen(["/usr/bin/python3", "-c", WRITER, str(shm_dir), str(here), str(here.parent)],
                                  env=env, stdout=subprocess.PIPE, stderr=err, text=True)

    def paused():
        assert writer.poll() is None, f"the writer exited ({writer.returncode}): {log.read_text()}"
        return "snapshot of step 20 paused after" in log.read_text()

    try:
        eventually(paused, 60, "the writer to stop mid-save")
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    with writer.stdout:
        assert "saved 10" in writer.stdout.read()
    restored = ckpt.FlashCheckpoint("troupe_ckpt.t.n.r0", shm_dir=shm_dir).restore()
    assert restored.step == 10
    assert_state(restored.state_dict, make_state(10, large=8 << 20))


TOO_SMALL = """
import torch, troupe.checkpoint as ckpt
try:
    ckpt.FlashCheckpoint(group="g", node="n").save(1, {"w": torch.zeros(2 << 20)})  # 8 MiB x 2 slots
except ckpt.CheckpointSpaceError as e:
    print("space error:", e)
"""


@needs_mount_namespace
def test_too_little_shared_memory_is_a_clear_error_not_a_sigbus(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    env_prefix = ["env", f"TROUPE_SHM_DIR={d}", "unshare", "-rm", "sh", "-c",
                  f'mount -t tmpfs -o size=4m tmpfs "{d}" && exec "$0" "$@"']
    child = run_python(TOO_SMALL, prefix=env_prefix)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr)  # -7 would be SIGBUS
    assert "space error: RESOURCE_EXHAUSTED: checkpoint segment" in child.stdout
    assert "but only" in child.stdout and "TROUPE_SHM_DIR" in child.stdout


DRIVER = """
import json, os, sys, time, warnings, torch, troupe
import troupe.checkpoint as ckpt
shm, disk = sys.argv[1], sys.argv[2]
troupe.init("auto")
members = ["ck-a", "ck-b"]
def actor(name, node):
    args = {"group": "job", "node": node, "self": name, "members": members, "dir": disk, "shm_dir": shm}
    # Peers find each other by these plain names: C++ looks them up in "default".
    return troupe.cpp_actor("Checkpoint", init_args=json.dumps(args), name=name, namespace="default", num_cpus=0.5,
                            resources={"ck" + node.upper(): 1})
a, b = actor("ck-a", "a"), actor("ck-b", "b")
from troupe import _typed
def status(h):  # rank -> step, per list of the typed status
    s = _typed.get(h, "Checkpoint", "status")["status"]
    return {k: {e["rank"]: e["step"] for e in s[k]} for k in ("persisted", "replicated", "replicasHeld")}
def until(cond, what):
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
state = {"w": torch.randn(256, 1024), "b": torch.arange(10), "h": torch.randn(7).to(torch.bfloat16)}
flash = ckpt.FlashCheckpoint(rank=0, world_size=1, actor=a)
flash.save(10, state, metadata=b"ten")
until(lambda: status(a)["persisted"].get(0) == 10 and status(a)["replicated"].get(0) == 10
      and status(b)["replicasHeld"].get(0) == 10, "persisted and replicated")
held = _typed.get(b, "Checkpoint", "inventory")["holdings"]
assert {"rank": 0, "step": 10, "worldSize": 1, "kind": "replica", "imageBytes": held[0]["imageBytes"]} in held, held
chunk = _typed.get(b, "Checkpoint", "read", kind="replica", rank=0, step=10, offset=0, length=64)["data"]
assert len(chunk) == 64 and isinstance(chunk, bytes)
try:                                                              # sizes are checked by the actor
    _typed.get(b, "Checkpoint", "read", kind="replica", rank=0, step=10, offset=0, length=9 << 20)
    raise AssertionError("a 9 MiB read was served")
except troupe.exceptions.ActorError as e:
    assert "at most 8388608 per call" in str(e), e
try:                                                              # JSON is no longer a payload
    troupe.get(b.read.remote(b'{"kind": "replica"}'))
    raise AssertionError("a JSON payload was taken")
except troupe.exceptions.ActorError as e:
    assert "not whole 8-byte words" in str(e) or "not a message" in str(e), e
from_disk, info = ckpt.load(disk, with_metadata=True)            # what the actor wrote, read by Python
assert info["step"] == 10 and info["metadata"] == b"ten"
assert all(torch.equal(from_disk[k], v) for k, v in state.items())
model = {k: torch.zeros_like(v) for k, v in state.items()}
r = flash.restore(model)
assert r.step == 10 and all(torch.equal(model[k], v) for k, v in state.items())
os.remove(os.path.join(shm, flash.segment_name))                  # this node's memory is lost
model = {k: torch.zeros_like(v) for k, v in state.items()}
r = flash.restore(model)                                          # from ck-b's replica
assert r.step == 10 and all(torch.equal(model[k], v) for k, v in state.items())
removed = _typed.get(a, "Checkpoint", "release")["removed"] + _typed.get(b, "Checkpoint", "release")["removed"]
print("OK", json.dumps(sorted(removed)))
"""


def test_checkpoint_actors_from_python(troupe, shm_dir, tmp_path):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port), "--num-cpus", "2", "--resources", "ckA=1")
    cluster = json.loads((troupe.run_dir() / "cluster.json").read_text())
    troupe.run("start", "--address", cluster["controller_address"], "--token-file", str(troupe.run_dir() / "token"), "--num-cpus", "2",
               "--resources", "ckB=1")
    disk = tmp_path / "ckpt"
    done = run_driver(DRIVER.replace("sys.argv[1], sys.argv[2]", f"{str(shm_dir)!r}, {str(disk)!r}"),
                      env=troupe.env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    removed = json.loads(done.stdout.split("OK ", 1)[1])
    # Rank 0's segment on node a (staged again from the replica) and node b's replica of it.
    assert removed == ["troupe_ckpt.job.a.r0", "troupe_ckpt.job.b.replica.r0"]
    assert sorted(p.name for p in shm_dir.iterdir()) == []  # the group ended: no segment left
    assert ckpt.steps(disk) == [10]


STALE_MEMBERS = """
import json, sys, time, torch, troupe
import troupe.checkpoint as ckpt
from troupe import _typed
shm = sys.argv[1]
troupe.init("auto")
members = ["ck-a", "ck-b", "ck-c"]  # what a restarted actor knows: its spawn's member list
def actor(name):
    args = {"group": "stale", "node": name[-1], "self": name, "members": members, "shm_dir": shm}
    return troupe.cpp_actor("Checkpoint", init_args=json.dumps(args), name=name, namespace="default", num_cpus=0.5)
a, b, c = actor("ck-a"), actor("ck-b"), actor("ck-c")
for h in (a, b, c):
    _typed.get(h, "Checkpoint", "status")
troupe.kill(b)                                 # ck-a's replica target is gone for good, name and all
flash = ckpt.FlashCheckpoint(rank=0, world_size=1, actor=a)
flash.save(7, {"w": torch.arange(1000.0)})
deadline = time.monotonic() + 60
while True:
    r = _typed.get(a, "Checkpoint", "pin", rank=0, step=7)
    if r["state"] != "running":
        break
    assert time.monotonic() < deadline, r
    time.sleep(0.02)
held = {e["rank"]: e["step"] for e in _typed.get(c, "Checkpoint", "status")["status"]["replicasHeld"]}
print("PIN", json.dumps({"state": r["state"], "step": r["step"], "replicaTo": r["replicaTo"], "held": held.get(0)}))
"""


def test_a_replica_target_whose_name_is_gone_is_replaced_not_waited_for(troupe, shm_dir):
    # A checkpoint actor restarted after its group lost a node starts with its spawn's member
    # list, naming the lost node's actor (killed since): its pin must go to the next live member,
    # not wait out the pin timeout for a name no lookup finds.
    troupe.run("start", "--head", "--port", str(free_port()), "--num-cpus", "2")
    done = run_driver(STALE_MEMBERS.replace("sys.argv[1]", repr(str(shm_dir))), env=troupe.env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    pin = json.loads(done.stdout.split("PIN ", 1)[1])
    assert pin == {"state": "done", "step": 7, "replicaTo": "ck-c", "held": 7}, pin


def test_typed_params_are_checked_before_they_are_sent():
    from troupe import _actors

    params = _actors.encode("Checkpoint", "restore", {"rank": 3, "maxStep": 20})
    assert len(params) % 8 == 0 and params
    with pytest.raises(ValueError, match=r"no field 'nope' \(rank, maxStep\)"):
        _actors.encode("Checkpoint", "restore", {"nope": 1})
    with pytest.raises(ValueError, match="must not be negative"):
        _actors.encode("Checkpoint", "attach", {"rank": -1})
    with pytest.raises(ValueError, match="out-of-range"):
        _actors.encode("Checkpoint", "attach", {"rank": 1 << 40})
    with pytest.raises(TypeError, match="expected an int"):
        _actors.encode("Checkpoint", "attach", {"rank": "0"})
    with pytest.raises(ValueError, match="'disk' is not one of memory, replica"):
        _actors.encode("Checkpoint", "read", {"kind": "disk"})
    with pytest.raises(ValueError, match="Checkpoint has no method 'nope'"):
        _actors.encode("Checkpoint", "nope", {})
    assert "replicaWrite" in _actors.methods("Checkpoint")
    # Replies from a peer: a results message is read back; anything else is refused, not guessed at.
    from troupe._actors import decode
    with pytest.raises(ValueError, match="not whole 8-byte words"):
        decode("Checkpoint", "attach", b"\x00" * 12)
    with pytest.raises(ValueError, match="not a results message"):
        decode("Checkpoint", "attach", b"\x00\x00\x00\x00\xff\xff\x00\x00")


def test_tracked_objects_round_trip_through_an_image_and_foreign_metadata_is_refused():
    import collections

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    states = {"model": model.state_dict(), "opt": opt.state_dict(), "n": {"seen": [1, (2, 3)]}}
    tensors, metadata = ckpt.pack_tracked(states)
    assert "model/0.weight" in tensors and "opt/state/0/exp_avg" in tensors
    assert tensors["model/0.weight"] is states["model"]["0.weight"]  # no copy on the way
    back = ckpt.unpack_tracked({k: v.clone() for k, v in tensors.items()}, metadata)
    assert isinstance(back["model"], collections.OrderedDict) and back["model"]._metadata == states["model"]._metadata
    assert back["opt"]["param_groups"][0]["betas"] == (0.8, 0.9) and back["n"] == {"seen": [1, (2, 3)]}
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(back["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    torch.optim.AdamW(fresh.parameters()).load_state_dict(back["opt"])
    with pytest.raises(ckpt.CheckpointError, match="does not hold tracked objects"):
        ckpt.unpack_tracked(tensors, b"ten")
    with pytest.raises(ckpt.CheckpointCorruptError, match="names tensor 'model/0.weight'"):
        ckpt.unpack_tracked({k: v for k, v in tensors.items() if k != "model/0.weight"}, metadata)
