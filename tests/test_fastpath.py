"""The fast CPU path changes speed, not results: same state dict, same cache semantics,
same greedy tokens."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from dflashkit.decoding import speculative_generate
from dflashkit.fastpath import (PACKED_MIN_ROWS, ROWWISE_ATTENTION, FusedGateUpMLP, InPlaceCache,
                                PackedLinear, bf16_fast, packed_min_rows, is_packed, pack_linears, resolve_dtype, unpack_linears)
from tests.conftest import VOCAB, tiny_target
from tests.test_decoding import OracleProposer


def test_packing_keeps_state_dict_names_and_round_trips():
    target = tiny_target("qwen2", seed=1)
    target.set_fast_path(False)
    plain = target.model.state_dict()
    assert not is_packed(target.model)
    target.set_fast_path(True)
    assert is_packed(target.model)
    packed = target.model.state_dict()
    assert list(packed) == list(plain)
    assert all(packed[k].data_ptr() == plain[k].data_ptr() for k in plain)   # no weight copies
    target.set_fast_path(False)
    assert not is_packed(target.model) and list(target.model.state_dict()) == list(plain)


def test_packed_linear_matches_linear_for_every_row_count():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    packed = PackedLinear(lin)
    with torch.inference_mode():
        for rows in range(1, 2 * PACKED_MIN_ROWS + 2):
            x = torch.randn(1, rows, 64)
            torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
        with torch.no_grad():                    # new weights loaded in place: repacked, never stale
            lin.load_state_dict({"weight": torch.randn(48, 64), "bias": torch.randn(48)})
        x = torch.randn(1, 2 * PACKED_MIN_ROWS, 64)
        torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert pack_linears(model) == 2 and unpack_linears(model) == 2
    assert type(model[0]) is nn.Linear and type(model[2][0]) is nn.Linear


def test_packed_row_threshold_is_measured_once_per_machine_or_overridden(monkeypatch, tmp_path):
    import dflashkit.fastpath as fastpath
    assert 1 <= packed_min_rows() <= PACKED_MIN_ROWS
    measured = []
    monkeypatch.setattr(fastpath, "_measure_packed_min_rows", lambda: measured.append(1) or 3)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    try:
        packed_min_rows.cache_clear()
        assert packed_min_rows() == 3 and len(measured) == 1
        packed_min_rows.cache_clear()                 # another process on this machine: read back
        assert packed_min_rows() == 3 and len(measured) == 1
        [kept] = (tmp_path / "costs").glob("packed-min-rows-*.json")
        kept.write_text("{damaged")
        packed_min_rows.cache_clear()
        assert packed_min_rows() == 3 and len(measured) == 2
        packed_min_rows.cache_clear()
        monkeypatch.setenv("DFLASHKIT_PACKED_MIN_ROWS", "2")
        assert packed_min_rows() == 2
        packed_min_rows.cache_clear()
        monkeypatch.setenv("DFLASHKIT_PACKED_MIN_ROWS", "9")
        with pytest.raises(ValueError, match="whole number from 1 to 4"):
            packed_min_rows()
    finally:
        packed_min_rows.cache_clear()


def test_in_place_cache_equals_dynamic_cache_through_growth_and_rollback():
    target = tiny_target("llama", seed=2)
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (1, 300))
    results = []
    for cache in (InPlaceCache(target.num_layers), DynamicCache(config=target.config)):
        out = [target.forward(ids[:, :40], 0, cache).logits[:, -1]]
        pos = 40
        while pos < 290:                      # grows past the initial 256 slots
            step = ids[:, pos:pos + 5]
            logits = target.forward(step, pos, cache).logits
            keep = 1 + pos % 4                # commit 1..4 of the 5, roll back the rest
            target.rollback(cache, pos + keep)
            out.append(logits[:, keep - 1])
            pos += keep
        assert cache.get_seq_length() == pos
        results.append(torch.cat(out))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


class _AttentionStub(nn.Module):
    num_key_value_groups = 2
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_attention_rows_are_bitwise_one_token_steps(dtype):
    """Each new row equals HF's own one-token attention call over the keys it would see alone,
    also in a batch whose shorter row has holes (masked-out entries) in its keys."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflashkit.fastpath import rowwise_sdpa
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, d, q, kv = 2, 4, 2, 16, 5, 300
    query = torch.randn(b, heads, q, d, generator=g).to(dtype)
    key = torch.randn(b, kv_heads, kv, d, generator=g).to(dtype)
    value = torch.randn(b, kv_heads, kv, d, generator=g).to(dtype)
    keep = torch.ones(b, kv, dtype=torch.bool)
    keep[1, :37] = False                     # row 1 joined later: left holes
    keep[1, 120:130] = False                 # and rejected entries in the middle
    mask = keep[:, None, None, :].expand(b, 1, q, kv).clone()
    for r in range(q):                       # causal inside the block
        mask[:, :, r, kv - q + r + 1:] = False
    module = _AttentionStub()
    out, _ = rowwise_sdpa(module, query, key, value, mask, scaling=d ** -0.5)
    assert out.shape == (b, q, heads, d)
    for i in range(b):
        for r in range(q):
            visible = keep[i, :kv - q + r + 1]
            alone, _ = sdpa_attention_forward(module, query[i:i + 1, :, r:r + 1],
                                              key[i:i + 1, :, :kv - q + r + 1][:, :, visible],
                                              value[i:i + 1, :, :kv - q + r + 1][:, :, visible],
                                              None, scaling=d ** -0.5)
            assert torch.equal(out[i:i + 1, r:r + 1], alone), (i, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_prefill_and_a_lone_row_with_holes_are_bitwise_the_prompt_alone(dtype):
    """A batched prefill of left-padded prompts gives each prompt's rows exactly as its prefill
    alone would; a batch shrunk to one row whose keys still hold holes gives a one-token step
    exactly as that sequence alone would (the kernel's rounding depends on the key length)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflashkit.fastpath import rowwise_sdpa
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, width = 4, 2, 16, 90
    lengths = [90, 61]
    query = torch.randn(2, heads, width, d, generator=g).to(dtype)
    key = torch.randn(2, kv_heads, width, d, generator=g).to(dtype)
    value = torch.randn(2, kv_heads, width, d, generator=g).to(dtype)
    keep = torch.zeros(2, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        keep[i, width - n:] = True
    mask = keep[:, None, None, :] & torch.ones(width, width, dtype=torch.bool).tril()[None, None]
    module = _AttentionStub()
    out, _ = rowwise_sdpa(module, query, key, value, mask, scaling=d ** -0.5)
    for i, n in enumerate(lengths):
        alone, _ = sdpa_attention_forward(module, query[i:i + 1, :, width - n:], key[i:i + 1, :, width - n:],
                                          value[i:i + 1, :, width - n:], None, scaling=d ** -0.5)
        assert torch.equal(out[i:i + 1, width - n:], alone), i
    # one row left in the batch, one new token, holes on the left and in the middle
    kv = 200
    q1 = torch.randn(1, heads, 1, d, generator=g).to(dtype)
    k1 = torch.randn(1, kv_heads, kv, d, generator=g).to(dtype)
    v1 = torch.randn(1, kv_heads, kv, d, generator=g).to(dtype)
    keep1 = torch.ones(kv, dtype=torch.bool)
    keep1[:23] = False
    keep1[100:104] = False
    out, _ = rowwise_sdpa(module, q1, k1, v1, keep1[None, None, None, :].clone(), scaling=d ** -0.5)
    alone, _ = sdpa_attention_forward(module, q1, k1[:, :, keep1], v1[:, :, keep1], None, scaling=d ** -0.5)
    assert torch.equal(out, alone)


@pytest.mark.skipif(not bf16_fast(), reason="this CPU has no bf16 matrix arithmetic (AMX)")
def test_bf16_verify_pass_is_bitwise_one_token_steps():
    """On the bf16 fast path a pass over 6 new tokens gives the very logits of 6 one-token
    steps, so speculative greedy output equals the plain loop's exactly."""
    target = tiny_target("qwen2", seed=3, dtype=torch.bfloat16, temperature_scale=3.0)
    target.set_fast_path(True)
    assert target.model.config._attn_implementation == ROWWISE_ATTENTION
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7, 30, 11]])
    block = torch.tensor([[4, 17, 8, 25, 6, 12]])
    cache = target.new_cache()
    target.forward(prompt, 0, cache)
    together = target.forward(block, prompt.shape[1], cache).logits
    cache = target.new_cache()
    target.forward(prompt, 0, cache)
    steps = torch.cat([target.forward(block[:, j:j + 1], prompt.shape[1] + j, cache).logits
                       for j in range(block.shape[1])], dim=1)
    assert torch.equal(together, steps)
    plain = speculative_generate(target, None, [5, 9, 14, 3], max_new_tokens=40, block_size=1,
                                 stop_token_ids=[])
    for noisy_every in (1, 3):
        cont = [t if (i + 1) % noisy_every else (t + 1) % VOCAB for i, t in enumerate(plain.tokens)]
        res = speculative_generate(target, OracleProposer(cont if noisy_every > 1 else plain.tokens, 4),
                                   [5, 9, 14, 3], max_new_tokens=40, block_size=6, stop_token_ids=[])
        assert res.tokens == plain.tokens
    target.set_fast_path(False)
    assert target.model.config._attn_implementation == "sdpa"


def test_dtype_names_resolve_and_bad_ones_say_what_to_choose():
    assert resolve_dtype(None) is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype("fp32") is torch.float32
    with pytest.raises(ValueError, match="choose float32 or bfloat16"):
        resolve_dtype("int8")


def test_bf16_without_the_fast_path_is_flagged_as_inexact():
    from dflashkit.target import inexact_output_warning
    fp32 = tiny_target("qwen2", seed=3)
    assert inexact_output_warning(fp32) is None
    fp32.set_fast_path(False)
    assert inexact_output_warning(fp32) is None                 # fp32: every kernel agrees
    bf16 = tiny_target("qwen2", seed=3, dtype=torch.bfloat16)
    bf16.set_fast_path(False)
    assert "may differ from plain decoding" in inexact_output_warning(bf16)
    if bf16_fast():
        bf16.set_fast_path(True)
        assert inexact_output_warning(bf16) is None


@pytest.mark.skipif(not bf16_fast(), reason="this CPU has no bf16 matrix arithmetic (AMX)")
def test_fused_gate_up_mlp_is_bitwise_the_mlp_and_keeps_the_state_dict():
    target = tiny_target("qwen2", seed=4, dtype=torch.bfloat16)
    target.set_fast_path(False)
    names = list(target.model.state_dict())
    mlp = target.model.model.layers[0].mlp
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 5):
            x = torch.randn(1, rows, 64, generator=g).to(torch.bfloat16)
            assert torch.equal(FusedGateUpMLP(mlp)(x), mlp(x))
    fused = FusedGateUpMLP(mlp)
    with torch.no_grad():                     # weights loaded in place after packing: repacked
        mlp.up_proj.weight.copy_(torch.randn(mlp.up_proj.weight.shape, generator=g))
    with torch.inference_mode():
        assert torch.equal(fused(x), mlp(x))
    target.set_fast_path(True)
    assert isinstance(target.model.model.layers[0].mlp, FusedGateUpMLP)
    assert list(target.model.state_dict()) == names
    target.set_fast_path(False)
    assert type(target.model.model.layers[0].mlp) is type(mlp) and list(target.model.state_dict()) == names
    target.set_fast_path(True)     # re-installed from the cache of packed modules
    assert isinstance(target.model.model.layers[0].mlp, FusedGateUpMLP)
