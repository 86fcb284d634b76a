"""A faster CPU execution path that keeps the model's float numbers (DESIGN.md section 7).

Two things make verify passes cheap on a CPU:

* **Prepacked linear weights.** PyTorch's default small-batch matmul (M = 2..16 rows) is far
  from the machine's floor; oneDNN with weights reordered once into its blocked layout is
  up to 2x faster from 4 rows on. For 1-3 rows (plain decoding) it depends on the CPU: on
  one machine here the default kernel was at the bandwidth floor and ahead of oneDNN, on
  another oneDNN was 1.7x faster even at one row. So :class:`PackedLinear` keeps both, the
  original weight and a packed copy, and uses the packed one from the row count measured on
  this machine (:func:`packed_min_rows`). The cost is a second copy of the linear weights.
* **A KV cache written in place** (:class:`InPlaceCache`): keys and values go into
  preallocated buffers that grow by doubling, so a step does not re-concatenate the whole
  cache, and a rollback only moves a length.

* **bf16, opt-in, where the CPU multiplies bf16 in hardware** (AMX): half the weight bytes
  of fp32, and a pass over 16 rows costs about what a pass over one does. bf16 rounds
  coarsely, so greedy output equal to plain decoding needs every row of a verify pass to be
  computed bit for bit as a one-token step: oneDNN's packed bf16 matmul is row-invariant
  (tested), and attention runs row by row over exactly the keys each row would see alone
  (:func:`rowwise_sdpa`), because the CPU attention kernel's rounding depends on the key
  length it is handed. The reference is our own one-token loop on this path: PyTorch's
  default one-row bf16 kernel for the MLP down-projection rounds differently from oneDNN, so
  HF ``generate`` in bf16 can choose another token where two logits tie (README, "bf16").

Quantisation is not part of this path: numbers stay those of the chosen float dtype.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask


@functools.cache
def bf16_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles, as on Sapphire
    Rapids and later). Without them PyTorch emulates bf16 and it is slower than fp32."""
    return (torch.backends.mkldnn.is_available()
            and bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def fast_path_available(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> bool:
    """Packing applies to fp32 weights, or bf16 weights where the CPU has bf16 arithmetic,
    on a CPU whose PyTorch build has oneDNN."""
    return (torch.device(device).type == "cpu"
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_fast()))
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


DTYPES = {"float32": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``None`` -> float32 (the default: greedy output identical to HF ``generate``); a name
    or a torch dtype -> that dtype."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose float32 or bfloat16")
    return DTYPES[dtype]


# Below this many rows PyTorch's default fp32 kernel can be as fast as oneDNN's packed one or
# faster, depending on the CPU: on an Intel Xeon (AMX) here, whole 0.5B forward at KV 256,
# default vs packed (ms): q=1 84/95, q=3 92/104, q=4 177/106; on an AMD EPYC (Zen 4) here,
# packed was ahead from one row on (q=1 146 vs ~88). So the crossover is measured once per
# machine (:func:`packed_min_rows`); this is the most it can be.
PACKED_MIN_ROWS = 4
_THRESHOLD_VERSION = 2   # 2: fastest rounds, default must win by 5%


def _measure_packed_min_rows() -> int:
    """Time both kernels at 1..3 rows over a set of MLP-shaped weights (0.5B model: 4864 x
    896) bigger than any last-level cache, so they stream from memory as a model's do; the
    kernels alternate within each round, so drift on a busy machine hits both alike."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(4864, 896, generator=g) for _ in range(8)]   # 140 MB in all
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    kernels = {"default": lambda x, w, p: F.linear(x, w),
               "packed": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")}
    threshold = PACKED_MIN_ROWS
    with torch.inference_mode():
        for rows in range(PACKED_MIN_ROWS - 1, 0, -1):
            x = torch.randn(1, rows, 896, generator=g)
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for r in range(8):                     # round 0 warms up
                for name, run in kernels.items():
                    start = time.perf_counter()
                    for w, p in zip(weights, packed):
                        run(x, w, p)
                    if r:
                        times[name].append(time.perf_counter() - start)
            # the fastest round of each (load only ever adds), and the default kernel must win
            # clearly: packed is at worst ~13% slower at one row (Intel Xeon here), default up to
            # 3x slower at two (AMD EPYC here), so a noisy tie goes to packed
            if min(times["default"]) < 0.95 * min(times["packed"]):
                break
            threshold = rows
    return threshold


@functools.cache
def packed_min_rows() -> int:
    """The fewest rows from which oneDNN's packed fp32 matmul beats PyTorch's default kernel
    on this CPU, at every row count up to :data:`PACKED_MIN_ROWS`. Measured once per machine
    (~1 s) and kept beside the cost curves (``~/.cache/dflashkit/costs``), so every process
    on a machine runs the same kernels (the cost curves and bench runs depend on it).
    ``DFLASHKIT_PACKED_MIN_ROWS`` overrides it."""
    override = os.environ.get("DFLASHKIT_PACKED_MIN_ROWS")
    if override:
        if not override.isdigit() or not 1 <= int(override) <= PACKED_MIN_ROWS:
            raise ValueError(f"DFLASHKIT_PACKED_MIN_ROWS={override!r}: give a whole number "
                             f"from 1 to {PACKED_MIN_ROWS}, or unset it to measure")
        return int(override)
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return PACKED_MIN_ROWS
    import hashlib
    import json
    from .checkpoint import atomic_write
    from .costs import cache_dir, cpu_features, cpu_model
    ident = json.dumps([cpu_model(), cpu_features(), os.cpu_count(), torch.get_num_threads(),
                        torch.__version__, _THRESHOLD_VERSION])
    path = cache_dir() / f"packed-min-rows-{hashlib.sha1(ident.encode()).hexdigest()[:16]}.json"
    try:
        value = int(json.loads(path.read_text())["packed_min_rows"])
        if 1 <= value <= PACKED_MIN_ROWS:
            return value
    except (OSError, ValueError, KeyError, TypeError):
        pass                              # absent or damaged: measured again
    value = _measure_packed_min_rows()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"packed_min_rows": value, "machine": json.loads(ident)})
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return value


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place modification counter (None for inference tensors, which keep none)."""
    return None if t.is_inference() else t._version


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference with a oneDNN-packed copy of the weight for many rows.

    It holds the original ``weight``/``bias`` parameters under the same names (state dicts
    and ``save_pretrained`` see a plain linear) plus the packed buffer (not saved).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", torch.empty(0), persistent=False)
        self._repack()
        object.__setattr__(self, "original", linear)   # restored by unpack_linears; not a child

    def _repack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.packed_version = _version(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != self.weight.dtype or (
                x.dtype == torch.float32 and x.numel() < packed_min_rows() * x.shape[-1]):
            return F.linear(x, self.weight, self.bias)
        if _version(self.weight) != self.packed_version:   # weights changed in place (a load)
            self._repack()
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def pack_linears(module: nn.Module) -> int:
    """Replace every fp32 ``nn.Linear`` inside ``module`` by a :class:`PackedLinear`, in place.

    Returns how many were packed. Weights are not copied out of the module: the packed
    buffers are extra memory (one more copy of each linear weight).
    """
    packed_min_rows()              # measured now, not inside the first timed step
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" \
                    and fast_path_available(child.weight.dtype):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count


def restore_originals(module: nn.Module, wrapper: type) -> int:
    """Put back the module each ``wrapper`` instance inside ``module`` replaced (its
    ``original``); returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, wrapper):
                setattr(parent, name, child.original)
                count += 1
    return count


def unpack_linears(module: nn.Module) -> int:
    """Undo :func:`pack_linears`: put the original ``nn.Linear`` modules back."""
    return restore_originals(module, PackedLinear)


class FusedGateUpMLP(nn.Module):
    """A gated MLP (``down(act(gate(x)) * up(x))``) whose gate and up projections run as one
    packed bf16 matmul: one weight stream of 2 x intermediate rows instead of two, ~6 ms less
    per 0.5B step here. oneDNN's result for each output is the same bits fused or not
    (tested), and the activation sees a contiguous tensor as in HF's own forward. The
    projections stay children under their names, so the state dict is unchanged."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn
        self.split = mlp.gate_proj.weight.shape[0]
        self.register_buffer("packed_gate_up", torch.empty(0), persistent=False)
        self._repack()
        object.__setattr__(self, "original", mlp)   # restored by unfuse_mlps; not a child

    def _versions(self) -> tuple[int, int]:
        return _version(self.gate_proj.weight), _version(self.up_proj.weight)

    def _repack(self) -> None:
        weight = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
        self.packed_gate_up = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.packed_versions = self._versions()

    @staticmethod
    def fusable(mlp: nn.Module) -> bool:
        names = ("gate_proj", "up_proj", "down_proj", "act_fn")
        return (all(hasattr(mlp, n) for n in names) and not isinstance(mlp, FusedGateUpMLP)
                and mlp.gate_proj.bias is None and mlp.up_proj.bias is None
                and mlp.gate_proj.weight.dtype == torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.bfloat16:
            return self.original(x)
        if self._versions() != self.packed_versions:     # weights changed in place (a load)
            self._repack()
        both = torch.ops.mkldnn._linear_pointwise(x, self.packed_gate_up, None, "none", [], "")
        gate, up = both[..., :self.split].contiguous(), both[..., self.split:].contiguous()
        return self.down_proj(self.act_fn(gate) * up)


def fuse_mlps(module: nn.Module) -> dict[str, FusedGateUpMLP]:
    """Replace every fusable bf16 gated MLP by a :class:`FusedGateUpMLP`; returns them by name."""
    fused = {}
    for name, mlp in list(module.named_modules()):
        if name.endswith("mlp") and FusedGateUpMLP.fusable(mlp):
            parent, _, child = name.rpartition(".")
            fused[name] = FusedGateUpMLP(mlp)
            setattr(module.get_submodule(parent) if parent else module, child, fused[name])
    return fused


def unfuse_mlps(module: nn.Module) -> int:
    """Undo :func:`fuse_mlps`."""
    return restore_originals(module, FusedGateUpMLP)


def is_packed(module: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in module.modules())


# Verify passes longer than this run attention in one call (a long prefill on top of a cache
# is not a verify pass; row by row would cost more than it is worth there).
ROWWISE_MAX_ROWS = 64
ROWWISE_ATTENTION = "dflashkit_rowwise_sdpa"


def rowwise_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA in which every new row sees exactly the keys a one-token step of that sequence
    alone would see, so its output is bitwise the one plain decoding computes.

    Called by transformers' attention modules after the cache update: the q new rows are the
    last q keys. Row r of batch row i attends to its own visible keys ``[:kv - q + r + 1]``
    with the holes of batched decoding (masked-out entries) removed, through the very call HF
    makes when it decodes one token alone. Needed because the CPU attention kernel's rounding
    depends on the key length it is handed, not only on the keys that count. A prefill and a
    one-token step without holes run as one call; a padded batched prefill runs one call per
    prompt over its own keys.
    """
    b, _, q, _ = query.shape
    kv = key.shape[2]
    bool_mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool \
        else attention_mask == 0
    # holes: left pads of a batched prefill, or entries of other rows' lengths in a batch
    holes = bool_mask is not None and not bool(bool_mask[:, :, -1, :].all())
    if q == kv and holes:
        return _prefill_without_pads(module, query, key, value, bool_mask, kwargs)
    if q == kv or q > ROWWISE_MAX_ROWS or (q == 1 and b == 1 and not holes):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "is_causal"}
    outputs = []
    for i in range(b):
        rows = []
        for r in range(q):
            end = kv - q + r + 1
            k, v = key[i:i + 1, :, :end], value[i:i + 1, :, :end]
            if bool_mask is not None:
                keep = bool_mask[i if bool_mask.shape[0] > 1 else 0, 0, r, :end]
                if not bool(keep.all()):
                    k, v = k[:, :, keep], v[:, :, keep]
            out, _ = sdpa_attention_forward(module, query[i:i + 1, :, r:r + 1], k, v, None,
                                            is_causal=False, **kwargs)
            rows.append(out)
        outputs.append(torch.cat(rows, dim=1))
    return torch.cat(outputs, dim=0), None


def _prefill_without_pads(module, query, key, value, bool_mask, kwargs):
    """A batched prefill of left-padded prompts, each row computed as its prompt alone would be
    (one causal call over exactly its own keys), so a request's cache and first token do not
    depend on the prompts it was batched with. Pad rows are left zero: nothing reads them."""
    b, heads, q, d = query.shape
    out = query.new_zeros(b, q, heads, value.shape[-1])
    for i in range(b):
        keep = bool_mask[i if bool_mask.shape[0] > 1 else 0, 0, -1, :]
        start = int(keep.to(torch.int8).argmax())
        if not bool(keep[start:].all()):     # not left padding: keep HF's masked call
            row, _ = sdpa_attention_forward(module, query[i:i + 1], key[i:i + 1], value[i:i + 1],
                                            bool_mask[i:i + 1] if bool_mask.shape[0] > 1 else bool_mask,
                                            **kwargs)
            out[i:i + 1] = row
            continue
        row, _ = sdpa_attention_forward(module, query[i:i + 1, :, start:], key[i:i + 1, :, start:],
                                        value[i:i + 1, :, start:], None, **kwargs)
        out[i:i + 1, start:] = row
    return out, None


AttentionInterface.register(ROWWISE_ATTENTION, rowwise_sdpa)
AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)


class InPlaceLayer(DynamicLayer):
    """A cache layer over preallocated key/value buffers: appends write in place."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty(b, h, 256, d)
        self._v = value_states.new_empty(b, h, 256, value_states.shape[-1])
        self._len = 0
        self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        cap = self._k.shape[2]
        if needed <= cap:
            return
        while cap < needed:
            cap *= 2
        k = self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[3])
        v = self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[3])
        k[:, :, :self._len] = self._k[:, :, :self._len]
        v[:, :, :self._len] = self._v[:, :, :self._len]
        self._k, self._v = k, v

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        end = self._len + n
        self._grow(end)
        self._k[:, :, self._len:end] = key_states
        self._v[:, :, self._len:end] = value_states
        self._len = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove (transformers 5.x)")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._len = max(0, self._len + tokens_to_remove)
        self.keys, self.values = self._k[:, :, :self._len], self._v[:, :, :self._len]

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self._len = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("InPlaceCache serves dflashkit's own loops only")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (batched decoding drops finished requests)."""
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, :self._len], self._v[:, :, :self._len]


class InPlaceCache(DynamicCache):
    """A ``DynamicCache`` whose layers write into preallocated buffers (full attention only)."""

    def __init__(self, num_layers: int):
        Cache.__init__(self, layers=[InPlaceLayer() for _ in range(num_layers)])
