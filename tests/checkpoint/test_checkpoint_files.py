"""troupe.checkpoint.save/load: the persisted format from Python (torch and numpy), corruption,
full disks. Writers that must fail run in their own processes (file size limits, small tmpfs)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_testing import assert_state, make_state, needs_mount_namespace, run_python, same, temp_files
from troupe_testing import import_troupe

troupe = import_troupe()
ckpt = troupe.checkpoint


def test_round_trip_of_many_dtypes_and_shapes(tmp_path):
    state = make_state(7)
    path = ckpt.save(state, tmp_path, step=7, metadata=b"rng\0state")
    assert path.endswith("step-00000000000000000007/rank-00000.tckpt")
    loaded, info = ckpt.load(tmp_path, with_metadata=True)
    assert_state(loaded, state)
    assert info["step"] == 7 and info["world_size"] == 1 and info["metadata"] == b"rng\0state"
    assert ckpt.steps(tmp_path) == [7]
    assert (tmp_path / "latest").read_text() == "7\n"
    # numpy out: every dtype numpy has comes back as itself; bfloat16 as its raw uint16 bits.
    arrays = ckpt.load(tmp_path, as_numpy=True)
    assert arrays["np.f32"].dtype == np.float32 and np.array_equal(arrays["np.f32"], state["np.f32"])
    assert arrays["emb"].dtype == np.uint16
    assert np.array_equal(arrays["emb"], state["emb"].view(torch.int16).numpy().view(np.uint16))
    assert arrays["step"].shape == () and arrays["step"] == 7
    # The loaded tensors are ordinary tensors the caller owns.
    loaded["linear.weight"].add_(1)
    assert same(ckpt.load(tmp_path)["linear.weight"], state["linear.weight"])


def test_ranks_steps_and_retention(tmp_path):
    for step in range(1, 6):
        ckpt.save(make_state(step), tmp_path, step=step, rank=0, world_size=2, keep=2)
        # Rank 1 of `step` is missing: only the earlier steps (the newest two) are complete.
        assert ckpt.steps(tmp_path) == [s for s in (step - 1, step - 2) if s >= 1]
        ckpt.save(make_state(step + 100), tmp_path, step=step, rank=1, world_size=2, keep=2)
    assert ckpt.steps(tmp_path) == [5, 4]
    assert_state(ckpt.load(tmp_path, rank=1), make_state(105))
    assert_state(ckpt.load(tmp_path, rank=0, step=4), make_state(4))
    with pytest.raises(ckpt.CheckpointNotFoundError, match="rank 2 is not one of them"):
        ckpt.load(tmp_path, rank=2)
    with pytest.raises(TypeError, match="checkpoints hold torch tensors and numpy arrays"):
        ckpt.save({"x": [1, 2]}, tmp_path)
    assert temp_files(tmp_path) == []


def test_a_flipped_byte_on_disk_is_detected_and_the_older_checkpoint_used(tmp_path):
    ckpt.save(make_state(10, large=1 << 20), tmp_path, step=10)
    ckpt.save(make_state(20, large=1 << 20), tmp_path, step=20)
    rank_file = tmp_path / "step-00000000000000000020" / "rank-00000.tckpt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x08  # inside the large tensor
    rank_file.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="step 20: corrupt checkpoint file .* tensor 'large' checksum"):
        loaded, info = ckpt.load(tmp_path, with_metadata=True)
    assert info["step"] == 10
    assert_state(loaded, make_state(10, large=1 << 20))
    # With every candidate corrupt, the error lists why each was skipped.
    other = tmp_path / "step-00000000000000000010" / "rank-00000.tckpt"
    data = bytearray(other.read_bytes())
    data[200] ^= 1  # in the header
    other.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointNotFoundError, match="step 20: .*step 10: .*corrupt"):
        ckpt.load(tmp_path)


SAVE_IN_CHILD = """
import sys, torch, troupe.checkpoint as ckpt
try:
    ckpt.save({"w": torch.ones(1 << 20)}, sys.argv[1], step=int(sys.argv[2]))
except ckpt.CheckpointSpaceError as e:
    print("space error:", e)
    sys.exit(3)
print("saved")
"""


def test_a_full_disk_reports_an_error_and_loses_nothing_file_size_limit(tmp_path):
    ckpt.save({"w": torch.zeros(1 << 20)}, tmp_path, step=10)  # 4 MiB

    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))  # Python ignores SIGXFSZ: EFBIG

    child = run_python(SAVE_IN_CHILD, tmp_path, 20, preexec_fn=limit)
    assert child.returncode == 3, child.stdout + child.stderr
    assert "RESOURCE_EXHAUSTED" in child.stdout and "file size limit" in child.stdout
    assert ckpt.steps(tmp_path) == [10]
    assert temp_files(tmp_path) == []
    assert torch.equal(ckpt.load(tmp_path)["w"], torch.zeros(1 << 20))


FILL_SMALL_DISK = """
import sys, warnings, torch, troupe.checkpoint as ckpt
from pathlib import Path
d = sys.argv[1]
ckpt.save({"w": torch.full((1 << 20,), 10.0)}, d, step=10)        # 4 MiB of a 6 MiB filesystem
try:
    ckpt.save({"w": torch.full((1 << 20,), 20.0)}, d, step=20)
    sys.exit("the second save fit")
except ckpt.CheckpointSpaceError as e:
    print("space error:", e)
assert ckpt.steps(d) == [10], ckpt.steps(d)
assert not [p for p in Path(d).rglob("*") if ".tmp." in p.name]
assert torch.equal(ckpt.load(d)["w"], torch.full((1 << 20,), 10.0))
print("previous checkpoint intact")
"""


@needs_mount_namespace
def test_a_full_disk_reports_an_error_and_loses_nothing_small_filesystem(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    child = run_python(FILL_SMALL_DISK, d, prefix=["unshare", "-rm", "sh", "-c",
                                                    f'mount -t tmpfs -o size=6m tmpfs "{d}" && exec "$0" "$@"'])
    assert child.returncode == 0, child.stdout + child.stderr
    assert "RESOURCE_EXHAUSTED: disk full" in child.stdout
    assert "previous checkpoint intact" in child.stdout


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


LOAD_IN_CHILD = """
import sys, troupe.checkpoint as ckpt
try:
    ckpt.load(sys.argv[1])
    print("loaded")
except ckpt.CheckpointNotFoundError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("field,offset,width,value", [
    ("metaOffset wraps with metaCapacity", 56, 8, (1 << 64) - 8),
    ("tableBytes", 52, 4, 0xFFFFFFFF),
    ("metaCapacity", 64, 8, (1 << 64) - 8),
    ("imageBytes", 24, 8, 1 << 63),
])
def test_a_crafted_header_with_a_valid_checksum_is_refused_not_a_crash(tmp_path, field, offset, width, value):
    # Anyone can compute the header checksum: each size and offset must still be checked, without
    # arithmetic that wraps (a crafted tableBytes or metaOffset ended troupe.checkpoint.load by SIGSEGV).
    ckpt.save(make_state(5), tmp_path, step=5)
    rank_file = tmp_path / "step-00000000000000000005" / "rank-00000.tckpt"
    data = bytearray(rank_file.read_bytes())
    data[offset:offset + width] = value.to_bytes(width, "little")
    data[92:96] = crc32c(bytes(data[:92])).to_bytes(4, "little")
    rank_file.write_bytes(bytes(data))
    child = run_python(LOAD_IN_CHILD, tmp_path)
    assert child.returncode == 0, f"{field}: exit {child.returncode}\n{child.stdout}{child.stderr}"
    assert child.stdout.startswith("refused:") and "corrupt checkpoint" in child.stdout, child.stdout


def test_a_crafted_manifest_is_refused_not_converted(tmp_path):
    ckpt.save(make_state(5), tmp_path, step=5)
    manifest = tmp_path / "step-00000000000000000005" / "MANIFEST.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"bytes": ', '"bytes": -1e30, "was": ', 1))
    with pytest.raises(ckpt.CheckpointNotFoundError, match='corrupt manifest .*"bytes" is not an integer'):
        ckpt.load(tmp_path)
