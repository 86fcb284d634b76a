"""Judge a drafter in seconds: teacher-forced acceptance on the target's own answers.

Greedy decoding commits exactly the target's greedy answer, so once that answer is known (a
bench run's ``ar`` records hold it) the drafts of every step are determined: the block
anchored at position p sees the target's features of everything before p, and accepts the
leading drafts that equal the answer. One target forward over prompt + answer gives all the
features, and one training-path drafter pass (objective.py; it gives the decoding path's
logits) scores a block at EVERY answer position. Walking those counts the way decoding does
(from the first answer token, each step moves on by the accepted drafts plus the bonus)
reproduces decoding's acceptance lengths, without a decode (tests/test_real_models.py).

Draft trees (tree.py) are judged the same way: the drafter's per-slot top tokens at every
anchor (``slot_top_tokens``) give the tree decoding would verify there, and the drafts it
accepts are the tree walked along the answer (``tree_accepted``).

Two figures come out: tau along that greedy walk (what ``dflashkit generate`` and ``bench``
report at a fixed block size), and tau averaged over every position, which is higher: decoding
lands right after each rejection, where the next tokens are harder to guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafter import DFlashDrafter
from .objective import (anchor_candidates, block_attention_mask, build_blocks, default_gamma, dflash_loss,
                        vocabulary_index)
from .tree import DraftTree, walk_tree


@dataclass
class AcceptanceProfile:
    blocks: int                # anchors scored (every answer position with a next token)
    tau_every_position: float  # 1 + mean leading accepted drafts over all anchors
    tau_greedy_walk: float     # the same over the anchors greedy decoding visits
    walk_steps: int
    slot_accuracy: list[float]  # top-1 accuracy of slots 1..B-1 (teacher-forced)


def greedy_walk(anchors: torch.Tensor, leading: torch.Tensor) -> list[int]:
    """Accepted drafts at each anchor greedy decoding visits. Decoding starts at the first
    answer token (the prefill's) and each step commits the accepted drafts and the bonus."""
    by_position = dict(zip(anchors.tolist(), leading.tolist()))
    position = int(anchors[0]) if anchors.numel() else 0
    steps = []
    while position in by_position:
        steps.append(by_position[position])
        position += by_position[position] + 1
    return steps


def answer_blocks(drafter: DFlashDrafter, ids: torch.Tensor, prompt_len: int, features: torch.Tensor,
                  block_size: int):
    """A block anchored at every answer position of ``ids`` (prompt + answer), and ``features``
    padded to every token (the last token is never context: its features are not needed)."""
    L = ids.numel()
    if features.shape[1] < L:
        pad = features.new_zeros(1, L - features.shape[1], features.shape[2])
        features = torch.cat([features, pad], dim=1)
    loss_mask = torch.zeros_like(ids)
    loss_mask[prompt_len:] = 1
    anchors = anchor_candidates(loss_mask)
    blocks = build_blocks(ids[None], loss_mask[None], [anchors], block_size, drafter.mask_token_id,
                          default_gamma(block_size))
    return anchors, blocks, features[:, :L].float()


@torch.no_grad()
def leading_accepted(drafter: DFlashDrafter, embed, head_weight: torch.Tensor, ids: torch.Tensor,
                     prompt_len: int, features: torch.Tensor, block_size: int | None = None,
                     vocab_index: torch.Tensor | None = None):
    """For every answer position p: how many drafts of the block anchored at p equal the answer.

    ids: ``[L]`` prompt + answer; features: ``[1, L, K*H]`` (or at least L-1 rows) of the
    drafter's target layers. head_weight / vocab_index as ``objective.dflash_loss``.
    Returns (anchors, leading counts, per-slot correct, per-slot total).
    """
    anchors, blocks, features = answer_blocks(drafter, ids, prompt_len, features,
                                              block_size or drafter.block_size)
    out = dflash_loss(drafter, embed, head_weight, vocab_index, features, blocks)
    return anchors, out.leading_correct, out.slot_correct, out.slot_total


def proposal_head(drafter: DFlashDrafter, target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM-head rows the drafter proposes from, as decoding uses them (its draft vocabulary,
    or all), and the id -> row index ``dflash_loss`` takes (None for the full head)."""
    head = target.lm_head.weight
    if drafter.draft_vocab is None:
        return head, None
    return head[drafter.draft_vocab], vocabulary_index(drafter.draft_vocab, target.num_embeddings)


def acceptance_profile(drafter: DFlashDrafter, target, answers: list[tuple[torch.Tensor, int]],
                       features: list[torch.Tensor], block_size: int | None = None) -> AcceptanceProfile:
    """Teacher-forced acceptance of ``drafter`` over ``answers`` (``(ids, prompt_len)`` pairs)
    with their target ``features``; ``target`` gives the embedding and LM head."""
    B = block_size or drafter.block_size
    head, index = proposal_head(drafter, target)
    correct, total, every, walked = torch.zeros(B), torch.zeros(B), [], []
    for (ids, prompt_len), f in zip(answers, features):
        anchors, leading, c, t = leading_accepted(drafter, target.embed, head, ids, prompt_len, f, B, index)
        correct += c
        total += t
        every.append(leading)
        walked += greedy_walk(anchors, leading)
    every = torch.cat(every).float() if every else torch.zeros(0)
    return AcceptanceProfile(
        blocks=int(every.numel()),
        tau_every_position=1 + float(every.mean()) if every.numel() else float("nan"),
        tau_greedy_walk=1 + sum(walked) / len(walked) if walked else float("nan"),
        walk_steps=len(walked),
        slot_accuracy=(correct / total.clamp(min=1)).tolist()[1:])


@torch.no_grad()
def slot_top_tokens(drafter: DFlashDrafter, target, ids: torch.Tensor, prompt_len: int,
                    features: torch.Tensor, k: int):
    """At every answer position p: the drafter's top-k target ids and log-probs for slots
    1..B-1 of the block anchored at p, from one training-path pass (what decoding's
    ``DFlashProposer.propose_top`` gives there). Returns (anchors, ids [n, B-1, k], log-probs)."""
    L, B = ids.numel(), drafter.block_size
    anchors, blocks, features = answer_blocks(drafter, ids, prompt_len, features, B)
    hidden = drafter(target.embed(blocks.ids), features, torch.arange(L)[None],
                     blocks.positions, attn_mask=block_attention_mask(blocks, L))
    head, _ = proposal_head(drafter, target)
    logits = (hidden[0] @ head.T).float().reshape(anchors.numel(), B, -1)[:, 1:]
    top = logits.log_softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
    vocab = drafter.draft_vocab
    return anchors, (top.indices if vocab is None else vocab[top.indices]), top.values


def tree_accepted(tree: DraftTree, answer: list[int], anchor: int) -> int:
    """Drafts of ``tree`` (rooted at ``anchor``) that greedy decoding accepts: the target's
    choice after each node is the answer's next token."""
    def choose(node: int) -> int:
        p = anchor + tree.depths[node] + 1
        return answer[p] if p < len(answer) else -1
    return len(walk_tree(tree, choose)[0])
