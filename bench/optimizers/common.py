"""Shared by the optimizer benchmarks: finding the built `troupe` package and printing results."""
import json
import os
import sys
from pathlib import Path


def import_troupe_optim():
    """troupe.optim from the build directory: $TROUPE_BIN_DIR (set by bench/run) or ./build."""
    build = Path(os.environ.get("TROUPE_BIN_DIR", Path(__file__).resolve().parents[2] / "build"))
    sys.path.insert(0, str(build / "python"))
    try:
        import troupe.optim
    except ImportError as e:
        sys.exit(f"bench: troupe.optim is not built under {build / 'python'} ({e}); run `make build`")
    return troupe.optim


def usable_cpus():
    return len(os.sched_getaffinity(0))


def print_table(title, header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print(title)
    for r in [header] + rows:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print("  " + "  ".join(cells))


def emit_json(enabled, obj):
    if enabled:
        print(json.dumps(obj), flush=True)
