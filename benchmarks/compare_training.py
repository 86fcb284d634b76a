"""Held-out curves of several training runs side by side: a Markdown table and a PNG.

Every run evaluates the same held-out sequences at the same anchors (seeded), so the curves
compare directly when the runs share their data (``data_dir`` in the config).

    python benchmarks/compare_training.py runs/ab-plain/train/log.csv runs/ab-distill/train/log.csv \
        --names plain,distill --out benchmarks/training/distill-ab
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def heldout_rows(log: Path) -> dict[int, dict]:
    """step (1-based, as the trainer prints it) -> the row of that held-out evaluation."""
    with log.open() as f:
        return {int(r["step"]) + 1: r for r in csv.DictReader(f) if r.get("heldout_tau")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="log.csv of each run")
    ap.add_argument("--names", help="comma-separated run names (default: the run folders)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.png")
    args = ap.parse_args()
    names = args.names.split(",") if args.names else [p.parent.parent.name for p in args.logs]
    if len(names) != len(args.logs):
        raise SystemExit(f"--names has {len(names)} names for {len(args.logs)} logs")
    runs = [heldout_rows(p) for p in args.logs]
    steps = sorted(set().union(*runs))
    head = "| step | " + " | ".join(f"{n}: tau / loss / slot-1 acc" for n in names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    for s in steps:
        cells = []
        for run in runs:
            r = run.get(s)
            cells.append(f"{float(r['heldout_tau']):.3f} / {float(r['heldout_loss']):.3f} / "
                         f"{float(r['heldout_acc_1']):.3f}" if r else "")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    minutes = []
    for p in args.logs:
        with p.open() as f:
            rows = list(csv.DictReader(f))
        minutes.append(float(rows[-1]["elapsed_s"]) / 60 if rows else 0.0)
    lines += ["", "Training time: " + ", ".join(f"{n} {m:.1f} min" for n, m in zip(names, minutes))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in zip(names, runs):
        xs = sorted(run)
        ax.plot(xs, [float(run[s]["heldout_tau"]) for s in xs], marker="o", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out expected acceptance length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
