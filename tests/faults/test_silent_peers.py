"""Every process's connections end on a silent peer within the cluster's heartbeat TTL (issue 34,
"No call waits on a dead host"): the TTL a head was started with reaches its daemons and every
worker, on the head's node and on a joined one, not only the default's 3 s."""
import json
import os

from troupe_testing import Troupe, free_port, run_driver

TTL_MS = 1500


def _environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)


def test_a_non_default_heartbeat_ttl_reaches_daemons_and_workers_of_every_node(troupe):
    troupe.run("start", "--head", "--port", str(free_port()), "--heartbeat-ttl-ms", str(TTL_MS),
               "--resources", "head=1")
    cluster = json.loads((troupe.run_dir() / "cluster.json").read_text())
    env = dict(troupe.env, TROUPE_TOKEN=cluster["token"])
    joined = Troupe(troupe.root)  # the same root: `troupe stop` ends both
    joined.env = env
    joined.run("start", "--address", cluster["controller_address"], "--resources", "joined=1")
    for daemon in ("controller", "gateway"):
        assert _environ(troupe.pid_of(daemon)).get(b"TROUPE_HEARTBEAT_TTL_MS") == str(TTL_MS).encode(), daemon
    p = run_driver(f"""
import os, troupe
troupe.init("auto")
@troupe.remote
class Probe:
    def ttl(self):
        return os.environ.get("TROUPE_HEARTBEAT_TTL_MS")
print([troupe.get(Probe.options(resources={{r: 1}}).remote().ttl.remote(), timeout=60) for r in ("head", "joined")])
""", env={"TROUPE_TEMP_DIR": str(troupe.root)}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str([str(TTL_MS)] * 2)
