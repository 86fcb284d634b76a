"""The adaptive block size against fixed sizes, in one process, greedy, the shipped drafter,
HumanEval prompts of the bench's subset for a seed. No HF generate: this isolates the policy.
Methods run prompt by prompt in a rotating order (each method takes each position equally
often), and one policy object serves every prompt, as in the bench and the server.

    .venv/bin/python benchmarks/auto_vs_fixed.py --sizes 5,6 --num-prompts 40 --seed 3

Prints per prompt the decode tokens/s of each method, then per fixed size the paired speed
ratio auto/fixed (median over prompts with a bootstrap 95% interval of the median, and pooled
as total tokens over total decode time), ms per step, tokens per step, drafts verified per
step, and whether every output equals the fixed sizes' (they must: all are lossless).
"""

from __future__ import annotations

import argparse
import json

from dflashkit.checkpoint import load_drafter
from dflashkit.costs import cost_curve
from dflashkit.decoding import DFlashProposer, speculative_generate
from dflashkit.policy import AdaptiveBlockSize
from dflashkit.report import Record, paired_comparison
from dflashkit.suites import load_suite
from dflashkit.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafter", default="checkpoints/qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sizes", default="5,6", help="fixed block sizes beside auto")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", help="write every run as JSON lines here")
    args = ap.parse_args()
    target = load_target(args.target, dtype=args.dtype, progress=False)
    proposer = DFlashProposer(load_drafter(args.drafter), target)
    block = proposer.drafter.block_size
    policy = AdaptiveBlockSize(cost_curve(target, proposer, max_q=block), max_drafts=block - 1)
    methods = {"auto": policy} | {f"fixed{b}": int(b) for b in args.sizes.split(",")}
    names = list(methods)
    runs: dict[str, list[dict]] = {m: [] for m in names}
    out = open(args.out, "w") if args.out else None
    for i, prompt in enumerate(load_suite("humaneval", args.num_prompts, seed=args.seed)):
        ids = target.encode_prompt([{"role": "user", "content": prompt.turns[0]}])
        order = names[i % len(names):] + names[:i % len(names)]
        row = {}
        for m in order:
            r = speculative_generate(target, proposer, ids, max_new_tokens=args.max_new_tokens,
                                     block_size=methods[m])
            s = r.stats
            rec = {"prompt": prompt.id, "method": m, "position": order.index(m), "tokens": r.tokens,
                   "decode_s": s.decode_s, "steps": len(s.acceptance_lengths),
                   "drafts": sum(v - 1 for v in s.verify_sizes)}
            runs[m].append(rec)
            row[m] = (len(r.tokens) - 1) / s.decode_s
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
        print(prompt.id, " ".join(f"{m} {row[m]:.2f}" for m in names), flush=True)
    print(f"\n{len(runs['auto'])} prompts, seed {args.seed}, {args.max_new_tokens} new tokens, {args.dtype}\n")
    print("| method | tok/s (pooled) | ms/step | tokens/step | drafts/step | auto vs it: median (95% interval), pooled | auto faster on |")
    print("|---|---|---|---|---|---|---|")
    records = [Record("humaneval", r["prompt"], 0, m, len(r["tokens"]), 0.0, r["decode_s"], r["tokens"])
               for m in names for r in runs[m]]
    for m in names:
        rs = runs[m]
        dec, tok, steps = sum(r["decode_s"] for r in rs), sum(len(r["tokens"]) - 1 for r in rs), sum(r["steps"] for r in rs)
        cell = faster = "-"
        if m != "auto":
            c = paired_comparison(records, "auto", m)["humaneval"]
            lo, hi = c["ci95"]
            cell = f"{c['median']:.3f}x ({lo:.3f}-{hi:.3f}), {c['pooled']:.3f}x"
            faster = f"{c['wins']} of {c['pairs']}"
        print(f"| {m} | {tok / dec:.2f} | {1000 * dec / steps:.1f} | {tok / steps:.3f} | "
              f"{sum(r['drafts'] for r in rs) / steps:.2f} | {cell} | {faster} |")
    same = all(a["tokens"] == b["tokens"] for m in names[1:] for a, b in zip(runs["auto"], runs[m]))
    print(f"\nevery output identical across methods: {same}")


if __name__ == "__main__":
    main()
