"""CPU cost of each part of a decoding step: target verify over q tokens, drafter body, and the
LM head the drafter borrows (full 152k rows vs a restricted draft vocabulary).

    .venv/bin/python benchmarks/part_costs.py --target qwen2.5-coder-0.5b-instruct

Prints a table of median milliseconds (several repeats, after warm-up); compare parts within
one run, since this machine is noisy.
"""

import argparse

import torch

from dflashkit.costs import median_ms
from dflashkit.drafter import ContextCache, config_for_target, init_drafter
from dflashkit.target import load_target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=16000, help="restricted draft vocabulary size")
    args = ap.parse_args()
    target = load_target(args.target)
    torch.manual_seed(0)
    prompt = torch.randint(100, 20000, (1, args.kv))
    cache = target.new_cache()
    target.forward(prompt, 0, cache)
    rows = []
    with torch.inference_mode():
        for q in (1, 2, 4, 8, 16):
            block = torch.randint(100, 20000, (1, q))

            def verify():
                target.forward(block, args.kv, cache, capture=[1, 6, 11, 16, 21])
                target.rollback(cache, args.kv)
            rows.append((f"target forward, q={q} (KV {args.kv})", median_ms(verify)))
        head = target.lm_head.weight
        small = head[: args.vocab].contiguous()
        for layers in (1, 2):
            cfg = config_for_target(target, num_layers=layers, block_size=8, target_layer_ids=[1, 6, 11, 16, 21])
            drafter = init_drafter(cfg).eval()
            feats = torch.randn(1, args.kv, 5 * target.hidden_size)
            dcache = ContextCache(layers)
            drafter(target.embed(block[:, :1]), feats, torch.arange(args.kv)[None],
                    torch.arange(args.kv, args.kv + 1)[None], cache=dcache)
            blk = target.embed(torch.randint(100, 20000, (1, 8)))
            new = torch.randn(1, 3, 5 * target.hidden_size)

            def body():
                cache_len = dcache.length
                drafter(blk, new, torch.arange(cache_len, cache_len + 3)[None],
                        torch.arange(cache_len + 3, cache_len + 11)[None], cache=dcache)
                dcache.crop(cache_len)
            rows.append((f"drafter body, {layers} layer(s), block 8, 3 new context tokens", median_ms(body)))
        hidden = torch.randn(7, target.hidden_size)
        rows.append(("drafter LM head, 7 slots, full vocabulary (151936 rows)", median_ms(lambda: hidden @ head.T)))
        rows.append((f"drafter LM head, 7 slots, draft vocabulary ({args.vocab} rows)",
                     median_ms(lambda: hidden @ small.T)))
    print(f"| part ({args.target}, fp32, {torch.get_num_threads()} threads) | median ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
