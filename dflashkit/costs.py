"""What each pass of the decoding loop costs on this machine, and what it could cost.

Speculation pays only when verifying q tokens costs little more than decoding one. This
module measures that cost curve (a target forward over q new tokens on top of a KV cache),
the drafter's pass, and the machine's two floors, measured in the same run:

* bandwidth floor: the bytes of every weight a pass reads, over the measured memory bandwidth;
* compute floor: the pass's FLOPs over the measured fp32 matrix-multiply peak.

The decoding loop's adaptive block size (``policy.py``) reads a cost curve cached per
machine, target and backend in ``~/.cache/dflashkit/costs/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .checkpoint import atomic_write


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_model(device: torch.device | str = "cpu") -> str:
    """What runs the passes: the CPU's model name, or the GPU's."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, repeats: int = 5, warmup: int = 2, device: torch.device | str = "cpu") -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth: a reduction over a buffer far larger than any cache."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    ms = median_ms(lambda: x.sum(), repeats=repeats)
    return x.numel() * 4 / (ms / 1000) / 1e9


def measure_matmul_gflops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Matrix-multiply peak in ``dtype``: a square product big enough to be compute-bound."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    ms = median_ms(lambda: a @ b, repeats=repeats)
    return 2 * n ** 3 / (ms / 1000) / 1e9


def pass_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one forward pass reads: all parameters except the input
    embedding (only its looked-up rows are read)."""
    embed = model.get_input_embeddings().weight
    total = 0
    seen = set()
    for p in model.parameters():
        if p.data_ptr() in seen or p is embed:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if embed.data_ptr() == model.get_output_embeddings().weight.data_ptr():  # tied
        total += embed.numel() * embed.element_size()
    return total


def pass_flops(target, q: int, kv_length: int) -> float:
    """Matmul FLOPs of a target forward over q new tokens: 2 per weight per token, plus
    attention scores and values over the cache."""
    weights = pass_weight_bytes(target.model) / target.model.get_output_embeddings().weight.element_size()
    cfg = target.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * q * (kv_length + q) * cfg.num_attention_heads * head_dim * target.num_layers
    return 2 * weights * q + attn


def drafter_pass_floor(proposer, kv_length: int, num_slots: int | None = None) -> tuple[int, float]:
    """(bytes read, matmul FLOPs) of one drafter pass: its own weights once, the LM-head rows
    of its draft vocabulary once, the block's rows through every weight and the verified
    slots through the head, attention over the context cache."""
    drafter = proposer.drafter
    cfg = drafter.config
    seen, body, size = set(), 0, 0
    for p in drafter.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            body += p.numel()
            size = p.element_size()
    rows = cfg.block_size
    slots = rows - 1 if num_slots is None else num_slots
    head = proposer.head.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * rows * (kv_length + rows) * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    return (body + head) * size, 2 * body * rows + 2 * head * slots + attn


@torch.inference_mode()
def measure_step_verify_rounds(target, qs: list[int], kv_length: int, capture: list[int] | None = None,
                               rounds: int = 7, acceptance: bool = True) -> dict[int, list[float]]:
    """What the decoding loop pays to verify q tokens: the target pass plus, with
    ``acceptance``, the argmax over the vocabulary per row, in ``rounds`` rounds that each
    visit every q once, so drift on a busy machine is spread over all q instead of landing on
    a few, and two q can be compared round by round (smooth_costs). Timing each q's repeats
    back to back instead made one bench-cost table on a noisy AMD EPYC read a 14-token pass
    32% dearer than a 15-token one and 1 to 6 rows as flat, where real decoding there paid
    ~12 ms per extra row."""
    g = torch.Generator().manual_seed(0)
    low, vocab = min(100, target.num_embeddings // 4), min(target.num_embeddings, 20000)
    cache, device = target.new_cache(), target.device
    target.forward(torch.randint(low, vocab, (1, kv_length), generator=g).to(device), 0, cache)
    blocks = {q: torch.randint(low, vocab, (1, q), generator=g).to(device) for q in qs}
    times: dict[int, list[float]] = {q: [] for q in qs}
    for r in range(rounds + 1):          # round 0 warms up
        for q in qs:
            synchronize(device)
            t = time.perf_counter()
            out = target.forward(blocks[q], kv_length, cache, capture=capture)
            if acceptance:
                out.logits[0].argmax(-1).tolist()
            synchronize(device)
            elapsed = (time.perf_counter() - t) * 1e3
            target.rollback(cache, kv_length)
            if r:
                times[q].append(elapsed)
    return times


def measure_step_verify_ms(target, qs: list[int], kv_length: int, capture: list[int] | None = None,
                           rounds: int = 7, acceptance: bool = True) -> dict[int, float]:
    """The median of measure_step_verify_rounds per q."""
    return {q: statistics.median(v) for q, v in
            measure_step_verify_rounds(target, qs, kv_length, capture, rounds, acceptance).items()}


def measure_verify_ms(target, qs: list[int], kv_length: int, capture: list[int] | None = None,
                      repeats: int = 5) -> dict[int, float]:
    """Median time of a target forward alone over q new tokens, ``repeats`` rounds."""
    return measure_step_verify_ms(target, qs, kv_length, capture, repeats, acceptance=False)


def cheaper_in_every_round(rounds: dict[int, list[float]], q: int, other: int,
                           min_effect: float = 0.01) -> bool:
    """True when a pass over ``other`` rows was faster than one over ``q`` rows in every round
    and by at least ``min_effect`` in the median round: a real property of the kernels (a
    sign test: 7 rounds agree by chance with probability 1/128), not noise."""
    a, b = rounds.get(q), rounds.get(other)
    if not a or not b or len(a) != len(b) or len(a) < 5:
        return False
    diffs = [x - y for x, y in zip(a, b)]
    return min(diffs) > 0 and statistics.median(diffs) >= min_effect * statistics.median(a)


def smooth_costs(points: dict[int, float], tolerance: float = 0.05,
                 rounds: dict[int, list[float]] | None = None) -> dict[int, float]:
    """A non-decreasing curve through noisy per-q medians. A verify pass costs about a fixed
    part plus a part per row, so the least-squares line is used when it passes within
    ``tolerance`` of every point. Otherwise the curve has kernel structure: on a CPU whose
    matmul kernels block rows by 6, a 6-row pass can be truly cheaper than a 3-row or a
    1-row one. Where the per-round times (``rounds``) show a bigger pass faster than a smaller
    one in every round, the smaller is priced at the bigger's cost: the loop would verify
    the extra rows rather than pay more for fewer, so the policy must see them as free. The
    rest gets the isotonic fit (adjacent violators pooled): noise alone must not make q + 1
    look cheaper than q, or the policy verifies rows it wrongly believes free."""
    qs = sorted(points)
    ys = [points[q] for q in qs]
    if len(qs) > 2:
        mq, my = statistics.mean(qs), statistics.mean(ys)
        slope = max(0.0, sum((q - mq) * (y - my) for q, y in zip(qs, ys))
                    / sum((q - mq) ** 2 for q in qs))
        line = [my + slope * (q - mq) for q in qs]
        if all(abs(f - y) <= tolerance * y for f, y in zip(line, ys)):
            return dict(zip(qs, line))
    if rounds:
        ys = [min([y] + [points[o] for o in qs[i + 1:] if cheaper_in_every_round(rounds, q, o)])
              for i, (q, y) in enumerate(zip(qs, ys))]
    blocks: list[list[float]] = []      # [sum, count] of pooled runs
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(qs, fitted))


@torch.inference_mode()
def measure_draft_ms(target, drafter, kv_length: int, num_slots: int | None = None,
                     new_context: int = 2, repeats: int = 5) -> float:
    """Median time of one drafter proposal (body + LM head over the verified slots), with
    ``new_context`` fresh context tokens as after a typical step."""
    from .decoding import DFlashProposer
    from .sampling import SamplingConfig
    proposer = drafter if isinstance(drafter, DFlashProposer) else DFlashProposer(drafter, target)
    slots = num_slots or proposer.drafter.block_size - 1
    width = len(proposer.feature_layers) * target.hidden_size
    g = torch.Generator().manual_seed(0)
    proposer.begin()
    device = target.device
    committed = torch.randint(0, min(1000, target.num_embeddings), (kv_length + 1,), generator=g).to(device)
    proposer.propose(committed[:kv_length - new_context + 1],
                     torch.randn(1, kv_length - new_context, width, generator=g).to(device, target.dtype),
                     slots, SamplingConfig(), None)
    base = proposer.cache.length
    feats = torch.randn(1, new_context, width, generator=g).to(device, target.dtype)

    def step():
        proposer.propose(committed, feats, slots, SamplingConfig(), None)
        proposer.cache.crop(base)
    return median_ms(step, repeats=repeats, device=device)


@dataclass
class CostCurve:
    """Measured milliseconds of a verify pass over q tokens, and of one drafter pass."""

    target: str
    backend: str                      # "fast" | "default"
    kv_length: int
    verify_ms: dict[int, float]       # smoothed: what the policy uses
    draft_ms: float = 0.0
    threads: int = field(default_factory=torch.get_num_threads)
    cpu: str = field(default_factory=cpu_model)
    measured_ms: dict[int, float] | None = None   # the raw per-q medians behind verify_ms
    rounds_ms: dict[int, list[float]] | None = None   # every round's time per q

    def verify(self, q: int) -> float:
        """Cost of verifying q tokens; linear between measured points, extrapolated past the last."""
        if q in self.verify_ms:      # the common case on the decoding path: a measured point
            return self.verify_ms[q]
        pts = sorted(self.verify_ms.items())
        if q <= pts[0][0]:
            return pts[0][1]
        for (q0, c0), (q1, c1) in zip(pts, pts[1:]):
            if q0 <= q <= q1:
                return c0 + (c1 - c0) * (q - q0) / (q1 - q0)
        # past the last point: the least-squares slope of the whole curve (the last segment's
        # may be flat where the smoothing pooled the tail, which would make big passes free)
        qb, cb = pts[-1]
        n = len(pts)
        mean_q, mean_c = sum(x for x, _ in pts) / n, sum(c for _, c in pts) / n
        var = sum((x - mean_q) ** 2 for x, _ in pts)
        slope = max(0.0, sum((x - mean_q) * (c - mean_c) for x, c in pts) / var) if var else 0.0
        return cb + slope * (q - qb)

    def to_json(self) -> dict:
        d = asdict(self)
        for key in ("verify_ms", "measured_ms", "rounds_ms"):
            if d.get(key) is not None:
                d[key] = {str(k): v for k, v in d[key].items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CostCurve":
        d = dict(d)
        for key in ("verify_ms", "measured_ms"):
            if d.get(key) is not None:
                d[key] = {int(k): float(v) for k, v in d[key].items()}
        if d.get("rounds_ms") is not None:
            d["rounds_ms"] = {int(k): [float(x) for x in v] for k, v in d["rounds_ms"].items()}
        return cls(**d)


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASHKIT_CACHE", Path.home() / ".cache" / "dflashkit")) / "costs"


CURVE_VERSION = 3   # 2: interleaved rounds, acceptance included, smoothed; 3: rounds kept, real
                    # dips priced (older curves are remeasured)


def cpu_features() -> list[str]:
    """The CPU flags that change which kernels run (a generic model name such as "Intel(R)
    Xeon(R) Processor" hides them)."""
    wanted = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "fma"}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(wanted & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def _cache_key(target, drafter_id: str, max_q: int, kv_length: int) -> str:
    import transformers
    from .fastpath import packed_min_rows     # which kernel runs 1-3 rows changes the curve
    ident = json.dumps([target.name, target.config.to_dict().get("num_hidden_layers"),
                        target.hidden_size, "fast" if target.fast_path else "default",
                        str(target.dtype), drafter_id, max_q, kv_length, torch.get_num_threads(), device_model(target.device),
                        cpu_features(), os.cpu_count(), torch.__version__, transformers.__version__,
                        target.model.config._attn_implementation, packed_min_rows(), CURVE_VERSION])
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def cost_curve(target, proposer=None, max_q: int = 16, kv_length: int = 256,
               rounds: int = 7, use_cache: bool = True, progress: bool = False) -> CostCurve:
    """The loop's verify curve for q = 1..max_q (smoothed, see smooth_costs) and the drafter's
    pass, measured once per machine/target/backend/thread count and then read from the
    cache folder."""
    kv_length = max(1, min(kv_length, target.max_positions - max_q - 1))   # small test models
    drafter_id = ""
    if proposer is not None:
        cfg = proposer.drafter.config
        drafter_id = (f"{cfg.num_hidden_layers}x{cfg.hidden_size}x{cfg.intermediate_size}-B{cfg.block_size}"
                      f"-L{len(cfg.target_layer_ids)}-V{len(proposer.vocab) if proposer.vocab is not None else 0}")
    path = cache_dir() / f"{_cache_key(target, drafter_id, max_q, kv_length)}.json"
    if use_cache and path.exists():
        try:
            return CostCurve.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass   # a damaged cache entry is measured again
    if progress:
        print(f"measuring verify costs of {target.name} (q = 1..{max_q}, once per machine)...",
              flush=True)
    capture = proposer.feature_layers if proposer is not None else None
    per_round = measure_step_verify_rounds(target, list(range(1, max_q + 1)), kv_length, capture, rounds)
    measured = {q: statistics.median(v) for q, v in per_round.items()}
    curve = CostCurve(target=target.name, backend="fast" if target.fast_path else "default",
                      kv_length=kv_length, verify_ms=smooth_costs(measured, rounds=per_round),
                      measured_ms=measured, rounds_ms=per_round)
    if proposer is not None:
        curve.draft_ms = measure_draft_ms(target, proposer, kv_length, repeats=rounds)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(curve.to_json(), indent=1)))
    return curve
