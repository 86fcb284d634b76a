"""The DFlash training objective (DESIGN.md section 5).

For a sequence with target features for every token, sample anchors p among response
positions (loss_mask[p] and loss_mask[p+1]); each anchor gets a block
``[token[p], MASK * (B-1)]`` at positions p..p+B-1. All blocks of a sequence run in ONE
drafter pass against the full context, with a mask that lets block n see context positions
j < anchor_n (strictly: the anchor's own features are not yet known at inference) and its
own block (bidirectionally), never other blocks. Slot k predicts token[anchor + k] (the
same position: no shift), weighted by exp(-(k-1)/gamma). The loss is the weighted mean
cross-entropy, computed in chunks over a (possibly restricted) vocabulary.

Optionally (``distill`` > 0) each slot's cross-entropy is mixed with the cross-entropy
against the target's own distribution at that position (its top k, renormalised over the
tokens the drafter can propose; teacher.py): ``(1 - distill) * CE(label) + distill * CE(p)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .drafter import DFlashDrafter

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size / 2.2))


@dataclass
class Blocks:
    """All blocks of a batch of sequences, flattened to ``N*B`` query slots per sequence."""

    anchors: torch.Tensor    # [b, N] anchor positions (0 where invalid)
    valid: torch.Tensor      # [b, N] bool
    ids: torch.Tensor        # [b, N*B] block token ids
    positions: torch.Tensor  # [b, N*B] absolute positions
    labels: torch.Tensor     # [b, N*B] token at anchor + k (0 where out of range)
    weights: torch.Tensor    # [b, N*B] loss weights (0 for slot 0, padding, out of range, prompt)
    block_size: int
    teacher_ids: torch.Tensor | None = None    # [b, N*B, k] the target's top-k at each label (-1: none)
    teacher_logp: torch.Tensor | None = None   # [b, N*B, k] their log-probs

    def to(self, device: torch.device | str) -> "Blocks":
        """The same blocks on ``device`` (built on the CPU, trained on the drafter's device)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def vocabulary_index(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full token id -> row of a head restricted to the sorted ids ``vocab`` (-1: not in it)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    return index


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] and loss_mask[p+1] (1-D mask -> 1-D positions)."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``num_anchors`` candidates without replacement, sorted."""
    cand = anchor_candidates(loss_mask)
    if cand.numel() > num_anchors:
        pick = torch.randperm(cand.numel(), generator=generator)[:num_anchors]
        cand = cand[pick]
    return cand.sort().values


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: list[torch.Tensor],
                 block_size: int, mask_token_id: int, gamma: float,
                 num_blocks: int | None = None) -> Blocks:
    """Blocks, positions, same-position labels and decayed weights for each sequence.

    input_ids / loss_mask: [b, L] (padding has loss_mask 0). anchors: one 1-D tensor per row.
    """
    b, L = input_ids.shape
    B = block_size
    N = num_blocks or max(1, max(int(a.numel()) for a in anchors))
    anchor = torch.zeros(b, N, dtype=torch.long)
    valid = torch.zeros(b, N, dtype=torch.bool)
    for i, a in enumerate(anchors):
        anchor[i, :a.numel()] = a
        valid[i, :a.numel()] = True
    k = torch.arange(B)
    pos = anchor[:, :, None] + k                                    # [b, N, B]
    in_bounds = pos < L
    gathered = torch.gather(input_ids, 1, pos.clamp(max=L - 1).reshape(b, -1)).reshape(b, N, B)
    labels = torch.where(in_bounds, gathered, torch.zeros_like(gathered))
    lm = torch.gather(loss_mask.float(), 1, pos.clamp(max=L - 1).reshape(b, -1)).reshape(b, N, B)
    decay = torch.exp(-(k.float() - 1) / gamma) * (k > 0)
    weights = valid[:, :, None] * in_bounds * lm * decay
    ids = torch.full((b, N, B), mask_token_id, dtype=torch.long)
    ids[:, :, 0] = torch.gather(input_ids, 1, anchor)
    return Blocks(anchors=anchor, valid=valid, ids=ids.reshape(b, N * B), positions=pos.reshape(b, N * B),
                  labels=labels.reshape(b, N * B), weights=weights.reshape(b, N * B).float(), block_size=B)


def block_attention_mask(blocks: Blocks, context_len: int) -> torch.Tensor:
    """Boolean ``[b, 1, N*B, L + N*B]``: True where a block slot may attend.

    Context key j is visible iff j < anchor (by POSITION, so overlapping anchors cannot
    leak); block keys only within the same block; padding blocks see nothing.
    """
    b, N = blocks.anchors.shape
    B = blocks.block_size
    device = blocks.anchors.device
    j = torch.arange(context_len, device=device)
    ctx = (j[None, None, :] < blocks.anchors[:, :, None]) & blocks.valid[:, :, None]   # [b, N, L]
    ctx = ctx[:, :, None, :].expand(b, N, B, context_len).reshape(b, N * B, context_len)
    block_of = torch.arange(N * B, device=device) // B
    same = block_of[:, None] == block_of[None, :]                                    # [NB, NB]
    blk = same[None] & blocks.valid.repeat_interleave(B, dim=1)[:, :, None]
    return torch.cat([ctx, blk], dim=-1)[:, None]


def flex_block_mask(blocks: Blocks, context_len: int):
    """The same mask as ``block_attention_mask`` as a flex-attention BlockMask (sparse: blocks
    that cannot see each other are skipped instead of computed and masked)."""
    from torch.nn.attention.flex_attention import create_block_mask
    anchors, valid, B, L = blocks.anchors, blocks.valid, blocks.block_size, context_len
    b, N = anchors.shape

    def mask_mod(bi, _h, q_idx, kv_idx):
        n = q_idx // B
        ctx = (kv_idx < L) & (kv_idx < anchors[bi, n])
        own = (kv_idx >= L) & ((kv_idx - L) // B == n)
        return valid[bi, n] & (ctx | own)

    return create_block_mask(mask_mod, b, None, N * B, L + N * B, device=str(anchors.device))


def flex_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@dataclass
class LossOutput:
    loss: torch.Tensor            # weighted sum of CE / normaliser (differentiable)
    weighted_ce_sum: float        # detached numerator
    weight_sum: float
    slot_correct: torch.Tensor    # [B] top-1 correct at slot k (valid, labelled slots)
    slot_total: torch.Tensor      # [B]
    leading_correct: torch.Tensor  # [num valid blocks] leading correct slots per block
    num_queries: int


def _ce_chunk(hidden, head, labels, soft_rows=None, soft_p=None, distill=0.0):
    """Per row: the loss, the hard-label CE and the argmax. With a teacher, the loss mixes in
    ``-sum_j p_j log q(row_j)`` (soft_p zero where a teacher entry is unusable; rows whose
    teacher is all zero keep the hard CE alone)."""
    logits = (hidden @ head.T).float()
    hard = F.cross_entropy(logits, labels, reduction="none")
    loss = hard
    if soft_rows is not None and distill > 0:
        log_q = logits - logits.logsumexp(-1, keepdim=True)
        soft = -(soft_p * log_q.gather(-1, soft_rows)).sum(-1)
        has = soft_p.sum(-1) > 0
        loss = torch.where(has, (1 - distill) * hard + distill * soft, hard)
    return loss, hard.detach(), logits.argmax(-1)


@functools.cache
def compiled_ce_chunk():
    """``_ce_chunk`` through torch.compile, built once per process for any number of rows. On
    a CPU the head matmul is fast (AMX) and the time goes to passes over the [rows, vocab]
    logits (the float cast, the softmax and their backward), which Inductor fuses: 618 -> 407
    ms per 448 rows x 41,845 tokens on a 2-core Xeon (``benchmarks/ce_compile.py``)."""
    return torch.compile(_ce_chunk, dynamic=True)


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                          chunk: int, soft_rows: torch.Tensor | None = None,
                          soft_p: torch.Tensor | None = None, distill: float = 0.0,
                          compiled: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss, hard-label CE and argmax against ``head`` [V, H] without holding all
    logits at once. ``soft_rows``/``soft_p`` [n, k]: teacher rows of ``head`` and their
    probabilities, mixed in with weight ``distill``.

    With several chunks each one is recomputed in the backward pass (activation checkpointing),
    so only one chunk's logits are ever held. With a single chunk that saves nothing (the
    backward pass would hold those logits anyway) and the recompute costs a second head
    matmul and softmax, about a seventh of a CPU training step: it runs plainly."""
    losses, hards, preds = [], [], []
    recompute = torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] > chunk
    ce_chunk = compiled_ce_chunk() if compiled else _ce_chunk
    for s in range(0, hidden.shape[0], chunk):
        part = (hidden[s:s + chunk], head, labels[s:s + chunk],
                None if soft_rows is None else soft_rows[s:s + chunk],
                None if soft_p is None else soft_p[s:s + chunk], distill)
        if recompute:
            loss, hard, pred = checkpoint(ce_chunk, *part, use_reentrant=False)
        else:
            loss, hard, pred = ce_chunk(*part)
        losses.append(loss)
        hards.append(hard)
        preds.append(pred)
    return torch.cat(losses), torch.cat(hards), torch.cat(preds)


def teacher_targets(teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
                    vocab_index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the scored head and probabilities renormalised over the usable entries (in
    the draft vocabulary, present); all zero where none is usable."""
    ok = teacher_ids >= 0
    rows = teacher_ids.clamp(min=0)
    if vocab_index is not None:
        rows = vocab_index[rows]
        ok = ok & (rows >= 0)
        rows = rows.clamp(min=0)
    p = torch.where(ok, teacher_logp.float().exp(), torch.zeros((), dtype=torch.float32))
    return rows, p / p.sum(-1, keepdim=True).clamp(min=1e-30)


def dflash_loss(drafter: DFlashDrafter, embed: torch.nn.Module, head_weight: torch.Tensor,
                vocab_index: torch.Tensor | None, features: torch.Tensor, blocks: Blocks,
                normaliser: float | None = None, logits_chunk: int = 1024,
                attention: str = "sdpa", distill: float = 0.0, compile_ce: bool = False) -> LossOutput:
    """The DFlash loss for one batch of sequences with precomputed target features.

    head_weight: LM-head rows the drafter scores against ([V', H]; all rows or the draft
        vocabulary). vocab_index: full id -> row of head_weight (-1: not in the draft
        vocabulary; such labels get weight 0). normaliser: the global weight sum when this
        batch is one part of a larger (accumulated or distributed) batch.
    attention: "sdpa" (dense boolean mask; runs everywhere) or "flex" (sparse BlockMask).
    distill: weight of the cross-entropy against the teacher distributions in ``blocks``
        (needs ``blocks.teacher_ids``); ``weighted_ce_sum`` stays the hard-label CE either way,
        so logged losses compare across runs.
    compile_ce: the head cross-entropy through torch.compile (same result up to rounding).
    """
    b, L, _ = features.shape
    mask = flex_block_mask(blocks, L) if attention == "flex" else block_attention_mask(blocks, L)
    ctx_pos = torch.arange(L, device=features.device).expand(b, L)
    hidden = drafter(embed(blocks.ids), features, ctx_pos, blocks.positions, attn_mask=mask)
    labels, weights = blocks.labels, blocks.weights
    if vocab_index is not None:
        mapped = vocab_index[labels]
        weights = weights * (mapped >= 0)
        labels = mapped.clamp(min=0)
    keep = weights.reshape(-1) > 0
    h = hidden.reshape(-1, hidden.shape[-1])[keep]
    y, w = labels.reshape(-1)[keep], weights.reshape(-1)[keep]
    soft_rows = soft_p = None
    if distill > 0:
        if blocks.teacher_ids is None:
            raise ValueError("distill > 0 needs the teacher distributions in blocks (teacher.py)")
        k = blocks.teacher_ids.shape[-1]
        soft_rows, soft_p = teacher_targets(blocks.teacher_ids.reshape(-1, k)[keep],
                                            blocks.teacher_logp.reshape(-1, k)[keep], vocab_index)
    per_row, ce, pred = chunked_cross_entropy(h, head_weight, y, logits_chunk, soft_rows, soft_p, distill,
                                              compiled=compile_ce)
    wsum = float(w.sum())
    total = (ce * w).sum()
    loss = (per_row * w).sum() / (normaliser if normaliser is not None else max(wsum, 1e-9))
    # Per-slot accuracy and leading-correct counts (for the acceptance estimate).
    B = blocks.block_size
    correct_all = torch.zeros(b * hidden.shape[1], dtype=torch.bool, device=hidden.device)
    correct_all[keep] = pred == y
    labelled = keep.reshape(b, -1, B)
    correct = correct_all.reshape(b, -1, B)
    slot_correct = (correct & labelled).sum((0, 1))
    slot_total = labelled.sum((0, 1))
    lead = (correct[..., 1:] & labelled[..., 1:]).long().cumprod(-1).sum(-1)[blocks.valid]
    # the counts go back to the CPU, where callers add them up (the loss stays on the device)
    return LossOutput(loss=loss, weighted_ce_sum=float(total.detach()), weight_sum=wsum,
                      slot_correct=slot_correct.cpu(), slot_total=slot_total.cpu(),
                      leading_correct=lead.cpu(),
                      num_queries=int(keep.sum()))


def expected_acceptance_length(leading_correct: torch.Tensor) -> float:
    """Teacher-forced estimate of tau: 1 (the bonus) + mean leading correct drafts per block."""
    return 1.0 + float(leading_correct.float().mean()) if leading_correct.numel() else math.nan
