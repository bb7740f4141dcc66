"""Bad quantities and records cannot brick a cluster (issue 14 finding 2): NaN, inf and negative
resources are refused at every entry (CLI, RPC, Python), and a malformed record written straight
into Redis hides nothing else. Names and values are checked once, at the API's edge (issue 34
finding 13): each quirk found has its test below."""
import json
import math
import socket
import subprocess
import textwrap

from troupe_testing import PYTHON_PACKAGE, eventually, free_port, one_line_error, run_driver



def test_nan_and_inf_quantities_are_refused_everywhere(troupe):
    port = free_port()
    for bad in ("x=nan", "x=inf", "x=-1", "x=1e300"):
        assert "finite number" in one_line_error(troupe.run("start", "--head", "--resources", bad, check=False))
    assert "finite number" in one_line_error(troupe.run("start", "--head", "--num-cpus", "nan", check=False))
    troupe.run("start", "--head", "--port", str(port), "--num-cpus", "2")
    for bad in ("x=nan", "x=inf"):
        p = troupe.run("start", "--address", f"127.0.0.1:{port}", "--resources", bad, check=False)
        assert "finite number" in one_line_error(p)
    code = textwrap.dedent("""
        import math, troupe
        troupe.init(address="auto")
        @troupe.remote
        class A:
            def f(self): return 1
        for opts in ({"num_cpus": math.nan}, {"resources": {"x": math.inf}}, {"num_cpus": -1}):
            try:
                A.options(**opts).remote()
                print("accepted", opts)
            except ValueError as e:
                print("refused")
        # Past the Python check, straight to the controller's RPC: refused there too.
        rt = troupe._api.runtime()
        try:
            troupe._api.runtime_call(rt.create_actor, "py:A", "", {"CPU": math.nan}, 0, 0, False, b"", "", -1)
            print("accepted raw")
        except Exception as e:
            print("raw refused:", e)
    """)
    p = run_driver(code, env=troupe.env)
    assert p.stdout.count("refused") == 4 and "accepted" not in p.stdout, p.stdout + p.stderr
    assert "finite number" in p.stdout
    status = troupe.status()
    assert len(status["nodes"]) == 1
    assert all(math.isfinite(q) for n in status["nodes"] for q in n["resources"].values())


def test_a_malformed_record_hides_nothing(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port))
    troupe.run("start", "--address", f"127.0.0.1:{port}")
    cluster = json.loads((troupe.run_dir() / "cluster.json").read_text())
    host, rport = cluster["redis_address"].split(":")
    # A node record whose resources are not numbers, as a bug or another writer could leave it.
    redis = ["redis-cli", "-h", host, "-p", rport, "--no-auth-warning", "-a", cluster["redis_password"]]
    subprocess.run(redis + ["HSET", "troupe:default:node:00000000deadbeef", "id", "00000000deadbeef", "state", "ALIVE",
                            "total", '{"CPU": null}', "used", "{}", "labels", "{}", "pid", "x"], check=True,
                   capture_output=True)
    subprocess.run(redis + ["ZADD", "troupe:default:nodes", "1", "00000000deadbeef"], check=True, capture_output=True)
    listed = subprocess.run(redis + ["ZRANGE", "troupe:default:nodes", "0", "-1"], check=True, capture_output=True,
                            text=True).stdout.split()
    assert len(listed) == 3 and "00000000deadbeef" in listed  # the bad record sits among the real ones
    nodes = troupe.status()["nodes"]
    assert len(nodes) == 2 and all(n["state"] == "ALIVE" for n in nodes)
    out = troupe.run("restart-controller").stdout
    assert "2 node(s) recovered" in out


# ---- Names and values are checked once, at the API's edge (issue 34 finding 13) ----

def start_head(troupe):
    troupe.run("start", "--head", "--port", str(free_port()), "--num-cpus", "2")


def driver_lines(troupe, code):
    p = run_driver(textwrap.dedent(code), env=troupe.env)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.splitlines()


def test_actor_names_are_printable_and_bounded(troupe):
    start_head(troupe)
    lines = driver_lines(troupe, """
        import troupe
        troupe.init("auto")
        @troupe.remote
        class A:
            def f(self): return 1
        for name in ("evil\\nDEAD_ACTOR py:Fake", "a\\0b", "abc\\u202etxt.exe", "x" * 100_000, "", "a\\x7fb",
                     "bad\\udcff"):
            try:
                A.options(name=name).remote()
                print("accepted", repr(name)[:40])
            except ValueError as e:
                print("refused:", str(e).splitlines()[0][:200])
        for namespace in ("ns\\nx", "n\\u2066s"):
            try:
                A.options(name="ok", namespace=namespace).remote()
                print("accepted namespace")
            except ValueError as e:
                print("refused:", e)
        try:
            troupe.get_actor("x\\ny")
        except ValueError as e:
            print("refused:", e)
        a = A.options(name="ok", lifetime="detached").remote()
        print("ok", troupe.get(a.f.remote()))
    """)
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 10 and not any(line.startswith("accepted") for line in lines), lines
    assert "U+000A" in refused[0] and "U+0000" in refused[1] and "U+202E" in refused[2]
    assert "100000 bytes long; at most 256" in refused[3] and "must not be empty" in refused[4]
    assert "U+007F" in refused[5] and "not UTF-8" in refused[6] and "namespace" in refused[7]
    assert lines[-1] == "ok 1"
    # Nothing forged a row: the one named actor is all `troupe status` lists.
    status = troupe.status()
    assert [a["name"].rpartition("/")[2] for a in status["actors"]] == ["ok"]
    assert "DEAD_ACTOR" not in troupe.run("status").stdout
    # The CLI checks a name with the same function before looking it up.
    assert "U+000A" in one_line_error(troupe.run("logs", "ok\nx", check=False))


def test_a_slash_in_a_name_is_refused_with_the_namespace_syntax(troupe):
    start_head(troupe)
    lines = driver_lines(troupe, """
        import troupe
        troupe.init("auto")
        @troupe.remote
        class A:
            def f(self): print("from b in a", flush=True); return 1
        for attempt in (lambda: A.options(name="a/b").remote(), lambda: troupe.get_actor("a/b")):
            try:
                attempt()
                print("accepted")
            except ValueError as e:
                print("refused:", e)
        b = A.options(name="b", namespace="a", lifetime="detached").remote()
        print("found", troupe.get(troupe.get_actor("b", namespace="a").f.remote()))
    """)
    assert lines[0].startswith("refused:") and "namespace='a', name='b'" in lines[0], lines
    assert lines[1].startswith("refused:") and "namespace='a', name='b'" in lines[1], lines
    assert lines[2] == "found 1"
    # The CLI takes "NAMESPACE/NAME" and says so when a part is wrong.
    out = troupe.run("logs", "a/b").stdout
    assert "from b in a" in out
    assert "namespace" in one_line_error(troupe.run("logs", "a\t/b", check=False))


def test_numeric_options_out_of_range_are_value_errors(troupe):
    start_head(troupe)
    lines = driver_lines(troupe, """
        import troupe
        troupe.init("auto")
        @troupe.remote
        class A:
            def f(self): return 1
        @troupe.remote
        def t(): return 1
        a = A.remote()
        for attempt in (lambda: A.options(max_restarts=2**40).remote(),
                        lambda: A.options(max_task_retries=2**31).remote(),
                        lambda: A.options(max_concurrency=2**40).remote(),
                        lambda: A.options(max_restarts=-2).remote(),
                        lambda: a.f.options(num_returns=2**40).remote(),
                        lambda: t.options(max_retries=2**40).remote()):
            try:
                attempt()
                print("accepted")
            except ValueError as e:
                print("refused:", e)
            except Exception as e:
                print("raw:", type(e).__name__, e)
    """)
    assert len(lines) == 6 and all(line.startswith("refused:") for line in lines), lines
    assert "max_restarts must be an integer in [-1, 2147483647], not 1099511627776" in lines[0]
    assert "max_concurrency must be an integer in [1, 2147483647]" in lines[2]


def test_get_and_wait_timeouts_are_none_or_finite_and_not_negative(troupe):
    start_head(troupe)
    lines = driver_lines(troupe, """
        import math, troupe
        troupe.init("auto")
        @troupe.remote
        class A:
            def f(self): return 1
        a = A.remote()
        ref = a.f.remote()
        for timeout in (-1, math.nan, math.inf, -math.inf, "1", True):
            for call in (lambda: troupe.get(ref, timeout=timeout), lambda: troupe.get([ref], timeout=timeout),
                         lambda: troupe.wait([ref], timeout=timeout)):
                try:
                    call()
                    print("accepted", timeout)
                except ValueError as e:
                    print("refused:", e)
        print("value", troupe.get(ref, timeout=30), troupe.get(ref, timeout=0))
    """)
    assert sum(line.startswith("refused:") for line in lines) == 18, lines
    assert "timeout must be None or a finite number of seconds >= 0, not nan" in "\n".join(lines)
    assert lines[-1] == "value 1 1"


def test_an_object_ref_of_another_cluster_is_refused(troupe, tmp_path):
    start_head(troupe)
    # Driver 1, on this cluster, puts an object and hands out the pickled ref; driver 2, on a
    # cluster of its own on the same machine (the same object store), must not read it.
    putter = subprocess.Popen(["/usr/bin/python3", "-c", textwrap.dedent("""
        import pickle, sys, troupe
        troupe.init("auto")
        ref = troupe.put({"secret": 42})
        print(pickle.dumps(ref).hex(), flush=True)
        sys.stdin.readline()
    """)], env=dict(troupe.env, PYTHONPATH=str(PYTHON_PACKAGE)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        pickled = putter.stdout.readline().strip()
        assert pickled
        other = dict(troupe.env, TROUPE_TEMP_DIR=str(tmp_path / "other"))
        p = run_driver(textwrap.dedent(f"""
            import pickle, troupe
            troupe.init(num_cpus=1)  # an embedded cluster of its own
            ref = pickle.loads(bytes.fromhex({pickled!r}))
            try:
                print("read", troupe.get(ref))
            except ValueError as e:
                print("refused:", e)
            troupe.shutdown()
        """), env=other, timeout=120)
        assert "refused:" in p.stdout and "another cluster" in p.stdout and "secret" not in p.stdout, \
            p.stdout + p.stderr
        # The same ref in a driver of its own cluster still reads.
        same = driver_lines(troupe, f"""
            import pickle, troupe
            troupe.init("auto")
            print("read", troupe.get(pickle.loads(bytes.fromhex({pickled!r}))))
        """)
        assert same == ["read {'secret': 42}"]
    finally:
        putter.communicate("\n", timeout=30)


def test_logs_of_an_empty_name_is_refused(troupe):
    start_head(troupe)
    driver_lines(troupe, """
        import troupe
        troupe.init("auto")
        @troupe.remote
        class A:
            def f(self): print("unnamed actor's output", flush=True); return 1
        a = A.options(lifetime="detached").remote()
        troupe.get(a.f.remote())
    """)
    p = troupe.run("logs", "", check=False)
    assert p.returncode == 2 and "unnamed actor's output" not in p.stdout
    assert "name an actor" in one_line_error(p)


def test_binding_an_address_the_machine_lacks_says_so(troupe):
    p = troupe.run("start", "--head", "--port", str(free_port()), "--node-ip-address", "8.8.8.8", check=False)
    line = one_line_error(p)
    assert "8.8.8.8 is not an address of this machine (EADDRNOTAVAIL)" in line and "in use" not in line
    # A port that is taken is still reported as such.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert "already in use" in one_line_error(troupe.run("start", "--head", "--port", str(taken), check=False))


def test_status_prints_every_record_as_one_line_whatever_its_text(troupe):
    """An actor's death reason carries the last lines of its stderr, which the actor writes: a
    newline, a carriage return or a bidi override there once forged rows of `troupe status`.
    Printed records are escaped by one function (displayText), checked names or not."""
    start_head(troupe)
    forged = "ffffffffffffffff  Echo      forged            -                 1       ALIVE      0"
    lines = driver_lines(troupe, f"""
        import os, sys, troupe
        troupe.init("auto")
        @troupe.remote(max_restarts=0)
        class Victim:
            def die(self):
                sys.stderr.write("boom\\n{forged}\\r\\u202eevil\\n")
                sys.stderr.flush()
                os._exit(3)
        v = Victim.options(name="victim", lifetime="detached").remote()
        try:
            troupe.get(v.die.remote(), timeout=60)
        except troupe.exceptions.ActorDiedError as e:
            print("died")
    """)
    assert lines[-1] == "died", lines
    out = eventually(lambda: (lambda s: s if "\\u{202E}evil" in s else None)(troupe.run("status").stdout),
                     30, "the death reason with its stderr in troupe status")
    assert not any(line.startswith("ffffffffffffffff") for line in out.splitlines()), out
    assert "\u202e" not in out and "\r" not in out
    row = next(line for line in out.splitlines() if "/victim " in line)
    assert forged in row and row.endswith("\\u{000D}\\u{202E}evil"), row
