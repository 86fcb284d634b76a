"""``dflashkit bench-cost``: the cost of every pass of the loop beside the machine's floors.

For each execution backend (the fast path and PyTorch's defaults) and KV length: a target
forward over q = 1..max_q new tokens, and one drafter pass; beside them the bandwidth floor
(weight bytes / measured read bandwidth) and the compute floor (FLOPs / measured matmul peak
in the target's dtype), both measured in the same run. Writes ``costs.json``, ``costs.md``
and ``costs.png``.
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

from .checkpoint import atomic_write
from .costs import (cpu_model, drafter_pass_floor, measure_bandwidth_gbs, measure_draft_ms,
                    measure_matmul_gflops, measure_step_verify_rounds, pass_flops,
                    pass_weight_bytes)


def run_cost_bench(target, drafter=None, kv_lengths=(256, 2048), max_q: int = 16,
                   backends=("fast", "default"), repeats: int = 5, out: Path | None = None,
                   progress: bool = True) -> dict:
    from .decoding import DFlashProposer
    say = print if progress else (lambda *a, **k: None)
    say("measuring memory bandwidth and matmul peak...", flush=True)
    bandwidth = measure_bandwidth_gbs()
    peak = measure_matmul_gflops(dtype=target.dtype)
    weight_bytes = pass_weight_bytes(target.model)
    qs = list(range(1, max_q + 1))
    capture = drafter.target_layer_ids if drafter is not None else None
    results: dict = {"target": target.name, "dtype": str(target.dtype).removeprefix("torch."),
                     "cpu": cpu_model(), "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "python": platform.python_version(),
                     "bandwidth_gbs": bandwidth, "matmul_gflops": peak,
                     "weight_bytes": weight_bytes, "qs": qs, "kv_lengths": list(kv_lengths),
                     "verify_ms": {}, "verify_rounds_ms": {}, "draft_ms": {}, "floors_ms": {},
                     "draft_floors_ms": {}}
    for kv in kv_lengths:
        results["floors_ms"][str(kv)] = {
            "bandwidth": weight_bytes / (bandwidth * 1e9) * 1000,
            "compute": {q: pass_flops(target, q, kv) / (peak * 1e9) * 1000 for q in qs}}
    was = target.fast_path
    try:
        for backend in backends:
            target.set_fast_path(backend == "fast")
            for kv in kv_lengths:
                say(f"{backend} backend, KV {kv}: target q = 1..{max_q}", flush=True)
                # every q once per round, so drift on a shared machine spreads over all q
                rounds = measure_step_verify_rounds(target, qs, kv, capture, repeats, acceptance=False)
                results["verify_ms"].setdefault(backend, {})[str(kv)] = {
                    q: statistics.median(v) for q, v in rounds.items()}
                results["verify_rounds_ms"].setdefault(backend, {})[str(kv)] = rounds
                if drafter is not None:
                    proposer = DFlashProposer(drafter, target)
                    results["draft_ms"].setdefault(backend, {})[str(kv)] = measure_draft_ms(
                        target, proposer, kv, repeats=repeats)
                    nbytes, flops = drafter_pass_floor(proposer, kv)
                    results["draft_floors_ms"][str(kv)] = {
                        "bandwidth": nbytes / (bandwidth * 1e9) * 1000, "compute": flops / (peak * 1e9) * 1000}
    finally:
        target.set_fast_path(was)
    if out is not None:
        write_cost_report(results, Path(out))
    return results


def cost_table(r: dict) -> str:
    backends = list(r["verify_ms"])
    dtype = r.get("dtype", "float32")
    lines = [f"Target `{r['target']}` in {dtype} on {r['cpu']}, {r['threads']} threads, torch "
             f"{r['torch']}. Measured in this run: read bandwidth {r['bandwidth_gbs']:.1f} GB/s, "
             f"{dtype} matmul peak "
             f"{r['matmul_gflops']:.0f} GFLOP/s; a pass reads {r['weight_bytes'] / 1e9:.2f} GB of weights.",
             ""]
    for kv in map(str, r["kv_lengths"]):
        floors = r["floors_ms"][kv]
        fast = r["verify_ms"].get("fast", r["verify_ms"][backends[0]])[kv]
        base = fast[_k(fast, 1)]
        ref = "fast" if "fast" in r["verify_ms"] else backends[0]
        rounds = r.get("verify_rounds_ms", {}).get(ref, {}).get(kv)   # absent in older runs
        spread = f" | {ref} rounds min-max ms" if rounds else ""
        head = "| q | " + " | ".join(f"{b} ms" for b in backends) + spread + \
            f" | {ref} / {ref} q=1 | bandwidth floor ms | compute floor ms |"
        lines += [f"### KV length {kv}", "", head, "|" + "---|" * (len(backends) + 4 + bool(rounds))]
        for q in r["qs"]:
            cells = [f"{r['verify_ms'][b][kv][_k(r['verify_ms'][b][kv], q)]:.1f}" for b in backends]
            if rounds:
                times = rounds[_k(rounds, q)]
                cells.append(f"{min(times):.1f}-{max(times):.1f}")
            ratio = fast[_k(fast, q)] / base
            comp = floors["compute"][_k(floors["compute"], q)]
            lines.append(f"| {q} | " + " | ".join(cells) +
                         f" | {ratio:.2f}x | {floors['bandwidth']:.1f} | {comp:.1f} |")
        if r["draft_ms"]:
            cells = ", ".join(f"{b} {r['draft_ms'][b][kv]:.1f} ms ({r['draft_ms'][b][kv] / base:.2f}x "
                              f"of the {ref} q=1 step)" for b in r["draft_ms"])
            floor = r.get("draft_floors_ms", {}).get(kv)
            floor_text = (f" Its floors: bandwidth {floor['bandwidth']:.2f} ms (its weights and the "
                          f"LM-head rows of its draft vocabulary), compute {floor['compute']:.2f} ms."
                          if floor else "")
            lines += ["", f"Drafter pass (whole block, LM head over the verified slots): {cells}.{floor_text}"]
        lines.append("")
    return "\n".join(lines)


def _k(d: dict, q: int):
    """Keys are ints in memory and strings after a JSON round trip."""
    return q if q in d else str(q)


def write_cost_report(r: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "costs.json", lambda tmp: Path(tmp).write_text(json.dumps(r, indent=1)))
    atomic_write(out / "costs.md", lambda tmp: Path(tmp).write_text(cost_table(r)))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kvs = list(map(str, r["kv_lengths"]))
    fig, axes = plt.subplots(1, len(kvs), figsize=(6 * len(kvs), 4.2), squeeze=False)
    for ax, kv in zip(axes[0], kvs):
        for b, per_kv in r["verify_ms"].items():
            d = per_kv[kv]
            ax.plot(r["qs"], [d[_k(d, q)] for q in r["qs"]], marker="o",
                    label=f"{b} backend ({r.get('dtype', 'float32')})")
        fl = r["floors_ms"][kv]
        ax.plot(r["qs"], [max(fl["bandwidth"], fl["compute"][_k(fl["compute"], q)]) for q in r["qs"]],
                "k--", label="floor: max(bandwidth, compute)")
        ax.set_xlabel("tokens per target forward (q)")
        ax.set_ylabel("ms")
        ax.set_title(f"{r['target']}, KV {kv}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = out / ".costs.png.tmp"
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(out / "costs.png")
