"""Bad quantities and records cannot brick a cluster (issue 14 finding 2): NaN, inf and negative
resources are refused at every entry (CLI, RPC, Python), and a malformed record written straight
into Redis hides nothing else."""
import json
import math
import subprocess
import textwrap

from troupe_testing import free_port, one_line_error, run_driver



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
        rt = troupe._api._runtime()
        try:
            troupe._api._call(rt.create_actor, "py:A", "", {"CPU": math.nan}, 0, 0, False, b"", "", -1)
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
