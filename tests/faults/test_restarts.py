"""Faults of the cluster's own daemons: the controller and Redis die and come back, and the
nodes, sessions and actors survive them (issue 14 findings 3, 9, 10)."""
import os
import signal
import textwrap

from troupe_testing import eventually, free_port, run_driver


def node_states(t):
    return {n["id"]: n["state"] for n in t.status()["nodes"]}


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] not in "ZX"


def exit_one_actor(t):
    code = textwrap.dedent(f"""
        import os, troupe
        troupe.init(address="auto")
        @troupe.remote(num_cpus=1)
        class Quitter:
            def pid(self): return os.getpid()
            def quit(self): os._exit(3)
        a = Quitter.remote()
        print(troupe.get(a.pid.remote()))
        try:
            troupe.get(a.quit.remote())
        except Exception as e:
            print("died:", type(e).__name__)
    """)
    p = run_driver(code, env=t.env)
    assert p.returncode == 0 and "died:" in p.stdout, p.stdout + p.stderr


def test_agent_survives_restart_controller_actor_exit_and_controller_kill(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port), "--num-cpus", "2")
    troupe.run("restart-controller")
    exit_one_actor(troupe)
    agents = [n["pid"] for n in troupe.status()["nodes"]]
    os.kill(troupe.pid_of("controller"), signal.SIGKILL)
    # An exit reported to the dead controller must not take the agent down.
    troupe.run("restart-controller")
    for pid in agents:
        assert alive(pid), f"node agent {pid} died after the controller was killed"
    assert set(node_states(troupe).values()) == {"ALIVE"}
    exit_one_actor(troupe)
    for pid in agents:
        assert alive(pid)
