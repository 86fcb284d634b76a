"""Teacher-forced acceptance of drafters on the target's own benchmark answers.

A bench run's `ar` records hold the target's greedy answer to each prompt. Running the target
once over prompt + answer gives the features every drafter call would have seen; one training-
path drafter pass per sequence then scores a block at EVERY answer position. The leading-correct
count of a block is exactly what greedy decoding would accept at that position (the training
path and the decoding path give the same logits: tests/test_objective.py), so the mean is the
tau greedy decoding reaches with that block size, measured over all positions instead of the
positions one decode happens to visit, and in seconds instead of a decode per prompt.

    python benchmarks/teacher_forced_eval.py RECORDS.jsonl DRAFTER [DRAFTER ...] \
        [--cache FEATURES.pt] [--max-prompts 20]

Features are computed once per (records, target layers) and cached in ``--cache``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflashkit.checkpoint import atomic_write, load_drafter
from dflashkit.objective import build_blocks, default_gamma, dflash_loss, anchor_candidates
from dflashkit.suites import load_suite
from dflashkit.target import load_target


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
    feats = [target.forward(ids[None], 0, None, capture=layer_ids, last_only=True).features.to(torch.bfloat16)
             for ids, _ in seqs]
    if cache is not None:
        atomic_write(cache, lambda tmp: torch.save({"key": key, "features": feats}, tmp))
    return feats


@torch.no_grad()
def score(drafter, target, seqs, feats, block_size: int | None = None) -> dict:
    B = block_size or drafter.block_size
    vocab = drafter.draft_vocab
    V = target.num_embeddings
    head = target.lm_head.weight
    index = None
    if vocab is not None:
        head = head[vocab]
        index = torch.full((V,), -1, dtype=torch.long)
        index[vocab] = torch.arange(vocab.numel())
    correct, total, lead, walk = torch.zeros(B), torch.zeros(B), [], []
    for (ids, prompt_len), f in zip(seqs, feats):
        lm = torch.zeros_like(ids)
        lm[prompt_len:] = 1
        anchors = anchor_candidates(lm)
        blocks = build_blocks(ids[None], lm[None], [anchors], B, drafter.mask_token_id, default_gamma(B))
        out = dflash_loss(drafter, target.embed, head, index, f.float(), blocks)
        correct += out.slot_correct
        total += out.slot_total
        lead.append(out.leading_correct)
        walk.append(greedy_walk(anchors, out.leading_correct))
    lead = torch.cat(lead).float()
    steps = sum(len(w) for w in walk)
    return {"tau": 1 + float(lead.mean()), "slot_acc": (correct / total.clamp(min=1)).tolist()[1:],
            "blocks": int(lead.numel()), "walk_tau": 1 + sum(sum(w) for w in walk) / max(steps, 1)}


def greedy_walk(anchors: torch.Tensor, leading: torch.Tensor) -> list[int]:
    """The anchors greedy decoding visits: from the first answer token, each step commits
    the accepted drafts plus the bonus token, so the next anchor is n + 1 further on."""
    by_pos = dict(zip(anchors.tolist(), leading.tolist()))
    pos, out = int(anchors[0]) if anchors.numel() else 0, []
    while pos in by_pos:
        out.append(by_pos[pos])
        pos += by_pos[pos] + 1
    return out


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
    drafters = [load_drafter(d) for d in args.drafters]
    layer_ids = drafters[0].target_layer_ids
    if any(d.target_layer_ids != layer_ids for d in drafters):
        sys.exit("every drafter must read the same target layers (one feature pass serves all)")
    feats = features(target, seqs, layer_ids, args.cache)
    print(f"{len(seqs)} answers, {sum(int(s.numel()) - p for s, p in seqs)} answer tokens")
    print("| drafter | blocks | tau, every position | tau, positions greedy decoding visits | slot accuracy 1..4 |")
    print("|---|---|---|---|---|")
    for path, d in zip(args.drafters, drafters):
        s = score(d, target, seqs, feats, args.block_size)
        print(f"| {path} | {s['blocks']} | {s['tau']:.2f} | {s['walk_tau']:.2f} | {' / '.join(f'{a:.2f}' for a in s['slot_acc'][:4])} |")


if __name__ == "__main__":
    main()
