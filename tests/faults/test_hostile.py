"""Hostile connections cannot stop a server (issue 14 findings 1 and 11): idle unauthenticated
connections from one host are capped and timed out, refusals are logged at a bounded rate."""
import os
import socket
import subprocess

from troupe_testing import eventually, free_port


def idle_connections(port, count, source="127.0.0.2"):
    """Connections from another loopback address that never say a word."""
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def test_a_host_holding_idle_connections_cannot_exhaust_the_controller(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port))
    pid = troupe.pid_of("controller")
    used = len(os.listdir(f"/proc/{pid}/fd"))
    # Room for the cap's worth of idle connections and a few real clients, not for 60 more.
    limit = used + 24
    subprocess.run(["prlimit", "--pid", str(pid), f"--nofile={limit}:{limit}"], check=True)
    socks = idle_connections(port, 60)
    try:
        # The controller closed what is over the per-source cap at once, and still serves.
        eventually(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= used + 20, 10, "the extra connections to be closed")
        for _ in range(3):
            assert troupe.run("status", check=False).returncode == 0
    finally:
        for s in socks:
            s.close()
    assert troupe.run("status", check=False).returncode == 0
    log = (troupe.run_dir() / "logs" / "controller.log").read_text()
    assert "already has 16 connections in the handshake" in log


def test_refusals_are_logged_at_a_bounded_rate(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port))
    log = troupe.run_dir() / "logs" / "controller.log"
    before = log.stat().st_size
    for _ in range(300):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\0" * 40)
            try:
                s.recv(16)
            except OSError:
                pass
    assert troupe.run("status", check=False).returncode == 0
    grown = log.stat().st_size - before
    assert grown < 4096, f"300 refused connections wrote {grown} bytes of log"
