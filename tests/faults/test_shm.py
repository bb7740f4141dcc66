"""Checkpoint shared memory and files are private to their cluster and user (issue 14 findings 5,
6, 7): stop removes only its own cluster's segments, a segment someone else planted is refused,
persisted checkpoints are 0600 in 0700 directories. Another local user cannot hang a restore or
squat the segments' directory (issue 34 finding 5)."""
import os
import secrets
import stat
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from troupe_testing import PYTHON_PACKAGE, Troupe, free_port, import_troupe, processes_under, run_driver

troupe_pkg = import_troupe()
from troupe import checkpoint as ckpt  # noqa: E402

SHM = Path("/dev/shm")
MINE = Path(ckpt._checkpoint.default_shm_dir())  # this user's segments (TROUPE_SHM_DIR unset)


@pytest.fixture
def two_users():
    """A victim and an attacker: two fresh local users, removed afterwards with what they left."""
    names = [f"tv{secrets.token_hex(3)}", f"ta{secrets.token_hex(3)}"]
    for name in names:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    uids = [int(subprocess.run(["id", "-u", n], check=True, capture_output=True, text=True).stdout) for n in names]
    try:
        yield list(zip(names, uids))
    finally:
        for name, uid in zip(names, uids):
            subprocess.run(["pkill", "-KILL", "-u", name], check=False)
            for path in SHM.iterdir():
                try:
                    owner = path.lstat().st_uid
                except FileNotFoundError:
                    continue
                if owner == uid:
                    subprocess.run(["rm", "-rf", str(path)], check=False)
            subprocess.run(["userdel", name], check=False)


def as_user(name, code, timeout=30):
    """Runs a Python snippet with the build's troupe as another user."""
    return subprocess.run(["runuser", "-u", name, "--", "env", f"PYTHONPATH={PYTHON_PACKAGE}", "HOME=/tmp",
                           "/usr/bin/python3", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, cwd="/")


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
        assert (MINE / f"troupe_ckpt.a{tag}.n.r0").exists() and (MINE / f"troupe_ckpt.b{tag}.n.r0").exists()
        a.run("stop")
        assert not (MINE / f"troupe_ckpt.a{tag}.n.r0").exists()
        assert (MINE / f"troupe_ckpt.b{tag}.n.r0").exists(), "stopping cluster a removed cluster b's segment"
        b.run("stop")
        assert not (MINE / f"troupe_ckpt.b{tag}.n.r0").exists()
        assert unrelated.exists(), "stop removed a segment no cluster made"
    finally:
        for t in (a, b):
            t.run("stop", check=False)
        unrelated.unlink(missing_ok=True)
        for name in (f"troupe_ckpt.a{tag}.n.r0", f"troupe_ckpt.b{tag}.n.r0"):
            (MINE / name).unlink(missing_ok=True)
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


def test_a_fifo_at_a_segment_name_is_refused_at_once(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    os.mkfifo(shm / "troupe_ckpt.fifo.n.r0", 0o600)
    code = f"""
        from troupe import checkpoint as ckpt
        try:
            ckpt.FlashCheckpoint("troupe_ckpt.fifo.n.r0", shm_dir={str(shm)!r}).restore()
        except Exception as e:
            print("refused:", e)
    """
    p = run_driver(textwrap.dedent(code), timeout=30)  # before: open() waited for a writer forever
    assert p.returncode == 0 and "refused:" in p.stdout and "FIFO" in p.stdout, p.stdout + p.stderr


def test_another_user_cannot_hang_a_restore_or_take_the_segments_directory(two_users):
    (victim, victim_uid), (attacker, _) = two_users
    name = f"troupe_ckpt.g{secrets.token_hex(3)}.n.r0"
    private = SHM / f"troupe-ckpt-{victim_uid}"
    # The attacker takes every name the victim could use: the segment's name in /dev/shm (where
    # segments were made before) and the victim's directory, world-writable, with a FIFO inside.
    plant = f"""
        import os
        os.mkfifo("/dev/shm/{name}", 0o666)
        os.mkdir("{private}")
        os.chmod("{private}", 0o777)
        os.mkfifo("{private}/{name}", 0o666)
    """
    p = as_user(attacker, plant)
    assert p.returncode == 0, p.stderr
    restore = f"""
        import numpy as np
        from troupe import checkpoint as ckpt
        for what in ("restore", "save"):
            try:
                flash = ckpt.FlashCheckpoint("{name}")
                flash.restore() if what == "restore" else flash.save(1, {{"w": np.ones(4, dtype=np.float32)}})
                print(what, "worked")
            except Exception as e:
                print(what, "refused:", e)
    """
    p = as_user(victim, restore)  # before: the restore waited on the attacker's FIFO forever
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("another user made it first") == 2, p.stdout
    # Once the squatted directory is gone, the victim's segments go to its own 0700 directory,
    # whatever the attacker left in /dev/shm.
    subprocess.run(["rm", "-rf", str(private)], check=True)
    p = as_user(victim, restore.replace('("restore", "save")', '("save", "restore")'))
    assert p.returncode == 0 and p.stdout.split() == ["save", "worked", "restore", "worked"], p.stdout + p.stderr
    st = private.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == victim_uid and stat.S_IMODE(st.st_mode) == 0o700
    assert (private / name).stat().st_uid == victim_uid


def test_a_squatted_object_directory_gets_a_private_fallback(two_users):
    (victim, victim_uid), (attacker, _) = two_users
    squatted = SHM / f"troupe-objects-{victim_uid}"
    p = as_user(attacker, f"import os; os.mkdir('{squatted}'); os.chmod('{squatted}', 0o777)")
    assert p.returncode == 0, p.stderr
    code = """
        import subprocess, sys
        import numpy as np
        from troupe import _objects
        store = _objects.store()
        object_id, _ = store.put(np.arange(1 << 20, dtype=np.int64))
        assert store.get(object_id, store.host, store.pid)[12345] == 12345
        # Another process of the user finds it from its id alone.
        child = f'''
        from troupe import _objects
        s = _objects.store()
        print("other process read", s.get({object_id!r}, s.host, {store.pid})[777])
        '''
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip())
        import os, stat
        st = os.lstat(store.root)
        print("private", st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700)
        print("root", store.root)
    """
    p = as_user(victim, code)  # before: every put() failed ("must be a directory owned by uid ...")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "other process read 777" in p.stdout, p.stdout
    root = Path(p.stdout.split("root ")[-1].strip())
    assert root.parent == SHM and root.name.startswith(f"troupe-objects-{victim_uid}.")
    assert "private True" in p.stdout, p.stdout
    assert not root.exists(), "the fallback directory outlived its process"
    # Said once (the child's stderr is its own), naming what was wrong.
    assert p.stderr.count(f"the object directory {squatted} belongs to uid") == 1, p.stderr
    assert not list(squatted.iterdir()), "an object went into the squatted directory"


def test_freed_objects_give_their_memory_back_when_a_checkpoint_needs_it(tmp_path):
    tmpfs = tmp_path / "shm"
    tmpfs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(tmpfs)], check=True)
    try:
        (tmpfs / "ckpt").mkdir(mode=0o700)
        env = {"TROUPE_OBJECT_DIR": str(tmpfs / "objects"), "TROUPE_SHM_DIR": str(tmpfs / "ckpt")}
        code = """
            import os
            import numpy as np
            from troupe import _objects, checkpoint as ckpt
            store = _objects.store()
            ids = [store.put(np.ones(4 << 20, dtype=np.uint8))[0] for _ in range(8)]  # 32 of 48 MiB
            for object_id in ids:  # the last ref goes: a file of 4 MiB is a candidate for reuse
                store.ref_added(object_id)
                store.ref_dropped(object_id)
            vfs = os.statvfs(store.root)
            free = vfs.f_bavail * vfs.f_frsize
            print("kept", store.free_bytes, "free", free)
            assert store.free_bytes <= free // 2, (store.free_bytes, free)
            # 3 slots of 11 MiB: more than is free while the kept files stay.
            ckpt.FlashCheckpoint("troupe_ckpt.room.n.r0").save(1, {"w": np.ones(11 << 20, dtype=np.uint8)})
            print("saved")
            # The store goes on without the files it kept.
            object_id, _ = store.put(np.ones(4 << 20, dtype=np.uint8))
            print("put again", store.get(object_id, store.host, store.pid)[0])
        """
        p = run_driver(textwrap.dedent(code), env=env, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr  # before: 32 MiB kept, the checkpoint refused
        assert "saved" in p.stdout and "put again 1" in p.stdout, p.stdout
    finally:
        subprocess.run(["umount", "-l", str(tmpfs)], check=False)


def test_the_object_directory_of_an_agent_killed_with_minus_9_is_removed_by_the_next_agent(tmp_path):
    # A node agent killed with -9 cannot remove its /dev/shm/troupe-node-<id>; the machine's next
    # agent does (the dead one's lock is free), and leaves a live agent's directory alone.
    dead, live, next_ = Troupe(tmp_path / "dead"), Troupe(tmp_path / "live"), Troupe(tmp_path / "next")
    try:
        for t in (dead, live):
            t.run("start", "--head", "--port", str(free_port()))
        directories = {}
        for name, t in (("dead", dead), ("live", live)):
            [node] = [n for n in t.status()["nodes"] if n["is_head"]]
            directories[name] = SHM / f"troupe-node-{node['id']}"
            assert (directories[name] / ".lock").exists(), directories[name]
        for pid, _ in processes_under(dead.root):
            os.kill(pid, 9)
        assert directories["dead"].exists()  # nobody removed it: its agent died at once
        next_.run("start", "--head", "--port", str(free_port()))
        assert not directories["dead"].exists(), "the next agent left a dead agent's object directory"
        assert directories["live"].exists(), "the next agent removed a live agent's object directory"
    finally:
        for t in (dead, live, next_):
            t.run("stop", check=False)
    assert processes_under(tmp_path) == []
