"""What a bench run's records mean: tau, pooled speedup with its spread, the losslessness
verdict, and the report written from them (summary.json, report.md, plots).

Speedup is pooled per suite: (sum of ar decode time / ar tokens) divided by (sum of method
decode time / method tokens), with the per-prompt spread beside it. Greedy outputs are
checked against their exact reference token by token (``mismatch_kind``); a mismatch is
reported loudly with the prompt and the first differing position. Everything here reads
records only, so a report can be redrawn from ``records.jsonl`` without running a model.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .checkpoint import atomic_write
from .sampling import SamplingConfig
from .suites import STAND_INS, load_suite


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
    first_diff_ar_loop: int | None = None
    # Tokens delivered with the first one: Hugging Face's speculative methods verify drafts in
    # their prefill pass and hand over several tokens at once; those are not decode tokens.
    first_tokens: int = 1

    @property
    def decode_tokens(self) -> int:
        return max(0, self.num_tokens - self.first_tokens)

    @property
    def tau(self) -> float | None:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else None


_FIELDS = {f.name for f in fields(Record)}


def record_line(rec: Record, ar: Record | None = None) -> str:
    """One line of records.jsonl: the raw fields, and under ``metrics`` what a reader would
    otherwise derive (decode tokens/s, TTFT, tau, speedup over the same turn's ``ar``)."""
    rate = rec.decode_tokens / rec.decode_s if rec.decode_s > 0 and rec.decode_tokens else None
    ar_rate = ar.decode_tokens / ar.decode_s if ar and ar.decode_s > 0 and ar.decode_tokens else None
    metrics = {"decode_tokens_per_s": rate, "ttft_s": rec.prefill_s, "tau": rec.tau,
               "speedup_vs_ar": rate / ar_rate if rate and ar_rate else None}
    return json.dumps({**asdict(rec), "metrics": metrics}) + "\n"


def write_records(path: Path, records: list[Record]) -> None:
    """Rewrite records.jsonl atomically, each line with its derived metrics."""
    ars = {(r.suite, r.prompt_id, r.turn): r for r in records if r.method == "ar"}
    text = "".join(record_line(r, ars.get((r.suite, r.prompt_id, r.turn))) for r in records)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def read_records(path: Path) -> list[Record]:
    """The records of a run; a torn last line (a run killed while writing it) is dropped, any
    other unreadable line is an error rather than a silent loss of what follows it."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            unknown = set(row) - _FIELDS - {"metrics"}
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            out.append(Record(**{k: v for k, v in row.items() if k in _FIELDS}))
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}, line {i + 1}: not a bench record ({e}); it was written by "
                             f"another version or edited by hand: fix or remove that line, or "
                             f"start over with --fresh") from None
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def attach_checks(records: list[Record], greedy: bool = True) -> None:
    """Fill in each record's losslessness fields from the same turn's ``ar`` and ``ar-loop``
    records, wherever those are (methods run in a rotated order, so a reference may come
    after the method it checks). Sampled outputs are not compared token by token."""
    if not greedy:
        return
    refs = {(r.suite, r.prompt_id, r.turn, r.method): r for r in records if r.method in ("ar", "ar-loop")}
    for r in records:
        turn = (r.suite, r.prompt_id, r.turn)
        ar, loop = refs.get(turn + ("ar",)), refs.get(turn + ("ar-loop",))
        if loop is not None and r.method not in ("ar", "ar-loop"):
            r.first_diff_ar_loop = first_difference(loop.tokens, r.tokens)
            r.identical_to_ar_loop = r.first_diff_ar_loop is None
        if ar is not None and r.method != "ar":
            r.first_diff = first_difference(ar.tokens, r.tokens)
            r.identical_to_ar = r.first_diff is None


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


def speculates_on_our_loop(method: str) -> bool:
    """dflash, dflash:B, dflash+lookup..., lookup:B: checked against ``ar-loop``, their exact reference."""
    return method.startswith("dflash") or method.partition(":")[0] == "lookup"


def _ours(method: str) -> bool:
    return method == "ar-loop" or speculates_on_our_loop(method)


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
    if speculates_on_our_loop(r.method) and r.identical_to_ar_loop is False:
        return "failure"
    if r.identical_to_ar is None and r.identical_to_ar_loop is False:
        # no ar run, so ar-loop is the reference of every method: in fp32 all must equal it
        return "kernel" if bf16 and not _ours(r.method) else "failure"
    if r.method == "ar" or r.identical_to_ar is not False:
        return None
    if not bf16:
        return "failure"
    shares_loop_rounding = r.method == "ar-loop" or (speculates_on_our_loop(r.method) and r.identical_to_ar_loop)
    return "kernel" if shares_loop_rounding or not _ours(r.method) else "failure"


def run_reference(records: list[Record]) -> str:
    """The method a run's ratios and checks refer to: ``ar`` (HF generate) when it ran, else
    ``ar-loop`` (our plain loop) when that ran."""
    if not any(r.method == "ar" for r in records) and any(r.method == "ar-loop" for r in records):
        return "ar-loop"
    return "ar"


def summarize(records: list[Record], bf16: bool = False) -> dict:
    """Per suite x method: tokens/s, pooled speedup over ar with spread, tau, slots, histogram.
    ``bf16``: our loop may differ from HF generate by kernel rounding (see mismatch_kind)."""
    out: dict = {}
    keys = list(dict.fromkeys((r.suite, r.method) for r in records))   # suites in run order
    by_prompt = {(r.suite, r.prompt_id, r.turn, r.method): r for r in records}
    reference = run_reference(records)   # what the per-prompt spread is taken over
    for suite, method in keys:
        rs = [r for r in records if r.suite == suite and r.method == method]
        ar = [by_prompt.get((r.suite, r.prompt_id, r.turn, "ar")) for r in rs]
        base = [by_prompt.get((r.suite, r.prompt_id, r.turn, reference)) for r in rs]
        tok = sum(r.decode_tokens for r in rs)
        sec = sum(r.decode_s for r in rs)
        per_prompt = [(a.decode_s / a.decode_tokens) / (r.decode_s / r.decode_tokens)
                      for r, a in zip(rs, base) if a and r.decode_tokens and a.decode_tokens and r.decode_s > 0]
        entry = {
            "prompts": len(rs), "tokens": sum(r.num_tokens for r in rs),
            "decode_tokens_per_s": tok / sec if sec > 0 else 0.0,
            "ttft_s_median": statistics.median([r.prefill_s for r in rs]),
            "speedup_vs_ar": _pooled_speedup(rs, ar),
            # what speculation itself buys: our plain loop on the same execution path
            "speedup_vs_ar_loop": _pooled_speedup(
                rs, [by_prompt.get((r.suite, r.prompt_id, r.turn, "ar-loop")) for r in rs]),
            "speedup_per_prompt": {"median": _percentile(per_prompt, 0.5), "p10": _percentile(per_prompt, 0.1),
                                   "p90": _percentile(per_prompt, 0.9), "vs": reference} if per_prompt else None,
            "mismatches": sum(1 for r in rs if mismatch_kind(r, bf16) == "failure"),
            "kernel_differences": sum(1 for r in rs if mismatch_kind(r, bf16) == "kernel"),
            "mismatches_vs_ar_loop": sum(1 for r in rs if r.identical_to_ar_loop is False),
        }
        lengths = [x for r in rs for x in (r.acceptance_lengths or [])]
        if lengths:
            # pooled over every verify step of the suite, like the histogram beside it
            entry["tau"] = sum(lengths) / len(lengths)
            acc = [sum(x) for x in zip(*[r.slot_accepted for r in rs if r.slot_accepted])]
            dra = [sum(x) for x in zip(*[r.slot_drafted for r in rs if r.slot_drafted])]
            drafted = sum(1 for d in dra if d)   # slots beyond it were never drafted (copies
            # alone, or an adaptive size that never went that far): no rate, rather than 0
            entry["slot_acceptance"] = [a / d for a, d in zip(acc[:drafted], dra[:drafted])]
            entry["acceptance_histogram"] = {str(k): lengths.count(k) for k in range(1, max(lengths) + 1)}
        out.setdefault(suite, {})[method] = entry
    return out


def lossless_verdict(records: list[Record], sampling, bf16: bool = False) -> tuple[bool | None, str]:
    """(no output changed by speculation or by our kernels, the report's paragraph on it);
    None for a sampling run, whose outputs are not compared token by token."""
    if not sampling.greedy:
        return None, (f"Sampling run (temperature {sampling.temperature}): outputs are not compared "
                      f"token by token, since two lossless samplers draw different texts. That "
                      f"speculative sampling keeps the target's distribution is tested "
                      f"(`tests/test_sampling.py`), not measured here.\n")
    kinds = [(r, mismatch_kind(r, bf16)) for r in records]
    failures = [r for r, k in kinds if k == "failure"]
    kernel = [r for r, k in kinds if k == "kernel"]
    reference = run_reference(records)
    others = [r for r in records if r.method not in ("ar", reference)]
    unchecked = sum(1 for r in others if r.identical_to_ar is None and r.identical_to_ar_loop is None)
    lines = []
    if not failures and not kernel:
        lines.append(f"Lossless: every greedy output identical to `{reference}`." if not unchecked else
                     f"Lossless so far: {len(others) - unchecked} of {len(others)} outputs checked "
                     f"(the rest wait for their turn's `{reference}` run), every one identical to "
                     f"`{reference}`.")
        if reference == "ar-loop":
            lines.append("No `ar` (Hugging Face generate) run: the reference is `ar-loop`, plain "
                         "one-token greedy decoding of the target on the same kernels (that it equals "
                         "`ar` in fp32 is tested in `tests/test_decoding.py`).")
    elif failures:
        lines.append("**LOSSLESS CHECK FAILED**: " + "; ".join(describe_failure(r) for r in failures) + ".")
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
                     f"tokens (README, bf16). In fp32 every path must equal `ar`. First differing "
                     f"positions: " + _positions(ours) + ".")
    theirs = [r for r in kernel if not _ours(r.method)]
    if theirs:
        lines.append(f"{len(theirs)} outputs of Hugging Face's own speculative methods differ from "
                     f"`ar` in bf16: they verify several tokens per pass with PyTorch's default "
                     f"kernels, whose multi-row bf16 results round differently from `ar`'s one-token "
                     f"steps (README, bf16); not a failure of dflashkit, and in fp32 they must equal "
                     f"`ar`: " + _positions(theirs) + ".")
    checked = [r for r in records if r.identical_to_ar_loop is not None]
    if checked:
        bad = sum(1 for r in checked if not r.identical_to_ar_loop)
        lines.append(f"Against `ar-loop`: {len(checked) - bad} of {len(checked)} outputs identical.")
    return not failures, "\n\n".join(lines) + "\n"


def _positions(records: list[Record]) -> str:
    return "; ".join(f"`{r.method}` on {r.suite}/{r.prompt_id} turn {r.turn} at position {r.first_diff}"
                     for r in records)


def describe_failure(r: Record) -> str:
    """Which reference a failed output differs from, where: ``ar-loop`` for our speculative
    methods, and for every method when no ``ar`` ran; ``ar`` otherwise."""
    if r.identical_to_ar_loop is False and (speculates_on_our_loop(r.method) or r.identical_to_ar is None):
        return (f"`{r.method}` differs from `ar-loop` on {r.suite}/{r.prompt_id} turn {r.turn} at "
                f"generated position {r.first_diff_ar_loop}")
    return (f"`{r.method}` differs from `ar` on {r.suite}/{r.prompt_id} turn {r.turn} at generated "
            f"position {r.first_diff}" + ("" if _ours(r.method) else " (a Hugging Face method: its reference is `ar`)"))


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
                loop = f"{e['speedup_vs_ar_loop']:.2f}x vs ar-loop"
                sp = loop if sp == "-" else f"{sp} ({loop})"   # no ar run: no bracket
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
                     f"{spread['median']:.2f}x ({spread['p10']:.2f}-{spread['p90']:.2f})"
                     + (" vs ar-loop" if spread.get("vs") == "ar-loop" else "") if spread else "-",
                     f"{e['speedup_vs_ar_loop']:.2f}x" if e.get("speedup_vs_ar_loop") else "-",
                     f"{e['tau']:.2f}" if "tau" in e else "-",
                     " / ".join(f"{a:.2f}" for a in e["slot_acceptance"][:4]) if e.get("slot_acceptance") else "-"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def paired_comparison(records: list[Record], first: str, second: str, resamples: int = 4000,
                      seed: int = 0) -> dict:
    """``first`` against ``second`` on the prompt-turns both ran, per suite and over all:
    the per-prompt ratio of decode speeds (median, bootstrap 95% interval of the median,
    wins), and the pooled ratio of time per token. Two methods a few percent apart are only
    told apart this way: per-prompt swings on a shared machine are larger than the gap, and
    pairing removes the prompt-to-prompt variation (length, acceptance) they share."""
    import random
    runs = {(r.suite, r.prompt_id, r.turn, r.method): r for r in records}
    pairs: dict[str, list[tuple[Record, Record]]] = {}
    for (suite, pid, turn, method), a in runs.items():
        b = runs.get((suite, pid, turn, second))
        if method == first and b is not None and a.decode_s > 0 and b.decode_s > 0 \
                and a.decode_tokens and b.decode_tokens:
            pairs.setdefault(suite, []).append((a, b))
    if len(pairs) > 1:
        pairs["all"] = [p for suite_pairs in list(pairs.values()) for p in suite_pairs]
    out = {}
    for suite, ps in pairs.items():
        if not ps:
            continue
        ratios = [(a.decode_tokens / a.decode_s) / (b.decode_tokens / b.decode_s) for a, b in ps]
        rng = random.Random(seed)
        medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
        out[suite] = {"pairs": len(ps), "median": statistics.median(ratios),
                      "ci95": [_percentile(medians, 0.025), _percentile(medians, 0.975)],
                      "pooled": _pooled_speedup([a for a, _ in ps], [b for _, b in ps]),
                      "wins": sum(x > 1 for x in ratios)}
    return out


def paired_tables(records: list[Record], methods: list[str]) -> tuple[dict, str]:
    """The first of our drafting methods against each other one (an adaptive block size
    against fixed sizes, say), as summary entries and Markdown."""
    ours = [m for m in methods if speculates_on_our_loop(m)]
    entries, md = {}, []
    for other in ours[1:]:
        comp = paired_comparison(records, ours[0], other)
        if not comp:
            continue
        entries[f"{ours[0]} vs {other}"] = comp
        md.append(f"### `{ours[0]}` against `{other}`, paired by prompt-turn\n\n| suite | pairs | "
                  f"speed ratio per prompt: median (95% interval of the median) | pooled | faster on |\n"
                  f"|---|---|---|---|---|")
        for suite, e in comp.items():
            pooled = f"{e['pooled']:.3f}x" if e["pooled"] else "-"
            md.append(f"| {suite} | {e['pairs']} | {e['median']:.3f}x ({e['ci95'][0]:.3f}-"
                      f"{e['ci95'][1]:.3f}) | {pooled} | {e['wins']} of {e['pairs']} |")
        md.append("")
    return entries, "\n".join(md)


def drafting_methods(summary: dict, methods: list[str]) -> list[str]:
    """Methods with a per-slot acceptance curve somewhere (ar-loop's is empty: it drafts nothing)."""
    return [m for m in methods if any(per.get(m, {}).get("slot_acceptance") for per in summary.values())]


def plot(summary: dict, methods: list[str], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    suites = list(summary)

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    # both speeds: over HF generate (what users compare with) and over our plain loop on the
    # same kernels (what speculation itself buys), when ar-loop ran
    bases = [(key, label) for key, label in (("speedup_vs_ar", "ar (HF generate)"),
                                              ("speedup_vs_ar_loop", "ar-loop (our plain loop)"))
             if any(e.get(key) for per in summary.values() for e in per.values())] \
        or [("speedup_vs_ar", "ar (HF generate)")]   # nothing to compare yet: an empty panel
    fig, axes = plt.subplots(len(bases), 1, figsize=(3.6 + 1.4 * len(suites), 3.4 * len(bases)),
                             squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, (key, label) in zip(axes[:, 0], bases):
        for i, m in enumerate(methods):
            # a method not run on a suite (or without a base there) gets no bar, not a 0.00x one
            ran = [(j, summary[s][m][key]) for j, s in enumerate(suites) if summary[s].get(m, {}).get(key)]
            if not ran:
                continue
            ax.bar([j + i * width for j, _ in ran], [v for _, v in ran], width, label=m, color=f"C{i}")
            ax.bar_label(ax.containers[-1], fmt="%.2f", fontsize=6, padding=1)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(suites))], suites)
        ax.set_ylabel(f"decode speedup over\n{label}, pooled", fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # outside the bars
    save(fig, "speedup.png")
    spec = drafting_methods(summary, methods)
    if spec:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        for s in suites:
            e = summary[s].get(spec[0], {})
            if e.get("slot_acceptance"):
                a1.plot(range(1, len(e["slot_acceptance"]) + 1), e["slot_acceptance"], marker="o", label=s)
                h = e["acceptance_histogram"]
                total = sum(h.values())
                a2.plot([int(k) for k in h], [v / total for v in h.values()], marker="o", label=s)
        a1.set_xlabel("draft slot k")
        a1.set_ylabel(f"P(accept slot k | drafted) [{spec[0]}]")
        a2.set_xlabel("tokens committed per verify step")
        a2.set_ylabel("fraction of steps")
        a1.legend(fontsize=8)
        save(fig, "acceptance.png")
    return paths


def _resumes(env: dict, run: dict) -> str:
    times = env.get("resumed_at") or []
    if not times:
        return ""
    adaptive = [m for m in run["methods"]
                if m.endswith(":auto") or (m == "dflash" and run.get("block_size") == "auto")]
    return (f" Resumed {len(times)} time(s) ({', '.join(times)})" + (
        f"; the adaptive block size of {', '.join(f'`{m}`' for m in adaptive)} restarted its "
        f"acceptance statistics at each resume (they forget within ~100 steps anyway)" if adaptive else "") + ".")


def _dtype_name(dtype: str) -> str:
    return str(dtype).removeprefix("torch.")


def write_report(out_dir: Path, records: list[Record], run: dict, config: dict, env: dict,
                 expected: int) -> dict:
    """summary.json, report.md and the plots of ``records``; ``run`` is the run's fingerprint
    (run.json). ``expected`` records make the run complete; fewer are reported as partial."""
    sampling = SamplingConfig(**run["sampling"])
    attach_checks(records, sampling.greedy)
    bf16 = _dtype_name(run["dtype"]) != "float32"   # our loop may differ from HF generate (mismatch_kind)
    summary = summarize(records, bf16)
    names, suites = list(run["methods"]), list(run["suites"])
    lossless, verdict = lossless_verdict(records, sampling, bf16)
    checked = [r.identical_to_ar for r in records if r.identical_to_ar is not None]
    loop_checked = [r.identical_to_ar_loop for r in records if r.identical_to_ar_loop is not None]
    report = {"config": config, "environment": env,
              "stand_ins": {s: STAND_INS[s] for s in suites}, "summary": summary,
              "lossless": lossless,
              # null where nothing was compared (a sampling run, or no ar run yet)
              "identical_to_ar": all(checked) if checked else None, "records_checked": len(checked),
              "identical_to_ar_loop": all(loop_checked) if loop_checked else None,
              "records": len(records), "expected_records": expected}
    paired, paired_md = paired_tables(records, names)
    if paired:
        report["paired"] = paired
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
          f"{_dtype_name(run['dtype'])} weights. {_machine(env)}, "
          f"torch {env['torch']}, transformers {env['transformers']}.{_resumes(env, run)}\n\n"
          f"Cells: tau (mean tokens committed per target pass, pooled over the suite's steps; "
          f"1.00 for `ar-loop` by construction), decode tokens/s, pooled decode "
          f"speedup over `ar` (Hugging Face generate) and, in brackets, over `ar-loop` (our own "
          f"plain loop on the same execution path: what speculation itself buys; without an `ar` "
          f"run, over `ar-loop` alone).\n\n{table}\n"
          + verdict
          + "\nStand-ins:\n" + "".join(f"- `{s}`: {STAND_INS[s]}\n" for s in suites)
          + "\n## Per suite\n\nA run is one prompt turn of one method (MT-Bench has two turns). TTFT: "
            "prefill and first token (Hugging Face's speculative methods may hand over several "
            "tokens with it; those are not counted as decode tokens). Per-slot acceptance: P(draft "
            "slot k accepted | drafted); a slot counts as accepted only when every slot before it "
            "was, so the curve falls by construction. "
            "Plots: `speedup.png`, `acceptance.png` (per-slot acceptance and acceptance-length "
            "histogram of the first dflash method); every record in `records.jsonl`.\n\n"
          + details_tables(summary, names)
          + ("\n## Paired comparisons\n\nBootstrap over prompt-turns (4,000 resamples, seed 0); "
             "a ratio above 1 means the first method decoded faster.\n\n" + paired_md if paired else ""))
    atomic_write(out_dir / "report.md", lambda tmp: Path(tmp).write_text(md))
    plot(summary, names, out_dir)
    return report


def load_run_folder(out_dir: Path) -> dict:
    """A bench run's fingerprint, environment, checked records and expected record count, read
    from ``out_dir`` without writing anything there."""
    run_file, env_file, log_file = out_dir / "run.json", out_dir / "environment.json", out_dir / "records.jsonl"
    missing = [f.name for f in (run_file, env_file, log_file) if not f.exists()]
    if missing:
        raise ValueError(f"{out_dir} holds no bench run ({', '.join(missing)} missing): pass the "
                         f"--out folder of a `dflashkit bench` run")
    run = json.loads(run_file.read_text())
    records = read_records(log_file)
    attach_checks(records, SamplingConfig(**run["sampling"]).greedy)
    prompts = [p for s in run["suites"] for p in load_suite(s, run["num_prompts"], run["seed"])]
    turns = sum(len(p.turns[:run["max_turns"]] if run.get("max_turns") else p.turns) for p in prompts)
    summary_file = out_dir / "summary.json"
    config = json.loads(summary_file.read_text()).get("config", run) if summary_file.exists() else run
    return {"run": run, "environment": json.loads(env_file.read_text()), "records": records,
            "config": config, "expected": turns * len(run["methods"])}


def _machine(env: dict) -> str:
    """Where the passes ran: the GPU when there was one, else the CPU and its threads."""
    if env.get("gpu"):
        return f"{env['gpu']} (GPU; host {env['cpu']})"
    return f"{env['cpu']}, {env['torch_threads']} threads"


def report_from_folder(out_dir: Path) -> dict:
    """Re-render the report of the run in ``out_dir`` from its records, running nothing: for a
    run still in progress or interrupted (reported as partial), or to redraw the plots."""
    part = load_run_folder(out_dir)
    # every line with its checks and metrics (an older run's too)
    write_records(out_dir / "records.jsonl", part["records"])
    return write_report(out_dir, part["records"], part["run"], part["config"], part["environment"],
                        expected=part["expected"])
