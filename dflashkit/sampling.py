"""The target's sampling distribution: temperature, then top-k, then top-p (as transformers).

Lossless sampling means every emitted token is drawn from exactly this distribution, so it
lives in one place and the loop, the tests and the benchmarks all call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities ``[..., vocab]`` after temperature, top-k and top-p; computed in fp32."""
    scores = logits.float() / cfg.temperature
    vocab = scores.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1.0 - cfg.top_p)
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` ``[..., vocab]``, made on the generator's device: the
    decoding loop's generator lives on the CPU, so a seed draws the same way wherever the
    target runs (and a GPU's probabilities cannot meet a CPU generator inside multinomial)."""
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and flat.device != generator.device:
        flat = flat.to(generator.device)
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1]).to(probs.device)
