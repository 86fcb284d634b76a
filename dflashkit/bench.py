"""``dflashkit bench``: every method on the same prompts, interleaved, in one run.

Methods run prompt by prompt in turn (so machine drift hits all alike) through the same
target weights. Speedup is pooled per suite: (sum of ar decode time / ar tokens) divided by
(sum of method decode time / method tokens), with the per-prompt spread beside it. Greedy
outputs are checked against ``ar`` token by token; a mismatch is reported loudly with the
prompt and the first differing position.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .baselines import hf_generate
from .checkpoint import atomic_write
from .costs import cpu_model
from .decoding import DFlashProposer, speculative_generate
from .sampling import SamplingConfig
from .suites import STAND_INS, BenchPrompt, load_suite
from .target import Target


@dataclass
class RunResult:
    tokens: list[int]
    prefill_s: float
    decode_s: float
    acceptance_lengths: list[int] | None = None
    slot_accepted: list[int] | None = None
    slot_drafted: list[int] | None = None


@dataclass
class Record:
    suite: str
    prompt_id: str
    turn: int
    method: str
    num_tokens: int
    prefill_s: float
    decode_s: float
    tokens: list[int]
    acceptance_lengths: list[int] | None = None
    slot_accepted: list[int] | None = None
    slot_drafted: list[int] | None = None
    identical_to_ar: bool | None = None
    first_diff: int | None = None
    # Our own plain loop on the same execution path: the exact reference of the bf16 path,
    # where HF generate's one-token kernel rounds differently (fastpath.py).
    identical_to_ar_loop: bool | None = None

    @property
    def decode_tokens(self) -> int:
        return max(0, self.num_tokens - 1)

    @property
    def tau(self) -> float | None:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else None


Method = Callable[[list[int], int, SamplingConfig, list[int]], RunResult]


def make_methods(names: list[str], target: Target, drafter=None, block_size: int | str | None = None,
                 load_assistant: Callable[[str], object] | None = None) -> dict[str, Method]:
    """Resolve method names: ar, ar-loop, dflash, dflash:B, dflash:auto, prompt-lookup,
    assisted:MODEL (``load_assistant(name)`` returns a Target, or a bare model)."""
    methods: dict[str, Method] = {}
    if drafter is not None and not isinstance(drafter, DFlashProposer):
        drafter = DFlashProposer(drafter, target)   # validate and prepare its LM head once
    for name in names:
        if name == "ar":
            methods[name] = lambda ids, n, s, stops: _from_hf(hf_generate(target, ids, n, s, stops))
        elif name == "ar-loop":
            methods[name] = lambda ids, n, s, stops: _from_loop(
                speculative_generate(target, None, ids, n, s, stops, block_size=1))
        elif name == "dflash" or name.startswith("dflash:"):
            if drafter is None:
                raise ValueError("method dflash needs a drafter (--drafter DIR)")
            size = _dflash_block_size(name, block_size, drafter, target)
            methods[name] = lambda ids, n, s, stops, b=size: _from_loop(
                speculative_generate(target, drafter, ids, n, s, stops, block_size=b))
        elif name == "prompt-lookup":
            methods[name] = lambda ids, n, s, stops: _from_hf(
                hf_generate(target, ids, n, s, stops, prompt_lookup_num_tokens=10))
        elif name.startswith("assisted:"):
            if load_assistant is None:
                raise ValueError("assisted generation needs a way to load the assistant model")
            assistant = load_assistant(name.split(":", 1)[1])
            kwargs = {"assistant_model": assistant.model if isinstance(assistant, Target) else assistant}
            if _needs_universal_assisted(target, assistant):
                # a draft model with another tokenizer: transformers' universal assisted
                # generation re-tokenises between the two (SmolLM2 drafting for Qwen, say)
                kwargs.update(tokenizer=target.tokenizer, assistant_tokenizer=assistant.tokenizer)
            methods[name] = lambda ids, n, s, stops, kw=kwargs: _from_hf(
                hf_generate(target, ids, n, s, stops, **kw))
        else:
            raise ValueError(f"unknown method {name!r}; choose from ar, ar-loop, dflash, "
                             f"dflash:B, dflash:auto, prompt-lookup, assisted:MODEL")
    if "ar" not in methods:
        raise ValueError("the methods must include 'ar' (the baseline of every ratio)")
    return methods


def _needs_universal_assisted(target: Target, assistant) -> bool:
    """True when the assistant (a Target or a bare model) does not share the target's vocabulary."""
    a_tok = assistant.tokenizer if isinstance(assistant, Target) else None
    t_tok = target.tokenizer
    if a_tok is None or t_tok is None or not hasattr(a_tok, "get_vocab") or not hasattr(t_tok, "get_vocab"):
        return False
    return a_tok.get_vocab() != t_tok.get_vocab()


def _dflash_block_size(name: str, default, proposer: DFlashProposer, target: Target):
    """``dflash`` uses --block-size; ``dflash:B`` / ``dflash:auto`` pick their own. An adaptive
    size is one policy object for the whole run, so its acceptance statistics carry over
    from prompt to prompt, as in the server."""
    spec = name.split(":", 1)[1] if ":" in name else default
    if spec is None:
        return None
    if spec == "auto":
        from .costs import cost_curve
        from .policy import AdaptiveBlockSize
        trained = proposer.drafter.block_size
        return AdaptiveBlockSize(cost_curve(target, proposer, max_q=trained, progress=True),
                                 max_drafts=trained - 1)
    try:
        size = int(spec)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise ValueError(f"method {name!r}: the block size must be a positive integer or 'auto'")
    return size


def _from_hf(r) -> RunResult:
    return RunResult(r.tokens, r.prefill_s, r.decode_s)


def _from_loop(r) -> RunResult:
    st = r.stats
    return RunResult(r.tokens, st.prefill_s, st.decode_s, st.acceptance_lengths, st.slot_accepted,
                     st.slot_drafted)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --- metrics -------------------------------------------------------------------------------

def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _pooled_speedup(runs: list[Record], bases: list[Record | None]) -> float | None:
    """(base seconds per decode token) / (method seconds per decode token), pooled over the
    prompts both ran."""
    pairs = [(r, b) for r, b in zip(runs, bases) if b is not None]
    tok, sec = sum(r.decode_tokens for r, _ in pairs), sum(r.decode_s for r, _ in pairs)
    b_tok, b_sec = sum(b.decode_tokens for _, b in pairs), sum(b.decode_s for _, b in pairs)
    return (b_sec / b_tok) / (sec / tok) if tok and sec and b_tok and b_sec else None


def _ours(method: str) -> bool:
    return method == "ar-loop" or method.startswith("dflash")


def mismatch_kind(r: Record, bf16: bool) -> str | None:
    """None (identical to ``ar`` or not checked), "kernel" or "failure".

    The exact reference of a method is plain one-token decoding on its own kernels: ``ar`` for
    Hugging Face's methods, ``ar-loop`` for ours. In fp32 every kernel agrees, so every method
    must equal ``ar``. In bf16 rounding depends on the kernel and on how many rows it is handed
    (README, bf16): ``ar-loop`` (packed oneDNN) may differ from ``ar`` with no speculation
    involved, and a dflash output identical to ``ar-loop`` then differs from ``ar`` the same
    way; HF's own speculative methods verify several rows per pass with PyTorch's default
    kernels, whose multi-row bf16 results differ from the one-row steps of ``ar``. Those are
    "kernel"; a dflash output that differs from ``ar-loop`` is always a failure.
    """
    dflash = r.method.startswith("dflash")
    if dflash and r.identical_to_ar_loop is False:
        return "failure"
    if r.method == "ar" or r.identical_to_ar is not False:
        return None
    if not bf16:
        return "failure"
    shares_loop_rounding = r.method == "ar-loop" or (dflash and r.identical_to_ar_loop)
    return "kernel" if shares_loop_rounding or not _ours(r.method) else "failure"


def summarize(records: list[Record], bf16: bool = False) -> dict:
    """Per suite x method: tokens/s, pooled speedup over ar with spread, tau, slots, histogram.
    ``bf16``: our loop may differ from HF generate by kernel rounding (see mismatch_kind)."""
    out: dict = {}
    keys = sorted({(r.suite, r.method) for r in records})
    by_prompt = {(r.suite, r.prompt_id, r.turn, r.method): r for r in records}
    for suite, method in keys:
        rs = [r for r in records if r.suite == suite and r.method == method]
        ar = [by_prompt.get((r.suite, r.prompt_id, r.turn, "ar")) for r in rs]
        tok = sum(r.decode_tokens for r in rs)
        sec = sum(r.decode_s for r in rs)
        per_prompt = [(a.decode_s / a.decode_tokens) / (r.decode_s / r.decode_tokens)
                      for r, a in zip(rs, ar) if a and r.decode_tokens and a.decode_tokens and r.decode_s > 0]
        entry = {
            "prompts": len(rs), "tokens": sum(r.num_tokens for r in rs),
            "decode_tokens_per_s": tok / sec if sec > 0 else 0.0,
            "ttft_s_median": statistics.median([r.prefill_s for r in rs]),
            "speedup_vs_ar": _pooled_speedup(rs, ar),
            # what speculation itself buys: our plain loop on the same execution path
            "speedup_vs_ar_loop": _pooled_speedup(
                rs, [by_prompt.get((r.suite, r.prompt_id, r.turn, "ar-loop")) for r in rs]),
            "speedup_per_prompt": {"median": _percentile(per_prompt, 0.5), "p10": _percentile(per_prompt, 0.1),
                                   "p90": _percentile(per_prompt, 0.9)} if per_prompt else None,
            "mismatches": sum(1 for r in rs if mismatch_kind(r, bf16) == "failure"),
            "kernel_differences": sum(1 for r in rs if mismatch_kind(r, bf16) == "kernel"),
            "mismatches_vs_ar_loop": sum(1 for r in rs if r.identical_to_ar_loop is False),
        }
        taus = [r.tau for r in rs if r.tau is not None]
        if taus:
            entry["tau"] = sum(taus) / len(taus)
            acc = [sum(x) for x in zip(*[r.slot_accepted for r in rs if r.slot_accepted])]
            dra = [sum(x) for x in zip(*[r.slot_drafted for r in rs if r.slot_drafted])]
            entry["slot_acceptance"] = [a / d if d else 0.0 for a, d in zip(acc, dra)]
            lengths = [x for r in rs for x in (r.acceptance_lengths or [])]
            entry["acceptance_histogram"] = {str(k): lengths.count(k) for k in range(1, max(lengths) + 1)}
        out.setdefault(suite, {})[method] = entry
    return out


def lossless_verdict(records: list[Record], sampling, bf16: bool = False) -> tuple[bool, str]:
    """(no output changed by speculation or by our kernels, the report's paragraph on it)."""
    if not sampling.greedy:
        return True, ""
    kinds = [(r, mismatch_kind(r, bf16)) for r in records]
    failures = [r for r, k in kinds if k == "failure"]
    kernel = [r for r, k in kinds if k == "kernel"]
    lines = []
    if not failures and not kernel:
        lines.append("Lossless: every greedy output identical to `ar`.")
    elif failures:
        lines.append("**LOSSLESS CHECK FAILED**: " + "; ".join(
            f"`{r.method}` differs on {r.suite}/{r.prompt_id} turn {r.turn} at generated position "
            f"{r.first_diff}" + ("" if _ours(r.method) else " (a Hugging Face method: its reference is `ar`)")
            for r in failures) + ".")
        if bf16 and not any(r.method == "ar-loop" for r in records):
            lines.append("In bf16 our loop may differ from `ar` by kernel rounding alone: add `ar-loop` "
                         "to --methods to tell that apart from a speculation failure.")
    else:
        lines.append("Speculation lossless: every `dflash` output is identical to `ar-loop`, plain "
                     "one-token decoding on the same kernels.")
    ours = [r for r in kernel if _ours(r.method)]
    if ours:
        loops = sum(1 for r in ours if r.method == "ar-loop")
        lines.append(f"{len(ours)} outputs of our loop ({loops} of them `ar-loop` itself, no "
                     f"speculation) differ from `ar` (HF generate) in bf16, and each dflash one "
                     f"equals `ar-loop`: PyTorch's one-row bf16 kernel rounds differently from "
                     f"oneDNN's packed one, so where two logits tie the paths can pick different "
                     f"tokens (README, bf16). In fp32 every path must equal `ar`.")
    theirs = [r for r in kernel if not _ours(r.method)]
    if theirs:
        lines.append(f"{len(theirs)} outputs of Hugging Face's own speculative methods differ from "
                     f"`ar` in bf16: they verify several tokens per pass with PyTorch's default "
                     f"kernels, whose multi-row bf16 results round differently from `ar`'s one-token "
                     f"steps (README, bf16); not a failure of dflashkit, and in fp32 they must equal "
                     f"`ar`: " + "; ".join(f"`{r.method}` on {r.suite}/{r.prompt_id} turn {r.turn} at "
                                           f"position {r.first_diff}" for r in theirs) + ".")
    checked = [r for r in records if r.identical_to_ar_loop is not None]
    if checked:
        bad = sum(1 for r in checked if not r.identical_to_ar_loop)
        lines.append(f"Against `ar-loop`: {len(checked) - bad} of {len(checked)} outputs identical.")
    return not failures, "\n\n".join(lines) + "\n"


def markdown_table(summary: dict, methods: list[str]) -> str:
    head = "| suite | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods) + "\n"
    rows = []
    for suite, per in summary.items():
        cells = []
        for m in methods:
            e = per.get(m)
            if not e:
                cells.append("-")
                continue
            tau = f"tau {e['tau']:.2f}, " if "tau" in e else ""
            sp = f"{e['speedup_vs_ar']:.2f}x" if e.get("speedup_vs_ar") else "-"
            if e.get("speedup_vs_ar_loop") and m not in ("ar", "ar-loop"):
                sp += f" ({e['speedup_vs_ar_loop']:.2f}x vs ar-loop)"
            bad = f" **{e['mismatches']} MISMATCH**" if e["mismatches"] else ""
            if e.get("kernel_differences"):
                bad += f" ({e['kernel_differences']} differ from ar by kernel rounding)"
            cells.append(f"{tau}{e['decode_tokens_per_s']:.1f} tok/s, {sp}{bad}")
        rows.append(f"| {suite} | " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"


def details_tables(summary: dict, methods: list[str]) -> str:
    """Per suite, one row per method: every metric of the summary but the histogram (plotted)."""
    out = []
    for suite, per in summary.items():
        out.append(f"### {suite}\n\n| method | runs | tokens | decode tok/s | TTFT s (median) | "
                   f"speedup vs ar, pooled | per prompt: median (p10-p90) | vs ar-loop | tau | "
                   f"P(accept) slots 1-4 |\n|---|---|---|---|---|---|---|---|---|---|")
        for m in methods:
            e = per.get(m)
            if not e:
                continue
            spread = e.get("speedup_per_prompt")
            cells = [m, str(e["prompts"]), str(e["tokens"]), f"{e['decode_tokens_per_s']:.1f}",
                     f"{e['ttft_s_median']:.2f}",
                     f"{e['speedup_vs_ar']:.2f}x" if e.get("speedup_vs_ar") else "-",
                     f"{spread['median']:.2f}x ({spread['p10']:.2f}-{spread['p90']:.2f})" if spread else "-",
                     f"{e['speedup_vs_ar_loop']:.2f}x" if e.get("speedup_vs_ar_loop") else "-",
                     f"{e['tau']:.2f}" if "tau" in e else "-",
                     " / ".join(f"{a:.2f}" for a in e["slot_acceptance"][:4]) if e.get("slot_acceptance") else "-"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(summary: dict, methods: list[str], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    suites = list(summary)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(suites), 3.6))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [summary[s].get(m, {}).get("speedup_vs_ar") or 0 for s in suites]
        ax.bar([j + i * width for j in range(len(suites))], vals, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(suites))], suites)
    ax.set_ylabel("decode speedup over ar (pooled)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    spec = [m for m in methods if any("slot_acceptance" in summary[s].get(m, {}) for s in suites)]
    if spec:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        for s in suites:
            e = summary[s].get(spec[0], {})
            if "slot_acceptance" in e:
                a1.plot(range(1, len(e["slot_acceptance"]) + 1), e["slot_acceptance"], marker="o", label=s)
                h = e["acceptance_histogram"]
                total = sum(h.values())
                a2.plot([int(k) for k in h], [v / total for v in h.values()], marker="o", label=s)
        a1.set_xlabel("draft slot k")
        a1.set_ylabel(f"P(accept slot k | drafted) [{spec[0]}]")
        a2.set_xlabel("tokens committed per verify step")
        a2.set_ylabel("fraction of steps")
        a1.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "acceptance.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def environment() -> dict:
    import transformers
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


# --- the run -------------------------------------------------------------------------------

def _resume(out_dir: Path, fingerprint: dict, fresh: bool) -> dict[tuple, Record]:
    """Records of an interrupted run with the same configuration, keyed by
    (suite, prompt, turn, method); a different configuration in the same folder is an error."""
    run_file, log_file = out_dir / "run.json", out_dir / "records.jsonl"
    if fresh or not log_file.exists():
        atomic_write(run_file, lambda tmp: Path(tmp).write_text(json.dumps(fingerprint, indent=1)))
        log_file.write_text("")
        return {}
    old = json.loads(run_file.read_text()) if run_file.exists() else None
    if old != fingerprint:
        raise ValueError(f"{out_dir} holds a bench run with a different configuration; pass another "
                         f"--out, or --fresh to start this folder over")
    done: dict[tuple, Record] = {}
    lines = log_file.read_text().splitlines()
    for line in lines:
        try:
            rec = Record(**json.loads(line))
        except (json.JSONDecodeError, TypeError):
            break     # a torn last line from an interrupted write
        done[(rec.suite, rec.prompt_id, rec.turn, rec.method)] = rec
    log_file.write_text("".join(json.dumps(asdict(r)) + "\n" for r in done.values()))
    return done


def _run_environment(out_dir: Path, fresh_start: bool) -> dict:
    """The machine the records were measured on, written when the run starts; a resumed run
    must use the same thread count, or its timings would not compare with the earlier ones."""
    path = out_dir / "environment.json"
    if fresh_start or not path.exists():
        env = environment()
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(env, indent=1)))
        return env
    env = json.loads(path.read_text())
    if env.get("torch_threads") != torch.get_num_threads():
        raise ValueError(f"{out_dir} was measured with {env.get('torch_threads')} torch threads and "
                         f"this process has {torch.get_num_threads()}: resume it with the same "
                         f"thread count (OMP_NUM_THREADS={env.get('torch_threads')}) or pass --fresh")
    return env


def run_bench(target: Target, methods: dict[str, Method], suites: list[str], num_prompts: int,
              max_new_tokens: int, sampling: SamplingConfig, seed: int, out_dir: Path,
              config: dict, progress: bool = True, max_turns: int | None = None,
              fresh: bool = False) -> dict:
    """Run (or resume: same configuration, same --out) the benchmark; returns the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts: list[BenchPrompt] = [p for s in suites for p in load_suite(s, num_prompts, seed)]
    if max_turns:
        prompts = [BenchPrompt(p.suite, p.id, p.turns[:max_turns]) for p in prompts]
    stops = target.stop_token_ids()
    # everything that changes a record: a resumed run must match it exactly (the drafter by
    # content, so one retrained in place starts a new run instead of mixing two drafters)
    fingerprint = {"target": target.name, "drafter": config.get("drafter"),
                   "drafter_sha256": config.get("drafter_sha256"), "dtype": str(target.dtype),
                   "suites": suites,
                   "methods": list(methods), "num_prompts": num_prompts,
                   "max_new_tokens": max_new_tokens, "sampling": asdict(sampling), "seed": seed,
                   "max_turns": max_turns, "block_size": str(config.get("block_size")),
                   "fast_path": getattr(target, "fast_path", None)}
    done = _resume(out_dir, fingerprint, fresh)
    bf16 = target.dtype != torch.float32   # our loop may then differ from HF generate (mismatch_kind)
    env = _run_environment(out_dir, fresh_start=not done)
    records: list[Record] = []
    log = (out_dir / "records.jsonl").open("a")
    total_turns = sum(len(p.turns) for p in prompts)
    bar = tqdm(total=total_turns * len(methods), disable=not progress, desc="bench")
    spec = next((m for m in methods if m.startswith("dflash")), None)
    for p in prompts:
        history: dict[str, list[dict]] = {m: [] for m in methods}
        for turn, text in enumerate(p.turns):
            ar_tokens = loop_tokens = None
            for name, method in methods.items():   # interleaved: every method on this turn
                messages = history[name] + [{"role": "user", "content": text}]
                previous = done.get((p.suite, p.id, turn, name))
                if previous is not None:            # finished before an interruption
                    records.append(previous)
                    ar_tokens = previous.tokens if name == "ar" else ar_tokens
                    loop_tokens = previous.tokens if name == "ar-loop" else loop_tokens
                    history[name] = messages + [{"role": "assistant",
                                                 "content": target.decode(previous.tokens)}]
                    bar.update(1)
                    continue
                ids = target.encode_prompt(messages)
                r = method(ids, max_new_tokens, sampling, stops)
                rec = Record(p.suite, p.id, turn, name, len(r.tokens), r.prefill_s, r.decode_s, r.tokens,
                             r.acceptance_lengths, r.slot_accepted, r.slot_drafted)
                if name == "ar-loop":
                    loop_tokens = r.tokens
                elif sampling.greedy and loop_tokens is not None and name != "ar":
                    rec.identical_to_ar_loop = r.tokens == loop_tokens
                if name == "ar":
                    ar_tokens = r.tokens
                elif sampling.greedy and ar_tokens is not None:
                    rec.first_diff = first_difference(ar_tokens, r.tokens)
                    rec.identical_to_ar = rec.first_diff is None
                    kind = mismatch_kind(rec, bf16)
                    if kind == "failure":
                        print(f"\n\033[31mLOSSLESS CHECK FAILED\033[0m: {name} differs from "
                              f"{'ar-loop' if rec.identical_to_ar_loop is False else 'ar'} on "
                              f"{p.suite}/{p.id} turn {turn} (first difference from ar at generated "
                              f"position {rec.first_diff}); prompt: {text[:120]!r}", file=sys.stderr)
                    elif kind == "kernel" and name == "ar-loop":
                        print(f"\nnote: bf16 ar-loop differs from ar on {p.suite}/{p.id} turn {turn} "
                              f"at position {rec.first_diff} (one-row kernel rounding; dflash is "
                              f"checked against ar-loop)", file=sys.stderr)
                history[name] = messages + [{"role": "assistant",
                                             "content": target.decode(r.tokens)}]
                records.append(rec)
                log.write(json.dumps(asdict(rec)) + "\n")
                log.flush()
                bar.update(1)
            summary = summarize(records, bf16)
            if spec is not None:
                e = summary.get(p.suite, {}).get(spec, {})
                bar.set_postfix(suite=p.suite, tau=f"{e.get('tau', 0):.2f}",
                                speedup=f"{e.get('speedup_vs_ar') or 0:.2f}x")
    bar.close()
    log.close()
    return write_report(out_dir, records, fingerprint, config, env, expected=len(records))


def _dtype_name(dtype: str) -> str:
    return str(dtype).removeprefix("torch.")


def write_report(out_dir: Path, records: list[Record], run: dict, config: dict, env: dict,
                 expected: int) -> dict:
    """summary.json, report.md and the plots of ``records``; ``run`` is the run's fingerprint
    (run.json). ``expected`` records make the run complete; fewer are reported as partial."""
    sampling = SamplingConfig(**run["sampling"])
    bf16 = _dtype_name(run["dtype"]) != "float32"   # our loop may differ from HF generate (mismatch_kind)
    summary = summarize(records, bf16)
    names, suites = list(run["methods"]), list(run["suites"])
    lossless, verdict = lossless_verdict(records, sampling, bf16)
    report = {"config": config, "environment": env,
              "stand_ins": {s: STAND_INS[s] for s in suites}, "summary": summary,
              "lossless": lossless, "identical_to_ar": all(r.identical_to_ar is not False for r in records),
              "records": len(records), "expected_records": expected}
    text = json.dumps(report, indent=2)
    atomic_write(out_dir / "summary.json", lambda tmp: Path(tmp).write_text(text))
    table = markdown_table(summary, names)
    max_turns = run.get("max_turns")
    partial = "" if len(records) >= expected else (
        f"**Partial run: {len(records)} of {expected} method runs measured so far** (rerun the same "
        f"`dflashkit bench` command to resume; every figure below covers only the prompts done).\n\n")
    md = (f"# dflashkit bench\n\n{partial}Target `{run.get('target')}`, drafter `{run.get('drafter')}`, "
          f"{run['num_prompts']} prompts per suite, max {run['max_new_tokens']} new tokens, temperature "
          f"{sampling.temperature}, seed {run['seed']}"
          f"{f', first {max_turns} turn(s) of each prompt only' if max_turns else ''}. "
          f"{_dtype_name(run['dtype'])} weights. {env['cpu']}, {env['torch_threads']} threads, "
          f"torch {env['torch']}, transformers {env['transformers']}.\n\n"
          f"Cells: tau (mean acceptance length, dflash only), decode tokens/s, pooled decode "
          f"speedup over `ar` (Hugging Face generate) and, in brackets, over `ar-loop` (our own "
          f"plain loop on the same execution path: what speculation itself buys).\n\n{table}\n"
          + verdict
          + "\nStand-ins:\n" + "".join(f"- `{s}`: {STAND_INS[s]}\n" for s in suites)
          + "\n## Per suite\n\nA run is one prompt turn of one method (MT-Bench has two turns). TTFT: "
            "prefill and first token. Per-slot acceptance: P(draft slot k accepted | drafted). "
            "Plots: `speedup.png`, `acceptance.png` (per-slot acceptance and acceptance-length "
            "histogram of the first dflash method); every record in `records.jsonl`.\n\n"
          + details_tables(summary, names))
    (out_dir / "report.md").write_text(md)
    plot(summary, names, out_dir)
    return report


def report_from_folder(out_dir: Path) -> dict:
    """Re-render the report of the run in ``out_dir`` from its records, running nothing: for a
    run still in progress or interrupted (reported as partial), or to redraw the plots."""
    run_file, env_file, log_file = out_dir / "run.json", out_dir / "environment.json", out_dir / "records.jsonl"
    missing = [f.name for f in (run_file, env_file, log_file) if not f.exists()]
    if missing:
        raise ValueError(f"{out_dir} holds no bench run ({', '.join(missing)} missing): pass the "
                         f"--out folder of a `dflashkit bench` run")
    run = json.loads(run_file.read_text())
    records = []
    for line in log_file.read_text().splitlines():
        try:
            records.append(Record(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            break     # a torn last line: the run was killed while writing it
    prompts = [p for s in run["suites"] for p in load_suite(s, run["num_prompts"], run["seed"])]
    turns = sum(len(p.turns[:run["max_turns"]] if run.get("max_turns") else p.turns) for p in prompts)
    summary_file = out_dir / "summary.json"
    config = json.loads(summary_file.read_text()).get("config", run) if summary_file.exists() else run
    return write_report(out_dir, records, run, config, json.loads(env_file.read_text()),
                        expected=turns * len(run["methods"]))
