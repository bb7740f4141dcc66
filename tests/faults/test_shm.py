"""Checkpoint shared memory and files are private to their cluster and user (issue 14 findings 5,
6, 7): stop removes only its own cluster's segments, a segment someone else planted is refused,
persisted checkpoints are 0600 in 0700 directories."""
import os
import stat
import textwrap
from pathlib import Path

import numpy as np
import pytest

from troupe_testing import Troupe, free_port, import_troupe, processes_under, run_driver

troupe_pkg = import_troupe()
from troupe import checkpoint as ckpt  # noqa: E402

SHM = Path("/dev/shm")


def make_segment_in_a_worker(t, name):
    code = textwrap.dedent(f"""
        import numpy as np, troupe
        from troupe import checkpoint as ckpt
        troupe.init(address="auto")
        @troupe.remote
        class Saver:
            def save(self):
                ckpt.FlashCheckpoint({name!r}).save(1, {{"w": np.ones(8, dtype=np.float32)}})
                return True
        s = Saver.options(lifetime="detached").remote()
        print("saved", troupe.get(s.save.remote()))
    """)
    p = run_driver(code, env=t.env)
    assert p.returncode == 0 and "saved True" in p.stdout, p.stdout + p.stderr


def test_stop_removes_only_its_own_clusters_segments(tmp_path):
    a, b = Troupe(tmp_path / "a"), Troupe(tmp_path / "b")
    tag = os.urandom(4).hex()
    unrelated = SHM / f"troupe_unrelated_{tag}"
    unrelated.write_bytes(b"not a cluster's")
    try:
        for t in (a, b):
            t.run("start", "--head", "--port", str(free_port()))
        make_segment_in_a_worker(a, f"troupe_ckpt.a{tag}.n.r0")
        make_segment_in_a_worker(b, f"troupe_ckpt.b{tag}.n.r0")
        assert (SHM / f"troupe_ckpt.a{tag}.n.r0").exists() and (SHM / f"troupe_ckpt.b{tag}.n.r0").exists()
        a.run("stop")
        assert not (SHM / f"troupe_ckpt.a{tag}.n.r0").exists()
        assert (SHM / f"troupe_ckpt.b{tag}.n.r0").exists(), "stopping cluster a removed cluster b's segment"
        b.run("stop")
        assert not (SHM / f"troupe_ckpt.b{tag}.n.r0").exists()
        assert unrelated.exists(), "stop removed a segment no cluster made"
    finally:
        for t in (a, b):
            t.run("stop", check=False)
        unrelated.unlink(missing_ok=True)
        for name in (f"troupe_ckpt.a{tag}.n.r0", f"troupe_ckpt.b{tag}.n.r0"):
            (SHM / name).unlink(missing_ok=True)
    assert processes_under(tmp_path) == []


def test_a_segment_planted_by_another_user_is_refused(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    name = "troupe_ckpt.planted.n.r0"
    mine = ckpt.FlashCheckpoint(name, shm_dir=shm)
    mine.save(1, {"w": np.ones(4, dtype=np.float32)})
    # Someone else's copy at the same name: readable by all, owned by another user.
    planted = shm / name
    os.chown(planted, 65534, 65534)
    os.chmod(planted, 0o666)
    with pytest.raises(Exception, match="must be yours"):
        ckpt.FlashCheckpoint(name, shm_dir=shm).restore()


def test_persisted_checkpoints_are_private_by_default(tmp_path):
    disk = tmp_path / "ckpt"
    for step in (1, 2):
        ckpt.save({"w": np.ones(4, dtype=np.float32)}, str(disk), step=step)
    paths = [disk, *disk.rglob("*")]
    assert len(paths) >= 4, paths  # the directory, two steps, their files
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} has mode {oct(mode)}"
