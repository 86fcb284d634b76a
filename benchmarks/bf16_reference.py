"""Is Hugging Face ``generate`` in bf16 a stable reference? Its greedy tokens under different
thread counts and batch sizes, beside our plain one-token loop on the bf16 fast path.

    .venv/bin/python benchmarks/bf16_reference.py --num-prompts 10 --max-new-tokens 128

For each HumanEval prompt of the bench's fixed subset (seed 0) it runs greedy decoding with
HF ``generate`` (PyTorch's default kernels) at 1 and 2 threads and with the prompt batched
twice, and our plain loop (B = 1, packed oneDNN kernels) at 1 and 2 threads, and prints the
first generated position where each differs from HF ``generate`` at 2 threads, batch 1 (the
bench's ``ar``). Only tokens are compared; timings are not measured here.
"""

import argparse

import torch

from dflashkit import baselines
from dflashkit.bench import first_difference
from dflashkit.decoding import speculative_generate
from dflashkit.suites import load_suite
from dflashkit.target import load_target


def shown_difference(a: list[int], b: list[int]) -> str:
    i = first_difference(a, b)
    return "-" if i is None else str(i)


def hf_generate(target, ids: list[int], n: int, batch: int) -> list[int]:
    if batch == 1:   # exactly the bench's ``ar``
        return baselines.hf_generate(target, ids, n).tokens
    x = torch.tensor([ids] * batch)
    with target.default_path(), torch.inference_mode():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                    do_sample=False, temperature=None, top_p=None, top_k=None,
                                    eos_token_id=target.stop_token_ids(),
                                    pad_token_id=target.pad_token_id() or 0)
    rows = out[:, len(ids):].tolist()
    if any(r != rows[0] for r in rows):
        print("  (the rows of one batch disagree with each other)")
    return baselines.cut_at_stop(rows[0], target.stop_token_ids())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    target = load_target(args.target, dtype="bfloat16")
    prompts = load_suite("humaneval", args.num_prompts, seed=0)
    cols = ["HF 1 thread", "HF batch 2", "ours 2 threads", "ours 1 thread"]
    print("first generated position differing from HF generate (2 threads, batch 1); - = identical")
    print("| prompt | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    counts = [0] * len(cols)
    for p in prompts:
        ids = target.encode_prompt([{"role": "user", "content": p.turns[0]}])
        torch.set_num_threads(2)
        ref = hf_generate(target, ids, args.max_new_tokens, 1)
        runs = []
        torch.set_num_threads(1)
        runs.append(hf_generate(target, ids, args.max_new_tokens, 1))
        torch.set_num_threads(2)
        runs.append(hf_generate(target, ids, args.max_new_tokens, 2))
        ours = speculative_generate(target, None, ids, args.max_new_tokens, block_size=1).tokens
        runs.append(ours)
        torch.set_num_threads(1)
        runs.append(speculative_generate(target, None, ids, args.max_new_tokens, block_size=1).tokens)
        torch.set_num_threads(2)
        diffs = [shown_difference(ref, r) for r in runs]
        counts = [c + (d != "-") for c, d in zip(counts, diffs)]
        print(f"| {p.id} | " + " | ".join(diffs) + " |", flush=True)
    print(f"| differ (of {len(prompts)}) | " + " | ".join(str(c) for c in counts) + " |")
    print("ours at 1 thread vs ours at 2 threads is the loop's own stability; the HF columns are "
          "HF generate's")


if __name__ == "__main__":
    main()
