"""How much of what the drafter misses could have been copied from the context?

Replays the dflash steps of a bench's records (the committed greedy text and how many tokens
each target pass committed) and asks, at the start of every step, what dflashkit's context
lookup (lookup.py: the latest earlier occurrence of the longest matching n-gram of the last
``max_ngram`` tokens) would have committed there, its copy (at most the drafts of that
method's block) checked against the committed text. No model runs; only the tokenizer, to
rebuild the prompts. The steps stay where the drafter put them, so the figures estimate what
`dflash+lookup` would get rather than replay it.

Per method and shortest trusted n-gram (``min_ngram``):
- copies: the share of steps where the lookup found a match, and how often its first
  copied token was right;
- rule: the copy wherever there is one, else the drafter (what `dflash+lookup` does);
- oracle: each step the better of the two (an upper bound of verifying both).

A large gap between tau and the oracle says the drafter fails where the answer repeats its
context (a one-layer DFlash drafter cannot look the context up by the anchor: every MASK
slot's query is the same embedding).

    .venv/bin/python benchmarks/copy_potential.py \
        benchmarks/baseline/qwen2.5-coder-0.5b-instruct/humaneval/records.jsonl
"""

import argparse
import json

from dflashkit.lookup import ContextLookup
from dflashkit.suites import load_suite
from dflashkit.target import load_target_info


def block_of(method: str, records: list[dict]) -> int:
    """Drafts a method could verify: its fixed size, else the most it ever verified."""
    spec = method.partition(":")[2]
    if spec.isdigit():
        return int(spec) - 1
    return max(max(r["acceptance_lengths"]) for r in records if r["method"] == method) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", help="records.jsonl of a dflashkit bench run")
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--seed", type=int, default=0, help="the bench's --seed (which prompts it drew)")
    ap.add_argument("--min-ngram", default="1,2,3", help="comma-separated shortest n-grams to try")
    args = ap.parse_args()

    records = [json.loads(line) for line in open(args.records) if line.strip()]
    records = [r for r in records if r["method"].partition(":")[0] == "dflash" and r["turn"] == 0]
    if not records:
        raise SystemExit(f"{args.records}: no first-turn dflash records")
    info, _ = load_target_info(args.target, progress=False)
    suite = records[0]["suite"]
    wanted = {r["prompt_id"] for r in records}
    prompts = {p.id: p for p in load_suite(suite, len(wanted), seed=args.seed)}
    if not wanted <= prompts.keys():
        raise SystemExit(f"{args.records}: prompts {sorted(wanted - prompts.keys())[:3]} are not among "
                         f"the first {len(wanted)} of {suite} at seed {args.seed}; pass the bench's --seed")
    encoded = {}
    for pid in wanted:
        messages = [{"role": "user", "content": prompts[pid].turns[0]}]
        ids = info.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        encoded[pid] = list(ids["input_ids"] if isinstance(ids, dict) else ids)

    print(f"{suite}: {len(records)} first-turn dflash runs of {args.records}\n")
    print("| method | min n-gram | steps | tau (drafter) | steps with a copy | first copied token right "
          "| rule: copy, else drafter | oracle: better of the two |")
    print("|---|---|---|---|---|---|---|---|")
    for method in dict.fromkeys(r["method"] for r in records):
        limit = block_of(method, records)
        for min_n in (int(x) for x in args.min_ngram.split(",")):
            lookup = ContextLookup(min_ngram=min_n, max_ngram=max(min_n, 4))
            steps = drafter = rule = oracle = copies = first_right = 0
            for r in (r for r in records if r["method"] == method):
                # the prefill commits the first token; each step then commits out[pos:pos + a]
                ids, out, pos = encoded[r["prompt_id"]], r["tokens"], 1
                lookup.reset()
                for committed in r["acceptance_lengths"]:
                    copy = lookup.propose(ids + out[:pos], min(limit, len(out) - pos - 1))
                    truth = out[pos:]
                    hits = 0
                    while hits < min(len(copy), len(truth)) and copy[hits] == truth[hits]:
                        hits += 1
                    steps += 1
                    drafter += committed
                    if copy:
                        copies += 1
                        first_right += hits > 0
                        rule += hits + 1
                    else:
                        rule += committed
                    oracle += max(committed, hits + 1)
                    pos += committed
            print(f"| {method} | {min_n} | {steps} | {drafter / steps:.2f} | {copies / steps:.0%} | "
                  f"{first_right / max(copies, 1):.0%} | {rule / steps:.2f} | {oracle / steps:.2f} |")


if __name__ == "__main__":
    main()
