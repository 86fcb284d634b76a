"""Where a decoding step's time goes, adaptive block size against fixed sizes, in one process,
interleaved prompt by prompt (the fast path in ``--dtype``, bf16 unless told; the shipped
drafter, greedy).

    .venv/bin/python benchmarks/step_breakdown.py --num-prompts 6 --fixed 4,5

Per method: milliseconds per step in the target pass, the drafter pass, the adaptive
policy's own calls, and everything else in the loop (acceptance, cache rollback, feature
bookkeeping), plus verified rows per step and tau. Then, from every target pass of the run,
the least-squares cost of one more verified row at the real context lengths, beside what
the start-up cost curve (which the policy starts from) says. Nothing in the loop is changed:
the timed calls are wrapped from outside.
"""

import argparse
import statistics
import time
from collections import defaultdict

from dflashkit.checkpoint import load_drafter
from dflashkit.costs import cost_curve
from dflashkit.decoding import DFlashProposer, speculative_generate
from dflashkit.policy import AdaptiveBlockSize
from dflashkit.suites import load_suite
from dflashkit.target import load_target


class Timers:
    """Wall time per label, and (rows, ms) of every target pass."""

    def __init__(self):
        self.ms = defaultdict(float)
        self.passes: list[tuple[int, float]] = []

    def wrap(self, obj, name: str, label: str, rows_of=None):
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            ms = (time.perf_counter() - t) * 1e3
            self.ms[label] += ms
            if rows_of is not None:
                self.passes.append((rows_of(*args), ms))
            return out
        setattr(obj, name, timed)


def slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, ms per extra row) over (rows, ms) pairs."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")
    return my - b * mx, b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafter", default="checkpoints/qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fixed", default="4,5", help="fixed block sizes to compare with auto")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    target = load_target(args.target, dtype=args.dtype)
    proposer = DFlashProposer(load_drafter(args.drafter), target)
    block = proposer.drafter.block_size
    curve = cost_curve(target, proposer, max_q=block)
    methods = {"auto": AdaptiveBlockSize(curve, block - 1)}
    methods.update({f"block {b}": int(b) for b in args.fixed.split(",")})
    timers = {m: Timers() for m in methods}
    steps, tokens, decode_s, rows = defaultdict(int), defaultdict(int), defaultdict(float), defaultdict(int)
    for p in load_suite("humaneval", args.num_prompts, seed=args.seed):
        ids = target.encode_prompt([{"role": "user", "content": p.turns[0]}])
        line = [p.id]
        for m, size in methods.items():
            t = timers[m]
            # the wrappers are instance attributes that shadow the methods until deleted
            t.wrap(target, "forward", "target pass", rows_of=lambda ids, *a: ids.shape[1])
            t.wrap(proposer, "propose", "drafter pass")
            if isinstance(size, AdaptiveBlockSize):
                for name in ("num_drafts", "should_draft", "observe", "observe_costs"):
                    if name not in vars(size):
                        t.wrap(size, name, "policy")
            try:
                r = speculative_generate(target, proposer, ids, args.max_new_tokens, block_size=size)
            finally:
                del target.forward, proposer.propose
            steps[m] += len(r.stats.acceptance_lengths)
            tokens[m] += len(r.tokens) - 1
            decode_s[m] += r.stats.decode_s
            rows[m] += sum(r.stats.verify_sizes)
            line.append(f"{m} {(len(r.tokens) - 1) / r.stats.decode_s:.1f} tok/s")
        print(" | ".join(line), flush=True)

    print("\n| method | decode tok/s | ms/step | target pass | drafter pass | policy | rest of the "
          "loop | verified rows/step | tau |\n|---|---|---|---|---|---|---|---|---|")
    for m in methods:
        t, n = timers[m], steps[m]
        step_ms = decode_s[m] * 1e3 / n
        # verify passes only: a prefill (the whole prompt, more rows than a block) is no step
        target_ms = sum(ms for q, ms in t.passes if q <= block) / n
        parts = [target_ms, t.ms["drafter pass"] / n, t.ms["policy"] / n]
        print(f"| {m} | {tokens[m] / decode_s[m]:.2f} | {step_ms:.1f} | " + " | ".join(f"{x:.1f}" for x in parts)
              + f" | {step_ms - sum(parts):.1f} | {rows[m] / n:.2f} | {tokens[m] / n:.2f} |")
    auto = [(q, ms) for q, ms in timers["auto"].passes if q <= block]
    a, b = slope(auto)
    ca, cb = slope([(q, curve.verify(q)) for q in range(1, block + 1)])
    print(f"\nTarget pass cost per extra verified row, least squares over the auto run's {len(auto)} "
          f"verify passes: {b:.2f} ms (at {a + b:.1f} ms for one row); the start-up curve says "
          f"{cb:.2f} ms (at {ca + cb:.1f}).")
    by_q = defaultdict(list)
    for m in methods:
        for q, ms in timers[m].passes:
            if q <= block:
                by_q[q].append(ms)
    print("\nMedian target pass by verified rows, every method's passes (count), beside the start-up "
          "curve:\n\n| rows | passes | median ms | start-up curve ms |\n|---|---|---|---|")
    for q in sorted(by_q):
        print(f"| {q} | {len(by_q[q])} | {statistics.median(by_q[q]):.1f} | {curve.verify(q):.1f} |")


if __name__ == "__main__":
    main()
