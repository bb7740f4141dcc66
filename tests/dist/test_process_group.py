"""torch.distributed's "troupe" backend (troupe.dist): real ranks (one process each, started
here) calling init_process_group, every op checked against gloo's result on the same inputs,
DDP and ZeroRedundancyOptimizer bitwise equal to gloo's, a SIGKILLed peer named in the error the
survivors get at once, unsupported ops refused by name."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the process group tests need Debian's python3-torch")

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("TROUPE_BUILD_DIR", REPO / "build")).resolve()
RANK = Path(__file__).with_name("dist_rank.py")

if not list((BUILD / "python" / "troupe").glob("_dist.*.so")):
    pytest.skip(f"troupe._dist is not built under {BUILD / 'python'}; run `make build`", allow_module_level=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario, world, tmp_path, init="file", timeout=90, env=None):
    """Starts `world` ranks of `scenario` and returns each rank's result (None: it wrote none)."""
    init_method = f"file://{tmp_path / 'store'}" if init == "file" else f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    out.mkdir()
    environ = {**os.environ, "TROUPE_BUILD_DIR": str(BUILD), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, str(RANK), scenario, str(r), str(world), init_method, str(out)],
                              env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r in range(world):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results, procs, logs


def expect_ok(results, logs):
    for r, result in enumerate(results):
        assert result is not None, f"rank {r} wrote no result:\n{logs[r][-3000:]}"
        assert result["ok"], f"rank {r}:\n{result['error']}"


@pytest.mark.parametrize("world,init", [(2, "file"), (3, "tcp")])
def test_every_op_matches_gloo(tmp_path, world, init):
    results, _, logs = run_ranks("ops", world, tmp_path, init=init)
    expect_ok(results, logs)
    for result in results:
        assert result["checked"] == 9  # 3 dtypes x 3 sizes, each through every op
        errors = result["errors"]
        for op in ("reduce", "scatter"):
            assert errors[op] is not None and f"{op} is not supported" in errors[op], errors[op]
        assert errors["PRODUCT"] is not None and "does not support reduce op" in errors["PRODUCT"], errors


def test_ops_over_tcp_match_gloo(tmp_path):
    """The same ops with shared memory off: ranks on one host talk TCP."""
    results, _, logs = run_ranks("ops", 2, tmp_path, env={"TROUPE_COLLECTIVES_SHM": "0"})
    expect_ok(results, logs)


def test_tls(tmp_path):
    """TROUPE_DIST_TLS_TOKEN: every connection speaks TLS (TCP between the ranks, shm off)."""
    results, _, logs = run_ranks("small", 2, tmp_path, env={"TROUPE_DIST_TLS_TOKEN": "t0ken-of-this-test",
                                                          "TROUPE_COLLECTIVES_SHM": "0"})
    expect_ok(results, logs)


def test_destroy_with_pending_op_and_python_callback(tmp_path):
    results, _, logs = run_ranks("destroy", 2, tmp_path, timeout=60)
    expect_ok(results, logs)
    assert results[0]["done_after_destroy"] is True, results[0]
    assert "destroyed" in results[0]["error"], results[0]


def test_ddp_and_zero_bitwise_equal_to_gloo(tmp_path):
    results, _, logs = run_ranks("ddp", 2, tmp_path)
    expect_ok(results, logs)
    assert results[0]["losses"] != results[1]["losses"]  # each rank trained on its own data


def test_killed_peer_fails_pending_all_reduce_naming_it(tmp_path):
    results, procs, logs = run_ranks("kill", 3, tmp_path, init="tcp")
    assert procs[1].returncode == -9 and results[1] is None
    for r in (0, 2):
        result = results[r]
        assert result is not None and result["ok"], f"rank {r}: {result or logs[r][-3000:]}"
        assert result["error"] is not None, f"rank {r}: the all_reduce did not fail"
        assert "rank 1" in result["error"], result["error"]
        # The all_reduce failed, or was refused when submitted (the death can be known by then).
        assert "allreduce failed" in result["error"] or "allreduce: rank" in result["error"], result["error"]
        assert result["failed_after_s"] < 5, result
        assert result["later"] is not None and "rank 1" in result["later"], result
        assert "rank 1" in result["health"], result
        # In the order seen (rank 2 may have ended too by the time rank 0 asks): what a
        # TorchTrainer's coordinator asks the survivors.
        assert result["dead_peers"][:1] == [1], result
