"""A multi-node Troupe cluster on one machine, for testing code that spans nodes (placement by
resources, a node dying) without several machines; modelled on Ray's ray.cluster_utils.Cluster.

    from troupe.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    node = cluster.add_node(num_cpus=2, resources={"gpu_slot": 1})
    cluster.wait_for_nodes()
    troupe.init(cluster.address, token=cluster.token)   # or cluster.connect()
    ...
    cluster.remove_node(node)                  # SIGTERM its agent; allow_graceful=False: SIGKILL
    cluster.shutdown()                         # `troupe stop`; nothing is left running

Every node is a real `troupe-node` agent started by the real `troupe` CLI, all on 127.0.0.1 and
sharing one run directory under the cluster's private TROUPE_TEMP_DIR, so a cluster never sees
or stops another one (the user's own /tmp/troupe-<uid> included). Nodes differ only in the
resources they offer: to pin an actor to a node, give that node a custom resource and ask for it
(`@troupe.remote(resources={"gpu_slot": 1})`).

A Cluster is used from one thread. A driver killed with SIGKILL leaves the daemons running:
`TROUPE_TEMP_DIR=<cluster.temp_dir> troupe stop` removes them.
"""
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from ._session import _free_port, _package_dir, _troupe_binary
from .exceptions import TroupeError
from .exceptions import ArgumentTypeError, InvalidArgumentError

_NODE_ARGS = {"num_cpus", "resources"}
_HEAD_ARGS = _NODE_ARGS | {"port", "heartbeat_ttl_ms", "cluster_name"}
_START_TIMEOUT_S = 60  # the CLI gives each daemon 10 s; this only guards against a hung CLI


class Node:
    """One node agent of a Cluster: its id in the cluster and its process."""

    def __init__(self, node_id, pid, is_head, num_cpus, resources, log_path):
        self.node_id = node_id
        self.pid = pid
        self.is_head = is_head
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})
        self.log_path = log_path

    def __repr__(self):
        return f"Node({self.node_id}, pid={self.pid}{', head' if self.is_head else ''})"


class Cluster:
    """A head and any number of added nodes on this machine, driven through the `troupe` CLI."""

    def __init__(self, initialize_head=False, connect=False, head_node_args=None, temp_dir=None,
                 shutdown_at_exit=True):
        """temp_dir: the cluster's TROUPE_TEMP_DIR; by default a fresh directory that shutdown()
        removes (a given one is kept, with its logs)."""
        self._owns_temp_dir = temp_dir is None
        self.temp_dir = tempfile.mkdtemp(prefix="troupe-cluster-") if temp_dir is None else os.path.abspath(temp_dir)
        os.makedirs(self.temp_dir, mode=0o700, exist_ok=True)
        self.head_node = None
        self.worker_nodes = []
        self.address = None
        self.token = None
        self.run_dir = None
        self._connected = False
        self._shut_down = False
        self._env = dict(os.environ, TROUPE_TEMP_DIR=self.temp_dir,
                         TROUPE_PYTHONPATH=os.path.dirname(_package_dir()))  # actors import this package
        self._env.pop("TROUPE_TOKEN", None)  # the token is passed explicitly, never picked up by accident
        self._at_exit = self.shutdown if shutdown_at_exit else None
        if self._at_exit:
            atexit.register(self._at_exit)
        try:
            if initialize_head:
                self.add_node(**(head_node_args or {}))
            if connect:
                self.connect()
        except BaseException:
            self.shutdown()
            raise

    def __repr__(self):
        return f"Cluster({self.address}, {len(self.list_all_nodes())} node(s), temp_dir={self.temp_dir})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    # ---- the CLI ----

    def _cli(self, *args, timeout=_START_TIMEOUT_S, check=True):
        # The token in the environment, never in argv (where every local user sees it).
        token = getattr(self, "token", None)
        env = dict(self._env, TROUPE_TOKEN=token) if token else self._env
        p = subprocess.run([_troupe_binary(), *args], env=env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise TroupeError(f"`troupe {' '.join(args)}` failed ({p.returncode}): "
                              f"{(p.stderr or p.stdout).strip()}")
        return p

    def status(self):
        """`troupe status --json` of this cluster, parsed: nodes, actors, groups."""
        if self.address is None:
            raise TroupeError("the cluster has no head yet: add_node() first")
        return json.loads(self._cli("status", "--json", "--address", self.address).stdout)

    # ---- nodes ----

    def add_node(self, wait=True, **node_args):
        """Starts a node agent offering node_args (num_cpus, resources) and returns its Node.
        The first node is the head (it also takes port, heartbeat_ttl_ms, cluster_name). The CLI
        returns once the node is ALIVE, so `wait` only exists for Ray compatibility."""
        if self._shut_down:
            raise TroupeError("this Cluster was shut down; make a new one")
        allowed = _NODE_ARGS if self.head_node else _HEAD_ARGS
        unknown = set(node_args) - allowed
        if unknown:
            raise ArgumentTypeError(f"unknown node argument(s) {sorted(unknown)} for "
                            f"{'an added node' if self.head_node else 'the head'}; known: {sorted(allowed)}")
        args = []
        if node_args.get("num_cpus") is not None:
            args += ["--num-cpus", str(node_args["num_cpus"])]
        if node_args.get("resources"):
            args += ["--resources", ",".join(f"{k}={v}" for k, v in node_args["resources"].items())]
        if self.head_node is None:
            node = self._start_head(args, node_args)
            self.head_node = node
        else:
            out = self._cli("start", "--address", self.address, *args).stdout
            node = self._node_from(out, r"^Node ([0-9a-f]+) ", False, node_args)
            self.worker_nodes.append(node)
        return node

    def _start_head(self, args, node_args):
        if node_args.get("heartbeat_ttl_ms") is not None:
            args += ["--heartbeat-ttl-ms", str(node_args["heartbeat_ttl_ms"])]
        if node_args.get("cluster_name"):
            args += ["--cluster-name", node_args["cluster_name"]]
        fixed_port = node_args.get("port")
        for attempt in range(3):  # a free port can be taken between picking and binding it
            port = fixed_port or _free_port()
            p = self._cli("start", "--head", "--port", str(port), *args, check=False)
            if p.returncode == 0:
                break
            if fixed_port or "already in use" not in p.stderr or attempt == 2:
                raise TroupeError(f"could not start the head node: {p.stderr.strip()}")
        from ._session import _read_cluster_file

        cluster = _read_cluster_file(self.temp_dir)  # the CLI's owner-and-mode checks
        self.run_dir = cluster["run_dir"]
        self.address, self.token = cluster["controller_address"], cluster["token"]
        return self._node_from(p.stdout, r"^\s*head node:\s+([0-9a-f]+)", True, node_args)

    def _node_from(self, cli_output, pattern, is_head, node_args):
        match = re.search(pattern, cli_output, re.MULTILINE)
        if not match:
            raise TroupeError(f"cannot find the node id in the output of `troupe start`: {cli_output!r}")
        node_id = match.group(1)
        with open(os.path.join(self.run_dir, "pids", f"node-{node_id}.pid")) as f:
            pid = int(f.read())
        return Node(node_id, pid, is_head, node_args.get("num_cpus"), node_args.get("resources"),
                    os.path.join(self.run_dir, "logs", f"node-{node_id}.log"))

    def remove_node(self, node, allow_graceful=True, wait=False, timeout=30):
        """Stops the node's agent (SIGTERM; SIGKILL unless allow_graceful), and with it its actors'
        workers. A graceful stop is DEAD at once; a killed one once its heartbeat TTL expires:
        wait=True waits (up to timeout s) until the controller shows it DEAD."""
        if node is self.head_node:
            self.head_node = None
        elif node in self.worker_nodes:
            self.worker_nodes.remove(node)
        else:
            raise InvalidArgumentError(f"{node} is not a node of this cluster")
        if self._owns(node.pid):
            os.kill(node.pid, signal.SIGTERM if allow_graceful else signal.SIGKILL)
            # Not _owns: an exiting process loses its command line and directory before it ends.
            self._wait_until(lambda: _exited(node.pid), timeout, f"{node} to exit")
        if wait:
            self._wait_until(lambda: self._node_states().get(node.node_id, ("DEAD", ""))[0] == "DEAD", timeout,
                             f"the controller to show {node} DEAD")

    def list_all_nodes(self):
        """The head (unless removed) and the added nodes not removed."""
        return ([self.head_node] if self.head_node else []) + list(self.worker_nodes)

    def wait_for_nodes(self, timeout=30):
        """Returns once every node of list_all_nodes() is ALIVE in the controller's view; raises
        TimeoutError naming the nodes that are not, with their state and log, after timeout s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                states = self._node_states()
                error = None
            except TroupeError as e:  # the controller may be restarting: keep asking until the deadline
                states, error = {}, e
            missing = [n for n in self.list_all_nodes() if states.get(n.node_id, ("",))[0] != "ALIVE"]
            if not missing:
                return
            if time.monotonic() > deadline:
                details = "; ".join(f"{n.node_id}: {states.get(n.node_id, ('not registered', ''))[0]} "
                                    f"{states.get(n.node_id, ('', ''))[1]} (log: {n.log_path})".rstrip()
                                    for n in missing)
                raise TimeoutError(f"after {timeout} s, {len(missing)} node(s) are not ALIVE: {details}"
                                   + (f"; last status error: {error}" if error else ""))
            time.sleep(0.05)

    def _node_states(self):
        return {n["id"]: (n["state"], n.get("death_reason", "")) for n in self.status()["nodes"]}

    # ---- drivers ----

    def connect(self, **init_kwargs):
        """troupe.init() against this cluster; shutdown() disconnects it again."""
        from . import _api

        if self.address is None:
            raise TroupeError("the cluster has no head yet: add_node() first")
        _api.init(self.address, token=self.token, **init_kwargs)
        self._connected = True

    # ---- teardown ----

    def shutdown(self, timeout=30):
        """Disconnects a driver connect() made, runs `troupe stop` for this cluster's TROUPE_TEMP_DIR,
        and waits until no process of the cluster (agents, workers, controller, Redis) is left.
        Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._at_exit:
            atexit.unregister(self._at_exit)
        from . import _api

        if self._connected and _api.is_initialized():
            _api.shutdown()
        self._connected = False
        self._cli("stop", timeout=timeout + 30, check=False)
        try:
            # Workers die with their agent (PDEATHSIG), an instant after `troupe stop` returns.
            self._wait_until(lambda: not _processes_under(self.temp_dir), timeout, "the cluster's processes to exit")
        except TimeoutError:
            for pid in _processes_under(self.temp_dir):
                os.kill(pid, signal.SIGKILL)
            self._wait_until(lambda: not _processes_under(self.temp_dir), 10, "the cluster's processes to die")
        finally:
            self.head_node, self.worker_nodes = None, []
            if self._owns_temp_dir:
                shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _owns(self, pid):
        """True while pid is a live process of this cluster (never a recycled pid)."""
        return pid in _processes_under(self.temp_dir)

    @staticmethod
    def _wait_until(condition, timeout, what):
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.02)


def _ancestors():
    """This process and its parents: a driver whose working directory is in the cluster's
    temp_dir must not count as one of the cluster's processes."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            pid = int(stat[stat.rfind(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _exited(pid):
    """True once pid has ended (a zombie has ended; only its exit status waits to be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def _processes_under(root):
    """Live processes whose command line or working directory names root (daemons name their run
    directory in argv; redis-server runs in it)."""
    found = []
    root = str(root)
    mine = _ancestors()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            if stat[stat.rfind(")") + 2] in "ZX":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except (OSError, IndexError):
            continue
        if root in cmd or cwd.startswith(root):
            found.append(int(entry))
    return found
