"""The DFlash drafter: a few non-causal decoder layers conditioned on target features.

One forward pass turns a block ``[last committed token, MASK, ..., MASK]`` into B-1 token
proposals. Keys and values are ``[context ; block]``: the context is a projection of the
target's hidden states (``hidden_norm(fc(concat_j h_j))``), shared by every layer and never
passed through a layer's input norm. The drafter owns no embedding and no LM head: it borrows
the target's, frozen. Tensor names and math follow the z-lab reference ``DFlashDraftModel``
so checkpoints load there, in SGLang and in vLLM unchanged (see ``checkpoint.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterConfig:
    """Shape and conditioning of a drafter; serialised as a Qwen3 config (checkpoint.py)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    # Keys we do not interpret but keep on a round trip (bos/eos ids, dtype, ...).
    extra: dict = field(default_factory=dict)

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Layers spread over the target as in the DFlash paper (DESIGN.md section 2)."""
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:
        # The spread formula needs T >= 5; small (test) targets take evenly spaced layers.
        return sorted({round(i * (num_target_layers - 1) / (num_draft_layers - 1))
                       for i in range(num_draft_layers)})
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [int(round(1 + i * step)) for i in range(num_draft_layers)]


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE tables for absolute positions ``[b, n]`` -> two ``[b, n, head_dim]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[b, heads, n, d]``; cos/sin: ``[b, n, d]``."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def _is_block_mask(mask) -> bool:
    return mask is not None and type(mask).__name__ == "BlockMask"


class ContextCache:
    """Per-layer keys/values of the CONTEXT only (after k_norm and RoPE), in preallocated
    buffers written in place.

    The block's own keys are recomputed every call and never kept: they are written just past
    the context (scratch space, overwritten by the next call), so attention reads one view of
    context + block with no concatenation. That is what the reference gets by appending the
    block and cropping it off again.
    """

    def __init__(self, num_layers: int, reserve: int = 512):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.filled = [0] * num_layers     # context entries written per layer
        self.length = 0                    # context entries every layer holds (set by the drafter)
        self.reserve = reserve

    def _room(self, layer: int, like: torch.Tensor, need: int) -> None:
        buf = self.keys[layer]
        if buf is not None and buf.shape[2] >= need:
            return
        b, h, _, d = like.shape
        capacity = max(need + self.reserve, 2 * buf.shape[2] if buf is not None else 0)
        keys, values = like.new_empty(b, h, capacity, d), like.new_empty(b, h, capacity, d)
        if buf is not None:   # grow: the one copy, amortised over many steps
            n = self.filled[layer]
            keys[:, :, :n], values[:, :, :n] = buf[:, :, :n], self.values[layer][:, :, :n]
        self.keys[layer], self.values[layer] = keys, values

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               block_k: torch.Tensor | None = None, block_v: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new context entries; returns keys/values of the context, followed by the
        block's when given (views into the buffers)."""
        n, q = self.filled[layer], 0 if block_k is None else block_k.shape[2]
        end = n + k.shape[2]
        self._room(layer, k, end + q)
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, n:end], values[:, :, n:end] = k, v
        if q:
            keys[:, :, end:end + q], values[:, :, end:end + q] = block_k, block_v
        self.filled[layer] = end
        return keys[:, :, :end + q], values[:, :, :end + q]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` context entries (rollback after a rejected prefix)."""
        self.filled = [min(f, length) for f in self.filled]
        self.length = min(self.length, length)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_x, rope_ctx,
                mask: torch.Tensor | None, cache: ContextCache | None, layer: int) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        k_x = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v_x = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        k_c = self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads)).transpose(1, 2)
        v_c = self._heads(self.v_proj(ctx), self.num_kv_heads).transpose(1, 2)
        q, k_x = apply_rope(q, *rope_x), apply_rope(k_x, *rope_x)
        k_c = apply_rope(k_c, *rope_ctx)
        if cache is not None:   # context and block in one view of the cache's buffers
            k, v = cache.extend(layer, k_c, v_c, k_x, v_x)
        else:
            k, v = torch.cat([k_c, k_x], dim=2), torch.cat([v_c, v_x], dim=2)
        if _is_block_mask(mask):   # flex attention (training on GPU; eager reference on CPU)
            from torch.nn.attention.flex_attention import flex_attention
            out = flex_attention(q, k, v, block_mask=mask, scale=self.head_dim ** -0.5,
                                 enable_gqa=self.num_heads != self.num_kv_heads)
            return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        has_key = None
        if mask is not None and mask.dtype == torch.bool:
            # A padding block sees nothing; give its rows every key (finite softmax, no NaN in
            # forward or backward) and zero their output, which is what "nothing" means.
            has_key = mask.any(-1, keepdim=True)
            mask = mask | ~has_key
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        if has_key is not None:
            out = out * has_key
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, x, ctx, rope_x, rope_ctx, mask, cache, layer):
        # The context is deliberately NOT normalised by input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_x, rope_ctx, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The DFlash draft model (parameters only; embedding and LM head come from the target)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        from .checkpoint import validate_config  # late import: checkpoint imports this module
        validate_config(cfg)
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # Optional restricted vocabulary (sorted ids) the drafter proposes from; None = all.
        self.draft_vocab: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def is_untrained(self) -> bool:
        return self.config.extra.get("dflashkit", {}).get("trained") is False

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Qwen-style init: normal(0, std) linears, unit norms. Seeded through ``generator``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """``[b, n, K*H]`` concatenated target layer outputs -> context vectors ``[b, n, H]``."""
        return self.hidden_norm(self.fc(target_features))

    def forward(self, block_embeds: torch.Tensor, target_features: torch.Tensor,
                context_positions: torch.Tensor, block_positions: torch.Tensor,
                attn_mask: torch.Tensor | None = None, cache: ContextCache | None = None) -> torch.Tensor:
        """Denoise blocks in one pass; returns final-normed hidden states ``[b, q, H]``.

        block_embeds: target embeddings of the block tokens ``[b, q, H]``.
        target_features: features of the NEW context tokens ``[b, c, K*H]`` (all of them when
            there is no cache; with a cache, only those not yet in it).
        context_positions ``[b, c]`` / block_positions ``[b, q]``: absolute positions.
        attn_mask: boolean ``[b|1, 1, q, keys]`` (True = visible) or None for "see everything".
        """
        dtype = block_embeds.dtype
        ctx = self.project_context(target_features.to(dtype))
        hd, theta = self.config.head_dim, self.config.rope_theta
        rope_x = rope_cos_sin(block_positions, hd, theta, dtype)
        rope_ctx = rope_cos_sin(context_positions, hd, theta, dtype)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_x, rope_ctx, attn_mask, cache, i)
        if cache is not None:
            cache.length += target_features.shape[1]
        return self.norm(x)

    # --- checkpoints (format: checkpoint.py) ---------------------------------------------
    def save_pretrained(self, path: str | Path) -> Path:
        from .checkpoint import save_drafter
        return save_drafter(self, path)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        from .checkpoint import load_drafter
        return load_drafter(path, dtype=dtype)


def config_for_target(target, num_layers: int = 1, block_size: int = 16,
                      target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                      intermediate_size: int | None = None) -> DrafterConfig:
    """Size a fresh drafter for ``target`` (a ``dflashkit.target.Target``).

    Attention shapes, norms and RoPE follow the target's config; the layer ids default to
    the paper's spread (one per drafter layer) and the mask id to the first unused row.
    """
    from .target import resolve_mask_token_id
    tc = target.config
    heads = tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(target.num_layers, num_layers)
    target.check_layer_ids(target_layer_ids)
    if mask_token_id is None:
        if target.tokenizer is None:
            raise ValueError("the target has no tokenizer: pass mask_token_id explicitly")
        forbidden = target.stop_token_ids() + [p for p in [target.pad_token_id()] if p is not None]
        mask_token_id = resolve_mask_token_id(target.tokenizer, target.num_embeddings, forbidden)
    extra = {k: getattr(tc, k) for k in ("bos_token_id", "eos_token_id") if getattr(tc, k, None) is not None}
    return DrafterConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        vocab_size=target.num_embeddings,
        num_target_layers=target.num_layers,
        target_layer_ids=list(target_layer_ids),
        mask_token_id=int(mask_token_id),
        block_size=block_size,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768)),
        extra=extra,
    )


def warm_start_from_target(drafter: DFlashDrafter, read) -> list[int]:
    """Start the drafter from the target's own layers instead of noise.

    Feature layer ``L = max(target_layer_ids)`` is the input of target layer ``L + 1``. So the
    context projection starts as that layer's normalised input (``fc`` picks feature L,
    ``hidden_norm`` takes layer L+1's input norm; the final norm when L is the last layer) and
    drafter layer i starts as target layer ``L + 1 + i`` (the last layer when there are
    fewer): on the context its keys and values are then the target's own, up to the biases
    and per-head norms below. The final norm is the target's. Dropped, because the drafter format has no
    place for them: attention biases (Qwen2); ``q_norm``/``k_norm`` start at one.
    ``read(names) -> {name: tensor}`` reads Hugging Face tensors (target.read_target_tensors).
    Returns the target layer each drafter layer came from.
    """
    cfg = drafter.config
    top = max(cfg.target_layer_ids)
    sources = [min(top + 1 + i, cfg.num_target_layers - 1) for i in range(cfg.num_hidden_layers)]
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
             "post_attention_layernorm")   # same names in the drafter and in HF Llama/Qwen
    context_norm = (f"model.layers.{top + 1}.input_layernorm.weight"
                    if top + 1 < cfg.num_target_layers else "model.norm.weight")
    names = {f"model.layers.{s}.{p}.weight" for s in sources for p in parts}
    names |= {context_norm, "model.norm.weight"}
    tensors = read(sorted(names))
    own = dict(drafter.named_parameters())

    def put(dst: str, src: str) -> None:
        if own[dst].shape != tensors[src].shape:
            raise ValueError(f"drafter.init: target: {dst} has shape {tuple(own[dst].shape)} but the "
                             f"target's {src} has {tuple(tensors[src].shape)}; leave "
                             f"drafter.intermediate_size unset or use drafter.init: random")
        own[dst].data.copy_(tensors[src])

    with torch.no_grad():
        for i, s in enumerate(sources):
            for part in parts:
                put(f"layers.{i}.{part}.weight", f"model.layers.{s}.{part}.weight")
            for norm in ("q_norm", "k_norm"):
                getattr(drafter.layers[i].self_attn, norm).weight.fill_(1.0)
        h, k = cfg.hidden_size, cfg.target_layer_ids.index(top)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, k * h:(k + 1) * h] = torch.eye(h)
        put("hidden_norm.weight", context_norm)
        put("norm.weight", "model.norm.weight")
    cfg.extra.setdefault("dflashkit", {})["init_from_target_layers"] = sources
    return sources


def warm_start_from_drafter(drafter: DFlashDrafter, source: DFlashDrafter) -> int:
    """Grow a trained drafter: start from ``source`` and add layers that change nothing yet.

    ``fc``, the norms and the first ``source`` layers are copied; each layer beyond the
    source's depth keeps its random init except its two output projections (attention
    ``o_proj`` and MLP ``down_proj``), which start at zero, so the layer adds nothing to the
    residual stream and the grown drafter's logits are exactly the source's. Training then
    starts where the source ended instead of from noise, and the new layers, whose queries
    carry the layers below (with one layer every MASK query is the same embedding), learn
    what the source could not. Returns the number of copied layers.

    A narrower ``intermediate_size`` than the source's (to keep a deeper drafter within a size
    budget) keeps, in each copied MLP, the hidden units with the largest
    ``|gate_u| * |up_u| * |down_u|`` (weight norms): the drafter then starts close to the
    source instead of exactly on it.
    """
    have, want = source.config, drafter.config
    if want.intermediate_size > have.intermediate_size:
        raise ValueError(f"drafter.init: the source drafter's intermediate_size is "
                         f"{have.intermediate_size}; a grown drafter may be narrower, not wider "
                         f"(got {want.intermediate_size})")
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "target_layer_ids", "mask_token_id", "vocab_size"):
        if getattr(have, name) != getattr(want, name):
            raise ValueError(f"drafter.init: the source drafter's {name} is {getattr(have, name)!r} but "
                             f"this config's is {getattr(want, name)!r}; a drafter can only grow in depth")
    n = have.num_hidden_layers
    if n > want.num_hidden_layers:
        raise ValueError(f"drafter.init: the source drafter has {n} layers, more than this config's "
                         f"drafter.num_layers ({want.num_hidden_layers}); a drafter can only grow")
    with torch.no_grad():
        for mine, theirs in ((drafter.fc, source.fc), (drafter.hidden_norm, source.hidden_norm),
                             (drafter.norm, source.norm)):
            mine.weight.copy_(theirs.weight)
        for i in range(n):
            state = source.layers[i].state_dict()
            if want.intermediate_size < have.intermediate_size:
                mlp = source.layers[i].mlp
                score = (mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1)
                         * mlp.down_proj.weight.norm(dim=0))
                keep = score.topk(want.intermediate_size).indices.sort().values
                for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                    state[name] = state[name][keep]
                state["mlp.down_proj.weight"] = state["mlp.down_proj.weight"][:, keep]
            drafter.layers[i].load_state_dict(state)
        for layer in drafter.layers[n:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return n


def init_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """A freshly (seeded, reproducibly) initialised drafter, marked untrained in its config."""
    cfg = replace(cfg, extra={**cfg.extra, "dflashkit": {"trained": False, "init_seed": seed}})
    model = DFlashDrafter(cfg)
    model.reset_parameters(generator=torch.Generator().manual_seed(seed))
    return model
