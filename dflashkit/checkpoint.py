"""The interoperable drafter checkpoint: ``config.json`` + ``model.safetensors`` (bf16).

The format is the one the z-lab reference code, SGLang (``--speculative-algorithm DFLASH``)
and vLLM (``"method": "dflash"``) load: a Qwen3 config with DFlash keys and tensor names
without prefix. Serving engines silently skip unknown tensor names, so a misnamed tensor
gives a drafter that loads and accepts nothing; therefore every save and every load checks
names, shapes and the config, and any mismatch is an error that names the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .drafter import DFlashDrafter, DrafterConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# dflashkit's optional extra: the token ids the drafter may propose (a restricted LM head).
# A separate file, so engines that load the folder see the standard format only.
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"


class CheckpointError(ValueError):
    """A drafter checkpoint or config that cannot be used as it is."""


# Keys we write ourselves; everything else found in a config is kept in ``extra``.
_OWN_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers",
    "block_size", "dflash_config", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "max_position_embeddings", "layer_types", "sliding_window",
    "use_sliding_window", "hidden_act", "attention_bias", "tie_word_embeddings",
    "max_window_layers", "attention_dropout", "dtype", "torch_dtype",
}


def validate_config(cfg: DrafterConfig) -> None:
    """Raise CheckpointError naming the first field that is out of range."""
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers", "block_size",
                 "max_position_embeddings"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"drafter config: {name} must be a positive integer, got {value!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(
            f"drafter config: num_attention_heads ({cfg.num_attention_heads}) must be a multiple "
            f"of num_key_value_heads ({cfg.num_key_value_heads})")
    if cfg.head_dim % 2:
        raise CheckpointError(f"drafter config: head_dim must be even for RoPE, got {cfg.head_dim}")
    ids = cfg.target_layer_ids
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
        raise CheckpointError(
            f"drafter config: dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < cfg.num_target_layers]
    if bad:
        raise CheckpointError(
            f"drafter config: dflash_config.target_layer_ids {bad} out of range for a target with "
            f"num_target_layers={cfg.num_target_layers} (valid ids: 0..{cfg.num_target_layers - 1}; "
            f"id j means the output of decoder layer j)")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"drafter config: dflash_config.target_layer_ids has duplicates: {ids}")
    if not isinstance(cfg.mask_token_id, int) or not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise CheckpointError(
            f"drafter config: dflash_config.mask_token_id {cfg.mask_token_id!r} is outside the "
            f"embedding table (vocab_size={cfg.vocab_size})")
    if cfg.rms_norm_eps <= 0 or cfg.rope_theta <= 0:
        raise CheckpointError("drafter config: rms_norm_eps and rope_theta must be positive")


def config_to_dict(cfg: DrafterConfig) -> dict:
    """The z-lab / SGLang / vLLM config.json for this drafter."""
    d = dict(cfg.extra)
    d.update({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": cfg.num_hidden_layers,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    })
    d.setdefault("dtype", "bfloat16")
    return d


def config_from_dict(d: dict, source: str = "config.json") -> DrafterConfig:
    """Parse a drafter config.json; refuse anything the DFlash drafter cannot mean."""
    def need(key, where=d, label=None):
        if key not in where:
            raise CheckpointError(f"{source}: missing required key {label or key!r}")
        return where[key]

    arch = d.get("architectures") or []
    if "DFlashDraftModel" not in arch:
        raise CheckpointError(
            f"{source}: architectures is {arch!r}; a DFlash drafter has ['DFlashDraftModel']")
    dflash = d.get("dflash_config")
    if not isinstance(dflash, dict):
        raise CheckpointError(f"{source}: missing 'dflash_config' with mask_token_id and target_layer_ids")
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("attention_bias", False):
        raise CheckpointError(f"{source}: attention_bias=true is not supported by the DFlash drafter")
    types = d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise CheckpointError(f"{source}: layer_types must all be 'full_attention', got {types!r}")
    rope = d.get("rope_scaling") or {}
    params = d.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type") or "default"
    if rope_type != "default":
        raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported (only default RoPE)")
    theta = d.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: missing 'rope_theta'")
    heads = need("num_attention_heads")
    cfg = DrafterConfig(
        hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or need("hidden_size") // heads,
        vocab_size=need("vocab_size"),
        num_target_layers=need("num_target_layers"),
        target_layer_ids=list(need("target_layer_ids", dflash, "dflash_config.target_layer_ids")),
        mask_token_id=need("mask_token_id", dflash, "dflash_config.mask_token_id"),
        block_size=d.get("block_size", dflash.get("block_size", 16)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        extra={k: v for k, v in d.items() if k not in _OWN_KEYS},
    )
    validate_config(cfg)
    return cfg


def expected_tensors(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the format and its shape."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out = {
        "fc.weight": (h, cfg.num_context_layers * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    return out


def validate_tensors(cfg: DrafterConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Names and shapes must match the format exactly; say what is wrong and what to do."""
    expected = expected_tensors(cfg)
    missing = sorted(set(expected) - set(shapes))
    unknown = sorted(set(shapes) - set(expected))
    if unknown or missing:
        hint = ""
        if any(n.startswith(("model.", "draft_model.", "module.")) for n in unknown):
            hint = " (tensor names carry a prefix such as 'model.'; the format has none: strip it)"
        elif any(n in ("embed_tokens.weight", "lm_head.weight") for n in unknown):
            hint = (" (the drafter borrows the target's embedding and LM head; remove "
                    "embed_tokens/lm_head from the drafter checkpoint)")
        raise CheckpointError(
            f"{source}: tensor names do not match the DFlash format{hint}: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unknown {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    fc = tuple(shapes["fc.weight"])
    if fc != expected["fc.weight"]:
        raise CheckpointError(
            f"{source}: fc.weight has shape {list(fc)} but the config asks for "
            f"[hidden_size={cfg.hidden_size}, len(target_layer_ids)={cfg.num_context_layers} x "
            f"hidden_size={cfg.num_context_layers * cfg.hidden_size}]; the fc input width must be K*H")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {list(shapes[name])}, "
                                  f"expected {list(shape)} from config.json")


def atomic_write(path: Path, write) -> None:
    """Write through ``write(tmp_path)`` then rename into place: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_drafter(model: DFlashDrafter, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the folder atomically file by file (weights first, config last)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    validate_config(cfg)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    validate_tensors(cfg, {k: tuple(v.shape) for k, v in state.items()}, str(path))
    atomic_write(path / WEIGHTS_NAME,
                        lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    text = json.dumps(config_to_dict(cfg) | {"dtype": str(dtype).removeprefix("torch.")},
                      indent=2, sort_keys=True) + "\n"
    atomic_write(path / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    return path


def read_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    file = path / CONFIG_NAME if path.is_dir() else path
    if not file.exists():
        raise CheckpointError(f"{path}: no {CONFIG_NAME}; a drafter folder holds config.json and "
                              f"model.safetensors (create one with `dflashkit drafter init`)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    return config_from_dict(data, str(file))


def drafter_digest(path: str | Path) -> str:
    """sha256 over the files that define a drafter folder: a resumed benchmark checks it, so
    a drafter retrained in place is never mixed with records of the old one."""
    digest = hashlib.sha256()
    for name in (CONFIG_NAME, WEIGHTS_NAME, DRAFT_VOCAB_NAME):
        f = Path(path) / name
        if f.exists():
            digest.update(name.encode())
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Load and fully validate a drafter folder; weights are cast to ``dtype``."""
    path = Path(path)
    cfg = read_config(path)
    weights = path / WEIGHTS_NAME
    if not weights.exists():
        raise CheckpointError(f"{path}: missing {WEIGHTS_NAME}")
    with safe_open(str(weights), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        validate_tensors(cfg, shapes, str(weights))
        state = {k: f.get_tensor(k).to(dtype) for k in f.keys()}
    with torch.device("meta"):  # no throw-away random init of large drafters
        model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.draft_vocab = load_draft_vocab(path, cfg)
    return model.eval()


def save_draft_vocab(ids: torch.Tensor, path: str | Path) -> None:
    path = Path(path)
    atomic_write(path / DRAFT_VOCAB_NAME,
                        lambda tmp: save_file({"ids": ids.to(torch.int64).contiguous()}, tmp))


def load_draft_vocab(path: str | Path, cfg: DrafterConfig) -> torch.Tensor | None:
    file = Path(path) / DRAFT_VOCAB_NAME
    if not file.exists():
        return None
    with safe_open(str(file), framework="pt") as f:
        if set(f.keys()) != {"ids"}:
            raise CheckpointError(f"{file}: expected one tensor named 'ids'")
        ids = f.get_tensor("ids")
    if ids.ndim != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise CheckpointError(f"{file}: ids must be a non-empty 1-D list in [0, vocab_size={cfg.vocab_size})")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{file}: ids must be sorted and unique")
    return ids


def check_compatible(cfg: DrafterConfig, target) -> None:
    """A drafter must be sized for its target; name the field that is not."""
    if cfg.hidden_size != target.hidden_size:
        raise CheckpointError(f"drafter hidden_size={cfg.hidden_size} but the target "
                              f"{target.name} has hidden_size={target.hidden_size}")
    if cfg.num_target_layers != target.num_layers:
        raise CheckpointError(f"drafter num_target_layers={cfg.num_target_layers} but the target "
                              f"{target.name} has {target.num_layers} decoder layers")
    if cfg.vocab_size != target.num_embeddings:
        raise CheckpointError(f"drafter vocab_size={cfg.vocab_size} but the target {target.name} "
                              f"has {target.num_embeddings} embedding rows")
    target.check_layer_ids(cfg.target_layer_ids)
    special = {"an EOS/stop id": target.stop_token_ids(), "the pad id": [target.pad_token_id()]}
    for what, ids in special.items():
        if cfg.mask_token_id in ids:
            raise CheckpointError(f"drafter dflash_config.mask_token_id={cfg.mask_token_id} is "
                                  f"{what} of the target; it must be an otherwise unused id")
