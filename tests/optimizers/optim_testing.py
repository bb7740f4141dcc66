"""Shared helpers for the optimizer tests: the import of troupe.optim from the build directory
(build/python, or $TROUPE_BUILD_DIR/python) with a useful error, random problems, and the
comparison metric. (Not a conftest.py: tests/e2e imports `conftest` by name.)"""
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the optimizer tests need Debian's python3-torch")
import numpy as np  # noqa: E402

BUILD = Path(os.environ.get("TROUPE_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
if str(BUILD / "python") not in sys.path:
    sys.path.insert(0, str(BUILD / "python"))

try:
    import troupe.optim as optim  # noqa: E402,F401 (re-exported to the tests)
except ImportError as e:  # the extension is built by `make build` into build/python/troupe/
    raise ImportError(f"troupe.optim is not built under {BUILD / 'python'} ({e}); run `make build` "
                      "(meson.build must include subdir('python') and LibTorch must be found)") from e

# Shapes of one problem: a matrix, a bias that starts at zero (norm 0: trust ratio 1), and a
# vector large enough (> 32768 elements) that the kernels split it over threads.
SHAPES = [(37, 29), (29,), (70001,)]
ZERO_INIT = {1}


def make_problem(dtype=np.float32, seed=0, shapes=SHAPES):
    """Returns (torch params, numpy float64 copies of them)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for i, shape in enumerate(shapes):
        a = np.zeros(shape) if i in ZERO_INIT else rng.standard_normal(shape)
        arrays.append(a.astype(dtype))
    params = [torch.from_numpy(a.copy()).requires_grad_(True) for a in arrays]
    return params, [a.astype(np.float64) for a in arrays]


def random_grads(seed, shapes=SHAPES, dtype=np.float32, scale=1.0):
    rng = np.random.default_rng(10_000 + seed)
    return [(scale * rng.standard_normal(s)).astype(dtype) for s in shapes]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = torch.from_numpy(g.copy())


def max_rel_diff(ours, ref):
    """The largest relative difference of any element: |ours - ref| / max(|ref|, scale/10), with
    scale the largest |ref| of that tensor. Elements smaller than a tenth of their tensor's scale
    are measured against that tenth: there a parameter has crossed zero, and the float32 rounding
    of p - update (about one ulp of the tensor's scale) is all any implementation can achieve."""
    worst = 0.0
    for a, b in zip(ours, ref):
        a = a.detach().numpy().astype(np.float64) if isinstance(a, torch.Tensor) else np.asarray(a, np.float64)
        floor = max(float(np.max(np.abs(b))) / 10, 1e-30)
        worst = max(worst, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), floor))))
    return worst


def tolerance(dtype):
    return 1e-5 if dtype == np.float32 else 1e-11
