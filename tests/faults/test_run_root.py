"""The run root holds the cluster's secrets (issue 14 findings 4 and 13): a root or a `latest`
link another user controls is refused, and a failed start leaves `latest` where it was."""
import os
import subprocess

from troupe_testing import BUILD, Troupe, free_port, one_line_error



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
