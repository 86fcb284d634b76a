"""The speculative decoding loop (DESIGN.md section 4), batch 1.

prefill -> [draft B-1 tokens -> verify the block in one target pass -> commit the accepted
prefix plus the target's own next token -> roll the target cache back] until a stop.
Every committed token is the target's own choice (argmax at temperature 0, a sample from
its processed distribution otherwise), so the output is the target's, only faster.
B = 1 (or no drafter) is plain autoregressive decoding through the same loop.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .checkpoint import check_compatible
from .drafter import ContextCache, DFlashDrafter
from .costs import cost_curve
from .fastpath import PackedLinear, pack_linears
from .lookup import ContextLookup
from .policy import AdaptiveBlockSize
from .sampling import SamplingConfig, sample, target_probs
from .target import Target, TargetError
from .tree import build_tree, check_tree_size, walk_tree


class Proposer(Protocol):
    """Anything that proposes the next tokens; the DFlash drafter is one."""

    feature_layers: list[int]   # target layers whose outputs the proposer consumes

    def begin(self) -> None: ...

    def propose(self, committed: torch.Tensor, new_features: torch.Tensor | None, num_slots: int,
                sampling: SamplingConfig, generator: torch.Generator | None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``num_slots`` proposed ids and, when sampled, their draft distributions."""


class DFlashProposer:
    """Runs the DFlash drafter against a target; keeps only context entries in its cache."""

    def __init__(self, drafter: DFlashDrafter, target: Target):
        check_compatible(drafter.config, target)
        if target.fast_path:   # pack a copy: the caller's drafter stays trainable
            drafter = copy.deepcopy(drafter).to(target.dtype).eval().requires_grad_(False)
            pack_linears(drafter)
        self.drafter = drafter.to(device=target.device, dtype=target.dtype).eval()   # follows the target
        self.target = target
        self.feature_layers = drafter.target_layer_ids
        self.cache: ContextCache | None = None
        self.last_logits: torch.Tensor | None = None
        # The drafter's LM head: the target's, restricted to the draft vocabulary if it has one,
        # run like the target's own (packed on the fast path: PyTorch's default kernel for the
        # few rows of a block was 3x slower on one CPU here, most of a drafter pass)
        target_head = target.lm_head
        self.vocab = drafter.draft_vocab
        if self.vocab is None:
            self.head, self.project = target_head.weight, target_head
        else:
            self.head = target_head.weight[self.vocab].contiguous()
            restricted = nn.Linear(self.head.shape[1], self.head.shape[0], bias=target_head.bias is not None,
                                   dtype=self.head.dtype, device=self.head.device)
            restricted.weight = nn.Parameter(self.head, requires_grad=False)
            if target_head.bias is not None:
                restricted.bias = nn.Parameter(target_head.bias[self.vocab].contiguous(), requires_grad=False)
            self.project = PackedLinear(restricted) if target.fast_path else restricted

    def begin(self) -> None:
        self.cache = ContextCache(len(self.drafter.layers))

    def _slot_logits(self, committed, new_features, num_slots) -> torch.Tensor:
        """One drafter pass: logits of slots 1..num_slots over the draft vocabulary."""
        cache = self.cache
        s = committed.shape[-1] - 1          # position of the last committed token (slot 0)
        n_new = new_features.shape[1]
        if cache.length + n_new != s:
            raise RuntimeError(f"drafter context out of sync: {cache.length}+{n_new} != {s}")
        device = committed.device
        # The drafter always sees a block of the size it was trained on (its masks attend to
        # each other); only the slots that will be verified go through the LM head.
        width = max(num_slots, self.drafter.block_size - 1)
        block = torch.full((1, width + 1), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = committed[-1]
        hidden = self.drafter(
            self.target.embed(block), new_features,
            context_positions=torch.arange(cache.length, s, device=device)[None],
            block_positions=torch.arange(s, s + width + 1, device=device)[None],
            cache=cache)
        logits = self.project(hidden[0, 1:num_slots + 1])
        self.last_logits = logits   # over the draft vocabulary; kept for analysis scripts
        return logits

    @torch.inference_mode()
    def propose(self, committed, new_features, num_slots, sampling, generator):
        logits = self._slot_logits(committed, new_features, num_slots)
        if self.vocab is not None and not sampling.greedy:
            full = logits.new_full((logits.shape[0], self.target.num_embeddings), float("-inf"))
            logits = full.index_copy_(1, self.vocab, logits)
        if sampling.greedy:
            best = logits.argmax(-1)
            return (best if self.vocab is None else self.vocab[best]), None
        probs = target_probs(logits, sampling)
        return sample(probs, generator), probs

    @torch.inference_mode()
    def propose_top(self, committed, new_features, num_slots, k):
        """Each slot's ``k`` most likely tokens (target ids), best first, with their log-probs:
        what a draft tree (tree.py) is built from."""
        logits = self._slot_logits(committed, new_features, num_slots).float()
        top = logits.log_softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
        ids = top.indices if self.vocab is None else self.vocab[top.indices]
        return ids, top.values


@dataclass
class GenerationStats:
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step
    slot_accepted: list[int] = field(default_factory=list)  # [k]: steps whose draft slot k+1 was accepted
    slot_drafted: list[int] = field(default_factory=list)   # [k]: steps that drafted slot k+1
    prompt_tokens: int = 0
    prefill_s: float = 0.0   # prompt forward and the first token (= time to first token)
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0    # everything after the first token
    verify_sizes: list[int] = field(default_factory=list)  # tokens per verify pass (1 + drafts)
    lookup_steps: int = 0      # steps that verified a context copy instead of the drafter's block
    lookup_accepted: int = 0   # copied tokens the target accepted

    @property
    def tau(self) -> float:
        """Mean acceptance length (committed tokens per verify step, bonus included)."""
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def slot_acceptance_rates(self) -> list[float]:
        """P(slot k accepted | slot k drafted) for k = 1..B-1."""
        return [a / d if d else 0.0 for a, d in zip(self.slot_accepted, self.slot_drafted)]

    def to_dict(self) -> dict:
        return {
            "tau": self.tau, "acceptance_lengths": self.acceptance_lengths,
            "slot_accepted": self.slot_accepted, "slot_drafted": self.slot_drafted,
            "slot_acceptance_rates": self.slot_acceptance_rates(),
            "prompt_tokens": self.prompt_tokens, "prefill_s": self.prefill_s,
            "draft_s": self.draft_s, "verify_s": self.verify_s, "decode_s": self.decode_s,
            "verify_sizes": self.verify_sizes,
            "lookup_steps": self.lookup_steps, "lookup_accepted": self.lookup_accepted,
        }


@dataclass
class GenerationResult:
    tokens: list[int]              # generated ids (prompt excluded), truncated after a stop id
    stop_reason: str               # "stop_token" | "max_new_tokens"
    stats: GenerationStats

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (prefill excluded)."""
        n = len(self.tokens) - 1
        return n / self.stats.decode_s if n > 0 and self.stats.decode_s > 0 else 0.0


def plan_step(policy: AdaptiveBlockSize | None, block_size: int, has_drafter: bool,
              remaining: int, rows: int = 1) -> tuple[int, bool]:
    """(drafted tokens to verify, whether to run the drafter) for one step."""
    if policy is not None:
        n = min(policy.num_drafts(remaining, rows=rows), remaining - 1)
        return n, policy.should_draft(n)
    n = min(block_size - 1, remaining - 1) if has_drafter else 0
    return n, n > 0


def _accept_greedy(proposals: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix equal to the target's argmax, and the target's next token."""
    posterior = logits.argmax(-1).tolist()
    a = 0
    while a < len(proposals) and proposals[a] == posterior[a]:
        a += 1
    return a, posterior[a]


def _accept_match(proposals, logits, sampling, generator) -> tuple[int, int]:
    """Draw the target's own sample slot by slot; keep proposals while they equal it."""
    probs = target_probs(logits, sampling)
    for i in range(len(proposals) + 1):
        y = int(sample(probs[i], generator))
        if i == len(proposals) or proposals[i] != y:
            return i, y
    raise AssertionError("unreachable")


def _accept_rejection(proposals, draft_probs, logits, sampling, generator) -> tuple[int, int]:
    """Speculative sampling: accept with min(1, p/q), else resample from max(p - q, 0)."""
    p = target_probs(logits, sampling)
    for i, d in enumerate(proposals):
        q_d = float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u * q_d < float(p[i, d]):
            continue
        residual = (p[i] - draft_probs[i]).clamp_min(0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return i, int(sample(dist, generator))
    return len(proposals), int(sample(p[len(proposals)], generator))


@torch.inference_mode()
def speculative_generate(
    target: Target,
    drafter: DFlashDrafter | Proposer | None,
    input_ids: list[int] | torch.Tensor,
    max_new_tokens: int = 256,
    sampling: SamplingConfig | None = None,
    stop_token_ids: list[int] | None = None,
    block_size: int | str | AdaptiveBlockSize | None = None,
    acceptance: str = "match",
    on_commit: Callable[[list[int], int], None] | None = None,
    lookup: ContextLookup | bool = False,
    tree: int | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens, lossless with respect to ``target``.

    block_size: tokens per verify pass (1 = plain decoding; default: the drafter's), or
        "auto" / an ``AdaptiveBlockSize`` (policy.py): at each step verify the number of drafted
        tokens that maximises expected tokens per second from the measured cost curve.
    acceptance (temperature > 0): "match" drafts greedily and keeps a proposal iff it equals
        the target's own sample; "rejection" samples drafts and uses min(1, p/q). Both emit
        exactly the target's distribution.
    stop_token_ids: default the target's EOS ids; the output ends AT the first one.
    on_commit(new_ids, accepted_from_draft): called whenever tokens are committed (streaming).
    lookup: True or a ``ContextLookup`` (lookup.py): where the context's last n-gram occurred
        before, verify what followed it (up to block_size - 1 tokens) instead of drafting; the
        drafter catches up on the skipped context at its next pass. With no drafter this is
        prompt lookup decoding on this loop.
    tree: verify a draft tree of this many drafted tokens per step instead of a chain
        (tree.py): the best-scoring continuations of the drafter's block, up to block_size - 1
        deep, all in one target pass. Needs a DFlash drafter and acceptance "match".
    """
    sampling = sampling or SamplingConfig()
    if acceptance not in ("match", "rejection"):
        raise ValueError(f"acceptance must be 'match' or 'rejection', got {acceptance!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    ids = input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    vocab = target.num_embeddings
    if any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab}) for this target")
    if len(ids) + max_new_tokens > target.max_positions:
        raise TargetError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                          f"the target's context of {target.max_positions} tokens")
    if isinstance(drafter, DFlashDrafter):
        drafter = DFlashProposer(drafter, target)
    if tree is not None:
        check_tree_size(tree)
        if not hasattr(drafter, "propose_top"):
            raise ValueError("a draft tree needs a DFlash drafter (its per-slot distributions)")
        if lookup:
            raise ValueError("a draft tree and lookup cannot be combined; choose one")
        if block_size == "auto" or isinstance(block_size, AdaptiveBlockSize):
            raise ValueError("a draft tree sets its own size (tree=N drafted tokens); pass block_size="
                             "None (the drafter's block bounds its depth) or an integer")
        if acceptance == "rejection" and not sampling.greedy:
            raise ValueError("a draft tree verifies with acceptance='match' (the target's own sample "
                             "picks the branch); rejection sampling over a tree is not implemented")
    if lookup is True:
        lookup = ContextLookup()
    lookup = lookup or None
    trained_block = drafter.drafter.block_size if isinstance(drafter, DFlashProposer) else 16
    policy = block_size if isinstance(block_size, AdaptiveBlockSize) else None
    if block_size == "auto":
        if drafter is None:
            raise ValueError("block_size='auto' needs a drafter")
        policy = AdaptiveBlockSize(
            cost_curve(target, drafter if isinstance(drafter, DFlashProposer) else None,
                       max_q=trained_block), max_drafts=trained_block - 1)
    if policy is not None:
        if drafter is None:
            raise ValueError("an adaptive block size needs a drafter")
        block_size = policy.max_drafts + 1
    if block_size is None:
        block_size = trained_block if drafter is not None else 1
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer or 'auto', got {block_size!r}")
    if tree is not None and block_size < 2:
        raise ValueError(f"a draft tree needs block_size >= 2 (its depth is block_size - 1), got {block_size}")
    if block_size > 1 and drafter is None and lookup is None:
        raise ValueError("block_size > 1 needs a drafter (or lookup=True); use block_size=1 for "
                         "plain decoding")
    if block_size == 1:
        drafter = lookup = None
    stops = set(target.stop_token_ids() if stop_token_ids is None else stop_token_ids)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device="cpu")
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()   # non-deterministic, without touching torch's global generator

    device = target.device
    stats = GenerationStats(prompt_tokens=len(ids),
                            slot_accepted=[0] * (block_size - 1), slot_drafted=[0] * (block_size - 1))
    capture = drafter.feature_layers if drafter is not None else None
    if drafter is not None:
        drafter.begin()
    if lookup is not None:
        lookup.reset()
    cache = target.new_cache()

    def pick(logits: torch.Tensor) -> int:
        if sampling.greedy:
            return int(logits.argmax(-1))
        return int(sample(target_probs(logits, sampling), generator))

    t0 = time.perf_counter()
    out = target.forward(torch.tensor([ids], device=device), 0, cache, capture, last_only=True)
    first = pick(out.logits[0, -1])
    stats.prefill_s = time.perf_counter() - t0
    committed = ids + [first]
    generated = [first]
    pending = out.features          # features of committed tokens not yet given to the drafter
    if on_commit:
        on_commit([first], 0)
    stop_reason = "stop_token" if first in stops else "max_new_tokens"
    done = first in stops or len(generated) >= max_new_tokens

    observations: list[tuple[int, list[int]]] = []   # (position of slot 0, all proposals)

    def settle(final: bool = False) -> None:
        """Tell the policy how far earlier proposals matched what was committed since."""
        while observations and (final or observations[0][0] + len(observations[0][1]) < len(committed)):
            pos, props = observations.pop(0)
            policy.observe(props, committed[pos + 1:pos + 1 + len(props)])

    rejection = acceptance == "rejection" and not sampling.greedy
    t_decode = time.perf_counter()
    while not done:
        s = len(committed) - 1
        remaining = max_new_tokens - len(generated)
        n_draft, drafting = plan_step(policy, block_size, drafter is not None, remaining)
        proposals, draft_probs, draft_s, dtree = [], None, None, None
        copy = lookup.propose(committed, min(block_size - 1, remaining - 1)) if lookup is not None else []
        if copy:   # verified like a draft, but not the drafter's: kept out of its statistics
            proposals, drafting = copy, False
            stats.lookup_steps += 1
        elif drafting and tree is not None:
            t = time.perf_counter()
            top_ids, top_lp = drafter.propose_top(torch.tensor(committed, device=device), pending,
                                                  n_draft, tree)
            dtree = build_tree(committed[-1], top_ids.cpu(), top_lp.cpu(), tree)
            n_draft = max(dtree.depths)
            pending = pending[:, :0] if pending is not None else None
            draft_s = time.perf_counter() - t
            stats.draft_s += draft_s
        elif drafting:
            t = time.perf_counter()
            # "match" drafts greedily (the most likely proposal is the one most often equal to
            # the target's sample); "rejection" needs sampled drafts and their distributions.
            draft_sampling = sampling if acceptance == "rejection" else SamplingConfig()
            width = policy.proposal_width(n_draft) if policy is not None else n_draft
            prop, draft_probs = drafter.propose(torch.tensor(committed, device=device), pending,
                                                width, draft_sampling, generator)
            proposals = [int(x) for x in prop.tolist()]
            if policy is not None and not rejection:
                observations.append((s, proposals))
            proposals = proposals[:n_draft]
            if draft_probs is not None:
                draft_probs = draft_probs[:n_draft]
            pending = pending[:, :0] if pending is not None else None
            draft_s = time.perf_counter() - t
            stats.draft_s += draft_s
        t = time.perf_counter()
        if dtree is not None:
            block = torch.tensor([dtree.tokens], device=device)
            out = target.forward(block, s, cache, capture, attention_mask=dtree.attention_mask(s, device),
                                 positions=dtree.positions(s, device))
        else:
            block = torch.tensor([[committed[-1]] + proposals], device=device)
            out = target.forward(block, s, cache, capture)
        logits = out.logits[0]
        rows = None   # block rows of the committed tokens, when not simply the first ones
        if dtree is not None:
            path, nxt = walk_tree(dtree, lambda i: pick(logits[i]))
            a, proposals, rows = len(path), [dtree.tokens[i] for i in path], [0] + path
        elif sampling.greedy:
            a, nxt = _accept_greedy(proposals, logits)
        elif copy:   # a deterministic draft: matching the target's sample IS rejection sampling
            a, nxt = _accept_match(proposals, logits, sampling, generator)
        elif acceptance == "rejection" and draft_probs is not None:
            a, nxt = _accept_rejection(proposals, draft_probs, logits, sampling, generator)
        else:
            a, nxt = _accept_match(proposals, logits, sampling, generator)
        if policy is not None:   # the acceptance's per-row work (argmax over the vocabulary) counts
            policy.observe_costs(block.shape[1], time.perf_counter() - t, draft_s)
        if policy is not None and rejection and proposals and not copy:
            # sampled drafts equal the target's sample less often than rejection sampling
            # accepts them (sum p*q < sum min(p, q)): learn from the verified slots only
            policy.observe(proposals, [t if k < a else -1 for k, t in enumerate(proposals)])
        new = proposals[:a] + [nxt]
        if copy:
            stats.lookup_accepted += a
        else:
            for k in range(n_draft):
                stats.slot_drafted[k] += 1
                stats.slot_accepted[k] += k < a
        if len(new) > remaining:
            new = new[:remaining]
        for i, tok in enumerate(new):
            if tok in stops:
                new = new[:i + 1]
                stop_reason = "stop_token"
                done = True
                break
        committed += new
        generated += new
        if len(generated) >= max_new_tokens:
            done = True
        # Cache keeps the block tokens that are now committed: positions s .. s+len(new)-1.
        if rows is not None:
            rows = rows[:len(new)]
            Target.keep(cache, s, rows)
        else:
            Target.rollback(cache, s + len(new))
        if out.features is not None:   # context the drafter has not seen yet
            fresh = out.features[:, rows] if rows is not None else out.features[:, :len(new)]
            pending = fresh if pending is None or not pending.shape[1] else torch.cat([pending, fresh], 1)
        if policy is not None:
            settle()
        stats.verify_s += time.perf_counter() - t
        stats.acceptance_lengths.append(len(new))
        stats.verify_sizes.append(block.shape[1])
        if on_commit:
            on_commit(new, min(a, len(new)))
    stats.decode_s = time.perf_counter() - t_decode
    if policy is not None:
        settle(final=True)
    return GenerationResult(tokens=generated, stop_reason=stop_reason, stats=stats)
