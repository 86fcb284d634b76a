"""What more anchors per sequence cost a training step, on a real config's data and target.

Each training sequence costs one target forward (online features) whatever the number of
anchors; the drafter's forward and backward grow with the anchors. When the target pass is a
large share of a step, more anchors per sequence buy supervised blocks cheaply: the
regenerated data is the scarce thing here (about an hour per 900 samples on this CPU), and at
64 anchors an epoch trains on under a quarter of its answer positions.

One trainer is built from the config (its drafter.init, its data, a scratch run folder:
nothing of the config's own run is touched), then the same steps of the seeded order run at
each anchor count, interleaved step by step. Per count: median seconds per step, of which the
target's feature pass and the drafter's forward + backward, blocks per step and blocks/s.

    .venv/bin/python benchmarks/anchor_cost.py configs/experiments/mix-all-online-3.yaml \\
        --anchors 64,128,256 --steps 4
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

from dflashkit.pipeline import load_config
from dflashkit.trainer import Trainer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--anchors", default="64,128,256")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per count (after one warm-up)")
    args = ap.parse_args()
    counts = [int(a) for a in args.anchors.split(",")]
    cfg = load_config(args.config)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(cfg.target, cfg.data_dirs, scratch, cfg.drafter,
                          replace(cfg.train, heldout_walk_tokens=0), progress=False)
        feature_s = [0.0]
        inner = trainer._features

        def timed_features(*a, **k):
            t = time.perf_counter()
            out = inner(*a, **k)
            feature_s[0] += time.perf_counter() - t
            return out
        trainer._features = timed_features
        rows = {n: {"step": [], "features": [], "blocks": []} for n in counts}
        for i in range(args.steps + 1):          # step 0 of each count warms up
            for n in counts:
                trainer.cfg.num_anchors = n
                feature_s[0] = 0.0
                t = time.perf_counter()
                m = trainer.train_step(i)     # the config's data_offset_steps applies
                dt = time.perf_counter() - t
                if i:
                    rows[n]["step"].append(dt)
                    rows[n]["features"].append(feature_s[0])
                    rows[n]["blocks"].append(m["blocks"])
                print(f"step {i} anchors {n}: {dt:.1f} s, target features {feature_s[0]:.1f} s, "
                      f"{m['blocks']} blocks", flush=True)
    print(f"\n{cfg.train.global_batch} sequences per step, median of {args.steps} steps\n")
    print("| anchors | s/step | target features s | drafter s | blocks/step | blocks/s |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        r = rows[n]
        step, feat = statistics.median(r["step"]), statistics.median(r["features"])
        blocks = statistics.median(r["blocks"])
        print(f"| {n} | {step:.2f} | {feat:.2f} | {step - feat:.2f} | {blocks:.0f} | {blocks / step:.1f} |")


if __name__ == "__main__":
    main()
