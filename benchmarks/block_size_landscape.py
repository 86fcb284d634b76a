"""How much can the choice of block size buy on this machine? Replays real decoding steps
under the measured cost curve: every fixed number of drafts, the policy's start-up choice,
and an ideal-calibration upper bound that picks each step's size from the drafter's own
confidence (cross-fitted, so it never sees the steps it is scored on).

    .venv/bin/python benchmarks/block_size_landscape.py --num-prompts 10

It decodes greedily with the full block (bf16 fast path, shipped drafter, HumanEval prompts
of seed 2 plus a few GSM ones), recording for every step the drafter's proposals, its top
probability per slot, and how many proposals the committed text matched. Verifying n drafts
of a step would have committed min(matched, n) + 1 tokens at cost verify(n + 1) + draft
(ms, the start-up curve). A flat table means the block size hardly matters here and an
adaptive policy can at best tie the best fixed size.
"""

import argparse
import statistics

import torch

from dflashkit.checkpoint import load_drafter
from dflashkit.costs import cost_curve
from dflashkit.decoding import DFlashProposer, speculative_generate
from dflashkit.suites import load_suite
from dflashkit.target import load_target

CONFIDENCE_BINS = [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98]


class RecordingProposer(DFlashProposer):
    """The shipped proposer, keeping each proposal and the drafter's top probability per slot."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps: list[tuple[int, list[int], list[float]]] = []

    def propose(self, committed, new_features, num_slots, sampling, generator):
        proposal, probs = super().propose(committed, new_features, num_slots, sampling, generator)
        top = self.last_logits.float().softmax(-1).max(-1).values.tolist()
        self.steps.append((committed.shape[-1] - 1, proposal.tolist(), top))
        return proposal, probs


def record_steps(target, proposer, prompts, max_new_tokens):
    """One dict per decoding step with a full block: prompt id, matched proposals, top probs."""
    steps = []
    for p in prompts:
        ids = target.encode_prompt([{"role": "user", "content": p.turns[0]}])
        proposer.steps = []
        r = speculative_generate(target, proposer, ids, max_new_tokens,
                                 block_size=proposer.drafter.block_size)
        text = ids + r.tokens
        slots = proposer.drafter.block_size - 1
        for pos, proposal, top in proposer.steps:
            actual = text[pos + 1:pos + 1 + len(proposal)]
            if len(proposal) < slots or len(actual) < slots:
                continue       # the last steps of an answer: a shorter block, or no text to judge it
            matched = next((k for k, (a, b) in enumerate(zip(proposal, actual)) if a != b), len(proposal))
            steps.append({"prompt": p.id, "matched": matched, "top": top})
        print(f"{p.id}: tau {r.stats.tau:.2f}", flush=True)
    return steps


def confidence_bin(p: float) -> int:
    return sum(p >= edge for edge in CONFIDENCE_BINS)


def fit_acceptance(steps):
    """P(slot k accepted | slots before it accepted, top-probability bin of slot k), with a
    uniform Beta(1, 1) prior per cell."""
    hits, seen = {}, {}
    for s in steps:
        for k, p in enumerate(s["top"]):
            cell = (k, confidence_bin(p))
            seen[cell] = seen.get(cell, 0) + 1
            hits[cell] = hits.get(cell, 0) + (s["matched"] > k)
            if s["matched"] <= k:
                break
    return lambda k, p: (hits.get((k, confidence_bin(p)), 0) + 1) / (seen.get((k, confidence_bin(p)), 0) + 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafter", default="checkpoints/qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--num-prompts", type=int, default=10, help="HumanEval prompts (plus a third as many GSM)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    target = load_target(args.target, dtype="bfloat16")
    proposer = RecordingProposer(load_drafter(args.drafter), target)
    slots = proposer.drafter.block_size - 1
    curve = cost_curve(target, proposer, max_q=slots + 1)
    prompts = (load_suite("humaneval", args.num_prompts, seed=2)
               + load_suite("gsm", max(1, args.num_prompts // 3), seed=2))
    steps = record_steps(target, proposer, prompts, args.max_new_tokens)

    def cost(n: int) -> float:
        return curve.verify(n + 1) + (curve.draft_ms if n else 0.0)

    def rate(choices: list[int], subset) -> float:
        tokens = sum(min(s["matched"], n) + 1 for s, n in zip(subset, choices))
        return 1000 * tokens / sum(cost(n) for n in choices)

    def by_confidence(model, s) -> int:
        best, best_rate, expected, prefix = 0, 1 / cost(0), 1.0, 1.0
        for n in range(1, slots + 1):
            prefix *= model(n - 1, s["top"][n - 1])
            expected += prefix
            if expected / cost(n) > best_rate:
                best, best_rate = n, expected / cost(n)
        return best

    print(f"\n{len(steps)} steps of {len(prompts)} prompts; cost curve (ms, verify q = 1..{slots + 1}): "
          + ", ".join(f"{curve.verify(q):.1f}" for q in range(1, slots + 2)) + f"; draft {curve.draft_ms:.1f}")
    print("\n| drafts verified per step | committed tokens/s (replayed) | vs best fixed |\n|---|---|---|")
    fixed = {n: rate([n] * len(steps), steps) for n in range(slots + 1)}
    best = max(fixed.values())
    for n, r in fixed.items():
        print(f"| fixed {n} | {r:.2f} | {r / best:.3f} |")
    # Cross-fitted: the calibration is fitted on half the prompts and scored on the other half.
    ids = sorted({s["prompt"] for s in steps})
    tokens = ms = 0.0
    for half in (set(ids[0::2]), set(ids[1::2])):
        model = fit_acceptance([s for s in steps if s["prompt"] in half])
        test = [s for s in steps if s["prompt"] not in half]
        choices = [by_confidence(model, s) for s in test]
        tokens += sum(min(s["matched"], n) + 1 for s, n in zip(test, choices))
        ms += sum(cost(n) for n in choices)
    print(f"| per step, from the drafter's confidence | {1000 * tokens / ms:.2f} | {1000 * tokens / ms / best:.3f} |")
    print(f"\nmedian top probability of slot 1: {statistics.median(s['top'][0] for s in steps):.2f}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
