"""A run's learning curves as a picture, from its ``metrics.jsonl``.

    python -m rlspmd.plot outputs/quickstart                              # outputs/quickstart/curves.png
    python -m rlspmd.plot outputs/run_a outputs/run_b --out compare.png   # two runs overlaid, one panel per metric
    python -m rlspmd.plot outputs/quickstart --metrics val/acc,reward/mean,'actor/*'

One panel per metric, every run drawn in each (labelled by its directory), against the step. By default the main
curves a run has (``DEFAULT_METRICS``: validation accuracy, reward, response length, entropy, KL, tool calls, the SFT
loss); ``--metrics`` takes names and shell-style patterns (``val/acc/*``). Metrics not logged at every step
(validation) are drawn with markers. Needs matplotlib (``pip install "rlspmd[plot]"``); draws without a display.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from pathlib import Path

DEFAULT_METRICS = (
    "val/acc",
    "reward/mean",
    "val/agent/tool_call_rate",
    "response_length/mean",
    "actor/entropy",
    "actor/kl_loss",
    "critic/vf_loss",
    "sft/loss",
)
"""The curves drawn when ``--metrics`` is not given, those a run logged."""

COLUMNS = 3
PANEL_INCHES = (4.8, 3.2)
DPI = 100


def read_metrics(run: Path) -> list[dict]:
    """The rows of ``<run>/metrics.jsonl`` (a torn last line of a killed run is skipped)."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl here (give a run's trainer.output_dir)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def curve(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; steps where it is missing or not finite are left out."""
    points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
    return [s for s, _ in points], [v for _, v in points]


def choose_metrics(runs: dict[str, list[dict]], wanted: list[str] | None) -> list[str]:
    """The metrics to draw, in order: ``wanted`` (names or patterns, each expanded over what the runs logged, sorted),
    else the ``DEFAULT_METRICS`` the runs have. A name or pattern no run logged is an error listing what they did."""
    logged = sorted({k for rows in runs.values() for r in rows for k in r if k not in ("step", "time")})
    if wanted is None:
        chosen = [m for m in DEFAULT_METRICS if m in logged]
        if not chosen:
            raise ValueError(f"none of the default curves {list(DEFAULT_METRICS)} is logged; choose with --metrics")
        return chosen
    chosen, missing = [], []
    for pattern in wanted:
        hits = [k for k in logged if fnmatch.fnmatchcase(k, pattern)]
        if not hits:
            missing.append(pattern)
        chosen += [k for k in hits if k not in chosen]
    if missing:
        raise ValueError(f"--metrics: {missing} not logged by any run; they logged: {', '.join(logged)}")
    return chosen


def labels(dirs: list[Path]) -> list[str]:
    """Short distinct names for the runs: their directory names, or their paths where names repeat."""
    names = [d.resolve().name for d in dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in dirs]


def plot_runs(dirs: list[Path], *, metrics: list[str] | None = None, title: str | None = None):
    """A matplotlib figure: one panel per metric, every run in each. Returns the figure."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError('rlspmd.plot needs matplotlib: pip install "rlspmd[plot]"') from e
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    dirs = [Path(d) for d in dirs]
    runs = dict(zip(labels(dirs), (read_metrics(d) for d in dirs)))
    names = choose_metrics(runs, metrics)
    cols = min(COLUMNS, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), dpi=DPI, squeeze=False
    )
    for ax, name in zip(axes.flat, names):
        for label, data in runs.items():
            steps, values = curve(data, name)
            # validation: a point every val_every steps, drawn with markers
            sparse = sum(s > 0 for s in steps) < len({r["step"] for r in data if r["step"] > 0})
            ax.plot(steps, values, marker="o" if sparse else None, markersize=4, label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.remove()
    if len(runs) > 1:
        fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper center", ncol=min(len(runs), 4))
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if len(runs) > 1 or title else 1))
    return fig


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m rlspmd.plot", description="Draw runs' learning curves from their metrics.jsonl into a PNG."
    )
    parser.add_argument("runs", nargs="+", type=Path, help="output directories (trainer.output_dir) of the runs")
    parser.add_argument(
        "--metrics", help="comma-separated names or patterns (val/acc,reward/mean,'actor/*'); default: the main curves"
    )
    parser.add_argument("--out", type=Path, help="the PNG to write (default: <first run>/curves.png)")
    parser.add_argument("--title", help="a title above the panels")
    args = parser.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    try:
        fig = plot_runs(args.runs, metrics=metrics, title=args.title)
    except (OSError, ValueError, ImportError) as e:
        print(f"rlspmd.plot: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    out = args.out or args.runs[0] / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(out)
    return out


if __name__ == "__main__":
    main()
