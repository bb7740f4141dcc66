"""Helpers shared by the checkpoint tests: a state of every dtype, comparisons, child processes.
(A module of its own: test modules do not import each other.)"""
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from troupe_testing import PYTHON_PACKAGE


def make_state(step, large=0):
    """Every dtype torch and numpy checkpoints hold, awkward shapes, values that depend on step."""
    g = torch.Generator().manual_seed(step)
    rng = np.random.default_rng(step)
    state = {
        "linear.weight": torch.randn(3, 4, generator=g),
        "linear.bias": torch.randn(4, generator=g, dtype=torch.float64),
        "emb": torch.randn(17, 3, generator=g).to(torch.bfloat16),
        "half": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "step": torch.tensor(step),  # 0-d int64
        "mask": torch.rand(9, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
        "i8": torch.randint(-100, 100, (2, 3), generator=g, dtype=torch.int8),
        "i16": torch.randint(-1000, 1000, (7,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-10**6, 10**6, (1, 1, 1), generator=g, dtype=torch.int32),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "c128": torch.randn(2, generator=g, dtype=torch.complex128),
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),  # requires grad
        "np.f32": rng.standard_normal((2, 3)).astype(np.float32),
        "np.i64": rng.integers(0, 1000, 4),
        "np.bool": rng.random(3) > 0.5,
        "np.scalar": np.float64(step / 3),
    }
    if large:
        state["large"] = torch.randn(large // 4, generator=g)
    return state


def same(a, b):
    a = a.detach() if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    b = b.detach() if isinstance(b, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_state(loaded, expected):
    assert list(loaded) == list(expected)
    for name, value in expected.items():
        assert same(loaded[name], value), name


def temp_files(root):
    return [p for p in Path(root).rglob("*") if ".tmp." in p.name]


def run_python(code, *args, preexec_fn=None, prefix=()):
    env = dict(os.environ, PYTHONPATH=str(PYTHON_PACKAGE))
    return subprocess.run([*prefix, "/usr/bin/python3", "-c", code, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=120, preexec_fn=preexec_fn)


def can_unshare_mount():
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


needs_mount_namespace = pytest.mark.skipif(not can_unshare_mount(),
                                           reason="cannot mount a tmpfs in a private mount namespace here")
