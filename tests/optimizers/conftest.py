"""Puts the built `troupe` package (build/python, or $TROUPE_BUILD_DIR/python) on sys.path for the
optimizer tests. They need Debian's python3-torch; without it they are not collected."""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("TROUPE_BUILD_DIR", REPO / "build"))

try:
    import torch  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(BUILD / "python"))
