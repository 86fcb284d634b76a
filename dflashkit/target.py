"""Adapter around a Hugging Face causal LM: the target that DFlash accelerates.

It gives the decoding loop and the trainer four things: a forward pass at absolute positions
over a KV cache that also returns the outputs of the chosen decoder layers (hooked, so the
other layers' states are never kept), the frozen embedding and LM head the drafter borrows,
a cache rollback with transformers 5.x semantics, and the tokenizer facts (stop ids, chat
template, the mask token id).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

from .fastpath import (ROWWISE_ATTENTION, InPlaceCache, InPlaceLayer, PackedLinear, fast_path_available,  # noqa: E402
                       fuse_mlps, pack_linears, resolve_dtype, unfuse_mlps, unpack_linears)


class TargetError(ValueError):
    """A target model or prompt that cannot be used as given."""


@dataclass
class TargetOutput:
    logits: torch.Tensor            # [b, q or 1, vocab]
    features: torch.Tensor | None   # [b, q, K*H]: concatenated outputs of the hooked layers


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TargetError(
            f"{type(model).__name__}: cannot find the decoder layers at model.model.layers; "
            "dflashkit supports Llama/Qwen2/Qwen3-style causal LMs")
    return layers


class TargetInfo:
    """What is known of a target without its weights: config, tokenizer, generation config."""

    def __init__(self, config, tokenizer=None, name: str = "target", generation_config=None):
        self.config = config
        self.tokenizer = tokenizer
        self.name = name
        self.generation_config = generation_config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_embeddings(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def stop_token_ids(self) -> list[int]:
        """EOS ids of the generation config and the tokenizer (Qwen instruct has two)."""
        ids: list[int] = []
        for source in (self.generation_config, self.tokenizer, self.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            for i in ([eos] if isinstance(eos, int) else list(eos or [])):
                if i is not None and i not in ids:
                    ids.append(int(i))
        return ids

    def pad_token_id(self) -> int | None:
        for source in (self.tokenizer, self.generation_config, self.config):
            pad = getattr(source, "pad_token_id", None) if source is not None else None
            if isinstance(pad, int):
                return pad
        return None

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        bad = [j for j in layer_ids if not 0 <= j < self.num_layers]
        if bad:
            raise TargetError(f"target layer ids {bad} out of range: {self.name} has "
                              f"{self.num_layers} decoder layers (valid ids 0..{self.num_layers - 1})")

    # --- prompts -------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """Token ids of a prompt; with ``chat`` the tokenizer's chat template is applied."""
        if self.tokenizer is None:
            raise TargetError("this target has no tokenizer; pass token ids instead of text")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise TargetError(f"{self.name}: the tokenizer has no chat template; use --raw")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            # non-thinking: templates with a thinking switch (Qwen3) answer directly; the others
            # ignore the variable
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False,
                                                     enable_thinking=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        if not isinstance(prompt, str):
            raise TargetError("a raw prompt must be a string")
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else str(ids)


class _DeepestLayerDone(Exception):
    """Raised by the capture hook of the deepest wanted layer to end a features() pass."""


class Target(TargetInfo):
    """A frozen causal LM with hidden-state capture for the drafter's context."""

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "target",
                 fast_path: bool | None = None):
        super().__init__(model.config, tokenizer, name, getattr(model, "generation_config", None))
        self.model = model.eval().requires_grad_(False)
        self.layers = _decoder_layers(model)
        self._captured: dict[int, list[torch.Tensor]] = {}
        for j, layer in enumerate(self.layers):
            layer.register_forward_hook(self._make_hook(j))
        self.fast_path = False
        self.set_fast_path(fast_path_available(self.dtype, self.device) if fast_path is None else fast_path)

    # --- execution path ------------------------------------------------------------------
    def set_fast_path(self, on: bool) -> None:
        """Switch the prepacked-weight CPU path (fastpath.py) on or off; cheap both ways."""
        if on and not fast_path_available(self.dtype, self.device):
            raise TargetError(f"the fast CPU path needs fp32 weights (or bf16 on a CPU with AMX) "
                              f"and oneDNN; this target is {self.dtype} on {self.device}. Use "
                              f"--no-fast-path or --dtype float32")
        if on and not self.fast_path:
            if self._packed is None:
                pack_linears(self.model)
                self._packed = {n: m for n, m in self.model.named_modules() if isinstance(m, PackedLinear)}
                self._packed.update(fuse_mlps(self.model))
            else:
                for name, packed in self._packed.items():   # linears first, then fused MLPs
                    parent, _, child = name.rpartition(".")
                    setattr(self.model.get_submodule(parent) if parent else self.model, child, packed)
        elif not on and self.fast_path:
            unfuse_mlps(self.model)
            unpack_linears(self.model)
        self._set_rowwise_attention(on and self.dtype != torch.float32)
        self.fast_path = bool(on)

    @contextmanager
    def batched_attention(self):
        """One attention call per pass even on the bf16 path: for batched generation whose
        rows need not equal one-token steps bit for bit (training data)."""
        before = self.model.config._attn_implementation
        self._set_rowwise_attention(False)
        try:
            yield self
        finally:
            self.model.config._attn_implementation = before

    def _set_rowwise_attention(self, on: bool) -> None:
        """bf16 verify passes attend row by row (fastpath.rowwise_sdpa) so they compute the
        very numbers of one-token steps; fp32 keeps one attention call per pass."""
        cfg = self.model.config
        if on and cfg._attn_implementation == "sdpa":
            cfg._attn_implementation = ROWWISE_ATTENTION
        elif not on and cfg._attn_implementation == ROWWISE_ATTENTION:
            cfg._attn_implementation = "sdpa"

    _packed: dict[str, nn.Module] | None = None   # PackedLinear and FusedGateUpMLP by name

    @contextmanager
    def default_path(self):
        """Run the block with PyTorch's default kernels (what plain HF ``generate`` uses)."""
        was = self.fast_path
        self.set_fast_path(False)
        try:
            yield self
        finally:
            self.set_fast_path(was)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_embeddings(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    # --- forward -------------------------------------------------------------------------
    def _make_hook(self, j: int):
        def hook(_module, _inputs, output):
            store = self._captured.get(j)
            if store is not None:
                store.append(output[0] if isinstance(output, tuple) else output)
            if j == self._stop_after:
                raise _DeepestLayerDone
        return hook

    _stop_after: int | None = None   # features(): the layer whose output ends the pass

    @contextmanager
    def capturing(self, layer_ids: list[int] | None):
        """Collect the outputs of ``layer_ids`` for every forward pass run inside the block.

        Yields ``{layer_id: [tensor per forward call]}``; nothing else is kept.
        """
        self.check_layer_ids(list(layer_ids or []))
        self._captured = {j: [] for j in layer_ids or []}
        try:
            yield self._captured
        finally:
            self._captured = {}

    def new_cache(self) -> DynamicCache:
        """An in-place cache on the fast path (full-attention models), else HF's own."""
        types = getattr(self.config, "layer_types", None) or ["full_attention"]
        if self.fast_path and all(t == "full_attention" for t in types):
            return InPlaceCache(self.num_layers)
        return DynamicCache(config=self.config)

    def _check_length(self, tokens: int) -> None:
        if tokens > self.max_positions:
            raise TargetError(f"sequence of {tokens} tokens exceeds the target's context "
                              f"({self.max_positions}); shorten the prompt or max_new_tokens")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, cache: DynamicCache | None,
                capture: list[int] | None = None, last_only: bool = False,
                attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> TargetOutput:
        """Run ``input_ids`` [b, q] at positions start..start+q-1 on top of ``cache``.

        ``capture``: target layer ids whose OUTPUTS (= HF ``hidden_states[j + 1]``, the raw
        residual stream) are returned concatenated in the given order.
        ``positions`` [b, q] / ``attention_mask`` [b, cache + q]: rows at their own positions
        over a shared cache with holes (batched decoding; ``start`` is then ignored).
        """
        b, q = input_ids.shape
        if positions is None:
            positions = torch.arange(start, start + q, device=input_ids.device).expand(b, q)
        self._check_length(int(positions.max()) + 1)
        layer_ids = list(capture or [])
        with self.capturing(layer_ids) as store:
            out = self.model(input_ids=input_ids, position_ids=positions, cache=cache,
                             use_cache=cache is not None, logits_to_keep=1 if last_only else 0,
                             attention_mask=attention_mask)
            feats = torch.cat([store[j][-1] for j in layer_ids], dim=-1) if layer_ids else None
        return TargetOutput(logits=out.logits, features=feats)

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        """The outputs of ``layer_ids`` for whole sequences [b, q] at positions 0..q-1, no
        cache, concatenated as ``forward`` does. The pass stops after the deepest of them:
        training features need neither the layers above it nor logits."""
        if not layer_ids:
            raise TargetError("features(): name at least one target layer to capture")
        b, q = input_ids.shape
        self._check_length(q)
        with self.capturing(layer_ids) as store:
            self._stop_after = max(layer_ids)
            try:
                self.model(input_ids=input_ids, position_ids=torch.arange(q, device=input_ids.device).expand(b, q),
                           use_cache=False, logits_to_keep=1)
            except _DeepestLayerDone:
                pass
            finally:
                self._stop_after = None
            return torch.cat([store[j][-1] for j in layer_ids], dim=-1)

    @staticmethod
    def keep(cache: DynamicCache, start: int, rows: list[int]) -> None:
        """Keep the cache entries at ``start + rows[i]`` as ``start + i`` and drop the rest
        past ``start``: a draft tree's accepted path (tree.py) moved next to the context."""
        n = len(rows)
        if rows != list(range(n)):
            for layer in cache.layers:
                if type(layer) not in (DynamicLayer, InPlaceLayer):
                    raise TargetError(f"draft trees need a full-attention key/value cache; this target's "
                                      f"cache has {type(layer).__name__} layers: use block decoding")
                idx = torch.tensor(rows, device=layer.keys.device) + start
                layer.keys[:, :, start:start + n] = layer.keys[:, :, idx]
                layer.values[:, :, start:start + n] = layer.values[:, :, idx]
        Target.rollback(cache, start + n)

    @staticmethod
    def rollback(cache: DynamicCache, length: int) -> None:
        """Drop cache entries past ``length`` tokens (transformers 5.x: crop takes -count)."""
        remove = cache.get_seq_length() - length
        if remove < 0:
            raise ValueError(f"cannot roll the cache forward: it holds {cache.get_seq_length()} "
                             f"tokens, asked for {length}")
        if remove:
            cache.crop(-remove)


_PADDING_TOKEN = re.compile(r"^\[PAD\d+\]$|^<\|?PAD_?\d*\|?>$")


def resolve_mask_token_id(tokenizer, num_embeddings: int, forbidden: list[int] = ()) -> int:
    """The id the drafter uses for MASK: the first embedding row no real token uses.

    Qwen2.5 tokenizers rebuilt from GGUF fill the unused rows with tokens named
    ``[PAD151665]``..., so ``len(tokenizer)`` is not a free id; such padding names count as
    unused. When every row is a real token (SmolLM2), take the highest-id special token
    that is not bos/eos/pad/unk and does not occur in the chat template.
    """
    vocab = tokenizer.get_vocab()
    used = {i for tok, i in vocab.items() if not _PADDING_TOKEN.match(tok)}
    for i in range(num_embeddings):
        if i not in used and i not in forbidden:
            return i
    template = getattr(tokenizer, "chat_template", None) or ""
    reserved = {getattr(tokenizer, a, None) for a in
                ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")} | set(forbidden)
    candidates = [i for i, tok in tokenizer.added_tokens_decoder.items()
                  if getattr(tok, "special", False) and i not in reserved
                  and tok.content not in template and i < num_embeddings]
    if not candidates:
        raise TargetError("could not find a free embedding row or spare special token for the "
                          "drafter's mask token; pass mask_token_id explicitly")
    return max(candidates)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device that exists here: "cpu" (the default), "cuda", "cuda:N" or
    "auto" (a GPU when torch sees one).
    Checked before a model loads, so a typo costs a second, not a minute."""
    if device is None:
        return torch.device("cpu")
    if device == "auto":
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TargetError(f"--device {device!r} is not a device: use cpu, cuda, cuda:N or auto") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise TargetError(f"--device {device}: dflashkit runs targets on cpu or cuda only")
    if not torch.cuda.is_available():
        raise TargetError(f"--device {device}: this PyTorch build sees no CUDA GPU "
                          f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
                          f"use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TargetError(f"--device {device}: only {torch.cuda.device_count()} CUDA GPU(s) here "
                          f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def load_target(name_or_path: str | Path, dtype: torch.dtype | str | None = None,
                progress: bool = True, fast_path: bool | None = None,
                device: str | torch.device | None = None) -> Target:
    """Load a target by registry name (prepared offline from PyPI) or local HF folder.

    ``dtype``: None = float32; "bfloat16" for the bf16 fast path on CPUs with AMX (fastpath.py).
    ``fast_path``: prepacked CPU kernels; None = on where available (never on a GPU).
    ``device``: "cpu" (None) or a CUDA GPU; the drafter follows the target there.
    """
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    from .models import resolve_model
    path = resolve_model(str(name_or_path), progress=progress)
    tokenizer = None
    if any(Path(path).glob("tokenizer*")):  # a folder with weights only is still a target
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise TargetError(f"{path}: the tokenizer failed to load: {e}") from e
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return Target(model, tokenizer, name=str(name_or_path), fast_path=fast_path)


def inexact_output_warning(target: "Target") -> str | None:
    """Why speculative greedy output may differ from plain decoding, when it may: a verify pass
    over several tokens and a one-token step run different kernels (bf16 without the CPU fast
    path; any dtype on a GPU, where cuBLAS picks kernels by shape), whose roundings differ where
    two logits tie. None when outputs are exact (fp32 on the CPU, or the fast path)."""
    if target.device.type == "cuda" and target.dtype != torch.float64:
        return (f"warning: {target.name} runs on {target.device}: a verify pass and a one-token "
                f"step may use different GPU kernels that round differently, so greedy speculative "
                f"output may differ from plain decoding where two logits tie to within rounding "
                f"(the CPU in float32 is exact)")
    if target.dtype == torch.float32 or target.fast_path:
        return None
    return (f"warning: {target.name} runs in {str(target.dtype).removeprefix('torch.')} without the "
            f"fast path, so a verify pass and a one-token step may round differently and greedy "
            f"speculative output may differ from plain decoding where two logits tie; use "
            f"--dtype float32 (exact everywhere on a CPU) or the bf16 fast path (a CPU with AMX)")


class TargetHead(TargetInfo):
    """Only the target's frozen embedding and LM head: all the trainer needs when features
    come from disk, so training never assumes the whole target fits in this process."""

    def __init__(self, info: TargetInfo, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__(info.config, info.tokenizer, info.name, info.generation_config)
        self.embedding = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.head_weight = head_weight.requires_grad_(False)

    @property
    def num_embeddings(self) -> int:
        return self.embedding.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


def load_target_info(name_or_path: str | Path, progress: bool = True) -> tuple[TargetInfo, Path]:
    """Config, tokenizer and generation config of a target, without its weights."""
    from transformers import AutoConfig, GenerationConfig
    from .models import resolve_model
    path = Path(resolve_model(str(name_or_path), progress=progress))
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path) if any(path.glob("tokenizer*")) else None
    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = None
    return TargetInfo(config, tokenizer, str(name_or_path), gen), path


def load_target_head(name_or_path: str | Path, dtype: torch.dtype = torch.float32,
                     progress: bool = True) -> TargetHead:
    """Read only the embedding and LM-head tensors from the target's safetensors files."""
    from safetensors import safe_open
    info, path = load_target_info(name_or_path, progress)
    wanted = {"embed": ("model.embed_tokens.weight", "embed_tokens.weight"),
              "head": ("lm_head.weight",)}
    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for role, names in wanted.items():
                for n in names:
                    if role not in found and n in keys:
                        found[role] = f.get_tensor(n).to(dtype)
    if "embed" not in found:
        raise TargetError(f"{path}: no embed_tokens tensor in the safetensors files")
    if "head" not in found:
        if not getattr(info.config, "tie_word_embeddings", False):
            raise TargetError(f"{path}: no lm_head.weight and the embeddings are not tied")
        found["head"] = found["embed"]
    return TargetHead(info, found["embed"], found["head"])


def read_target_tensors(name_or_path: str | Path, names: list[str],
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Read the named tensors (Hugging Face names) from the target's safetensors files,
    without building the model; a name that is not there is a clear error."""
    from safetensors import safe_open
    _, path = load_target_info(name_or_path, progress=False)
    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for n in set(names) & set(f.keys()):
                found[n] = f.get_tensor(n).to(dtype)
    missing = [n for n in names if n not in found]
    if missing:
        raise TargetError(f"{path}: no tensor named {missing[0]!r} in the safetensors files "
                          f"({len(missing)} of {len(names)} missing); drafter.init: target needs "
                          f"a Llama/Qwen-style checkpoint (model.layers.N.self_attn.q_proj.weight, ...)")
    return found
