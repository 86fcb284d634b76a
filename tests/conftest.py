"""Tiny randomly initialised targets built in the tests (Qwen2, Qwen3, Llama)."""

import os

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from dflashkit.target import Target

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

VOCAB = 96
EOS = 2
MASK = VOCAB - 1

_FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
}


def tiny_target(family: str = "qwen2", seed: int = 0, layers: int = 4, dtype=torch.float32,
                temperature_scale: float = 1.0) -> Target:
    """A tiny random target; its logits are scaled up so greedy decoding is not one token."""
    config_cls, model_cls, extra = _FAMILIES[family]
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=1024, eos_token_id=EOS, pad_token_id=0,
                     bos_token_id=1, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(temperature_scale)
    return Target(model, None, name=f"tiny-{family}")


@pytest.fixture(params=sorted(_FAMILIES))
def family(request):
    return request.param
