"""Several requests decoded together: one target verify pass per step for all rows.

Each row drafts on its own (the drafter is cheap and its context cache is per row), then
one target forward verifies every row's block at once, and each row commits its own number
of accepted tokens. Rows share one KV cache whose length grows by the block width every
step; a row's rejected (or padding) entries stay in the cache as holes that its attention
mask hides, and every row runs at its own positions (RoPE uses position ids, not cache
slots). A row that finishes leaves the batch at once. Acceptance per row is exactly the
single-request rule (decoding.py), so each request gets the target's own output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .decoding import (DFlashProposer, GenerationResult, GenerationStats, _accept_greedy,
                       _accept_match, _accept_rejection, plan_step)
from .drafter import ContextCache, DFlashDrafter
from .policy import AdaptiveBlockSize
from .sampling import SamplingConfig, sample, target_probs
from .target import Target, TargetError


@dataclass
class BatchRequest:
    input_ids: list[int]
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: list[int] | None = None        # default: the target's EOS ids
    # on_commit(new_ids, accepted_from_draft) -> False ends this row (client gone, stop string)
    on_commit: Callable[[list[int], int], bool | None] | None = None
    on_finish: Callable[[GenerationResult], None] | None = None     # called once, when it ends


@dataclass
class _Row:
    request: BatchRequest
    committed: list[int]
    generated: list[int]
    stops: set[int]
    stats: GenerationStats
    generator: torch.Generator | None
    context: ContextCache | None
    pending: torch.Tensor | None = None
    stop_reason: str = "max_new_tokens"
    done: bool = False
    started: float = 0.0
    observations: list[tuple[int, list[int]]] = field(default_factory=list)


def _validate(target: Target, req: BatchRequest) -> list[int]:
    ids = list(req.input_ids)
    if not ids:
        raise ValueError("a prompt is empty: give at least one token")
    if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {req.max_new_tokens!r}")
    if any(not 0 <= i < target.num_embeddings for i in ids):
        raise ValueError(f"prompt token ids must be in [0, {target.num_embeddings}) for this target")
    if len(ids) + req.max_new_tokens > target.max_positions:
        raise TargetError(f"prompt ({len(ids)} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds "
                          f"the target's context of {target.max_positions} tokens")
    return ids


def _resolve_block_size(drafter, block_size):
    policy = block_size if isinstance(block_size, AdaptiveBlockSize) else None
    if policy is not None:
        block_size = policy.max_drafts + 1
    if block_size is None:
        block_size = drafter.drafter.block_size if isinstance(drafter, DFlashProposer) else (
            16 if drafter is not None else 1)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if block_size > 1 and drafter is None:
        raise ValueError("block_size > 1 needs a drafter; use block_size=1 for plain decoding")
    return block_size, policy


class BatchDecoder:
    """Rows decoded together; new requests join at any step boundary (continuous batching).

    ``add`` prefills the new prompts (left-padded among themselves) and merges their cache
    rows into the running batch, padding the shorter side with holes on the left; ``step``
    runs one draft + verify step for every row; a finished row leaves at once and its
    request's ``on_finish`` gets the result.
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | DFlashProposer | None,
                 block_size: int | AdaptiveBlockSize | None = None, acceptance: str = "match"):
        if acceptance not in ("match", "rejection"):
            raise ValueError(f"acceptance must be 'match' or 'rejection', got {acceptance!r}")
        if isinstance(drafter, DFlashDrafter):
            drafter = DFlashProposer(drafter, target)
        self.block_size, self.policy = _resolve_block_size(drafter, block_size)
        if self.block_size == 1:
            drafter, self.policy = None, None
        self.target, self.drafter, self.acceptance = target, drafter, acceptance
        self.capture = drafter.feature_layers if drafter is not None else None
        self.rows: list[_Row] = []          # active rows, in cache-row order
        self.cache = None
        self.mask: torch.Tensor | None = None   # [rows, physical cache length]: 1 = valid entry

    @property
    def active(self) -> int:
        return len(self.rows)

    def _new_row(self, req: BatchRequest, ids: list[int]) -> _Row:
        generator = None
        if not req.sampling.greedy:
            generator = torch.Generator(device="cpu")
            if req.sampling.seed is not None:
                generator.manual_seed(req.sampling.seed)
            else:
                generator.seed()
        stops = set(self.target.stop_token_ids() if req.stop_token_ids is None else req.stop_token_ids)
        b = self.block_size
        return _Row(req, list(ids), [], stops,
                    GenerationStats(prompt_tokens=len(ids), slot_accepted=[0] * (b - 1),
                                    slot_drafted=[0] * (b - 1)),
                    generator, ContextCache(len(self.drafter.drafter.layers))
                    if isinstance(self.drafter, DFlashProposer) else None)

    @torch.inference_mode()
    def add(self, requests: list[BatchRequest]) -> None:
        """Prefill ``requests`` and let them join; invalid ones raise before anything runs."""
        if not requests:
            return
        prompts = [_validate(self.target, r) for r in requests]
        rows = [self._new_row(r, p) for r, p in zip(requests, prompts)]
        target, device = self.target, self.target.device
        t0 = time.perf_counter()
        width = max(len(p) for p in prompts)
        ids = torch.full((len(rows), width), target.pad_token_id() or 0, dtype=torch.long, device=device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for k, p in enumerate(prompts):
            ids[k, width - len(p):] = torch.tensor(p, device=device)
            mask[k, width - len(p):] = 1
        cache = target.new_cache()
        out = target.forward(ids, 0, cache, self.capture, last_only=True, attention_mask=mask,
                             positions=(mask.cumsum(-1) - 1).clamp_min(0))
        prefill_s = time.perf_counter() - t0
        for k, (r, p) in enumerate(zip(rows, prompts)):
            r.stats.prefill_s = prefill_s
            r.started = time.perf_counter()
            if out.features is not None:
                r.pending = out.features[k:k + 1, width - len(p):]
            _commit(r, [_pick(out.logits[k, -1], r)], 0)
        if self.cache is None:
            self.cache, self.mask, self.rows = cache, mask, rows
        else:
            self.cache, self.mask = _merge(target, self.cache, self.mask, cache, mask)
            self.rows = self.rows + rows
        self._drop_finished()

    @torch.inference_mode()
    def step(self) -> None:
        """One step for every active row: draft per row, verify all rows in one target pass."""
        if not self.rows:
            return
        target, drafter, policy, device = self.target, self.drafter, self.policy, self.target.device
        t = time.perf_counter()
        blocks: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        n_batch, n_drafted = len(self.rows), 0
        for r in self.rows:
            remaining = r.request.max_new_tokens - len(r.generated)
            n, drafting = plan_step(policy, self.block_size, drafter is not None, remaining, rows=n_batch)
            proposals, dprobs = [], None
            if drafting:
                n_drafted += 1
                draft_sampling = r.request.sampling if self.acceptance == "rejection" else SamplingConfig()
                if isinstance(drafter, DFlashProposer):
                    drafter.cache = r.context    # each row has its own drafter context
                width_n = policy.proposal_width(n) if policy is not None else n
                prop, dprobs = drafter.propose(torch.tensor(r.committed, device=device), r.pending,
                                               width_n, draft_sampling, r.generator)
                proposals = [int(x) for x in prop.tolist()]
                if policy is not None:
                    r.observations.append((len(r.committed) - 1, proposals))
                proposals = proposals[:n]
                dprobs = dprobs[:n] if dprobs is not None else None
                r.pending = r.pending[:, :0] if r.pending is not None else None
            blocks.append([r.committed[-1]] + proposals)
            probs.append(dprobs)
        draft_s = time.perf_counter() - t

        t = time.perf_counter()
        q = max(len(b) for b in blocks)
        block = torch.tensor([b + [b[0]] * (q - len(b)) for b in blocks], device=device)
        starts = torch.tensor([len(r.committed) - 1 for r in self.rows], device=device)
        pos = starts[:, None] + torch.arange(q, device=device)[None]
        mask = torch.cat([self.mask, torch.ones((n_batch, q), dtype=self.mask.dtype, device=device)], 1)
        out = target.forward(block, 0, self.cache, self.capture, attention_mask=mask, positions=pos)
        verify_s = time.perf_counter() - t
        if policy is not None:
            policy.observe_costs(n_batch * q, verify_s, draft_s / n_drafted if n_drafted else None)
        for k, r in enumerate(self.rows):
            proposals = blocks[k][1:]
            logits = out.logits[k, :len(blocks[k])]
            sampling = r.request.sampling
            if sampling.greedy:
                a, nxt = _accept_greedy(proposals, logits)
            elif self.acceptance == "rejection" and probs[k] is not None:
                a, nxt = _accept_rejection(proposals, probs[k], logits, sampling, r.generator)
            else:
                a, nxt = _accept_match(proposals, logits, sampling, r.generator)
            for j in range(len(proposals)):
                r.stats.slot_drafted[j] += 1
                r.stats.slot_accepted[j] += j < a
            kept = _commit(r, proposals[:a] + [nxt], a)
            # the cache keeps the fed tokens that are now committed; the rest become holes
            mask[k, mask.shape[1] - q + kept:] = 0
            if out.features is not None:
                fresh = out.features[k:k + 1, :kept]
                r.pending = fresh if r.pending is None or not r.pending.shape[1] else \
                    torch.cat([r.pending, fresh], 1)
            r.stats.draft_s += draft_s / n_batch
            r.stats.verify_s += verify_s / n_batch
            r.stats.acceptance_lengths.append(kept)
            r.stats.verify_sizes.append(len(blocks[k]))
            if policy is not None:
                _settle(policy, r, final=r.done)
        self.mask = mask
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Finished rows leave: their cache and mask rows go, their requests are told."""
        keep = [k for k, r in enumerate(self.rows) if not r.done]
        finished = [r for r in self.rows if r.done]
        if len(keep) < len(self.rows):
            if keep:
                index = torch.tensor(keep, device=self.mask.device)
                self.cache.batch_select_indices(index)
                self.mask = self.mask[index]
                self.rows = [self.rows[k] for k in keep]
            else:
                self.rows, self.cache, self.mask = [], None, None
        for r in finished:
            if r.request.on_finish is not None:
                r.request.on_finish(GenerationResult(tokens=r.generated, stop_reason=r.stop_reason,
                                                     stats=r.stats))


def _merge(target: Target, cache_a, mask_a: torch.Tensor, cache_b, mask_b: torch.Tensor):
    """One cache holding the rows of both; the shorter side gets holes on the left (masked,
    and causality only matters within a step's new tokens, which come after everything)."""
    length = max(mask_a.shape[1], mask_b.shape[1])
    merged = target.new_cache()
    for i, (la, lb) in enumerate(zip(cache_a.layers, cache_b.layers)):
        parts_k, parts_v = [], []
        for layer, have in ((la, mask_a.shape[1]), (lb, mask_b.shape[1])):
            k, v = layer.keys, layer.values
            if have < length:
                k = torch.cat([k.new_zeros(*k.shape[:2], length - have, k.shape[3]), k], dim=2)
                v = torch.cat([v.new_zeros(*v.shape[:2], length - have, v.shape[3]), v], dim=2)
            parts_k.append(k)
            parts_v.append(v)
        merged.update(torch.cat(parts_k), torch.cat(parts_v), i)
    masks = [torch.cat([m.new_zeros(m.shape[0], length - m.shape[1]), m], dim=1) for m in (mask_a, mask_b)]
    return merged, torch.cat(masks)


def batch_generate(target: Target, drafter: DFlashDrafter | DFlashProposer | None,
                   requests: list[BatchRequest], block_size: int | AdaptiveBlockSize | None = None,
                   acceptance: str = "match") -> list[GenerationResult]:
    """Decode ``requests`` together; result i is what request i gets from
    ``speculative_generate`` alone (identical tokens at temperature 0)."""
    decoder = BatchDecoder(target, drafter, block_size, acceptance)
    results: list[GenerationResult | None] = [None] * len(requests)
    wrapped = []
    for i, req in enumerate(requests):
        def finish(res, i=i, user=req.on_finish):
            results[i] = res
            if user is not None:
                user(res)
        wrapped.append(replace(req, on_finish=finish))
    decoder.add(wrapped)
    while decoder.active:
        decoder.step()
    return results


def _pick(logits: torch.Tensor, r: _Row) -> int:
    if r.request.sampling.greedy:
        return int(logits.argmax(-1))
    return int(sample(target_probs(logits, r.request.sampling), r.generator))


def _commit(r: _Row, new: list[int], from_draft: int) -> int:
    """Append ``new`` (cut at a stop id or the token budget); returns how many were kept."""
    remaining = r.request.max_new_tokens - len(r.generated)
    new = new[:remaining]
    for j, tok in enumerate(new):
        if tok in r.stops:
            new = new[:j + 1]
            r.stop_reason, r.done = "stop_token", True
            break
    r.committed += new
    r.generated += new
    if len(r.generated) >= r.request.max_new_tokens:
        r.done = True
    if r.request.on_commit is not None and r.request.on_commit(new, min(from_draft, len(new))) is False:
        r.stop_reason, r.done = "aborted", True
    if r.done:
        r.stats.decode_s = time.perf_counter() - r.started
    return len(new)


def _settle(policy: AdaptiveBlockSize, r: _Row, final: bool) -> None:
    while r.observations and (final or r.observations[0][0] + len(r.observations[0][1]) < len(r.committed)):
        pos, props = r.observations.pop(0)
        policy.observe(props, r.committed[pos + 1:pos + 1 + len(props)])
