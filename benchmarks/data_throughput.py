"""Target throughput of the data stage per dtype: batched greedy generation (new samples)
against one forward pass over a finished sample (imported samples, `data.import_samples`).

    .venv/bin/python benchmarks/data_throughput.py --dtypes float32,bfloat16 --rounds 2

Both dtypes are loaded once and measured alternately, round by round, on the same prompts
(training prompts of the config's mix that its `data.import_samples` do not hold, by default
`configs/experiments/part-10.yaml` and the committed archive part 10; their first samples for the
forward pass), so machine drift hits both alike. Prints
tokens/s per round and the median; a data stage is about `generated tokens / generation rate
+ imported tokens / forward rate` long.

On a GPU machine, where the target's weights cannot travel, `--random-weights CONFIG.json`
builds a model of the same shapes with random weights and feeds it random prompts of
`--prompt-tokens` tokens; no row stops early, so every row generates `--new-tokens`:

    python benchmarks/data_throughput.py --device cuda --random-weights config.json \
        --dtypes float32,bfloat16 --batch 24 --new-tokens 320
"""

from __future__ import annotations

import argparse
import statistics
import time

from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflashkit.drafter import default_target_layer_ids
from dflashkit.fastpath import resolve_dtype
from dflashkit.pipeline import load_config
from dflashkit.prompts import training_prompts
from dflashkit.regenerate import DataConfig, _generate_batch, _replay_batch, read_import, sources
from dflashkit.target import Target, load_target, resolve_device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/experiments/part-10.yaml")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=24, help="rows generated together")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    ap.add_argument("--replay", type=int, default=6, help="imported samples forwarded per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto: where the target runs")
    ap.add_argument("--random-weights", type=Path, default=None,
                    help="a config.json: a target of its shapes with random weights, random prompts")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="prompt length with --random-weights")
    args = ap.parse_args()
    setup = random_setup if args.random_weights else real_setup
    measure(args, *setup(args))


def random_setup(args):
    """Random-weight targets of a config's shapes (one per dtype) and random prompts."""
    config = AutoConfig.from_pretrained(args.random_weights.parent)
    device = resolve_device(args.device)
    targets = {}
    for name in args.dtypes.split(","):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(name)).to(device).eval()
        model.generation_config.eos_token_id = -1      # random weights: never stop early
        targets[name] = Target(model, None, name=f"random-{name}", fast_path=device.type == "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 30000, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.batch)]
    replay = [(p, torch.randint(1000, 30000, (args.new_tokens,), generator=g).tolist())
              for p in prompts[:args.replay]]
    layers = default_target_layer_ids(config.num_hidden_layers, 5)
    gen_cfg = DataConfig(max_new_tokens=args.new_tokens, teacher_top_k=0, feature_layers=layers)
    return targets, prompts, replay, gen_cfg, []


def real_setup(args):
    """The config's target (one per dtype), fresh prompts of its mix, archived samples."""
    cfg = load_config(args.config)
    d = cfg.data
    if not d.import_samples:
        raise SystemExit(f"{args.config}: data.import_samples is empty; the forward rate needs finished samples")
    archive = [r for source in sources(d.import_samples) for r in read_import(source).values()]
    held = {r["id"] for r in archive}
    mix = training_prompts(d.num_code, d.num_math, d.num_chat, seed=d.seed, num_docs=d.num_docs,
                           num_apis=d.num_apis, num_pkgs=d.num_pkgs, num_meths=d.num_meths)
    fresh = [p for p in mix if p["id"] not in held][:args.batch]
    targets = {name: load_target(cfg.target, dtype=name, progress=False, device=args.device)
               for name in args.dtypes.split(",")}
    first = next(iter(targets.values()))
    prompts = [ids for ids in (first.encode_prompt(p["messages"]) for p in fresh) if len(ids) <= d.max_prompt_tokens]
    replay = [(r["input_ids"][:r["prompt_len"]], r["input_ids"][r["prompt_len"]:]) for r in archive[:args.replay]]
    gen_cfg = replace(d, max_new_tokens=args.new_tokens, teacher_top_k=0)
    return targets, prompts, replay, gen_cfg, first.stop_token_ids()


def measure(args, targets, prompts, replay, gen_cfg, stops) -> None:
    """Generation and replay rates, the dtypes alternating round by round."""
    replay_tokens = sum(len(p) + len(r) - 1 for p, r in replay)
    first = next(iter(targets.values()))
    rates = {name: {"generate": [], "forward": []} for name in targets}
    for rnd in range(args.rounds):
        for name, target in targets.items():
            t0 = time.perf_counter()
            with target.batched_attention():
                rows = _generate_batch(target, prompts, gen_cfg, stops)
            gen = sum(len(r) for r, *_ in rows) / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            _replay_batch(target, [(p, r, {}) for p, r in replay], gen_cfg)   # {}: nothing to copy
            fwd = replay_tokens / (time.perf_counter() - t0)
            rates[name]["generate"].append(gen)
            rates[name]["forward"].append(fwd)
            print(f"round {rnd + 1} {name}: generate {gen:.1f} tok/s ({len(prompts)} rows x up to "
                  f"{args.new_tokens}), forward {fwd:.1f} tok/s ({len(replay)} samples, "
                  f"{replay_tokens} tokens)", flush=True)
    where = (torch.cuda.get_device_name(first.device) if first.device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"\n{where}; {len(prompts)} rows; median over {args.rounds} rounds\n")
    print("| dtype | generate tok/s | forward tok/s |\n|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r['generate']):.1f} | {statistics.median(r['forward']):.1f} |")


if __name__ == "__main__":
    main()
