"""Teacher-forced acceptance of draft trees (dflashkit/tree.py) on the target's own answers.

As ``teacher_forced_eval.py``, but every block becomes the tree decoding would verify: the
drafter's per-slot top tokens and log-probs at that anchor through ``tree.build_tree``, walked
along the answer (greedy decoding commits the answer, so the target's choice after every node
is the answer's next token; ``tfeval.tree_accepted``). Walking those counts the way decoding
does gives the tau that ``dflashkit bench --methods dflash-tree:N`` reports, without a decode;
``chain`` is the block decoding verifies without a tree.

    python benchmarks/tree_walk.py RECORDS.jsonl DRAFTER --cache FEATURES.pt [--trees 7,15,31]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dflashkit.target import load_target
from dflashkit.tfeval import greedy_walk, slot_top_tokens, tree_accepted
from dflashkit.tree import build_tree, chain_tree
from teacher_forced_eval import answers, features, load_any, sequences


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path)
    ap.add_argument("drafter")
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--max-prompts", type=int, default=20)
    ap.add_argument("--trees", default="7,15,31", help="drafted tokens per tree, comma-separated")
    args = ap.parse_args(argv)
    budgets = [int(x) for x in args.trees.split(",")]
    torch.manual_seed(0)
    target = load_target(args.target, progress=False)
    drafter = load_any(args.drafter)
    rows = answers(args.records, args.max_prompts)
    seqs = sequences(target, rows)
    feats = features(target, seqs, drafter.target_layer_ids, args.cache)
    names = ["chain"] + [f"tree {n}" for n in budgets]
    every = {n: [] for n in names}
    walked = {n: [] for n in names}
    for (ids, prompt_len), f in zip(seqs, feats):
        anchors, top_ids, top_lp = slot_top_tokens(drafter, target, ids, prompt_len, f, max(budgets))
        answer = ids.tolist()
        for name in names:
            counts = []
            for a, t_ids, t_lp in zip(anchors.tolist(), top_ids, top_lp):
                tree = chain_tree(answer[a], t_ids[:, 0].tolist()) if name == "chain" else \
                    build_tree(answer[a], t_ids, t_lp, int(name.split()[1]))
                counts.append(tree_accepted(tree, answer, a))
            every[name] += counts
            walked[name] += greedy_walk(anchors, torch.tensor(counts))
    print(f"{len(seqs)} answers, {sum(int(s.numel()) - p for s, p in seqs)} answer tokens, "
          f"block size {drafter.block_size}")
    print("| drafts | tokens per verify pass | tau, every position | tau, greedy walk |")
    print("|---|---|---|---|")
    for name in names:
        width = drafter.block_size if name == "chain" else int(name.split()[1]) + 1
        print(f"| {name} | {width} | {1 + sum(every[name]) / len(every[name]):.2f} | "
              f"{1 + sum(walked[name]) / len(walked[name]):.2f} |")


if __name__ == "__main__":
    main()
