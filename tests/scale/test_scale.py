"""The scale simulator (bench/scale.cc) at its small size, as a regression check on correctness,
not on time: 100 simulated nodes and 5,000 simulated actors against a real controller, store
gateway and redis-server. The simulator checks every step itself (every actor ALIVE, silenced
nodes marked DEAD and their actors moved, kills and groups counted) and exits 1 on a wrong one;
this test also reads its JSON."""
import json
import os
import subprocess

import pytest

from troupe_testing import BUILD

SCALE = BUILD / "bench" / "scale"


@pytest.mark.skipif(not SCALE.exists(), reason="build/bench/scale is not built (ninja -C build)")
def test_small_simulation_is_correct():
    env = dict(os.environ, TROUPE_BIN_DIR=str(BUILD))
    done = subprocess.run([str(SCALE), "--small", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"scale --small failed:\n{done.stdout}\n{done.stderr}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] is True
    assert result["nodes"] == 100 and result["actors"] == 5000 and result["pgs"] == 1000
    # Every silenced node's actors were on a node that died, and all came up elsewhere.
    assert result["actors_on_dead_nodes"] > 0
    assert result["death_detect_p99_s"] > 0
    assert result["redis_bytes_per_actor"] > 0 and result["redis_bytes_per_node"] > 0
