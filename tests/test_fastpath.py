"""The fast CPU path changes speed, not results: same state dict, same cache semantics,
same greedy tokens."""

import torch
from torch import nn
from transformers import DynamicCache

from dflashkit.fastpath import (PACKED_MIN_ROWS, InPlaceCache, PackedLinear, is_packed,
                                pack_linears, unpack_linears)
from tests.conftest import tiny_target


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
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert pack_linears(model) == 2 and unpack_linears(model) == 2
    assert type(model[0]) is nn.Linear and type(model[2][0]) is nn.Linear


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
