"""What a held-out evaluation costs a training run with online features, with the held-out
features kept from the first evaluation (the trainer's default) and recomputed every time.

An evaluation runs the drafter over each held-out sequence twice (random anchors for loss and
accuracy, every answer position for the greedy walk); each pass needs the target's features.
Online, those are the same at every evaluation, so the trainer keeps them after computing them
once. Builds one trainer from a config (its data stage made if missing, a scratch run folder,
the drafter from --init) and times: the first evaluation (fills the store), the next ones, and
evaluations with nothing kept. The figures must agree across all of them.

    .venv/bin/python benchmarks/heldout_eval.py configs/experiments/mix-all-online.yaml \\
        --init checkpoints/qwen2.5-coder-0.5b-instruct --target-dtype float32 --repeats 2
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

import dflashkit.trainer as trainer_module
from dflashkit.pipeline import load_config, run_data_stage
from dflashkit.trainer import Trainer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--init", default="checkpoints/qwen2.5-coder-0.5b-instruct",
                    help="drafter to evaluate (a drafter folder)")
    ap.add_argument("--target-dtype", help="train.target_dtype override (float32 on CPUs without AMX)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cfg = load_config(args.config)
    run_data_stage(cfg, progress=False)
    train = replace(cfg.train, features="online", target_dtype=args.target_dtype or cfg.train.target_dtype)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(cfg.target, cfg.data_dirs, scratch, replace(cfg.drafter, init=args.init),
                          train, progress=False)
        passes = [0]
        inner = trainer.target.features
        trainer.target.features = lambda *a, **k: passes.__setitem__(0, passes[0] + 1) or inner(*a, **k)

        def timed(label: str) -> tuple[str, float, int, dict]:
            passes[0] = 0
            t = time.perf_counter()
            figures = trainer.evaluate()
            return label, time.perf_counter() - t, passes[0], figures

        rows = [timed("first (fills the store)")]
        for _ in range(args.repeats):
            rows.append(timed("kept features"))
        kept = sum(t.numel() * t.element_size() for t in trainer._heldout_features.values())
        budget = trainer_module.HELDOUT_FEATURE_BYTES
        trainer_module.HELDOUT_FEATURE_BYTES = 0
        for _ in range(args.repeats):
            trainer._heldout_features.clear()
            rows.append(timed("nothing kept"))
        trainer_module.HELDOUT_FEATURE_BYTES = budget
    print(f"{len(trainer.heldout_records)} held-out sequences, target {trainer.target.dtype}, "
          f"walk over {train.heldout_walk_tokens} answer tokens; kept features {kept / 2 ** 20:.0f} MiB")
    print(f"{'evaluation':<24} | {'seconds':>7} | {'target passes':>13} | walk tau")
    for label, s, n, figures in rows:
        print(f"{label:<24} | {s:>7.1f} | {n:>13} | {figures['heldout_walk_tau']:.4f}")
    agree = all(r[3] == rows[0][3] for r in rows)
    kept_s = statistics.median(r[1] for r in rows if r[0] == "kept features")
    none_s = statistics.median(r[1] for r in rows if r[0] == "nothing kept")
    print(f"median kept / nothing kept: {kept_s / none_s:.2f}; figures identical: {agree}")


if __name__ == "__main__":
    main()
