"""Driver sessions outlive a controller restart (issue 14 finding 10): an attached driver goes on
without noticing, and the actors of a driver that died meanwhile are reclaimed."""
import os
import signal
import subprocess
import textwrap

from troupe_testing import PYTHON_PACKAGE, eventually, free_port, run_driver

DRIVER = textwrap.dedent("""
    import os, sys, troupe
    troupe.init(address="auto")
    @troupe.remote(num_cpus=1)
    class Counter:
        def __init__(self): self.n = 0
        def add(self): self.n += 1; return self.n
        def pid(self): return os.getpid()
    c = Counter.remote()
    print("actor", troupe.get(c.pid.remote()), flush=True)
    for line in sys.stdin:
        if line.strip() == "call":
            print("n", troupe.get(c.add.remote()), flush=True)
        elif line.strip() == "new":
            d = Counter.remote()
            print("new", troupe.get(d.add.remote()), flush=True)
""")


class Driver:
    def __init__(self, env):
        self.p = subprocess.Popen(["/usr/bin/python3", "-c", DRIVER], env=dict(env, PYTHONPATH=str(PYTHON_PACKAGE)),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.actor_pid = int(self.expect("actor"))

    def expect(self, word):
        line = self.p.stdout.readline()
        assert line.startswith(word), f"driver said {line!r}; stderr: {self.p.stderr.read() if not line else ''}"
        return line.split()[1]

    def ask(self, command, word):
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()
        return int(self.expect(word))


def alive_actors(t):
    """The worker pids of the ALIVE actors (a DEAD actor shows no pid)."""
    return {a["pid"] for a in t.status()["actors"] if a["state"] == "ALIVE"}


def test_sessions_survive_a_controller_restart_and_dead_drivers_lose_their_actors(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port), "--num-cpus", "4")
    staying, leaving = Driver(troupe.env), Driver(troupe.env)
    assert staying.ask("call", "n") == 1
    try:
        old = troupe.pid_of("controller")
        os.kill(old, signal.SIGKILL)
        leaving.p.kill()  # dies while no controller runs: nobody will resume its session
        leaving.p.wait()
        # The attached driver goes on as if nothing happened, once the head restarted its controller.
        assert staying.ask("call", "n") == 2
        assert staying.ask("new", "new") == 1
        # The dead driver's actor is reclaimed after the restarted controller's grace period ...
        eventually(lambda: leaving.actor_pid not in alive_actors(troupe), 30, "the dead driver's actor to end")
        assert any("owner" in a["death_reason"] for a in troupe.status()["actors"] if a["state"] == "DEAD")
        # ... and the live driver's actor, whose session was resumed, is untouched.
        assert staying.actor_pid in alive_actors(troupe)
        assert staying.ask("call", "n") == 3
    finally:
        staying.p.kill()
        staying.p.wait()
    # A driver that goes away ends its session at once, as before.
    eventually(lambda: staying.actor_pid not in alive_actors(troupe), 10, "the second driver's actor to end")


SHUTDOWN_WHILE_RESOLVING = textwrap.dedent("""
    import troupe
    troupe.init(num_cpus=1)
    @troupe.remote(num_cpus=1)
    class Slow:
        def __init__(self):
            import time; time.sleep(60)
        def f(self): return 1
    handles = [Slow.remote() for _ in range(20)]  # one starts slowly, the others wait for the CPU
    refs = [h.f.remote() for h in handles]  # each call waits for its actor's address
    del refs, handles
    troupe.shutdown()
    print("clean exit")
""")


def test_shutdown_while_calls_wait_for_their_actors_exits_cleanly():
    # The last reference to an actor's connection used to go from inside its own pending address
    # lookup, which KJ aborts on: SIGABRT at shutdown in about half the runs.
    for _ in range(3):
        p = run_driver(SHUTDOWN_WHILE_RESOLVING)
        assert p.returncode == 0 and p.stdout.strip() == "clean exit", (p.returncode, p.stderr[-2000:])
