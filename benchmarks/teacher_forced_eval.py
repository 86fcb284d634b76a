"""Teacher-forced acceptance of drafters on the target's own benchmark answers (tfeval.py).

A bench run's `ar` records hold the target's greedy answer to each prompt: one target forward
per answer gives the features, then each drafter is scored at every answer position and along
the greedy walk, whose tau is what decoding at that block size reports.

    python benchmarks/teacher_forced_eval.py RECORDS.jsonl DRAFTER [DRAFTER ...] \
        [--cache FEATURES.pt] [--max-prompts 20]

DRAFTER: a drafter folder, or a trainer's ``last.pt`` (to follow a run while it trains).

Features are computed once per (records, target layers) and cached in ``--cache``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflashkit.checkpoint import atomic_write, load_drafter
from dflashkit.drafter import DFlashDrafter, DrafterConfig
from dflashkit.suites import load_suite
from dflashkit.target import load_target
from dflashkit.tfeval import acceptance_profile


def load_any(path: str) -> DFlashDrafter:
    """A drafter folder, or a training checkpoint (``last.pt``) to judge a run while it trains."""
    if not path.endswith(".pt"):
        return load_drafter(path)
    blob = torch.load(path, weights_only=False, map_location="cpu")
    drafter = DFlashDrafter(DrafterConfig(**blob["drafter_config"]))
    drafter.load_state_dict(blob["drafter"])
    drafter.draft_vocab = blob["vocab"]
    return drafter.eval()


def answers(records_path: Path, max_prompts: int) -> list[dict]:
    rows = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["method"] == "ar" and r["turn"] == 0][:max_prompts]
    if not rows:
        raise SystemExit(f"{records_path}: no first-turn `ar` records (the target's own answers)")
    return rows


def sequences(target, rows: list[dict]) -> list[tuple[torch.Tensor, int]]:
    suites = {}
    out = []
    for r in rows:
        if r["suite"] not in suites:
            suites[r["suite"]] = {p.id: p for p in load_suite(r["suite"], 10_000)}
        prompt = target.encode_prompt([{"role": "user", "content": suites[r["suite"]][r["prompt_id"]].turns[0]}])
        out.append((torch.tensor(prompt + r["tokens"], dtype=torch.long), len(prompt)))
    return out


def features(target, seqs, layer_ids: list[int], cache: Path | None) -> list[torch.Tensor]:
    key = {"layers": layer_ids, "lengths": [int(s.numel()) for s, _ in seqs]}
    if cache is not None and cache.exists():
        blob = torch.load(cache)
        if blob["key"] == key:
            return blob["features"]
    feats = [target.features(ids[None], layer_ids).to(torch.bfloat16) for ids, _ in seqs]
    if cache is not None:
        atomic_write(cache, lambda tmp: torch.save({"key": key, "features": feats}, tmp))
    return feats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path)
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--max-prompts", type=int, default=20)
    ap.add_argument("--block-size", type=int)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    target = load_target(args.target, progress=False)
    rows = answers(args.records, args.max_prompts)
    seqs = sequences(target, rows)
    drafters = [load_any(d) for d in args.drafters]
    layer_ids = drafters[0].target_layer_ids
    if any(d.target_layer_ids != layer_ids for d in drafters):
        sys.exit("every drafter must read the same target layers (one feature pass serves all)")
    feats = features(target, seqs, layer_ids, args.cache)
    print(f"{len(seqs)} answers, {sum(int(s.numel()) - p for s, p in seqs)} answer tokens")
    print("| drafter | blocks | tau, every position | tau, positions greedy decoding visits | slot accuracy 1..4 |")
    print("|---|---|---|---|---|")
    for path, d in zip(args.drafters, drafters):
        p = acceptance_profile(d, target, seqs, feats, args.block_size)
        print(f"| {path} | {p.blocks} | {p.tau_every_position:.2f} | {p.tau_greedy_walk:.2f} | "
              f"{' / '.join(f'{a:.2f}' for a in p.slot_accuracy[:4])} |")


if __name__ == "__main__":
    main()
