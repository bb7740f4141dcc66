"""The collectives' CPU ring over real hosts (network namespaces): ranks find which of their peers
share their host from the host identity alone (boot id + network namespace), with no test seam.
Each host's interface counters say which link carried the bytes: a host's loopback carries what
its ranks send each other over TCP, its eth0 what crosses to the other host."""
import secrets
import subprocess

import pytest

from testbed import BUILD

MIB = 1 << 20
BYTES = 16 * MIB
ALLREDUCES = 2 + 3  # allreduce_bench's two warm-ups and the timed iterations asked for
REDIS_PORT = 6390


def interface_bytes(host):
    """{interface: (rx bytes, tx bytes)} inside the host's namespace."""
    counters = {}
    for line in host.run(["cat", "/proc/net/dev"], check=True).stdout.splitlines()[2:]:
        name, fields = line.split(":", 1)
        fields = fields.split()
        counters[name.strip()] = (int(fields[0]), int(fields[8]))
    return counters


def run_ranks(placement, env):
    """allreduce_bench ranks (it binds each rank to TROUPE_BENCH_HOST), placement[r] hosting rank r,
    meeting through a redis-server on the first host. Returns each host's tx bytes per interface."""
    head = placement[0]
    hosts = list(dict.fromkeys(placement))
    password = secrets.token_hex(16)
    redis = head.popen(["redis-server", "--bind", head.address, "--port", str(REDIS_PORT), "--requirepass", password,
                        "--save", "", "--appendonly", "no", "--dir", str(head.root)], stdout=subprocess.DEVNULL)
    try:
        ping = ["redis-cli", "-h", head.address, "-p", str(REDIS_PORT), "-a", password, "--no-auth-warning", "ping"]
        assert any(head.run(ping).stdout.strip() == "PONG" for _ in range(200)), "redis-server did not start"
        before = {h.index: interface_bytes(h) for h in hosts}
        group = "mh-links-" + secrets.token_hex(3)
        ranks = []
        for r, host in enumerate(placement):
            rank_env = {"TROUPE_BENCH_REDIS_HOST": head.address, "TROUPE_BENCH_REDIS_PORT": str(REDIS_PORT),
                        "TROUPE_BENCH_REDIS_PASSWORD": password, "TROUPE_BENCH_HOST": host.address, **env}
            ranks.append(host.popen([str(BUILD / "collectives" / "allreduce_bench"), "--serve-rank", str(r), "--world",
                                     str(len(placement)), "--group", group, "--sizes", f"{BYTES}:3"], env=rank_env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for r, p in enumerate(ranks):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, f"rank {r} failed ({p.returncode}): {err[-2000:]}"
        after = {h.index: interface_bytes(h) for h in hosts}
        return {i: {name: after[i][name][1] - before[i][name][1] for name in after[i]} for i in after}
    finally:
        redis.kill()
        redis.wait()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp-forced"])
def test_two_hosts_of_two_ranks_use_shared_memory_within_a_host_and_tcp_between(make_testbed, shm):
    bed = make_testbed(2)
    a, b = bed.hosts
    tx = run_ranks([a, a, b, b], {} if shm else {"TROUPE_COLLECTIVES_SHM": "0"})
    # The ring 0 -> 1 -> 2 -> 3 -> 0: each hop carries 2 (n - 1) / n of the buffer per all-reduce;
    # 1 -> 2 and 3 -> 0 cross between the hosts, 0 -> 1 and 2 -> 3 stay within one.
    per_hop = ALLREDUCES * BYTES * 2 * 3 // 4
    for host in (0, 1):
        # Headers, the rendezvous, the barriers and the timing all-reduce add well under 5%.
        assert per_hop <= tx[host]["eth0"] <= per_hop * 1.05, (host, tx)
        if shm:
            # Only the same-host control connections, hellos and (on the head) Redis replies.
            assert tx[host]["lo"] < 2 * MIB, (host, tx)
        else:
            assert per_hop <= tx[host]["lo"] <= per_hop * 1.05, (host, tx)
