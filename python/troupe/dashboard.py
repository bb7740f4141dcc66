"""The dashboard and Prometheus endpoint of a cluster, served by its head.

`troupe start --head` runs `python3 -m troupe.dashboard --run-dir DIR` as one of the head's
supervised daemons (restarted if it dies). It connects to the controller like a driver, reads the
cluster's state with one status call (refreshed in the background when over 0.5 s old, so many
browsers cost the controller no more than one, and no page waits for it), and serves on
127.0.0.1 (port 8265, or a free one if that is taken):

  /                      the page (plain HTML/JS/SVG, every asset served here; no internet)
  /app.js                its script
  /api/cluster           nodes, with resources used/total and death reasons; counts
  /api/actors            actors, filtered and paginated here (?state= &node= &q= &offset= &limit=)
  /api/placement_groups  placement groups
  /api/groups            training groups: step, loss curve, samples/s, world size, the step time
                         split per rank, stragglers, recoveries, events, the tuner's decisions
  /api/logs?actor=ID     the tail of an actor's stdout and stderr, from its node's agent
  /metrics               Prometheus text format (troupe_* metrics; Ray's meaning where it has one),
                         with every worker's counters read live from its node's agent

It writes its URL to DIR/dashboard.url (0600) once it listens: `troupe status` shows it. It
listens on loopback only, whatever the node's address; other machines reach it through
`ssh -L 8265:127.0.0.1:PORT`.

Access (Access below): every request must name a loopback host in its Host header (a DNS-rebound
name is refused with 403), and carry the session cookie, which only GET /login?key=LOGIN sets;
anything else gets 401. LOGIN and the cookie's value are HMAC-SHA256s of the cluster token, so
only who can read the token (the run directory is 0700) can log in, and the token itself is never
shown. The login URL is written to DIR/dashboard.login (0600) for `troupe dashboard` and the
head's start banner. /metrics also takes `Authorization: Bearer METRICS`, a third HMAC of the
token, written to DIR/dashboard.metrics-token (0600) for Prometheus's `credentials_file`.
"""
import argparse
import hashlib
import hmac
import json
import re
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, urlparse

from troupe.exceptions import InvalidArgumentError

DEFAULT_PORT = 8265
CACHE_S = 0.5
MAX_PAGE = 500
LOG_TAIL_BYTES = 16 * 1024


class ClusterView:
    """The cluster's state from the controller. A request is answered from the state in hand; one
    older than CACHE_S, or than 3 refreshes when they are slow, is refreshed in the background
    (a status call at 10k actors takes about half a second), so no page waits for the controller
    except the very first, and open pages keep the controller at most a quarter busy."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.lock = threading.Lock()
        self.at = 0.0
        self.state = None
        self.error = None
        self.refreshing = False
        self.took = 0.0  # the last refresh's time

    def get(self):
        with self.lock:
            if self.state is None:
                self._refresh()
            elif time.monotonic() - self.at > max(CACHE_S, 3 * self.took) and not self.refreshing:
                self.refreshing = True
                threading.Thread(target=self._refresh_in_background, name="troupe-dashboard-refresh",
                                 daemon=True).start()
            return self.state, self.error

    def _refresh_in_background(self):
        try:
            self._refresh()
        finally:
            self.refreshing = False

    def _refresh(self):
        started = time.monotonic()
        try:
            state, error = self.runtime.snapshot(), None
        except Exception as e:  # the controller restarting: show the last state, and why
            state, error = self.state, f"cannot read the cluster's state: {e}"
            if state is None:
                state = {"nodes": [], "actors": [], "placement_groups": [], "groups": []}
        self.state, self.error, self.at = state, error, time.monotonic()
        self.took = self.at - started


def _groups(state):
    out = []
    for g in state["groups"]:
        try:
            doc = json.loads(g["doc"]) if g["doc"] else {}
        except ValueError:
            doc = {}
        events = []
        for line in g["events"][-50:]:
            ms, _, text = line.partition(" ")
            events.append({"time_ms": int(ms) if ms.isdigit() else 0, "text": text})
        out.append({"id": g["id"], "epoch": g["epoch"], "name": doc.get("name", g["id"]),
                    "state": doc.get("state", ""), "step": doc.get("step", 0), "world_size": doc.get("world_size", 0),
                    "min_workers": doc.get("min_workers"), "max_workers": doc.get("max_workers"),
                    "loss": doc.get("loss"), "samples_per_s": doc.get("samples_per_s", 0.0),
                    "split": {k: doc.get(k) for k in ("step_s", "compute_s", "comm_s", "wait_s", "snapshot_s")},
                    "ranks": doc.get("ranks", []), "curve": doc.get("curve", []),
                    "stragglers": doc.get("stragglers", []),
                    "members_per_node": _members_per_node(doc), "recovery_count": doc.get("recovery_count", 0),
                    "recoveries": doc.get("recoveries", []), "tuner_decisions": doc.get("tuner_decisions", []),
                    "heartbeat_ms": doc.get("heartbeat_ms"), "events": events})
    return out


def _members_per_node(doc):
    counts = {}
    for node in (doc.get("trainer_nodes") or {}).values():
        counts[node] = counts.get(node, 0) + 1
    return counts


def _actors_page(state, query):
    def one(name, default=""):
        return (query.get(name) or [default])[0]

    wanted_state, node, text = one("state").upper(), one("node"), one("q").lower()
    try:
        offset = max(0, int(one("offset", "0")))
        limit = min(MAX_PAGE, max(1, int(one("limit", "100"))))
    except ValueError:
        raise InvalidArgumentError("offset and limit must be integers") from None
    rows = [a for a in state["actors"]
            if (not wanted_state or a["state"] == wanted_state) and (not node or a["node_id"].startswith(node))
            and (not text or text in a["type"].lower() or text in a["name"].lower() or a["id"].startswith(text))]
    return {"total": len(rows), "offset": offset, "limit": limit, "actors": rows[offset:offset + limit]}


# ---- Prometheus text format ----

def _label(value):
    """A label value in the text format: backslash, quote and newline escaped. Every label this
    module writes goes through it (_label_text)."""
    return str(value).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _label_text(labels):
    """`a="x",b="y"` from (name, value) pairs."""
    return ",".join(f'{k}="{_label(v)}"' for k, v in labels)


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _parse_labels(text):
    """The (name, value) pairs of label text, or None if it is not label text."""
    pairs, at = [], 0
    while at < len(text):
        if pairs:
            if text[at] != ",":
                return None
            at += 1
        m = _LABEL.match(text, at)
        if m is None:
            return None
        pairs.append((m.group(1), re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], m.group(2))))
        at = m.end()
    return pairs


class _Metrics:
    def __init__(self):
        self.lines = []

    def family(self, name, kind, help_text, samples):
        """samples: [(labels dict, value)], written only if there are any."""
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if value is None:
                continue
            text = _label_text(sorted(labels.items()))
            self.lines.append(f"{name}{{{text}}} {float(value):.17g}" if text else f"{name} {float(value):.17g}")

    def text(self):
        return "\n".join(self.lines) + "\n"


def metrics_text(state, node_samples=()):
    m = _Metrics()
    node_states = {"ALIVE": 0, "DEAD": 0}
    for n in state["nodes"]:
        node_states[n["state"]] = node_states.get(n["state"], 0) + 1
    m.family("troupe_cluster_nodes", "gauge", "Nodes by state.",
             [({"state": s}, c) for s, c in sorted(node_states.items())])
    resources = []
    for name in sorted({r for n in state["nodes"] for r in n["resources"]}):
        total = sum(n["resources"].get(name, 0.0) for n in state["nodes"] if n["state"] == "ALIVE")
        used = sum(n["used"].get(name, 0.0) for n in state["nodes"] if n["state"] == "ALIVE")
        resources += [({"name": name, "state": "USED"}, used), ({"name": name, "state": "AVAILABLE"}, total - used)]
    m.family("troupe_resources", "gauge", "Resources of the alive nodes by state (as ray_resources).", resources)
    actor_states = {s: 0 for s in ("PENDING", "ALIVE", "RESTARTING", "DEAD")}
    restarts = 0
    for a in state["actors"]:
        actor_states[a["state"]] = actor_states.get(a["state"], 0) + 1
        restarts += a["restarts"]
    m.family("troupe_actors", "gauge", "Actors by state (as ray_actors).",
             [({"state": s}, c) for s, c in sorted(actor_states.items())])
    m.family("troupe_actor_restarts", "gauge", "Restarts of the actors the cluster knows, summed.", [({}, restarts)])
    pg_states = {s: 0 for s in ("PENDING", "CREATED", "REMOVED")}
    for g in state["placement_groups"]:
        pg_states[g["state"]] = pg_states.get(g["state"], 0) + 1
    m.family("troupe_placement_groups", "gauge", "Placement groups by state (as ray_placement_groups).",
             [({"state": s}, c) for s, c in sorted(pg_states.items())])
    groups = _groups(state)
    for name, key, help_text in (("troupe_train_step", "step", "Training step reached."),
                                 ("troupe_train_loss", "loss", "Loss at the last step."),
                                 ("troupe_train_samples_per_second", "samples_per_s", "Samples per second at the last step."),
                                 ("troupe_train_world_size", "world_size", "Trainers in the group."),
                                 ("troupe_train_epoch", "epoch", "Membership epoch."),
                                 ("troupe_train_recoveries", "recovery_count", "Recoveries since the group started.")):
        m.family(name, "gauge", help_text, [({"group": g["name"]}, g[key]) for g in groups])
    split = []
    for g in groups:
        for rank in g["ranks"]:
            for phase, field in (("compute", "compute_s"), ("communication", "comm_s"), ("data_wait", "wait_s"),
                                 ("snapshot", "snapshot_s")):
                split.append(({"group": g["name"], "rank": rank.get("rank", 0), "phase": phase}, rank.get(field)))
    m.family("troupe_train_step_phase_seconds", "gauge", "The last step's time per rank and phase.", split)
    flagged = []
    for g in groups:
        slow = {s.get("rank") for s in g["stragglers"]}
        flagged += [({"group": g["name"], "rank": r.get("rank", 0)}, 1 if r.get("rank") in slow else 0)
                    for r in g["ranks"]]
    m.family("troupe_train_straggler", "gauge",
             "1 for a rank computing more than 2x the other ranks' median over the last steps.", flagged)
    for name, lines in _node_families(node_samples):
        m.lines.append(f"# HELP {name} {NODE_COUNTERS.get(name, 'A worker counter.')}")
        m.lines.append(f"# TYPE {name} {'gauge' if name in NODE_GAUGES else 'counter'}")
        m.lines += lines
    return m.text()


# The counters workers keep (troupe/runtime/metrics.h), read live from each node's agent; every
# sample is labelled with its node, actor and class. The agent adds its object store's gauges.
NODE_COUNTERS = {
    "troupe_actor_calls_total": "Calls the actor answered.",
    "troupe_actor_call_errors_total": "Calls that raised (or returned an error) in the actor.",
    "troupe_actor_call_seconds_total": "Time from a call's arrival at the actor to its reply, summed.",
    "troupe_collective_ops_total": "Collective operations finished, by operation.",
    "troupe_collective_bytes_total": "Bytes of the buffers of finished collective operations, by operation.",
    "troupe_collective_seconds_total": "Time collective operations took from start to finish, by operation.",
    "troupe_checkpoint_snapshots_total": "Flash snapshots a trainer wrote to shared memory.",
    "troupe_checkpoint_snapshot_bytes_total": "Bytes of the flash snapshots written.",
    "troupe_checkpoint_snapshot_seconds_total": "Time the flash snapshots took (the step waits for them).",
    "troupe_checkpoint_persists_total": "Snapshots a checkpoint actor persisted to the directory.",
    "troupe_checkpoint_persist_bytes_total": "Bytes persisted.",
    "troupe_checkpoint_persist_seconds_total": "Time persisting took (in the background).",
    "troupe_object_store_objects": "Objects (files) in the node's object directory.",
    "troupe_object_store_bytes": "Bytes the node's object directory holds.",
    "troupe_object_store_limit_bytes": "Bytes the node's objects may hold in memory before they spill to disk.",
    "troupe_object_store_spilled_objects": "Objects spilled to the node's spill directory.",
    "troupe_object_store_spilled_bytes": "Bytes the node's spill directory holds.",
}
# Of those, the node's own gauges (labelled with the node only).
NODE_GAUGES = frozenset(["troupe_object_store_objects", "troupe_object_store_bytes", "troupe_object_store_limit_bytes",
                         "troupe_object_store_spilled_objects", "troupe_object_store_spilled_bytes"])


def _node_families(samples):
    """[(name, [sample lines])] in name order. The node agents send label text; it is parsed and
    written again here, and a sample whose text does not parse (or whose name is not a metric
    name) is dropped: one bad worker must not break the scrape."""
    by_name = {}
    for name, labels, value in samples:
        pairs = _parse_labels(labels)
        if pairs is None or not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
            continue
        by_name.setdefault(name, []).append(f"{name}{{{_label_text(pairs)}}} {float(value):.17g}")
    return sorted(by_name.items())


# ---- Access ----

# Host header names a browser uses for this server: anything else is a DNS-rebound name (a page
# of evil.example whose name now resolves to 127.0.0.1) and is refused. Any port: an SSH tunnel
# shows the browser's local one.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def derived_secret(token, purpose):
    """A secret for `purpose` derived from the cluster token: showing it does not show the token."""
    return hmac.new(token.encode(), f"troupe dashboard {purpose}".encode(), hashlib.sha256).hexdigest()


class Access:
    """Who may read the dashboard: requests to a loopback Host that carry the session cookie (set by
    /login?key=LOGIN), and for /metrics also a bearer credential. All three secrets are derived from
    the cluster token."""

    def __init__(self, token, port):
        self.login_key = derived_secret(token, "login")
        self.session = derived_secret(token, "session")
        self.metrics_bearer = derived_secret(token, "metrics")
        # The port in the name: a browser keeps one cookie jar for 127.0.0.1 whatever the port, and
        # the dashboards of two clusters must not overwrite each other's session.
        self.cookie = f"troupe_session_{port}"

    @staticmethod
    def host_allowed(host):
        if not host:
            return False
        host = host.strip().lower()
        name = host.rsplit(":", 1)[0] if re.fullmatch(r".*:\d+", host) else host
        return name in LOOPBACK_HOSTS

    def has_session(self, headers):
        for header in headers.get_all("Cookie") or []:
            for part in header.split(";"):
                name, _, value = part.strip().partition("=")
                if name == self.cookie and hmac.compare_digest(value.encode(), self.session.encode()):
                    return True
        return False

    def has_bearer(self, headers):
        kind, _, value = (headers.get("Authorization") or "").partition(" ")
        return kind.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.metrics_bearer.encode())

    def login_ok(self, key):
        return hmac.compare_digest(key.encode(), self.login_key.encode())

    def set_cookie(self):
        return f"{self.cookie}={self.session}; Path=/; HttpOnly; SameSite=Strict"


LOGIN_HINT = "Open the URL that `troupe dashboard` prints (on the cluster's head, as the user who started it).\n"


# ---- HTTP ----

def make_handler(view, assets):
    class Handler(BaseHTTPRequestHandler):
        server_version = "troupe-dashboard"

        def log_message(self, fmt, *args):  # quiet: a page polls every second
            pass

        def send(self, code, body, content_type, headers=()):
            data = body if isinstance(body, bytes) else body.encode()
            self.send_response(code)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
            self.end_headers()
            self.wfile.write(data)

        def admitted(self, url):
            """Whether the request may go on; if not, the refusal has been sent."""
            access = self.server.access
            if not access.host_allowed(self.headers.get("Host")):
                self.send(403, "Host not allowed: open the dashboard as 127.0.0.1 or localhost\n", "text/plain")
                return False
            if url.path == "/login":
                query = parse_qs(url.query)
                if not access.login_ok((query.get("key") or [""])[0]):
                    self.send(403, "Wrong or missing login key. " + LOGIN_HINT, "text/plain")
                    return False
                target = (query.get("next") or ["/"])[0]
                if not target.startswith("/") or target.startswith("//") or "\\" in target:
                    target = "/"  # only a page of this server
                self.send(303, "", "text/plain", [("Location", target), ("Set-Cookie", access.set_cookie())])
                return False
            if access.has_session(self.headers) or (url.path == "/metrics" and access.has_bearer(self.headers)):
                return True
            self.send(401, LOGIN_HINT, "text/plain", [("WWW-Authenticate", 'Bearer realm="troupe"')])
            return False

        def do_GET(self):
            url = urlparse(self.path)
            if not self.admitted(url):
                return
            if url.path in assets:
                return self.send(200, *assets[url.path])
            state, error = view.get()
            try:
                if url.path == "/metrics":
                    try:
                        samples = view.runtime.node_metrics(
                            [n["address"] for n in state["nodes"] if n["state"] == "ALIVE"])
                    except Exception:  # the controller is away: the cluster gauges still come
                        samples = []
                    return self.send(200, metrics_text(state, samples), "text/plain; version=0.0.4; charset=utf-8")
                if url.path == "/api/cluster":
                    alive = [n for n in state["nodes"] if n["state"] == "ALIVE"]
                    body = {"nodes": state["nodes"], "alive": len(alive), "dead": len(state["nodes"]) - len(alive),
                            "actors": len(state["actors"]), "groups": len(state["groups"]), "error": error}
                elif url.path == "/api/actors":
                    body = _actors_page(state, parse_qs(url.query))
                elif url.path == "/api/placement_groups":
                    body = {"placement_groups": state["placement_groups"]}
                elif url.path == "/api/groups":
                    body = {"groups": _groups(state)}
                elif url.path == "/api/logs":
                    actor = (parse_qs(url.query).get("actor") or [""])[0]
                    if not actor or not all(c in "0123456789abcdef" for c in actor):
                        raise InvalidArgumentError("actor= must be an actor id (hex)")
                    try:
                        out, err = view.runtime.read_logs(actor, LOG_TAIL_BYTES)
                    except Exception as e:  # its node is gone, or no such actor: say so on the page
                        return self.send(404, json.dumps({"error": str(e)}), "application/json")
                    body = {"actor": actor, "stdout": out.decode(errors="replace"),
                            "stderr": err.decode(errors="replace")}
                else:
                    return self.send(404, json.dumps({"error": f"no page {url.path}"}), "application/json")
            except ValueError as e:
                return self.send(400, json.dumps({"error": str(e)}), "application/json")
            self.send(200, json.dumps(body), "application/json")

    return Handler


def _assets():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboard_assets")
    out = {}
    for name, kind in (("index.html", "text/html; charset=utf-8"), ("app.js", "text/javascript; charset=utf-8")):
        with open(os.path.join(here, name), "rb") as f:
            out["/" + name] = (f.read(), kind)
    out["/"] = out["/index.html"]
    return out


def _write_private(path, text):
    """Writes path (0600) by a rename, so a reader never sees half of it."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _listen(host, port, handler):
    try:
        return ThreadingHTTPServer((host, port), handler)
    except OSError:
        if port == 0:
            raise
        return ThreadingHTTPServer((host, 0), handler)  # the port is taken: any free one


def main(argv=None):
    parser = argparse.ArgumentParser(prog="troupe.dashboard", description="The cluster's dashboard and /metrics.")
    parser.add_argument("--run-dir", required=True, help="the head's run directory (holds cluster.json)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to try first (a free one if taken)")
    args = parser.parse_args(argv)
    from . import _core

    with open(os.path.join(args.run_dir, "cluster.json")) as f:
        cluster = json.load(f)
    runtime = _core.Runtime(cluster["controller_address"], cluster["token"])
    server = _listen("127.0.0.1", args.port, make_handler(ClusterView(runtime), _assets()))
    host, port = server.server_address[:2]
    server.access = access = Access(cluster["token"], port)  # named after the port: set before serving
    url = f"http://{host}:{port}"
    # The secrets first: `troupe start` waits for dashboard.url, then reads the login URL.
    metrics_path = os.path.join(args.run_dir, "dashboard.metrics-token")
    login_path = os.path.join(args.run_dir, "dashboard.login")
    _write_private(metrics_path, access.metrics_bearer)
    _write_private(login_path, f"{url}/login?key={quote(access.login_key)}")
    path = os.path.join(args.run_dir, "dashboard.url")
    _write_private(path, url)
    # Like the head's other daemons: a pid file that `troupe stop` and the supervisor read, and a
    # clean exit on SIGTERM.
    pid_path = os.path.join(args.run_dir, "pids", "dashboard.pid")
    with open(pid_path, "w") as f:
        f.write(f"{os.getpid()}\n")
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"troupe dashboard at {url} (pid {os.getpid()}, host {socket.gethostname()})", flush=True)
    try:
        server.serve_forever()
    finally:
        for stale in (pid_path, path, login_path, metrics_path):
            try:
                os.unlink(stale)
            except OSError:
                pass
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
