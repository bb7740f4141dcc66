"""The foundation end to end: start --head, join, status, node death, stop, restart, bad input."""
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from troupe_testing import BUILD, Troupe, eventually, free_port, processes_under, run_driver, start_redis


def node_states(t):
    return {n["id"]: n for n in t.status()["nodes"]}


def test_head_join_status_death_and_stop(troupe):
    port = free_port()
    out = troupe.run("start", "--head", "--port", str(port), "--num-cpus", "2", "--resources", "ssd=1").stdout
    assert f"127.0.0.1:{port}" in out and "--token-file" in out
    troupe.run("start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1")

    status = troupe.status()
    assert set(status) >= {"nodes", "actors", "groups"}
    nodes = status["nodes"]
    assert len(nodes) == 2
    assert all(n["state"] == "ALIVE" for n in nodes)
    head = next(n for n in nodes if n["is_head"])
    worker = next(n for n in nodes if not n["is_head"])
    assert head["resources"]["CPU"] == 2 and head["resources"]["ssd"] == 1
    assert worker["resources"]["CPU"] == 1 and worker["resources"]["memory"] > 0
    for n in nodes:
        assert set(n) >= {"id", "address", "state", "pid", "resources", "used"}
        assert n["address"].startswith("127.0.0.1:")

    killed_at = time.monotonic()
    os.kill(worker["pid"], signal.SIGKILL)
    dead = eventually(lambda: node_states(troupe)[worker["id"]]["state"] == "DEAD" and node_states(troupe),
                      5, "the killed node to be shown DEAD")
    assert time.monotonic() - killed_at <= 5
    assert "heartbeat" in dead[worker["id"]]["death_reason"]
    assert dead[head["id"]]["state"] == "ALIVE"

    stopped = troupe.run("stop").stdout
    assert "Stopped" in stopped
    assert processes_under(troupe.root) == []
    # The cluster is gone: status says so in one line, quickly.
    p = troupe.run("status", check=False)
    assert p.returncode != 0 and "no running Troupe cluster" in p.stderr and p.seconds < 5


def test_status_pages_and_filters_actors_in_the_store(troupe):
    troupe.run("start", "--head", "--port", str(free_port()), "--num-cpus", "2", "--resources", "slot=1")
    code = """
import troupe
troupe.init("auto")
@troupe.remote(resources={"slot": 1})
class Holder:
    def ping(self):
        return 1
import time
def next_millisecond():  # the listing orders by creation time in ms, ties by id
    now = time.time_ns() // 1_000_000
    while time.time_ns() // 1_000_000 == now:
        pass
first = Holder.options(lifetime="detached").remote()
troupe.get(first.ping.remote())  # it holds the slot: the others stay PENDING
rest = []
for _ in range(4):
    next_millisecond()
    rest.append(Holder.options(lifetime="detached").remote())
print(" ".join(h._id for h in [first] + rest))
"""
    p = run_driver(code, env=troupe.env)
    assert p.returncode == 0, p.stderr
    ids = p.stdout.split()
    everything = troupe.status()
    assert everything["actor_counts"] == {"ALIVE": 1, "PENDING": 4} and everything["actors_matching"] == 5
    assert [a["id"] for a in everything["actors"]] == ids  # oldest first
    page = troupe.status("--limit", "2", "--offset", "1")
    assert [a["id"] for a in page["actors"]] == ids[1:3] and page["actors_matching"] == 5
    pending = troupe.status("--state", "pending", "--offset", "1", "--limit", "10")
    assert [a["id"] for a in pending["actors"]] == ids[2:] and pending["actors_matching"] == 4
    head = everything["nodes"][0]["id"]
    on_head = troupe.status("--node", head[:6])
    assert [a["id"] for a in on_head["actors"]] == ids[:1] and on_head["actor_counts"]["PENDING"] == 4
    text = troupe.run("status", "--limit", "2").stdout
    assert "Actors (2 shown of 5 matching, from 5; --limit 0 shows all: 1 ALIVE, 4 PENDING)" in text, text
    text = troupe.run("status", "--state", "PENDING").stdout
    assert "Actors (4 shown of 4 matching, from 5: 1 ALIVE, 4 PENDING)" in text, text
    bad = troupe.run("status", "--state", "SLEEPING", check=False)
    assert bad.returncode != 0 and "--state" in bad.stderr


def test_stop_also_ends_a_daemon_no_pid_file_names(troupe):
    troupe.run("start", "--head", "--port", str(free_port()))
    run_dir = str(troupe.run_dir())
    # As a controller the supervisor started in the same moment as restart-controller did.
    stray = subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(120)", "--run-dir", run_dir],
                             start_new_session=True)
    try:
        out = troupe.run("stop").stdout
        assert f"(pid {stray.pid}), which no pid file named" in out, out
        assert stray.wait(timeout=10) is not None
    finally:
        if stray.poll() is None:
            stray.kill()


def test_workers_temporary_files_live_in_the_run_and_stop_removes_them(troupe):
    # A killed worker cannot remove its temporary files (a text dataloader's token file was left
    # in /tmp by every group): workers get TMPDIR in the run directory, which stop removes.
    troupe.run("start", "--head", "--port", str(free_port()), "--num-cpus", "1")
    code = """
import os, tempfile, troupe
troupe.init("auto")
@troupe.remote(num_cpus=1)
class Scratch:
    def make(self):
        fd, path = tempfile.mkstemp(prefix="scratch-")
        os.close(fd)
        return path
print(troupe.get(Scratch.remote().make.remote()))
"""
    p = run_driver(code, env=troupe.env)
    assert p.returncode == 0, p.stderr
    path = p.stdout.split()[-1]
    tmp = troupe.run_dir() / "tmp"
    assert os.path.dirname(path) == str(tmp) and os.path.exists(path), path
    assert os.stat(tmp).st_mode & 0o777 == 0o700
    troupe.run("stop")
    assert not os.path.exists(tmp)


def test_controller_kill9_and_restart_keeps_the_nodes(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port))
    troupe.run("start", "--address", f"127.0.0.1:{port}")
    before = node_states(troupe)
    os.kill(troupe.pid_of("controller"), signal.SIGKILL)
    p = troupe.run("status", check=False)
    assert p.returncode != 0 and "cannot connect" in p.stderr
    out = troupe.run("restart-controller").stdout
    assert "2 node(s) recovered" in out
    after = node_states(troupe)
    assert after.keys() == before.keys()
    for node_id, n in after.items():
        assert n["state"] == "ALIVE"
        assert n["registered_ms"] == before[node_id]["registered_ms"], "a node registered again"


def test_unauthenticated_rpc_and_redis_are_refused(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port))
    # A raw connection without the token: answered 'N' and closed, nothing else.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"\x00\x00\x00\x00\x02\x00\x00\x00" + b"\x00" * 16)
        data = b""
        try:
            while chunk := s.recv(64):
                data += chunk
        except ConnectionResetError:
            pass  # closed with our unread bytes still queued: a reset is a close too
        assert data in (b"", b"N"), data
    wrong = troupe.root / "wrong-token"
    wrong.write_text("0" * 32)
    wrong.chmod(0o600)
    p = troupe.run("status", "--address", f"127.0.0.1:{port}", "--token-file", str(wrong), check=False)
    assert p.returncode != 0 and "token was rejected" in p.stderr
    # The embedded Redis refuses a client that has no password.
    redis = json.loads((troupe.run_dir() / "cluster.json").read_text())["redis_address"]
    host, rport = redis.split(":")
    with socket.create_connection((host, int(rport)), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(128).startswith(b"-NOAUTH")
    assert oct((troupe.run_dir() / "cluster.json").stat().st_mode & 0o777) == "0o600"


def one_line_error(p):
    assert p.returncode != 0
    assert p.seconds < 5
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("troupe: error:"), p.stderr
    return lines[0]


def test_bad_input_gets_one_clear_line(troupe, tmp_path):
    assert "not expected" in one_line_error(troupe.run("start", "--head", "--bogus", check=False))
    assert "exactly one" in one_line_error(troupe.run("start", check=False))
    assert "NAME=QUANTITY" in one_line_error(troupe.run("start", "--head", "--resources", "gpu", check=False))
    assert "no running Troupe cluster" in one_line_error(troupe.run("status", check=False))

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "already in use" in one_line_error(troupe.run("start", "--head", "--port", str(port), check=False))

    closed = free_port()
    err = one_line_error(troupe.run("start", "--head", "--port", str(free_port()), "--redis-address",
                                    f"127.0.0.1:{closed}", "--redis-password", "x", check=False))
    assert "cannot reach Redis" in err

    # A Redis without a password is refused.
    redis, rport = start_redis(tmp_path)
    try:
        err = one_line_error(troupe.run("start", "--head", "--port", str(free_port()), "--redis-address",
                                        f"127.0.0.1:{rport}", check=False))
        assert "without a password" in err
    finally:
        redis.kill()
        redis.wait()
    assert processes_under(troupe.root) == [], "a failed start left processes behind"


def test_block_runs_in_the_foreground_until_interrupted(troupe):
    port = free_port()
    p = subprocess.Popen([str(BUILD / "troupe"), "start", "--head", "--block", "--port", str(port)],
                         env=troupe.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The CLI says when start-up is done (readline returns at each line or at its exit).
        lines = []
        while not lines or "Running in the foreground" not in lines[-1]:
            line = p.stdout.readline()
            assert line, f"troupe start --block exited early: {''.join(lines)} {p.stderr.read()}"
            lines.append(line)
        assert troupe.status()["nodes"][0]["state"] == "ALIVE"
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert processes_under(troupe.root) == []


def test_external_redis_cluster_survives_a_new_head(troupe, tmp_path):
    """A head started with --redis-address continues the cluster already in that Redis."""
    password = "s3cret-pass"
    redis, rport = start_redis(tmp_path, password)
    try:
        port = free_port()
        args = ["start", "--head", "--port", str(port), "--redis-address", f"127.0.0.1:{rport}",
                "--redis-password", password]
        troupe.run(*args)
        first = node_states(troupe)
        troupe.run("stop")
        troupe.run(*args)
        second = node_states(troupe)
        assert set(first) < set(second)  # the old head node is still on record, now dead
        assert all(second[i]["state"] == "DEAD" for i in first)
        assert "SIGTERM" in second[next(iter(first))]["death_reason"]
    finally:
        troupe.run("stop", check=False)
        redis.kill()
        redis.wait()


def test_no_suggested_command_line_and_no_process_carries_the_token(troupe, tmp_path):
    """Issue 34 finding 8: the head's banner told users to join with `--token <token>`, which every
    local user saw in ps for the node's life. The banner names a 0600 token file instead; a join
    from another run root with --token-file works; --token still works but warns."""
    port = free_port()
    out = troupe.run("start", "--head", "--port", str(port), "--num-cpus", "1").stdout
    token = json.loads((troupe.run_dir() / "cluster.json").read_text())["token"]
    token_file = troupe.run_dir() / "token"
    assert token not in out and str(token_file) in out and "--token-file" in out, out
    assert token_file.read_text().strip() == token and token_file.stat().st_mode & 0o777 == 0o600
    elsewhere = Troupe(tmp_path / "joined")  # no cluster file of its own to take the token from
    copy = tmp_path / "copied-token"
    copy.write_text(token + "\n")
    copy.chmod(0o644)
    refused = elsewhere.run("start", "--address", f"127.0.0.1:{port}", "--token-file", str(copy), check=False)
    assert refused.returncode != 0 and "go-rwx" in refused.stderr, refused.stderr
    copy.chmod(0o600)
    joined = elsewhere.run("start", "--address", f"127.0.0.1:{port}", "--token-file", str(copy), "--num-cpus", "1")
    assert "warning" not in joined.stderr
    try:
        assert len([n for n in troupe.status()["nodes"] if n["state"] == "ALIVE"]) == 2
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    continue
                assert token.encode() not in cmdline, cmdline
        warned = troupe.run("status", "--address", f"127.0.0.1:{port}", "--token", token)
        assert "visible to every local user" in warned.stderr
    finally:
        elsewhere.run("stop", check=False)
