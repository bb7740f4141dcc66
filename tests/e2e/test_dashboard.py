"""The head's dashboard and /metrics on a real cluster: the URL in `start` and `status`, the
Prometheus text parsed by a real parser, and the pages loaded by headless Chromium (Debian's
chromium, installed by scripts/setup) while a real training group trains, loses a trainer to
kill -9 and recovers. Screenshots are saved under build/ for people to look at."""
import json
import os
import re
import shutil
import subprocess
import textwrap
import http.client
import urllib.error
import urllib.parse

import pytest

from troupe_testing import BUILD, PYTHON_PACKAGE, eventually, free_port

pytestmark = pytest.mark.timeout(300)

CHROMIUM = shutil.which("chromium")
TEXT = "/usr/share/common-licenses/GPL-3"


def request(url, headers=None):
    """(status, headers, body) of a GET, redirects not followed."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", parts.path + ("?" + parts.query if parts.query else ""), headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, r.read().decode()
    finally:
        conn.close()


def parse_metrics(text):
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Dashboard:
    """The head's dashboard, logged in through the URL the start banner printed."""

    def __init__(self, login_url):
        self.login_url = login_url
        self.url = re.match(r"(http://127\.0\.0\.1:\d+)/login\?key=[0-9a-f]{64}$", login_url).group(1)
        status, headers, _ = request(login_url)
        assert status == 303 and headers["Location"] == "/"
        self.cookie = headers["Set-Cookie"].split(";")[0]
        assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]

    def fetch(self, path):
        status, _, body = request(self.url + path, {"Cookie": self.cookie})
        if status != 200:
            raise urllib.error.HTTPError(self.url + path, status, body, None, None)
        return body

    def metrics(self):
        return parse_metrics(self.fetch("/metrics"))

    def browse(self, path, screenshot=None):
        """The page's DOM after its script ran (headless Chromium, logged in by the login URL with
        next=path), and a screenshot if asked."""
        assert CHROMIUM, "chromium is missing: scripts/setup installs it"
        url = self.login_url + "&next=" + urllib.parse.quote(path, safe="")
        base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--virtual-time-budget=4000", "--window-size=1280,1400"]
        dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=60).stdout
        if screenshot:
            subprocess.run(base + [f"--screenshot={screenshot}", url], capture_output=True, timeout=60)
            assert os.path.getsize(screenshot) > 1000
        return dom


def counter(m, name, **labels):
    """The sum of a worker counter's samples whose labels include `labels` (None if none)."""
    found = [v for (n, ls), v in m.items() if n == name and labels.items() <= dict(ls).items()]
    return sum(found) if found else None


@pytest.fixture
def head(troupe):
    port = free_port()
    out = troupe.run("start", "--head", "--port", str(free_port()), "--dashboard-port", str(port)).stdout
    login = re.search(r"dashboard:\s+(\S+)", out).group(1)
    return troupe, Dashboard(login), port


def test_start_and_status_give_the_url_and_metrics_follow_the_cluster(head):
    troupe, dash, port = head
    url = dash.url
    no_group = troupe.run("timeline", check=False)
    assert no_group.returncode == 1 and "name the group with --group (groups: none)" in no_group.stderr
    assert url == f"http://127.0.0.1:{port}"
    assert f"Dashboard: {url} (log in with the URL 'troupe dashboard' prints)" in troupe.run("status").stdout
    assert troupe.run("dashboard").stdout.splitlines()[0] == dash.login_url
    assert troupe.status()["cluster"]["dashboard"] == url
    m = dash.metrics()
    assert m[("troupe_cluster_nodes", (("state", "ALIVE"),))] == 1
    assert m[("troupe_resources", (("name", "CPU"), ("state", "AVAILABLE")))] > 0
    assert m[("troupe_actors", (("state", "ALIVE"),))] == 0
    # A driver creates an actor holding a CPU: the metrics follow.
    driver = subprocess.Popen(["/usr/bin/python3", "-c",
                               textwrap.dedent("""
                                   import sys, troupe
                                   troupe.init("auto")
                                   @troupe.remote(num_cpus=1)
                                   class A:
                                       def f(self):
                                           print("hello from the actor", flush=True)
                                           return 1
                                   a = A.remote(); troupe.get(a.f.remote())
                                   print("up", flush=True); sys.stdin.readline()
                               """)],
                              env=dict(troupe.env, PYTHONPATH=str(PYTHON_PACKAGE)),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "up"
        # The dashboard reads the cluster at most every 0.5 s.
        eventually(lambda: dash.metrics()[("troupe_actors", (("state", "ALIVE"),))] == 1, 10, "the actor in /metrics")
        assert dash.metrics()[("troupe_resources", (("name", "CPU"), ("state", "USED")))] == 1
        dom = dash.browse("/?tab=actors")
        assert "py:A" in dom and "ALIVE" in dom
        actor = json.loads(dash.fetch("/api/actors?state=ALIVE"))["actors"][0]["id"]
        # Its worker's counters, read live from its node's agent, labelled with node, actor, class.
        m = dash.metrics()
        assert counter(m, "troupe_actor_calls_total", actor=actor, **{"class": "py:A"}) >= 1
        assert counter(m, "troupe_actor_call_seconds_total", actor=actor) > 0
        assert counter(m, "troupe_actor_call_errors_total", actor=actor) == 0
        node = troupe.status()["nodes"][0]["id"]
        assert counter(m, "troupe_actor_calls_total", node=node) >= 1
        assert "hello from the actor" in json.loads(dash.fetch(f"/api/logs?actor={actor}"))["stdout"]
        dom = dash.browse(f"/?tab=actors&logs={actor}")
        assert re.search(r'<pre id="log-tail">hello from the actor', dom), "the actor's output is not shown"
    finally:
        driver.communicate("\n", timeout=30)
    eventually(lambda: dash.metrics()[("troupe_actors", (("state", "ALIVE"),))] == 0, 30, "the driver's actor to end")
    page = json.loads(dash.fetch("/api/actors?state=DEAD&limit=1"))
    assert page["total"] == 1 and len(page["actors"]) == 1
    with pytest.raises(urllib.error.HTTPError):
        dash.fetch("/api/actors?limit=x")
    dom = dash.browse("/", screenshot=str(BUILD / "dashboard-cluster.png"))
    assert "1 node(s) alive, 0 dead" in dom


@pytest.mark.skipif(not os.path.exists(os.path.join(BUILD, "troupe-worker-torch")), reason="built without LibTorch")
def test_a_training_group_is_shown_live_with_its_recovery(head, tmp_path):
    troupe, dash, _ = head
    stop = tmp_path / "stop"
    code = textwrap.dedent(f"""
        import os, troupe
        from troupe.train import ElasticTrainer
        troupe.init("auto")  # log_to_driver on, as a user's: the trainers' output goes to the driver's log
        t = ElasticTrainer(model="tinylm", data={TEXT!r}, optimizer={{"name": "adamw", "lr": 3e-3}},
                           global_batch_size=8, max_micro_batch=4, min_workers=1, max_workers=2, context=32,
                           steps_per_call=3, progress=False, seed=7,
                           checkpoint={{"snapshot_every": 1, "dir": {str(tmp_path / "ckpt")!r}, "persist_every": 3}},
                           name="dash", _fault={{"rank": 1, "kill_at_step": 12}})
        while not os.path.exists({str(stop)!r}) and t.step < 600:
            t.fit(3)
        t.close()
    """)
    # Its output goes to a file, read at the end: a pipe nobody reads meanwhile would fill with the
    # trainers' followed output and block the driver.
    log = open(tmp_path / "driver.log", "w+")
    driver = subprocess.Popen(["/usr/bin/python3", "-c", code], env=dict(troupe.env, PYTHONPATH=str(PYTHON_PACKAGE)),
                              stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        def group():
            groups = json.loads(dash.fetch("/api/groups"))["groups"]
            return groups[0] if groups else None

        eventually(lambda: (group() or {}).get("step", 0) >= 3, 120, "the group to train its first steps")
        first = int(re.search(r'class="group-step">step (\d+)', dash.browse("/?tab=training")).group(1))
        eventually(lambda: group()["step"] > first, 60, "the group to train on")
        dom = dash.browse("/?tab=training")
        second = int(re.search(r'class="group-step">step (\d+)', dom).group(1))
        assert second > first  # the page shows the step advancing between two loads
        eventually(lambda: group()["recovery_count"] >= 1, 120, "the killed trainer's recovery")
        dom = dash.browse("/?tab=training", screenshot=str(BUILD / "dashboard-training.png"))
        assert "recovered in" in dom and "signal 9" in dom  # the event, with why the trainer died
        assert re.search(r'class="recoveries">.*?<td>12</td>', dom, re.S), "the recovery is not listed"
        assert "<polyline" in dom  # the loss curve
        m = dash.metrics()
        assert m[("troupe_train_step", (("group", "dash"),))] >= second
        assert m[("troupe_train_recoveries", (("group", "dash"),))] >= 1
        assert m[("troupe_train_world_size", (("group", "dash"),))] == 2
        assert m[("troupe_train_step_phase_seconds", (("group", "dash"), ("phase", "compute"), ("rank", "1")))] > 0
        # Where the data lives: the trainers' collectives and snapshots, the checkpoint actors'
        # persists, each counted in its worker and read from its node's agent; they keep counting.
        allreduced = counter(m, "troupe_collective_bytes_total", op="allreduce", **{"class": "Trainer"})
        assert allreduced > 0 and counter(m, "troupe_collective_seconds_total", op="allreduce") > 0
        assert counter(m, "troupe_checkpoint_snapshots_total", **{"class": "Trainer"}) >= 1
        assert counter(m, "troupe_checkpoint_snapshot_seconds_total") > 0
        eventually(lambda: (counter(dash.metrics(), "troupe_checkpoint_persists_total") or 0) >= 1, 60,
                   "a persisted snapshot in the checkpoint actors' counters")
        assert counter(dash.metrics(), "troupe_checkpoint_persist_bytes_total") > 0
        eventually(lambda: counter(dash.metrics(), "troupe_collective_bytes_total", op="allreduce") > allreduced, 60,
                   "the all-reduced bytes to grow")
        # The CLI's timeline of the same group: a Chrome trace file with both ranks.
        trace_file = tmp_path / "trace.json"
        out = troupe.run("timeline", "--group", "dash", "-o", str(trace_file), timeout=120).stdout
        assert "of 2 rank(s)" in out
        trace = json.loads(trace_file.read_text())
        assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "forward"} == {0, 1}
    finally:
        stop.touch()
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert driver.returncode == 0, output[-3000:]


def test_metrics_text_parses_and_escapes_labels():
    import sys as _sys

    _sys.path.insert(0, str(PYTHON_PACKAGE))
    from prometheus_client.parser import text_string_to_metric_families

    from troupe.dashboard import metrics_text

    doc = {"name": 'odd "name"\nhere', "step": 9, "world_size": 2, "loss": 1.5, "samples_per_s": 10.0,
           "ranks": [{"rank": 0, "compute_s": 0.1}, {"rank": 1, "compute_s": 0.5}], "stragglers": [{"rank": 1}]}
    state = {"nodes": [], "actors": [], "placement_groups": [],
             "groups": [{"id": "g", "doc": json.dumps(doc), "events": [], "epoch": 3}]}
    node_samples = [("troupe_object_store_bytes", 'node="n1"', 4096.0), ("troupe_object_store_objects", 'node="n1"', 1.0)]
    families = list(text_string_to_metric_families(metrics_text(state, node_samples)))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    group = ("group", 'odd "name"\nhere')
    assert samples[("troupe_object_store_bytes", (("node", "n1"),))] == 4096  # a node's store, as a gauge
    assert {f.name: f.type for f in families}["troupe_object_store_objects"] == "gauge"
    assert samples[("troupe_train_step", (group,))] == 9
    assert samples[("troupe_train_epoch", (group,))] == 3
    assert samples[("troupe_train_straggler", (group, ("rank", "1")))] == 1
    assert samples[("troupe_train_straggler", (group, ("rank", "0")))] == 0


def test_only_a_logged_in_session_on_a_loopback_host_is_served(head):
    """Issue 34: a request without the session cookie, with a wrong one or a wrong login key, or
    naming another host (DNS rebinding) is refused; the URL `troupe dashboard` prints logs in."""
    troupe, dash, port = head
    run_dir = troupe.status()["cluster"]["run_dir"]
    token = json.loads(open(os.path.join(run_dir, "cluster.json")).read())["token"]
    for path in ("/", "/index.html", "/app.js", "/api/cluster", "/api/actors", "/api/groups", "/metrics",
                 "/api/logs?actor=00"):
        status, headers, body = request(dash.url + path)
        assert status == 401, path
        assert "troupe dashboard" in body and "node" not in body and "Set-Cookie" not in headers
        assert request(dash.url + path, {"Cookie": dash.cookie.split("=")[0] + "=" + "0" * 64})[0] == 401, path
    name, _, value = dash.cookie.partition("=")
    assert token not in dash.login_url and token not in value
    # A wrong key sets nothing; the printed URL sets the cookie (see Dashboard) and only sends to
    # this server's pages.
    status, headers, _ = request(dash.url + "/login?key=" + "0" * 64)
    assert status == 403 and "Set-Cookie" not in headers
    assert request(dash.url + "/login")[0] == 403
    status, headers, _ = request(dash.login_url + "&next=//evil.example/x")
    assert status == 303 and headers["Location"] == "/"
    status, headers, _ = request(dash.login_url + "&next=/%3Ftab%3Dactors")
    assert status == 303 and headers["Location"] == "/?tab=actors"
    # DNS rebinding: the browser sends the cookie of the page's own name only, but the Host check
    # holds whatever it sends.
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", ""):
        status, _, body = request(dash.url + "/api/cluster", {"Cookie": dash.cookie, "Host": host})
        assert status == 403 and "nodes" not in body, host
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost:8265", "LOCALHOST"):
        assert request(dash.url + "/api/cluster", {"Cookie": dash.cookie, "Host": host})[0] == 200, host
    assert json.loads(dash.fetch("/api/cluster"))["alive"] == 1
    # Prometheus: a bearer credential from a 0600 file, for /metrics only.
    bearer_file = os.path.join(run_dir, "dashboard.metrics-token")
    assert os.stat(bearer_file).st_mode & 0o777 == 0o600
    assert os.stat(os.path.join(run_dir, "dashboard.login")).st_mode & 0o777 == 0o600
    bearer = open(bearer_file).read().strip()
    assert bearer != token
    status, _, body = request(dash.url + "/metrics", {"Authorization": f"Bearer {bearer}"})
    assert status == 200 and parse_metrics(body)[("troupe_cluster_nodes", (("state", "ALIVE"),))] == 1
    assert request(dash.url + "/api/cluster", {"Authorization": f"Bearer {bearer}"})[0] == 401
    assert request(dash.url + "/metrics", {"Authorization": "Bearer " + "0" * 64})[0] == 401
    # The dashboard's page itself, in a browser, through the printed URL.
    assert "1 node(s) alive" in dash.browse("/")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another user")
def test_another_local_user_is_served_nothing(head):
    troupe, dash, _ = head
    run_dir = troupe.status()["cluster"]["run_dir"]
    probe = textwrap.dedent(f"""
        import http.client, json
        out = {{}}
        for path in ("/", "/api/cluster", "/metrics", "/api/actors"):
            c = http.client.HTTPConnection("127.0.0.1", {dash.url.rsplit(":", 1)[1]}, timeout=10)
            c.request("GET", path)
            out[path] = c.getresponse().status
        for f in ("dashboard.login", "dashboard.metrics-token", "cluster.json"):
            try:
                open({run_dir!r} + "/" + f).read()
                out[f] = "read"
            except OSError as e:
                out[f] = type(e).__name__
        print(json.dumps(out))
    """)
    result = subprocess.run(["/usr/bin/python3", "-c", probe], user=65534, group=65534, extra_groups=[],
                            capture_output=True, text=True, timeout=60, cwd="/")
    seen = json.loads(result.stdout)
    assert {seen[p] for p in ("/", "/api/cluster", "/metrics", "/api/actors")} == {401}
    assert {seen[f] for f in ("dashboard.login", "dashboard.metrics-token", "cluster.json")} == {"PermissionError"}


def test_label_text_a_worker_forges_never_reaches_the_scrape(head):
    """Issue 34: an actor writes label text into its own counters file: a well-escaped value with
    a quote, a backslash and a newline comes through intact; text that is not label text is
    dropped, and the scrape still parses."""
    troupe, dash, _ = head
    code = textwrap.dedent("""
        import mmap, os, struct, sys, troupe
        troupe.init("auto")
        @troupe.remote
        class Forger:
            def ping(self):  # the first call's counters make the worker's file
                return True

            def forge(self):
                with open(os.environ["TROUPE_METRICS_FILE"], "r+b") as f:
                    m = mmap.mmap(f.fileno(), 0)
                used = struct.unpack_from("<I", m, 16)[0]
                for i, (name, labels) in enumerate([
                        (b"troupe_forged_ok_total", b'why="a\\\\"b\\\\\\\\c\\\\nd"'),
                        (b"troupe_forged_bad_total", b'why="x"y",z="}'),
                        (b"troupe_forged_worse_total", b'why="x"} 1\\\\ntroupe_fake 7 #')]):
                    at = 64 + (used + i) * 192
                    m[at:at + 192] = name.ljust(96, b"\\0") + labels.ljust(80, b"\\0") + bytes([1]) + bytes(7) + \\
                        struct.pack("<Q", 5)
                struct.pack_into("<I", m, 16, used + 3)
                return True
        f = Forger.options(name="forger").remote()
        assert troupe.get(f.ping.remote()) and troupe.get(f.forge.remote())
        print("up", flush=True); sys.stdin.readline()
    """)
    driver = subprocess.Popen(["/usr/bin/python3", "-c", code], env=dict(troupe.env, PYTHONPATH=str(PYTHON_PACKAGE)),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "up"
        m = dash.metrics()  # parses: a forged sample would make the parser raise
        assert counter(m, "troupe_forged_ok_total", why='a"b\\c\nd') == 5
        assert counter(m, "troupe_forged_bad_total") is None
        assert counter(m, "troupe_forged_worse_total") is None and counter(m, "troupe_fake") is None
    finally:
        driver.communicate("\n", timeout=30)
