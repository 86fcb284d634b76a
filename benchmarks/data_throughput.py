"""Target throughput of the data stage per dtype: batched greedy generation (new samples)
against one forward pass over a finished sample (imported samples, `data.import_samples`).

    .venv/bin/python benchmarks/data_throughput.py --dtypes float32,bfloat16 --rounds 2

Both dtypes are loaded once and measured alternately, round by round, on the same prompts
(training prompts of `configs/experiments/data-v2.yaml`'s mix that the committed archive does
not hold; its first samples for the forward pass), so machine drift hits both alike. Prints
tokens/s per round and the median; a data stage is about `generated tokens / generation rate
+ imported tokens / forward rate` long.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from dataclasses import replace

import torch

from dflashkit.pipeline import load_config
from dflashkit.prompts import training_prompts
from dflashkit.regenerate import _generate_batch, _replay_batch
from dflashkit.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/experiments/data-v2.yaml")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=24, help="rows generated together")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    ap.add_argument("--replay", type=int, default=6, help="imported samples forwarded per round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cfg = load_config(args.config)
    d = cfg.data
    with gzip.open(d.import_samples, "rt") as f:
        archive = [json.loads(line) for line in f]
    held = {r["id"] for r in archive}
    mix = training_prompts(d.num_code, d.num_math, d.num_chat, seed=d.seed, num_docs=d.num_docs,
                           num_apis=d.num_apis, num_pkgs=d.num_pkgs)
    fresh = [p for p in mix if p["id"] not in held][:args.batch]
    targets = {name: load_target(cfg.target, dtype=name, progress=False) for name in args.dtypes.split(",")}
    first = next(iter(targets.values()))
    prompts = [ids for ids in (first.encode_prompt(p["messages"]) for p in fresh) if len(ids) <= d.max_prompt_tokens]
    replay = [(r["input_ids"][:r["prompt_len"]], r["input_ids"][r["prompt_len"]:]) for r in archive[:args.replay]]
    replay_tokens = sum(len(p) + len(r) - 1 for p, r in replay)
    gen_cfg = replace(d, max_new_tokens=args.new_tokens, teacher_top_k=0)
    rates = {name: {"generate": [], "forward": []} for name in targets}
    for rnd in range(args.rounds):
        for name, target in targets.items():
            t0 = time.perf_counter()
            with target.batched_attention():
                rows = _generate_batch(target, prompts, gen_cfg, target.stop_token_ids())
            gen = sum(len(r) for r, *_ in rows) / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            _replay_batch(target, replay, gen_cfg)
            fwd = replay_tokens / (time.perf_counter() - t0)
            rates[name]["generate"].append(gen)
            rates[name]["forward"].append(fwd)
            print(f"round {rnd + 1} {name}: generate {gen:.1f} tok/s ({len(prompts)} rows x up to "
                  f"{args.new_tokens}), forward {fwd:.1f} tok/s ({len(replay)} samples, "
                  f"{replay_tokens} tokens)", flush=True)
    print(f"\n{torch.get_num_threads()} threads; median over {args.rounds} rounds\n")
    print("| dtype | generate tok/s | forward tok/s |\n|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r['generate']):.1f} | {statistics.median(r['forward']):.1f} |")


if __name__ == "__main__":
    main()
