"""Cost of the drafter's LM-head cross-entropy (forward and backward) three ways, at the
shipped recipe's shapes: eager with the logits recomputed in the backward pass (activation
checkpointing, what one chunk used to do), eager, and through torch.compile
(``objective.compiled_ce_chunk``). Interleaved repeats, medians, bf16 autocast as training
runs it. Prints one row per way.

    python benchmarks/ce_compile.py [--rows 448] [--vocab 41845] [--hidden 896] [--repeats 10]

Rows: 64 anchors x 7 labelled slots of one sequence; vocab: mix-all's draft vocabulary.
"""

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from dflashkit.objective import _ce_chunk, compiled_ce_chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=448)
    ap.add_argument("--vocab", type=int, default=41845)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    head = torch.randn(args.vocab, args.hidden) * 0.02
    proj = torch.nn.Linear(args.hidden, args.hidden)       # stands in for the drafter's last layer
    compiled = compiled_ce_chunk()
    ways = {
        "eager, recomputed in backward": lambda h, y: checkpoint(_ce_chunk, h, head, y, use_reentrant=False),
        "eager": lambda h, y: _ce_chunk(h, head, y),
        "torch.compile": lambda h, y: compiled(h, head, y),
    }

    def step(way, rows: int) -> float:
        x, y = torch.randn(rows, args.hidden), torch.randint(0, args.vocab, (rows,))
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = way(proj(x), y)
        loss.sum().backward()
        return time.perf_counter() - start

    t0 = time.perf_counter()
    for rows in (args.rows, args.rows - 17):                # compiles once, for any row count
        step(ways["torch.compile"], rows)
    print(f"compile (first two calls): {time.perf_counter() - t0:.1f} s")
    for way in ways.values():
        step(way, args.rows)
    times = {name: [] for name in ways}
    for i in range(args.repeats):
        for name, way in ways.items():
            times[name].append(step(way, args.rows - i % 3))
    base = statistics.median(times["eager, recomputed in backward"])
    print(f"\n{args.rows} rows x {args.vocab} tokens x {args.hidden}, bf16 autocast, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}\n")
    print("| way | ms per call | vs recomputed |\n|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m * 1000:.0f} | {base / m:.2f}x |")


if __name__ == "__main__":
    main()
