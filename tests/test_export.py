"""Export round trips: what SGLang, vLLM and the z-lab code load is what we trained."""

import argparse
import json

import pytest
import torch
from safetensors import safe_open

from dflashkit.checkpoint import (DRAFT_VOCAB_NAME, CheckpointError, config_to_dict, expected_tensors,
                                  load_drafter, save_draft_vocab, save_drafter)
from dflashkit.drafter import config_for_target, init_drafter
from dflashkit.export import ENGINES, add_export_parsers, export_drafter, launch_commands
from tests.conftest import MASK, tiny_target


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random drafter saved in fp32, with a draft vocabulary the export must drop."""
    target = tiny_target("qwen3", layers=6)
    cfg = config_for_target(target, num_layers=2, block_size=8, mask_token_id=MASK)
    path = tmp_path_factory.mktemp("src")
    save_drafter(init_drafter(cfg, seed=3), path, dtype=torch.float32)
    save_draft_vocab(torch.arange(0, 64), path)
    return path


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("engine", ENGINES)
def test_round_trip(source, tmp_path, engine):
    out = tmp_path / engine
    result = export_drafter(source, out, engine=engine, target="qwen2.5-coder-0.5b-instruct")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not (out / DRAFT_VOCAB_NAME).exists()

    src, dst = _tensors(source), _tensors(out)
    assert set(dst) == set(src) == set(expected_tensors(load_drafter(source).config))
    for name, t in dst.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, src[name].to(torch.bfloat16)), name

    reloaded = load_drafter(out)
    assert reloaded.draft_vocab is None
    original = load_drafter(source)
    for (n, a), (_, b) in zip(sorted(reloaded.state_dict().items()), sorted(original.state_dict().items())):
        assert torch.equal(a, b.to(torch.bfloat16).float()), n

    cfg = json.loads((out / "config.json").read_text())
    fmt = config_to_dict(original.config)
    for key in ("architectures", "model_type", "block_size", "num_target_layers", "dflash_config",
                "layer_types", "sliding_window", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "hidden_act",
                "attention_bias", "tie_word_embeddings"):
        assert cfg[key] == fmt[key], key
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["sliding_window"] is None
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": original.target_layer_ids}
    assert cfg["dtype"] == "bfloat16"
    ids = original.target_layer_ids
    if engine == "vllm":
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [j + 1 for j in ids]
    else:
        assert "eagle_aux_hidden_state_layer_ids" not in cfg
    assert "auto_map" not in cfg      # no dflash.py was supplied

    assert result.commands["sglang"].endswith("--speculative-num-draft-tokens 8")
    assert "--speculative-algorithm DFLASH" in result.commands["sglang"]
    assert "--model-path Qwen/Qwen2.5-Coder-0.5B-Instruct" in result.commands["sglang"]
    assert '"num_speculative_tokens": 7' in result.commands["vllm"]
    assert ("zlab" in result.commands) == (engine == "zlab")
    card = (out / "README.md").read_text()
    assert "UNTRAINED" in card and "draft vocabulary" in card


def test_zlab_auto_map_only_with_the_code(source, tmp_path):
    code = tmp_path / "dflash.py"
    code.write_text("class DFlashDraftModel:\n    pass\n")
    out = tmp_path / "z"
    export_drafter(source, out, engine="zlab", zlab_code=code)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert (out / "dflash.py").read_text() == code.read_text()
    load_drafter(out)   # our loader ignores auto_map
    with pytest.raises(ValueError):
        export_drafter(source, tmp_path / "s", engine="sglang", zlab_code=code)


def test_block_size_conventions(tmp_path):
    cmds = launch_commands(tmp_path / "my drafter", "org/model", 16)
    assert cmds["sglang"].split()[-1] == "16"
    assert '"num_speculative_tokens": 15' in cmds["vllm"]
    assert "'" in cmds["sglang"]   # the path with a space is quoted for the shell
    with pytest.raises(ValueError):
        launch_commands(tmp_path, "t", 1)


def test_refuses_bad_sources_and_targets(source, tmp_path):
    with pytest.raises(CheckpointError):
        export_drafter(tmp_path / "missing", tmp_path / "o1")
    with pytest.raises(CheckpointError):
        export_drafter(source, source, overwrite=True)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError):
        export_drafter(source, busy)
    with pytest.raises(CheckpointError):
        export_drafter(source, busy, overwrite=True)
    assert (busy / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError):
        export_drafter(source, tmp_path / "o2", engine="tgi")
    # A misnamed tensor must not be exported (engines would load it and accept nothing).
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((source / "config.json").read_text())
    from safetensors.torch import save_file
    tensors = _tensors(source)
    tensors["model.norm.weight"] = tensors.pop("norm.weight")
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="prefix"):
        export_drafter(bad, tmp_path / "o3")


def test_overwrite_replaces_an_earlier_export(source, tmp_path):
    out = tmp_path / "o"
    export_drafter(source, out, engine="vllm")
    with pytest.raises(CheckpointError):
        export_drafter(source, out, engine="sglang")
    export_drafter(source, out, engine="sglang", overwrite=True, block_size=4)
    cfg = json.loads((out / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    assert cfg["block_size"] == 8    # the trained block stays in the config


def test_parser(source, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_export_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", str(source), str(tmp_path / "o"), "--for", "vllm"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "vllm serve TARGET_MODEL" in printed and "sglang.launch_server" in printed
