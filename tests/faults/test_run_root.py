"""The run root holds the cluster's secrets (issue 14 findings 4 and 13): a root or a `latest`
link another user controls is refused, and a failed start leaves `latest` where it was."""
import json
import os
import socket
import subprocess

from troupe_testing import BUILD, Troupe, free_port, one_line_error, run_driver



def test_a_run_root_of_another_user_or_open_to_others_is_refused(tmp_path):
    for setup in ("other-owner", "world-writable"):
        root = tmp_path / setup
        root.mkdir()
        if setup == "other-owner":
            os.chown(root, 65534, 65534)
            root.chmod(0o755)
        else:
            root.chmod(0o777)
        t = Troupe(root)
        err = one_line_error(t.run("start", "--head", "--port", str(free_port()), check=False))
        assert ("not to you" in err) if setup == "other-owner" else ("writable by group or others" in err), err
        assert list(root.iterdir()) == [], "something was written into a run root we do not trust"


def test_a_latest_link_of_another_user_is_not_followed(troupe):
    troupe.run("start", "--head", "--port", str(free_port()))
    latest = troupe.root / "latest"
    os.lchown(latest, 65534, 65534)
    assert "not following it" in one_line_error(troupe.run("status", check=False))
    os.lchown(latest, os.geteuid(), os.getegid())
    assert troupe.run("status", check=False).returncode == 0


def test_a_failed_start_leaves_latest_on_the_running_cluster(troupe, tmp_path):
    troupe.run("start", "--head", "--port", str(free_port()))
    before = os.readlink(troupe.root / "latest")
    # A start that fails after its run directory exists: its controller cannot start.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("troupe-node", "troupe-gateway"):
        os.symlink(BUILD / name, bin_dir / name)
    broken = bin_dir / "troupe-controller"
    broken.write_text("#!/bin/sh\necho 'injected: the controller cannot start' >&2\nexit 1\n")
    broken.chmod(0o755)
    env = dict(troupe.env, TROUPE_BIN_DIR=str(bin_dir))
    p = subprocess.run([str(BUILD / "troupe"), "start", "--head", "--port", str(free_port())], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "troupe-controller" in p.stderr, p.stderr
    assert os.readlink(troupe.root / "latest") == before
    assert troupe.run("status", check=False).returncode == 0


def test_ids_are_checked_before_they_become_file_names(troupe):
    troupe.run("start", "--head", "--port", str(free_port()))
    p = subprocess.run([str(BUILD / "troupe-node"), "--run-dir", str(troupe.run_dir()), "--address", "127.0.0.1:1",
                        "--node-id", "../../../etc/x", "--token", "0" * 32], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "hex digits" in p.stderr
    assert not (troupe.root / "etc").exists()


def _plant_cluster(root, owner, attacker_port, file_mode=0o600, dir_mode=0o700):
    """A run root holding a `latest` run whose cluster.json points at attacker_port."""
    run = root / "run_20260101_000000_1"
    run.mkdir(parents=True)
    (run / "cluster.json").write_text(json.dumps({"controller_address": f"127.0.0.1:{attacker_port}",
                                                  "token": "f" * 64}))
    (run / "cluster.json").chmod(file_mode)
    run.chmod(dir_mode)
    os.symlink("run_20260101_000000_1", root / "latest")
    for p in (run / "cluster.json", run):
        os.chown(p, *owner)
    os.lchown(root / "latest", *owner)
    return run


def test_a_planted_cluster_file_is_never_followed_by_a_driver(tmp_path):
    """Finding 2 of issue 34: troupe.init("auto") followed another user's latest/cluster.json,
    ran that user's workers and unpickled their replies. Each planted variant is refused with
    the C++ check's reason, and the planted address never sees a connection."""
    attacker = socket.socket()
    attacker.bind(("127.0.0.1", 0))
    attacker.listen(8)
    attacker.setblocking(False)
    port = attacker.getsockname()[1]
    me, nobody = (os.geteuid(), os.getegid()), (65534, 65534)
    variants = {
        "foreign root": dict(root_owner=nobody, owner=nobody, why="not to you"),
        "foreign run": dict(root_owner=me, owner=nobody, why="not to you"),
        "open cluster file": dict(root_owner=me, owner=me, file_mode=0o644, why="must be yours and 0600"),
        "open run dir": dict(root_owner=me, owner=me, dir_mode=0o755, why="open to group or others"),
    }
    for name, v in variants.items():
        root = tmp_path / name.replace(" ", "-")
        root.mkdir(mode=0o755)
        _plant_cluster(root, v["owner"], port, v.get("file_mode", 0o600), v.get("dir_mode", 0o700))
        os.chown(root, *v["root_owner"])
        p = run_driver("import troupe\ntroupe.init('auto')\nprint('CONNECTED')",
                       env={"TROUPE_TEMP_DIR": str(root)}, timeout=60)
        assert p.returncode != 0 and "CONNECTED" not in p.stdout, (name, p.stdout, p.stderr)
        assert "FailedPreconditionError" in p.stderr and v["why"] in p.stderr, (name, p.stderr)
    try:
        attacker.accept()
        raise AssertionError("a driver connected to the planted cluster's address")
    except BlockingIOError:
        pass
    finally:
        attacker.close()


def test_a_fifo_in_place_of_the_cluster_file_is_refused_at_once(troupe):
    troupe.run("start", "--head", "--port", str(free_port()))
    cluster = troupe.run_dir() / "cluster.json"
    saved = cluster.read_bytes()
    cluster.unlink()
    os.mkfifo(cluster, 0o600)
    try:
        p = run_driver("import troupe\ntroupe.init('auto')", env={"TROUPE_TEMP_DIR": str(troupe.root)}, timeout=30)
        assert p.returncode != 0 and "not a regular file" in p.stderr, p.stderr
        assert "not a regular file" in one_line_error(troupe.run("status", check=False))
    finally:
        cluster.unlink()
        fd = os.open(cluster, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, saved)
        os.close(fd)


def test_the_default_run_root_is_per_user_and_the_same_in_python_and_cpp():
    p = run_driver("import troupe._core as c, troupe._api as a\nprint(c.default_run_root())\nprint(a.default_run_root())",
                   env={"TROUPE_TEMP_DIR": ""})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [f"/tmp/troupe-{os.geteuid()}"] * 2
