"""Actor logs are bounded (issue 14 finding 11): a chatty worker's log is rotated at the per-file
cap, and `troupe logs` still shows its latest lines."""
import textwrap

from troupe_testing import eventually, free_port, run_driver


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
