"""The checkpoint format: round trips, exact config keys, every rejection, reference math."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflashkit.checkpoint import (CheckpointError, check_compatible, config_from_dict,
                                  expected_tensors, load_drafter, save_drafter)
from dflashkit.drafter import (ContextCache, DFlashDrafter, DrafterConfig, config_for_target,
                               default_target_layer_ids, init_drafter)
from dflashkit.target import resolve_mask_token_id
from tests.conftest import EOS, MASK, VOCAB, tiny_target


def small_config(**over) -> DrafterConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_target_layers=4,
                target_layer_ids=[0, 2, 3], mask_token_id=MASK, block_size=8)
    base.update(over)
    return DrafterConfig(**base)


def test_default_layer_ids_follow_the_paper():
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(78, 5) == [1, 20, 38, 56, 75]
    assert default_target_layer_ids(28, 1) == [14]


def test_round_trip_is_exact_and_config_keys_are_the_format(tmp_path):
    model = init_drafter(small_config(), seed=3)
    save_drafter(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 2, 3]}
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 4
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["sliding_window"] is None
    assert cfg["hidden_act"] == "silu" and cfg["attention_bias"] is False
    assert cfg["tie_word_embeddings"] is False
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "vocab_size"):
        assert key in cfg, key
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == set(expected_tensors(model.config))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    loaded = load_drafter(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16).float()), name
    assert loaded.config == model.config
    # Saving the loaded drafter gives the same bytes of tensors again.
    save_drafter(loaded, tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_glm52_shaped_drafter(tmp_path):
    """The seeds' GLM-5.2 drafter: full config validated, a narrow copy round-tripped."""
    full = small_config(hidden_size=6144, intermediate_size=12288, num_hidden_layers=5,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        vocab_size=154880, num_target_layers=78,
                        target_layer_ids=[1, 20, 38, 56, 75], mask_token_id=154856, block_size=16)
    shapes = expected_tensors(full)
    assert shapes["fc.weight"] == (6144, 5 * 6144)
    assert len(shapes) == 3 + 5 * 11
    parsed = config_from_dict(json.loads(json.dumps(
        __import__("dflashkit.checkpoint", fromlist=["x"]).config_to_dict(full))))
    assert parsed == full
    narrow = small_config(hidden_size=128, intermediate_size=128, num_hidden_layers=5,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                          vocab_size=1024, num_target_layers=78,
                          target_layer_ids=[1, 20, 38, 56, 75], mask_token_id=1000, block_size=16)
    model = init_drafter(narrow)
    save_drafter(model, tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.target_layer_ids == [1, 20, 38, 56, 75]
    assert loaded.fc.weight.shape == (128, 5 * 128) and loaded.block_size == 16


# --- rejections ------------------------------------------------------------------------------

def _saved(tmp_path) -> Path:
    save_drafter(init_drafter(small_config()), tmp_path)
    return tmp_path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if k in ("target_layer_ids", "mask_token_id"):
            cfg["dflash_config"][k] = v
        elif v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    t = load_file(str(path / "model.safetensors"))
    save_file(fn(t), str(path / "model.safetensors"))


@pytest.mark.parametrize("edit,message", [
    (lambda p: _edit_config(p, target_layer_ids=[0, 2]), "fc input width must be K\\*H"),
    (lambda p: _edit_config(p, target_layer_ids=[0, 2, 9]), "target_layer_ids \\[9\\] out of range"),
    (lambda p: _edit_config(p, target_layer_ids=[0, 2, 2]), "duplicates"),
    (lambda p: _edit_config(p, mask_token_id=VOCAB), "mask_token_id .* outside the embedding"),
    (lambda p: _edit_config(p, architectures=["Qwen3ForCausalLM"]), "DFlashDraftModel"),
    (lambda p: _edit_config(p, dflash_config=None), "dflash_config"),
    (lambda p: _edit_config(p, hidden_size=None), "hidden_size"),
    (lambda p: _edit_config(p, num_attention_heads=3), "num_attention_heads"),
    (lambda p: _edit_config(p, hidden_act="gelu"), "hidden_act"),
    (lambda p: _edit_config(p, rope_scaling={"rope_type": "yarn", "factor": 4}), "rope type"),
    (lambda p: (p / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda p: (p / "config.json").unlink(), "no config.json"),
    (lambda p: (p / "model.safetensors").unlink(), "missing model.safetensors"),
    (lambda p: _edit_tensors(p, lambda t: {"model." + k: v for k, v in t.items()}), "prefix"),
    (lambda p: _edit_tensors(p, lambda t: {**t, "lm_head.weight": torch.zeros(VOCAB, 64)}), "borrows"),
    (lambda p: _edit_tensors(p, lambda t: {k: v for k, v in t.items() if k != "layers.1.mlp.up_proj.weight"}),
     "missing \\['layers.1.mlp.up_proj.weight'\\]"),
    (lambda p: _edit_tensors(p, lambda t: {**t, "layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}),
     "layers.0.self_attn.q_proj.weight has shape \\[32, 64\\]"),
    (lambda p: _edit_tensors(p, lambda t: {**t, "fc.weight": torch.zeros(64, 128)}), "fc.weight has shape"),
])
def test_bad_checkpoints_are_refused_with_a_clear_message(tmp_path, edit, message):
    path = _saved(tmp_path)
    edit(path)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(path)


def test_save_refuses_an_inconsistent_model(tmp_path):
    model = init_drafter(small_config())
    model.extra_head = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="unknown"):
        save_drafter(model, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_compatibility_with_the_target_is_checked():
    target = tiny_target("qwen2")
    ok = config_for_target(target, num_layers=1, mask_token_id=MASK)
    check_compatible(ok, target)
    for over, message in [(dict(hidden_size=128), "hidden_size=128"),
                          (dict(num_target_layers=6, target_layer_ids=[5]), "num_target_layers=6"),
                          (dict(vocab_size=VOCAB + 4), "vocab_size"),
                          (dict(mask_token_id=EOS), "EOS"), (dict(mask_token_id=0), "pad")]:
        cfg = DrafterConfig(**{**ok.__dict__, **over})
        with pytest.raises(CheckpointError, match=message):
            check_compatible(cfg, target)
    with pytest.raises(ValueError, match="out of range"):
        config_for_target(target, target_layer_ids=[4])


class _FakeTokenizer:
    chat_template = "{{ '<|im_start|>' }}"
    bos_token_id, eos_token_id, pad_token_id, unk_token_id = None, 5, 6, None

    def __init__(self, vocab, added):
        self._vocab, self.added_tokens_decoder = vocab, added

    def get_vocab(self):
        return self._vocab


def test_mask_id_skips_gguf_padding_names_and_falls_back_to_a_spare_special_token():
    class Tok:
        def __init__(self, content, special=True):
            self.content, self.special = content, special

    vocab = {f"t{i}": i for i in range(10)} | {f"[PAD{i}]": i for i in range(10, 16)}
    assert resolve_mask_token_id(_FakeTokenizer(vocab, {}), 16) == 10
    full = {f"t{i}": i for i in range(16)}
    added = {5: Tok("<eos>"), 6: Tok("<pad>"), 7: Tok("<|im_start|>"), 8: Tok("<spare>"), 9: Tok("<x>", False)}
    assert resolve_mask_token_id(_FakeTokenizer(full, added), 16) == 8


# --- the reference math, implemented independently from transformers' Qwen3 pieces ----------

class _ReferenceStyleDrafter(nn.Module):
    """Module tree named as z-lab's DFlashDraftModel, computing its documented forward with
    transformers' own Qwen3RMSNorm / Qwen3MLP / Qwen3RotaryEmbedding from config.json."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        ids = config.dflash_config["target_layer_ids"]
        self.config = config
        self.fc = nn.Linear(len(ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.layers = nn.ModuleList()
        for _ in range(config.num_hidden_layers):
            layer = nn.Module()
            layer.input_layernorm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
            layer.post_attention_layernorm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
            attn = nn.Module()
            attn.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
            attn.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
            attn.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
            attn.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
            attn.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
            attn.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
            layer.self_attn, layer.mlp = attn, Qwen3MLP(config)
            self.layers.append(layer)

    def forward(self, noise, target_hidden, position_ids):
        from transformers.models.qwen3.modeling_qwen3 import rotate_half
        cfg = self.config
        d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        x = noise
        b, q_len, _ = x.shape
        c_len = ctx.shape[1]
        for layer in self.layers:
            a = layer.self_attn
            hs = layer.input_layernorm(x)
            q = a.q_norm(a.q_proj(hs).view(b, q_len, nh, d)).transpose(1, 2)
            k = a.k_norm(torch.cat([a.k_proj(ctx), a.k_proj(hs)], 1).view(b, c_len + q_len, nkv, d)).transpose(1, 2)
            v = torch.cat([a.v_proj(ctx), a.v_proj(hs)], 1).view(b, c_len + q_len, nkv, d).transpose(1, 2)
            q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            w = torch.softmax(q @ k.transpose(-1, -2) * d ** -0.5, dim=-1)
            x = x + a.o_proj((w @ v).transpose(1, 2).reshape(b, q_len, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def test_checkpoint_gives_reference_draft_logits(tmp_path):
    """Loaded unmodified as a Qwen3Config + strict state dict, the reference-style forward
    gives the same draft logits as dflashkit's drafter (inference path with a cache)."""
    target = tiny_target("qwen3")
    cfg = config_for_target(target, num_layers=2, block_size=8, mask_token_id=MASK,
                            target_layer_ids=[0, 1, 3])
    save_drafter(init_drafter(cfg, seed=5), tmp_path)

    ref_cfg = Qwen3Config.from_pretrained(tmp_path)
    assert ref_cfg.dflash_config["target_layer_ids"] == [0, 1, 3]
    ref = _ReferenceStyleDrafter(ref_cfg)
    ref.load_state_dict({k: v.float() for k, v in load_file(str(tmp_path / "model.safetensors")).items()},
                        strict=False)
    missing = set(ref.state_dict()) - set(load_file(str(tmp_path / "model.safetensors")))
    assert missing <= {"rotary_emb.inv_freq", "rotary_emb.original_inv_freq"}, missing

    ours = load_drafter(tmp_path)
    torch.manual_seed(0)
    prompt = torch.randint(3, VOCAB - 2, (1, 13))
    feats = target.forward(prompt, 0, None, capture=[0, 1, 3]).features
    s, B = 12, 8   # block at positions 12..19: slot 0 is token 12, context = tokens 0..11
    block = torch.full((1, B), MASK)
    block[0, 0] = prompt[0, s]
    emb = target.embed(block)
    with torch.no_grad():
        want = ref(emb, feats[:, :s], torch.arange(0, s + B)[None])
        cache = ContextCache(2)
        got_part = ours(emb, feats[:, :5], torch.arange(0, 5)[None], torch.arange(s, s + B)[None], cache=cache)
        cache_free = ours(emb, feats[:, :s], torch.arange(0, s)[None], torch.arange(s, s + B)[None])
        got = ours(emb, feats[:, 5:s], torch.arange(5, s)[None], torch.arange(s, s + B)[None], cache=cache)
    assert got_part.shape == got.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_free, want, atol=1e-5, rtol=1e-5)
    head = target.lm_head
    assert torch.equal(head(got[:, 1:]).argmax(-1), head(want[:, 1:]).argmax(-1))


def test_drafter_digest_follows_the_weights_not_the_folder(tmp_path):
    from dflashkit.checkpoint import drafter_digest
    save_drafter(init_drafter(small_config(), seed=3), tmp_path / "a")
    save_drafter(init_drafter(small_config(), seed=3), tmp_path / "b")
    save_drafter(init_drafter(small_config(), seed=4), tmp_path / "c")
    assert drafter_digest(tmp_path / "a") == drafter_digest(tmp_path / "b")
    assert drafter_digest(tmp_path / "a") != drafter_digest(tmp_path / "c")
