"""Plots bench/run scale's JSON results (one file per run, the JSON object on its last line)
against the simulated size: docs/scale.png. Usage: scale_plot.py OUT.png RUN.json...
Runs of the same size are shown as their median, with the spread as an error bar."""
import json
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MEASURES = [
    ("heartbeat_cpu_fraction", "controller + Redis CPU, heartbeats alone (of one core)", "nodes"),
    ("cpu_fraction_after_deaths", "controller + Redis CPU, DEAD nodes in history", "actors"),
    ("death_detect_p99_s", "death detected after last beat, p99 (s)", "nodes"),
    ("status_ms", "troupe status --json --limit 100 (ms)", "actors"),
    ("actor_create_per_s", "actor creation (/s)", "actors"),
    ("pg_create_remove_per_s_at_10k", "placement group create+remove (/s)", "actors"),
]


def main():
    out, paths = sys.argv[1], sys.argv[2:]
    runs = defaultdict(list)
    for path in paths:
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
        if lines:
            r = json.loads(lines[-1])
            runs[(r["nodes"], r["actors"])].append(r)
    sizes = sorted(runs)
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for ax, (key, title, axis) in zip(axes.flat, MEASURES):
        xs, ys, lo, hi = [], [], [], []
        for size in sizes:
            values = [r[key] for r in runs[size]]
            med = statistics.median(values)
            xs.append(size[0] if axis == "nodes" else size[1])
            ys.append(med)
            lo.append(med - min(values))
            hi.append(max(values) - med)
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("simulated nodes" if axis == "nodes" else "simulated actors (nodes = actors / 100)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    for size in sizes:
        print(size, {k: statistics.median(r[k] for r in runs[size]) for k, _, _ in MEASURES})


if __name__ == "__main__":
    main()
