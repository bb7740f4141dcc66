"""Hostile connections cannot stop a server (issue 14 findings 1 and 11): idle unauthenticated
connections from one host are capped and timed out, refusals are logged at a bounded rate. A
hostile actor cannot wedge its node agent with FIFOs at the files the agent opens (issue 34
finding 4)."""
import os
import socket
import subprocess
import textwrap

from troupe_testing import eventually, free_port, run_driver


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


def test_an_actor_that_puts_fifos_at_its_files_cannot_wedge_its_node_agent(troupe):
    troupe.run("start", "--head", "--port", str(free_port()))
    code = textwrap.dedent("""
        import os, troupe
        from troupe import _api
        troupe.init(address="auto")

        @troupe.remote
        class Hostile:
            def plant(self):
                # The agent opens these: its counters, its output, and the args of its restart.
                metrics = os.environ["TROUPE_METRICS_FILE"]
                out = os.readlink("/proc/self/fd/1")
                args = out[:-len(".out")] + ".2.args"
                for path in (metrics, out, args):
                    if os.path.lexists(path):
                        os.unlink(path)
                    os.mkfifo(path, 0o600)
                return "planted"

            def die(self):
                os._exit(1)

            def pid(self):
                return os.getpid()

        @troupe.remote
        class Echo:
            def ping(self):
                return "pong"

        h = Hostile.options(name="hostile", max_restarts=1).remote()
        print(troupe.get(h.plant.remote(), timeout=30), flush=True)
        rt = _api.runtime()
        agents = [n["address"] for n in rt.snapshot()["nodes"] if n["state"] == "ALIVE"]
        rt.node_metrics(agents)  # the agent reads every worker's counters file
        first = troupe.get(h.pid.remote(), timeout=30)
        h.die.remote()  # its restart writes the args file it replaced
        e = Echo.remote()
        print(troupe.get(e.ping.remote(), timeout=30), flush=True)
        assert troupe.get(h.pid.remote(), timeout=30) != first  # restarted all the same
        # The agent still answers: another worker's counters come, the hostile one's are left out.
        samples = rt.node_metrics(agents)
        assert any("Echo" in labels for _, labels, _ in samples), samples
        print("done", flush=True)
    """)
    p = run_driver(code, env=troupe.env, timeout=90)
    assert p.returncode == 0 and "planted" in p.stdout and "pong" in p.stdout and "done" in p.stdout, p.stdout + p.stderr
    # The node's agent serves the CLI too: status and the hostile actor's logs return.
    logs = troupe.run("logs", "hostile", timeout=20, check=False)
    assert logs.returncode in (0, 1), logs.stderr
    assert troupe.run("status", timeout=20, check=False).returncode == 0


def test_the_object_bulk_port_serves_nobody_without_the_token():
    """A node agent's bulk port (object pulls) is a listener beside its RPC port: a client that
    cannot prove the token gets the refusal byte and nothing of any object; one speaking for
    another service (the RPC purpose) is refused at its first bytes; the agent serves on."""
    code = textwrap.dedent("""
        import os, socket, troupe
        troupe.init(num_cpus=1)
        from troupe import _api
        rt = _api.runtime()
        ref = troupe.put(b"secret-object-bytes" * 100_000)
        head = [n for n in troupe.nodes() if n["is_head"]][0]
        host = head["address"].rpartition(":")[0]
        store = rt.object_store(head["address"])
        directory, port = store["directory"], store["bulk_port"]
        assert port > 0 and store["objects"] >= 1

        def talk(hello, then=b""):
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(hello)
                got = b""
                try:
                    while len(got) < 1 << 20:
                        chunk = s.recv(65536)
                        if not chunk:
                            break
                        got += chunk
                        if then and len(got) >= 64:  # the server's nonce and proof: answer with a wrong one
                            s.sendall(then)
                            then = b""
                except (ConnectionResetError, socket.timeout):
                    pass
                return got

        # The right purpose, then a proof made without the token: 'N' after the server's own proof.
        wrong = talk(b"TRPE\x03B" + os.urandom(32), then=os.urandom(32))
        assert len(wrong) == 65 and wrong[-1:] == b"N", wrong
        # Another service's hello on this port: refused at once.
        assert talk(b"TRPE\x03R" + os.urandom(32)) == b"N"
        # A request framed as the bulk protocol, with no handshake at all: nothing comes back.
        request = (8).to_bytes(4, "little") + b"anything" + (0).to_bytes(8, "little") + (1 << 20).to_bytes(8, "little")
        assert b"secret" not in talk(request)
        # The agent still serves its directory.
        assert rt.object_store(head["address"])["objects"] >= 1
        assert troupe.get(ref)[:6] == b"secret"
        print("BULK OK")
    """)
    p = run_driver(code, timeout=90)
    assert p.returncode == 0 and "BULK OK" in p.stdout, p.stderr



def test_malformed_holds_are_refused_and_touch_nothing_outside_the_object_directory(tmp_path):
    """NodeAgent.holdObject/lendObject/releaseObject build file names from a peer's strings: each
    part is checked (an object name, a holder "<node>.<pid>", a hex token), so none of them reaches
    a path outside the node's .refs directory, and the holds of a real object still work."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    code = textwrap.dedent(f"""
        import os, troupe
        troupe.init(num_cpus=1)
        from troupe import _api
        from troupe.exceptions import InvalidArgumentError
        rt = _api.runtime()
        head = [n for n in troupe.nodes() if n["is_head"]][0]["address"]
        ref = troupe.put(b"held")
        bad = [("hold", "../../x", "1.2", ""), ("hold", ref.hex(), "../1", ""),
               ("hold", ref.hex(), "ab.1", "../../victim"), ("lend", ref.hex(), "ab.1", "zz"),
               ("release", ref.hex(), "ab.1:../x", ""), ("release", ".refs", "1", ""),
               ("release", ref.hex(), {str(victim)!r}, "")]
        for op, name, holder, extra in bad:
            try:
                rt.hold_object(head, op, name, holder, extra)
            except InvalidArgumentError:
                continue
            raise AssertionError(f"accepted {{(op, name, holder, extra)}}")
        assert open({str(victim)!r}).read() == "keep me"
        # A hold of a node that does not exist on a freed object: NOT_FOUND, as a freed object's.
        try:
            rt.hold_object(head, "hold", "1-2-abcdef01", "ab.1", "")
        except troupe.exceptions.NotFoundError:
            pass
        else:
            raise AssertionError("held an object that does not exist")
        assert troupe.get(ref) == b"held"
        print("HOLDS OK")
    """)
    p = run_driver(code, timeout=90)
    assert p.returncode == 0 and "HOLDS OK" in p.stdout, p.stderr
