"""Training throughput with stored features (from the data stage) vs features computed online
(a target forward per step), on the same data, drafter and recipe.

    .venv/bin/python benchmarks/feature_modes.py --config configs/qwen2.5-coder-0.5b.yaml --steps 6

Runs a few optimizer steps of each mode in a scratch folder (the config's finished data stage
is reused, nothing of the real run is touched) and prints seconds per step, tokens/s and the
memory each mode needs beside the drafter: the stored features' bytes per token on disk, or
the whole target in memory.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from dflashkit.pipeline import load_config
from dflashkit.trainer import Trainer


def run(cfg, mode: str, steps: int, scratch: Path) -> dict:
    train = replace(cfg.train, features=mode, max_steps=steps, eval_every=10 ** 9, save_every=10 ** 9)
    out = scratch / mode
    t0 = time.perf_counter()
    trainer = Trainer(cfg.target, cfg.data_dir, out, cfg.drafter, train, progress=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    rows = rows[1:] or rows            # the first step includes warm-up
    return {"mode": mode, "setup_s": setup, "steps": steps, "wall_s": wall,
            "s_per_step": statistics.median(float(b["elapsed_s"]) - float(a["elapsed_s"])
                                            for a, b in zip(rows, rows[1:])) if len(rows) > 1 else wall / steps,
            "tokens_per_s": statistics.median(float(r["tokens_per_s"]) for r in rows)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen2.5-coder-0.5b.yaml")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    cfg = load_config(args.config)
    meta = json.loads((cfg.data_dir / "meta.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(cfg, mode, args.steps, Path(tmp)) for mode in ("stored", "online")]
    print("| features | s/step (median) | tokens/s (median) | set-up s | extra storage or memory |")
    print("|---|---|---|---|---|")
    for r in results:
        extra = (f"{meta['feature_bytes_per_token']:.0f} B/token on disk "
                 f"({meta['feature_bytes'] / 1e9:.2f} GB for {meta['num_tokens']} tokens)"
                 if r["mode"] == "stored" else "the whole target in memory, one forward per sequence per step")
        print(f"| {r['mode']} | {r['s_per_step']:.2f} | {r['tokens_per_s']:.0f} | {r['setup_s']:.1f} | {extra} |")


if __name__ == "__main__":
    main()
