"""Actor logs are bounded (issue 14 finding 11): a chatty worker's log is rotated at the per-file
cap, and `troupe logs` still shows its latest lines."""
import os
import re
import subprocess
import textwrap
import time

from troupe_testing import PYTHON_PACKAGE, eventually, free_port, run_driver


def test_a_chatty_actor_has_its_log_rotated_and_logs_shows_the_tail(troupe):
    troupe.env["TROUPE_LOG_MAX_BYTES"] = str(64 * 1024)
    troupe.run("start", "--head", "--port", str(free_port()))
    code = textwrap.dedent("""
        import troupe
        troupe.init(address="auto")
        @troupe.remote
        class Chatty:
            def talk(self, n):
                for i in range(n):
                    print(f"line {i:07d} " + "x" * 90)
                return n
        c = Chatty.options(name="chatty", lifetime="detached").remote()
        print("said", troupe.get(c.talk.remote(20000)))  # about 2 MB
        troupe.get(c.talk.remote(1))
    """)
    p = run_driver(code, env=troupe.env)
    assert p.returncode == 0 and "said 20000" in p.stdout, p.stderr
    logs = troupe.run_dir() / "logs"
    out = next(f for f in logs.iterdir() if f.name.startswith("actor-") and f.name.endswith(".out"))
    eventually(lambda: out.stat().st_size <= 256 * 1024 and (logs / (out.name + ".1")).exists(), 20,
               "the agent to rotate the actor's log")
    total = sum(f.stat().st_size for f in logs.iterdir() if f.name.startswith(out.name))
    assert total < 2 * 1024 * 1024 + 256 * 1024
    tail = troupe.run("logs", "chatty").stdout
    assert "line 0000000 " in tail  # the last call's line, written after the rotation


def _actor_logs(logs):
    """{name: size} of the actor logs (current and rotated) in a logs directory."""
    sizes = {}
    for f in logs.iterdir():
        if f.name.startswith("actor-") and f.name.endswith((".out", ".err", ".1")):
            try:
                sizes[f.name] = f.stat().st_size
            except FileNotFoundError:
                pass  # rotated or dropped while we looked
    return sizes


def test_flooding_actors_stay_within_the_per_file_and_per_run_caps(troupe, tmp_path):
    """Issue 34 finding 7: with a 1 MB per-file and 4 MB per-run cap, a flooding actor's logs
    reached 1 GB (rotation copied on the agent's loop every 2 s; logs under the per-file cap were
    never deleted). Three actors flood stdout and stderr for 3 s while the logs are measured."""
    mb = 1 << 20
    troupe.env["TROUPE_LOG_MAX_BYTES"] = str(mb)
    troupe.env["TROUPE_LOG_RUN_MAX_BYTES"] = str(4 * mb)
    troupe.run("start", "--head", "--port", str(free_port()), "--num-cpus", "4")
    # The driver runs as a user's does, log_to_driver on: it follows the flood at a bounded rate
    # (and says what it dropped) while the agent keeps its caps.
    code = textwrap.dedent("""
        import os, time, troupe
        troupe.init(address="auto")
        @troupe.remote(num_cpus=1)
        class Flood:
            def flood(self, seconds):
                line = (b"y" * 1023 + b"\\n") * 64
                end, n = time.monotonic() + seconds, 0
                while time.monotonic() < end:
                    os.write(1, line)
                    os.write(2, line)
                    n += 2 * len(line)
                return n
        floods = [Flood.options(name=f"flood{i}", lifetime="detached").remote() for i in range(3)]
        print("wrote", sum(troupe.get([f.flood.remote(3.0) for f in floods])))
    """)
    logs = troupe.run_dir() / "logs"
    out_path = tmp_path / "driver.out"
    with open(out_path, "w") as out:
        driver = subprocess.Popen(["/usr/bin/python3", "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                  env={**troupe.env, "PYTHONPATH": str(PYTHON_PACKAGE)})
    largest_total, largest_file, deadline = 0, 0, time.monotonic() + 60
    try:
        while driver.poll() is None and time.monotonic() < deadline:
            sizes = _actor_logs(logs)
            largest_total = max(largest_total, sum(sizes.values()))
            largest_file = max([largest_file, *sizes.values()])
    finally:
        driver.kill()
        driver.wait()
    output = out_path.read_text()
    assert driver.returncode == 0 and "wrote" in output, output
    wrote = int(re.search(r"^wrote (\d+)$", output, re.M).group(1))
    assert "line(s) of actor output dropped" in output  # the driver said it did not print all
    assert out_path.stat().st_size < 4 * mb, out_path.stat().st_size  # its copy is bounded, not the flood
    print("wrote", wrote, "largest file", largest_file, "largest total", largest_total)
    assert wrote > 40 * mb, wrote  # a flood: ten times the run's cap (before: all of it stayed)
    eventually(lambda: sum(_actor_logs(logs).values()) <= 4 * mb, 10, "the run's actor logs to be within the run cap")
    assert largest_file <= mb + mb // 2, largest_file
    assert largest_total <= 4 * mb + 3 * mb, largest_total  # the run cap plus a write or two per file
    # The run cap empties the logs written longest ago: the latest writer's tail stays.
    assert any("yyyy" in troupe.run("logs", f"flood{i}").stdout for i in range(3))
