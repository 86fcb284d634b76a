"""``dflashkit export``: hand a drafter to SGLang, vLLM or the z-lab reference code.

The folder the trainer writes is already the interoperable format (DESIGN.md section 3);
an export re-validates it through our own loader, rewrites it as bf16 with exactly the
format's keys and tensor names, adds the engine's optional keys, drops dflashkit-only
files (``draft_vocab.safetensors``: engines would ignore it and propose from the full
vocabulary anyway), writes a model card and prints the launch commands. The block-size
conventions differ between engines and are the most common launch mistake, so the
commands are generated here rather than left to the reader.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import (atomic_write, CONFIG_NAME, DRAFT_VOCAB_NAME, WEIGHTS_NAME, CheckpointError,
                         config_to_dict, load_drafter, read_config, validate_tensors)
from .drafter import DrafterConfig

ENGINES = ("sglang", "vllm", "zlab")
CARD_NAME = "README.md"
ZLAB_CODE_NAME = "dflash.py"
TARGET_PLACEHOLDER = "TARGET_MODEL"   # shown when the target's hub id is unknown
# Files an export owns; anything else in OUT is left alone (or refused, see _prepare_out).
_OWNED = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, ZLAB_CODE_NAME)


@dataclass(frozen=True)
class ExportResult:
    """What was written and how to launch it (commands keyed by engine)."""

    path: Path
    engine: str
    block_size: int
    target: str
    commands: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"exported a DFlash drafter for {self.engine} to {self.path}", ""]
        for engine, cmd in self.commands.items():
            lines += [f"# {engine}", cmd, ""]
        return "\n".join(lines).rstrip() + "\n"


def engine_config(cfg: DrafterConfig, engine: str, remote_code: bool = False) -> dict:
    """config.json for ``engine``: the format's keys plus that engine's optional ones."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    d = config_to_dict(cfg)
    d["dtype"] = "bfloat16"
    d["torch_dtype"] = "bfloat16"   # transformers < 4.56 (inside many engine images) reads this name
    d.pop("auto_map", None)         # only written when the code it names is in the folder
    if engine == "vllm":
        # vLLM indexes hidden states with the embedding output at 0: our id j is its j + 1.
        d["eagle_aux_hidden_state_layer_ids"] = [j + 1 for j in cfg.target_layer_ids]
    else:
        d.pop("eagle_aux_hidden_state_layer_ids", None)
    if engine == "zlab" and remote_code:
        d["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    return d


def target_hub_id(target: str | None) -> str:
    """The hub id an engine should load: registry names map to their upstream model."""
    if not target:
        return TARGET_PLACEHOLDER
    from .models import REGISTRY
    spec = REGISTRY.get(target)
    return spec.upstream if spec is not None else target


def launch_commands(out: Path, target: str, block_size: int) -> dict[str, str]:
    """SGLang counts the block including the anchor; vLLM counts only the drafted slots."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 to speculate, got {block_size}")
    path = str(Path(out).resolve())
    spec = json.dumps({"method": "dflash", "model": path, "num_speculative_tokens": block_size - 1})
    return {
        "sglang": " ".join([
            "python -m sglang.launch_server", "--model-path", shlex.quote(target),
            "--speculative-algorithm DFLASH", "--speculative-draft-model-path", shlex.quote(path),
            "--speculative-num-draft-tokens", str(block_size)]),
        "vllm": " ".join(["vllm serve", shlex.quote(target), "--speculative-config", shlex.quote(spec)]),
    }


def _zlab_snippet(out: Path, remote_code: bool) -> str:
    path = str(Path(out).resolve())
    if remote_code:
        return (f"python -c \"from transformers import AutoModel; "
                f"AutoModel.from_pretrained({path!r}, trust_remote_code=True, dtype='auto')\"")
    return (f"python -c \"from dflash import DFlashDraftModel; "
            f"DFlashDraftModel.from_pretrained({path!r}, dtype='auto')\"  # in a z-lab/dflash checkout")


def _prepare_out(src: Path, out: Path, overwrite: bool) -> None:
    """Refuse to write over the source or over a folder holding files we do not own."""
    if out.exists() and out.resolve() == src.resolve():
        raise CheckpointError(f"{out}: the export folder must differ from the source drafter")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out}: folder is not empty; pass overwrite=True (--overwrite) "
                              f"to replace an earlier export")
    out.mkdir(parents=True, exist_ok=True)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _OWNED + (DRAFT_VOCAB_NAME,))
    if foreign:
        raise CheckpointError(f"{out}: holds files an export does not write ({foreign[:5]}); "
                              f"choose an empty folder")


def _check_written(out: Path) -> None:
    """Re-read what was written: config parses, names and shapes are the format's."""
    cfg = read_config(out)
    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    validate_tensors(cfg, shapes, str(out / WEIGHTS_NAME))
    if dtypes != {"BF16"}:
        raise CheckpointError(f"{out / WEIGHTS_NAME}: expected bf16 tensors only, found {sorted(dtypes)}")


def model_card(cfg: DrafterConfig, engine: str, target: str, block_size: int,
               commands: dict[str, str], had_draft_vocab: bool, remote_code: bool) -> str:
    """A README that says what the folder is, how each engine launches it, and its caveats."""
    trained = cfg.extra.get("dflashkit", {}).get("trained")
    lines = [
        f"# DFlash drafter (exported by dflashkit for {engine})",
        "",
        f"Target: `{target}`. Format: `config.json` + bf16 `model.safetensors`, the DFlash "
        "layout SGLang (`--speculative-algorithm DFLASH`), vLLM (`\"method\": \"dflash\"`) and "
        "the z-lab reference code load.",
        "",
        "## Drafter",
        f"- {cfg.num_hidden_layers} layer(s), hidden {cfg.hidden_size}, intermediate "
        f"{cfg.intermediate_size}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, "
        f"head dim {cfg.head_dim}",
        f"- trained block size {cfg.block_size}; launch commands below use {block_size}",
        f"- target layers {cfg.target_layer_ids} of {cfg.num_target_layers} (id j = output of decoder "
        f"layer j); mask token id {cfg.mask_token_id}",
    ]
    if trained is False:
        lines.append("- WARNING: this drafter is UNTRAINED (freshly initialised): expect almost no "
                     "accepted tokens and a slowdown.")
    lines += ["", "## Launch", "",
              f"SGLang counts the block including the anchor token (`--speculative-num-draft-tokens "
              f"{block_size}`); vLLM counts only the drafted slots (`num_speculative_tokens: "
              f"{block_size - 1}`).", ""]
    for name, cmd in commands.items():
        lines += [f"{name}:", "", "```bash", cmd, "```", ""]
    if engine == "vllm":
        lines += ["`eagle_aux_hidden_state_layer_ids` in config.json is the target layer ids in "
                  "vLLM's indexing (ours + 1, because vLLM counts the embedding output as 0).", ""]
    if engine == "zlab":
        if remote_code:
            lines += ["`dflash.py` (supplied by the exporter from a z-lab/dflash checkout) and "
                      "`auto_map` let `AutoModel.from_pretrained(..., trust_remote_code=True)` load "
                      "the folder.", ""]
        else:
            lines += ["No `auto_map` is written: it would point at a `dflash.py` that dflashkit does "
                      "not ship, and `from_pretrained` would fail on it. Load the folder with "
                      "`DFlashDraftModel.from_pretrained(path)` from a z-lab/dflash checkout, or "
                      "re-export with `--zlab-code path/to/dflash.py` to copy that file in and add "
                      "`auto_map: {\"AutoModel\": \"dflash.DFlashDraftModel\"}`. Without either, "
                      "`AutoModel` would build a plain Qwen3 model from this config.", ""]
    lines += ["## Caveats",
              "- The target must be the model the drafter was trained on; targets prepared by "
              "dflashkit are dequantised GGUF files, so features from the original hub weights "
              "differ slightly and acceptance may be a little lower (output stays lossless)."]
    if had_draft_vocab:
        lines.append("- The source had a restricted draft vocabulary (`draft_vocab.safetensors`); "
                     "engines have no such option, so they propose from the full vocabulary. "
                     "Acceptance can differ from dflashkit's measurements.")
    return "\n".join(lines) + "\n"


def export_drafter(src: str | Path, out: str | Path, engine: str = "sglang", target: str | None = None,
                   block_size: int | None = None, overwrite: bool = False,
                   zlab_code: str | Path | None = None) -> ExportResult:
    """Validate ``src`` and write an engine-ready copy to ``out``; return the launch commands.

    target: registry name, hub id or path shown in the commands (default: a placeholder).
    block_size: the block at serving time (default: the trained one); may be smaller.
    zlab_code: a ``dflash.py`` from a z-lab/dflash checkout (engine "zlab" only), copied in
        so that ``auto_map`` can be written.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if zlab_code is not None and engine != "zlab":
        raise ValueError("zlab_code only applies to engine 'zlab'")
    src, out = Path(src), Path(out)
    drafter = load_drafter(src, dtype=torch.bfloat16)   # full validation: config, names, shapes
    cfg = drafter.config
    block = cfg.block_size if block_size is None else block_size
    if not isinstance(block, int) or not 2 <= block:
        raise ValueError(f"block_size must be an integer >= 2, got {block!r}")
    code = _check_zlab_code(Path(zlab_code)) if zlab_code is not None else None
    _prepare_out(src, out, overwrite)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    validate_tensors(cfg, {k: tuple(v.shape) for k, v in state.items()}, str(src))
    hub_target = target_hub_id(target)
    commands = launch_commands(out, hub_target, block)
    if engine == "zlab":
        commands["zlab"] = _zlab_snippet(out, code is not None)

    (out / DRAFT_VOCAB_NAME).unlink(missing_ok=True)   # never part of an engine export
    (out / ZLAB_CODE_NAME).unlink(missing_ok=True)
    atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config_text = json.dumps(engine_config(cfg, engine, code is not None), indent=2, sort_keys=True) + "\n"
    atomic_write(out / CONFIG_NAME, lambda tmp: Path(tmp).write_text(config_text))
    if code is not None:
        atomic_write(out / ZLAB_CODE_NAME, lambda tmp: shutil.copyfile(code, tmp))
    card = model_card(cfg, engine, hub_target, block, commands,
                      had_draft_vocab=drafter.draft_vocab is not None, remote_code=code is not None)
    atomic_write(out / CARD_NAME, lambda tmp: Path(tmp).write_text(card))
    _check_written(out)
    return ExportResult(path=out, engine=engine, block_size=block, target=hub_target, commands=commands)


def _check_zlab_code(path: Path) -> Path:
    """Only a file that defines the class auto_map names is worth pointing at."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (expected dflash.py from a z-lab/dflash checkout)")
    if "class DFlashDraftModel" not in path.read_text(errors="replace"):
        raise CheckpointError(f"{path}: does not define DFlashDraftModel; auto_map would not resolve")
    return path


# --- command line -----------------------------------------------------------------------------

def cmd_export(args) -> int:
    result = export_drafter(args.drafter, args.out, engine=args.engine, target=args.target,
                            block_size=args.block_size, overwrite=args.overwrite,
                            zlab_code=args.zlab_code)
    print(result.describe(), end="")
    return 0


def add_export_parsers(subparsers) -> argparse.ArgumentParser:
    """Register ``export DRAFTER OUT [--for sglang|vllm|zlab]`` on a subparsers object."""
    p = subparsers.add_parser("export", help="write a drafter folder SGLang, vLLM or z-lab code loads",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="source drafter folder (config.json + model.safetensors)")
    p.add_argument("out", help="export folder (created; must be empty unless --overwrite)")
    p.add_argument("--for", dest="engine", choices=ENGINES, default="sglang")
    p.add_argument("--target", default=None,
                   help="target registry name, hub id or path for the printed launch commands")
    p.add_argument("--block-size", type=int, default=None,
                   help="block size at serving time, anchor included (default: the trained one)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    p.add_argument("--zlab-code", default=None,
                   help="(--for zlab) dflash.py from a z-lab/dflash checkout: copied in, auto_map written")
    p.set_defaults(func=cmd_export)
    return p
