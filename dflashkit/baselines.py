"""Plain decoding with Hugging Face ``generate``: the baseline users compare against."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from .sampling import SamplingConfig
from .target import Target


@dataclass
class BaselineResult:
    tokens: list[int]
    prefill_s: float   # time to first token
    decode_s: float    # after the first token
    # tokens handed over with the first one: assisted and prompt-lookup generation verify
    # drafts in the prefill pass, so their first delivery may hold several tokens
    first_tokens: int = 1

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.tokens) - self.first_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class _FirstTokenClock(BaseStreamer):
    """Timestamps the first delivery of generated tokens and counts them (generate's first
    put() is the prompt)."""

    def __init__(self):
        self.puts, self.first_token_at, self.first_tokens = 0, None, 1

    def put(self, value):
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.first_tokens = max(1, int(value.numel()))

    def end(self):
        pass


def cut_at_stop(tokens: list[int], stops: list[int]) -> list[int]:
    """Tokens up to and including the first stop id (generate pads after EOS only in batches;
    be exact anyway)."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


@torch.inference_mode()
def hf_generate(target: Target, input_ids: list[int], max_new_tokens: int,
                sampling: SamplingConfig | None = None,
                stop_token_ids: list[int] | None = None,
                **generate_kwargs) -> BaselineResult:
    """``model.generate`` on one prompt, timed as prefill and decode like our loop."""
    sampling = sampling or SamplingConfig()
    ids = torch.tensor([input_ids], device=target.device)
    stops = target.stop_token_ids() if stop_token_ids is None else stop_token_ids
    kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if not sampling.greedy:
        kwargs = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k or None)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
    clock = _FirstTokenClock()
    with target.default_path():   # plain transformers, as users run it
        t0 = time.perf_counter()
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    eos_token_id=stops or None, pad_token_id=target.pad_token_id() or 0,
                                    streamer=clock, **kwargs, **generate_kwargs)
        end = time.perf_counter()
    tokens = cut_at_stop(out[0, len(input_ids):].tolist(), stops)
    first = clock.first_token_at or end
    return BaselineResult(tokens=tokens, prefill_s=first - t0, decode_s=end - first,
                          first_tokens=min(clock.first_tokens, max(1, len(tokens))))
