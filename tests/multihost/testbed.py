"""Several "hosts" on one Linux machine: one network namespace per host, joined by a bridge.

Why: multi-host behaviour (a node on another machine, a partition, a host that cannot reach the
head's loopback) cannot be tested with every process on 127.0.0.1. A namespace has its own
loopback, interfaces and routes, so a process inside host A truly cannot reach 127.0.0.1 of
host B, and taking a host's link down partitions it while its processes keep running.

    with Testbed(3) as bed:
        head = bed.hosts[0]
        head.troupe("start", "--head", "--node-ip-address", head.address, "--port", "6380")
        bed.hosts[1].run(["python3", "-c", "..."])
        bed.hosts[1].cut(); bed.hosts[1].heal()

Needs root and iproute2 (`Testbed.available()` says why not). Only addresses the bed assigned
itself are used (a /24 in 10.231-250.x.0 that nothing on the machine routes); the bridge has no
address unless root_address=True, and no route leads out of it, so no traffic leaves the bed.

/dev/shm is shared by every namespace (the mount namespace is the machine's), and the names
of Troupe's segments (troupe_*) do not say which host made them, so close() leaves /dev/shm
alone: `troupe stop` inside a host removes them, as it does on a real machine.

Concurrent beds (other tests, other engineers, `scripts/testbed`) never collide: names carry a
random suffix, and each subnet is claimed by an exclusively created file under STATE_DIR.
"""
import atexit
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("TROUPE_BUILD_DIR", REPO / "build")).resolve()
STATE_DIR = Path(os.environ.get("TROUPE_TESTBED_STATE_DIR", "/run/troupe-testbed"))

# Second octet range of the candidate subnets 10.<a>.<b>.0/24.
_FIRST_A, _LAST_A = 231, 250
_ROOT_HOST = 254  # the bridge's own address with root_address=True
_MAX_HOSTS = 253
_MAX_PREFIX = 5  # prefix + 6 hex + "v" + 3 digits fits IFNAMSIZ (15)
_KILL_DEADLINE_S = 10.0

_open_beds = weakref.WeakSet()


class CommandError(subprocess.CalledProcessError):
    """A failed command inside a host; unlike CalledProcessError, its message shows stderr."""

    def __init__(self, where, returncode, cmd, output, stderr):
        super().__init__(returncode, cmd, output, stderr)
        self.where = where

    def __str__(self):
        tail = (self.stderr or self.output or "").strip()[-2000:]
        return f"{self.where}: {' '.join(map(str, self.cmd))} exited {self.returncode}: {tail}"


def _ip(*args, check=True, timeout=30):
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise CommandError("root namespace", p.returncode, ["ip", *args], p.stdout, p.stderr)
    return p


def _link_exists(name):
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def _netns_names():
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _netns_pids(ns):
    p = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _alive(pid):
    """True while pid exists and is not a zombie (a zombie in a namespace holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _networks_in_use():
    """Every IPv4 network the root namespace has an address in or a route to (default excluded)."""
    nets = []
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        fields = line.split()
        if fields and fields[0] in ("local", "broadcast", "unicast", "multicast", "anycast", "blackhole",
                                    "unreachable", "prohibit", "throw"):
            fields = fields[1:]
        if not fields or fields[0] == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(fields[0], strict=False))
        except ValueError:
            continue
    return nets


class Host:
    """One namespace of a Testbed: its address, private run root, and ways to run things in it."""

    def __init__(self, bed, index, netns, veth, address, root):
        self.bed = bed
        self.index = index
        self.netns = netns
        self.veth = veth  # the bridge side, in the root namespace; the namespace side is eth0
        self.address = address
        self.root = Path(root)
        # Overrides merged over os.environ: each host keeps its own run directories, as a machine would.
        self.env = {"TROUPE_TEMP_DIR": str(self.root / "troupe")}
        self.is_cut = False

    def __repr__(self):
        return f"Host({self.index}, {self.netns}, {self.address})"

    def _env(self, env):
        merged = dict(os.environ)
        merged.pop("TROUPE_TOKEN", None)  # a token from the caller's shell must not leak into a host
        merged.update(self.env)
        merged.update(env or {})
        return merged

    def _argv(self, argv):
        if isinstance(argv, (str, bytes)):
            raise TypeError("pass argv as a list (use ['sh', '-c', script] for a shell line)")
        return ["ip", "netns", "exec", self.netns, *map(str, argv)]

    def run(self, argv, env=None, timeout=60, check=False, input=None, cwd=None):
        """subprocess.run inside the namespace, output captured as text."""
        p = subprocess.run(self._argv(argv), env=self._env(env), capture_output=True, text=True, timeout=timeout,
                           input=input, cwd=cwd)
        if check and p.returncode != 0:
            raise CommandError(repr(self), p.returncode, list(argv), p.stdout, p.stderr)
        return p

    def popen(self, argv, env=None, **kwargs):
        """subprocess.Popen inside the namespace; close() kills it with everything else in the namespace."""
        proc = subprocess.Popen(self._argv(argv), env=self._env(env), **kwargs)
        self.bed._procs.append(proc)
        return proc

    def troupe(self, *args, env=None, timeout=60, check=True):
        """The build's `troupe` CLI inside the namespace, with this host's TROUPE_TEMP_DIR."""
        return self.run([str(BUILD / "troupe"), *args], env=env, timeout=timeout, check=check)

    def pids(self):
        """Live processes in this host's namespace."""
        return [pid for pid in _netns_pids(self.netns) if _alive(pid)]

    def cut(self):
        """Partitions the host: its link goes down on both ends; its processes keep running."""
        _ip("link", "set", "dev", self.veth, "down")
        _ip("-n", self.netns, "link", "set", "dev", "eth0", "down")
        self.is_cut = True

    def heal(self):
        """Undoes cut(): the address stays configured while down, so only the links come back up."""
        _ip("link", "set", "dev", self.veth, "up")
        _ip("-n", self.netns, "link", "set", "dev", "eth0", "up")
        self.is_cut = False

    def limit(self, rate):
        """Caps the host's link at `rate` (tc's units, e.g. "1gbit") each way, as a NIC would: a
        token bucket on both ends of its veth."""
        for where in (["tc"], ["ip", "netns", "exec", self.netns, "tc"]):
            dev = self.veth if len(where) == 1 else "eth0"
            p = subprocess.run([*where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb",
                                "latency", "50ms"], capture_output=True, text=True, timeout=30)
            if p.returncode != 0:
                raise CommandError(repr(self), p.returncode, ["tc", "qdisc", "replace", dev], p.stdout, p.stderr)

    def _state(self):
        return {"index": self.index, "netns": self.netns, "veth": self.veth, "address": self.address,
                "root": str(self.root), "is_cut": self.is_cut}


class Testbed:
    """N hosts (network namespaces) on one bridge; close() always removes all of it."""

    __test__ = False  # not a pytest test class, despite the name

    @staticmethod
    def available():
        """(True, "") if beds can be built here, else (False, why) for pytest.skip."""
        if Testbed._available is None:
            Testbed._available = Testbed._probe()
        return Testbed._available

    _available = None

    @staticmethod
    def _probe():
        if os.geteuid() != 0:
            return False, "the multi-host test bed needs root (network namespaces, a bridge)"
        if shutil.which("ip") is None:
            return False, "the multi-host test bed needs iproute2's `ip` (apt-get install iproute2)"
        probe = "tbprobe" + secrets.token_hex(3)
        try:
            p = _ip("netns", "add", probe, check=False)
            if p.returncode != 0:
                return False, f"cannot create a network namespace: {p.stderr.strip()}"
            _ip("netns", "del", probe, check=False)
            p = _ip("link", "add", probe, "type", "bridge", check=False)
            if p.returncode != 0:
                return False, f"cannot create a bridge: {p.stderr.strip()}"
            _ip("link", "del", probe, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            return False, f"cannot use `ip`: {e}"
        try:
            STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            return False, f"cannot create {STATE_DIR}: {e}"
        return True, ""

    def __init__(self, n_hosts, name_prefix=None, root_address=False, persistent=False):
        """persistent=True (scripts/testbed) skips the at-exit clean-up, so the bed outlives this process."""
        prefix = name_prefix or "tb"
        if not (1 <= n_hosts <= _MAX_HOSTS):
            raise ValueError(f"n_hosts must be 1..{_MAX_HOSTS}, not {n_hosts}")
        if len(prefix) > _MAX_PREFIX or not prefix.isalnum():
            raise ValueError(f"name_prefix must be 1..{_MAX_PREFIX} letters or digits (interface names are "
                             f"at most 15 characters), not {prefix!r}")
        self.tag = prefix + secrets.token_hex(3)
        self.bridge = self.tag + "br"
        self.hosts = []
        self.root_address = None
        self.persistent = persistent
        self._procs = []
        self._netns = []  # what this bed created, and so may delete
        self._links = []
        self._claim = None
        self._closed = False
        if not persistent:
            _open_beds.add(self)
        try:
            self._build(n_hosts, root_address)
        except BaseException:
            self.close()
            raise

    def _build(self, n_hosts, root_address):
        ok, why = Testbed.available()
        if not ok:
            raise RuntimeError(why)
        if self.bridge in _netns_names() or _link_exists(self.bridge):
            raise RuntimeError(f"name clash on {self.bridge}; try again")
        self.subnet = self._claim_subnet()
        addrs = list(self.subnet.hosts())  # .1 .. .254
        _ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        self._save_claim()
        # No IPv6 link-local addresses: nothing on the bed speaks but what the tests start.
        _ip("link", "set", "dev", self.bridge, "addrgenmode", "none")
        _ip("link", "set", "dev", self.bridge, "up")
        if root_address:
            self.root_address = str(addrs[_ROOT_HOST - 1])
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
        for i in range(n_hosts):
            netns, veth = f"{self.tag}-{i}", f"{self.tag}v{i}"
            _ip("netns", "add", netns)
            self._netns.append(netns)  # recorded only once made: a name clash must not make it ours
            self._save_claim()
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            self._links.append(veth)
            _ip("link", "set", "dev", veth, "addrgenmode", "none")
            _ip("link", "set", "dev", veth, "master", self.bridge, "up")
            address = str(addrs[i])
            _ip("-n", netns, "link", "set", "dev", "eth0", "addrgenmode", "none")
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "dev", "eth0", "up")
            _ip("-n", netns, "link", "set", "dev", "lo", "up")
            root = tempfile.mkdtemp(prefix=f"{netns}.")  # mkdtemp makes it 0700
            self.hosts.append(Host(self, i, netns, veth, address, root))
            self._save_claim()

    # ---- subnet claims ----

    def _claim_subnet(self):
        claims = STATE_DIR / "subnets"
        claims.mkdir(mode=0o700, parents=True, exist_ok=True)
        in_use = _networks_in_use()
        candidates = [(a, b) for a in range(_FIRST_A, _LAST_A + 1) for b in range(256)]
        random.shuffle(candidates)
        for a, b in candidates:
            net = ipaddress.ip_network(f"10.{a}.{b}.0/24")
            if any(net.overlaps(used) for used in in_use):
                continue
            path = claims / f"10.{a}.{b}.0"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                if not self._claim_is_stale(path):
                    continue
                path.unlink(missing_ok=True)
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    continue  # another bed took it in between
            with os.fdopen(fd, "w") as f:
                json.dump({"bridge": self.bridge, "pid": os.getpid()}, f)
            self._claim = path
            return net
        raise RuntimeError("no free /24 left in 10.231.0.0-10.250.255.0 for a test bed")

    @staticmethod
    def _claim_is_stale(path):
        """A claim is dead once its bridge is gone and the process that made it has exited
        (the bridge does not exist yet while its maker is still building)."""
        try:
            claim = json.loads(path.read_text())
        except (OSError, ValueError):
            return False  # being written right now
        pid = claim.get("pid", 0)
        return not _link_exists(claim.get("bridge", "")) and not (pid and _alive(pid))

    def _save_claim(self):
        """The whole state, rewritten after each step, so scripts/testbed can re-attach from another
        process and `scripts/testbed gc` can remove a bed whose process was killed mid-way."""
        tmp = self._claim.with_name(self._claim.name + ".tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(self.state(), f)
        os.replace(tmp, self._claim)

    # ---- state for scripts/testbed ----

    def state(self):
        return {"tag": self.tag, "bridge": self.bridge, "pid": os.getpid(), "subnet": str(self.subnet),
                "root_address": self.root_address, "persistent": self.persistent, "netns": self._netns,
                "links": self._links, "claim": str(self._claim), "hosts": [h._state() for h in self.hosts]}

    @classmethod
    def from_state(cls, state):
        """Re-attaches to a bed another process built (scripts/testbed); close() then removes it."""
        bed = cls.__new__(cls)
        bed.tag, bed.bridge = state["tag"], state["bridge"]
        bed.subnet = ipaddress.ip_network(state["subnet"])
        bed.root_address = state["root_address"]
        bed.persistent = True
        bed._procs, bed._netns, bed._links = [], list(state["netns"]), list(state["links"])
        bed._claim = Path(state["claim"])
        bed._closed = False
        bed.hosts = []
        for h in state["hosts"]:
            host = Host(bed, h["index"], h["netns"], h["veth"], h["address"], h["root"])
            host.is_cut = h.get("is_cut", False)
            bed.hosts.append(host)
        return bed

    # ---- teardown ----

    def close(self):
        """Kills every process in the bed's namespaces, then deletes the namespaces, links, run
        roots and subnet claim it made. Idempotent; safe on a half-built bed. Raises if a
        process survives SIGKILL (after removing everything else)."""
        if self._closed:
            return
        self._closed = True
        _open_beds.discard(self)
        survivors = self._kill_all()
        for proc in self._procs:  # reap our own children so none stays a zombie
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        existing = _netns_names()
        for netns in self._netns:
            if netns in existing:
                _ip("netns", "del", netns, check=False)
        for link in reversed(self._links):  # a veth went with its namespace; the bridge is last
            if _link_exists(link):
                _ip("link", "del", "dev", link, check=False)
        for host in self.hosts:
            shutil.rmtree(host.root, ignore_errors=True)
        if self._claim is not None:
            self._claim.unlink(missing_ok=True)
        if survivors:
            raise RuntimeError(f"test bed {self.tag}: processes survived SIGKILL: {survivors}")

    def _kill_all(self):
        existing = _netns_names()
        netns = [n for n in self._netns if n in existing]
        deadline = time.monotonic() + _KILL_DEADLINE_S
        while True:
            pids = [pid for n in netns for pid in _netns_pids(n) if _alive(pid)]
            if not pids:
                return []
            if time.monotonic() > deadline:
                return pids
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for proc in self._procs:
                proc.poll()  # reaps our own killed children, which would otherwise stay zombies
            time.sleep(0.01)

    def pids(self):
        """Live processes in any of the bed's namespaces."""
        return [pid for h in self.hosts for pid in h.pids()]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"Testbed({self.tag}, {self.subnet if hasattr(self, 'subnet') else '?'}, {self.hosts})"


@atexit.register
def _close_open_beds():
    """A test run that dies on an exception still leaves no namespaces behind."""
    for bed in list(_open_beds):
        try:
            bed.close()
        except Exception:
            pass


def leaked_beds():
    """Beds whose process died without close() (killed test runs), re-attached so that close()
    removes them; beds made by scripts/testbed are meant to outlive it and are not listed."""
    beds = []
    for path in sorted((STATE_DIR / "subnets").glob("10.*.0")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if state.get("persistent") or _alive(state.get("pid", 0)):
            continue
        if "hosts" not in state:  # died before its bridge existed: only the claim is left
            path.unlink(missing_ok=True)
            continue
        beds.append(Testbed.from_state(state))
    return beds
