"""``dflashkit bench``: every method on the same prompts, interleaved, in one run.

Methods run prompt by prompt in turn (so machine drift hits all alike) through the same
target weights; each run becomes one record in ``records.jsonl``, appended as it finishes, so
an interrupted run resumes where it stopped (the file is rewritten, atomically, once a turn's
references ran, to fill in every record's losslessness check). What the records mean (tau, speedup, the
losslessness verdict) and the report drawn from them are in report.py.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .baselines import hf_generate
from .checkpoint import atomic_write
from .costs import cpu_features, cpu_model
from .decoding import DFlashProposer, speculative_generate
from .report import (Record, attach_checks, describe_failure, mismatch_kind, read_records, record_line,
                     speculates_on_our_loop, summarize, write_records, write_report)
from .sampling import SamplingConfig
from .suites import BenchPrompt, load_suite
from .target import Target


@dataclass
class RunResult:
    tokens: list[int]
    prefill_s: float
    decode_s: float
    acceptance_lengths: list[int] | None = None
    slot_accepted: list[int] | None = None
    slot_drafted: list[int] | None = None
    first_tokens: int = 1      # tokens delivered with the first one (report.Record)


Method = Callable[[list[int], int, SamplingConfig, list[int]], RunResult]


METHOD_FORMS = ("ar, ar-loop, dflash, dflash:B, dflash:auto, dflash-tree[:N], dflash+lookup[:B|:auto], lookup[:B], "
                "prompt-lookup, assisted:MODEL")


def _split_method(name: str) -> tuple[str, str | None]:
    """``dflash+lookup:auto`` -> ("dflash+lookup", "auto"); ``lookup`` -> ("lookup", None)."""
    base, sep, spec = name.partition(":")
    return base, (spec if sep else None)


def check_method_names(names: list[str]) -> None:
    """Reject a bad --methods list before any model is loaded."""
    if not names:
        raise ValueError(f"--methods is empty; choose from {METHOD_FORMS}")
    for name in names:
        if name in ("ar", "ar-loop", "dflash", "dflash-tree", "prompt-lookup", "dflash+lookup", "lookup"):
            continue
        base, spec = _split_method(name)
        if base == "dflash-tree":
            if not (spec.isdigit() and int(spec) >= 1):
                raise ValueError(f"method {name!r}: N, the drafted tokens each tree verifies, must be "
                                 f"a positive integer")
        elif base in ("dflash", "dflash+lookup"):
            if spec != "auto" and not (spec.isdigit() and int(spec) >= 1):
                raise ValueError(f"method {name!r}: the block size must be a positive integer or 'auto'")
        elif base == "lookup":
            if not (spec.isdigit() and int(spec) >= 2):
                raise ValueError(f"method {name!r}: the block size of lookup must be an integer >= 2 "
                                 f"(1 target token + at least one copied)")
        elif name.startswith("assisted:"):
            if not name.split(":", 1)[1].strip():
                raise ValueError(f"method {name!r} names no draft model: write assisted:MODEL, e.g. "
                                 f"assisted:smollm2-135m-instruct")
        else:
            raise ValueError(f"unknown method {name!r}; choose from {METHOD_FORMS}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--methods lists {duplicates} more than once")
    if "ar" not in names and "ar-loop" not in names:
        raise ValueError("the methods must include a baseline for the ratios and the lossless check: "
                         "'ar' (Hugging Face generate) or 'ar-loop' (our plain one-token loop, the "
                         "cheaper one where HF generate is slow), or both")


def make_methods(names: list[str], target: Target, drafter=None, block_size: int | str | None = None,
                 load_assistant: Callable[[str], object] | None = None) -> dict[str, Method]:
    """Resolve method names: ar, ar-loop, dflash, dflash:B, dflash:auto, dflash-tree[:N] (a draft
    tree of N drafted tokens, default the drafter's block size - 1: the chain's verify width, up to
    that deep), prompt-lookup, assisted:MODEL (``load_assistant(name)`` returns a Target, or a bare model)."""
    check_method_names(names)
    methods: dict[str, Method] = {}
    if drafter is not None and not isinstance(drafter, DFlashProposer):
        drafter = DFlashProposer(drafter, target)   # validate and prepare its LM head once
    for name in names:
        base, spec = _split_method(name)
        if name == "ar":
            methods[name] = lambda ids, n, s, stops: _from_hf(hf_generate(target, ids, n, s, stops))
        elif name == "ar-loop":
            methods[name] = lambda ids, n, s, stops: _from_loop(
                speculative_generate(target, None, ids, n, s, stops, block_size=1))
        elif base in ("dflash", "dflash+lookup"):
            if drafter is None:
                raise ValueError(f"method {name} needs a drafter (--drafter DIR)")
            size = _dflash_block_size(name, block_size, drafter, target)
            copy = base == "dflash+lookup"
            methods[name] = lambda ids, n, s, stops, b=size, c=copy: _from_loop(
                speculative_generate(target, drafter, ids, n, s, stops, block_size=b, lookup=c))
        elif base == "dflash-tree":
            if drafter is None:
                raise ValueError(f"method {name} needs a drafter (--drafter DIR)")
            nodes = int(spec or drafter.drafter.block_size - 1)
            methods[name] = lambda ids, n, s, stops, t=nodes: _from_loop(
                speculative_generate(target, drafter, ids, n, s, stops, tree=t))
        elif base == "lookup":
            size = int(spec or (drafter.drafter.block_size if drafter is not None else 8))
            methods[name] = lambda ids, n, s, stops, b=size: _from_loop(
                speculative_generate(target, None, ids, n, s, stops, block_size=b, lookup=True))
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
    return RunResult(r.tokens, r.prefill_s, r.decode_s, first_tokens=r.first_tokens)


def _from_loop(r) -> RunResult:
    st = r.stats
    return RunResult(r.tokens, st.prefill_s, st.decode_s, st.acceptance_lengths, st.slot_accepted,
                     st.slot_drafted)


# what must not change when a run resumes: the timings would not compare (the code included:
# a resume after a speed fix would mix records of two programs)
MACHINE_KEYS = ("cpu", "gpu", "cpu_features", "cores", "torch_threads", "torch", "transformers",
                "packed_min_rows", "dflashkit_commit")


def environment(device: torch.device | str = "cpu") -> dict:
    """The machine and libraries behind a run's timings; ``gpu`` names the GPU the target ran on."""
    from importlib import metadata
    versions = {}
    for package in ("tokenizers", "numpy", "reasoning-gym", "accelerate"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    import transformers
    from .fastpath import packed_min_rows
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None
    return {"cpu": cpu_model(), "gpu": gpu, "cpu_features": cpu_features(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "packed_min_rows": packed_min_rows(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "packages": versions, "dflashkit_commit": _git_commit(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _git_commit() -> str | None:
    """The checkout's commit (with ``+changes`` when it has uncommitted edits), if it is one."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        # only the program counts: a bench writing its records into a tracked folder of the
        # checkout (benchmarks/) does not make the code another one
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "dflashkit", "pyproject.toml", "requirements.lock"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if dirty else "")) if head else None


# --- the run -------------------------------------------------------------------------------

def _differences(old: dict, new: dict) -> list[str]:
    """Keys whose values differ between two run fingerprints. A drafter is the same by content:
    its path may differ (another checkout, a copy) when the sha256 agrees."""
    same_drafter = old.get("drafter_sha256") and old.get("drafter_sha256") == new.get("drafter_sha256")
    return [k for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and not (k == "drafter" and same_drafter)]


def _resume(out_dir: Path, fingerprint: dict, fresh: bool) -> dict[tuple, Record]:
    """Records of an interrupted run with the same configuration, keyed by
    (suite, prompt, turn, method); a different configuration in the same folder is an error."""
    run_file, log_file = out_dir / "run.json", out_dir / "records.jsonl"
    if fresh or not log_file.exists():
        atomic_write(run_file, lambda tmp: Path(tmp).write_text(json.dumps(fingerprint, indent=1)))
        write_records(log_file, [])
        return {}
    if not run_file.exists():
        raise ValueError(f"{out_dir} has records.jsonl but no run.json, so what it measured is unknown: "
                         f"pass another --out, or --fresh to start this folder over")
    old = json.loads(run_file.read_text())
    changed = _differences(old, fingerprint)
    if changed:
        raise ValueError(f"{out_dir} holds a bench run with a different configuration ("
                         + "; ".join(f"{k}: {old.get(k)!r} there, {fingerprint.get(k)!r} now" for k in changed)
                         + "): pass another --out, or --fresh to start this folder over")
    done: dict[tuple, Record] = {}
    for rec in read_records(log_file):
        done[(rec.suite, rec.prompt_id, rec.turn, rec.method)] = rec
    write_records(log_file, list(done.values()))   # without the torn line or duplicates
    return done


def _run_environment(out_dir: Path, fresh_start: bool, device: torch.device | str = "cpu") -> dict:
    """The machine the records were measured on, written when the run starts; a resumed run
    must run on the same CPU with the same threads and libraries, or its timings would not
    compare with the earlier ones. Each resume is noted (the report says so)."""
    path = out_dir / "environment.json"
    now = environment(device)
    if fresh_start or not path.exists():
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(now, indent=1)))
        return now
    env = json.loads(path.read_text())
    # keys an older run did not record yet are not held against it
    changed = [k for k in MACHINE_KEYS if k in env and env.get(k) != now.get(k)]
    if changed:
        hint = (f" (resume with OMP_NUM_THREADS={env.get('torch_threads')})"
                if "torch_threads" in changed else
                f" (resume from a checkout of {env.get('dflashkit_commit')})"
                if changed == ["dflashkit_commit"] else "")
        raise ValueError(f"{out_dir} was measured with "
                         + ", ".join(f"{k} {env.get(k)!r}" for k in changed) + " and this process has "
                         + ", ".join(f"{k} {now.get(k)!r}" for k in changed)
                         + f": its timings would not compare{hint}; pass --fresh to start over")
    env["resumed_at"] = env.get("resumed_at", []) + [now["time"]]
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(env, indent=1)))
    return env


def _say_mismatch(rec: Record, kind: str | None, text: str) -> None:
    where = f"{rec.suite}/{rec.prompt_id} turn {rec.turn}"
    if kind == "failure":   # the report's wording (which reference, which position), unquoted
        print(f"\n\033[31mLOSSLESS CHECK FAILED\033[0m: {describe_failure(rec).replace('`', '')}; "
              f"prompt: {text[:120]!r}", file=sys.stderr)
    elif kind == "kernel" and rec.identical_to_ar is None:
        print(f"\nnote: bf16 {rec.method} differs from ar-loop on {where} at position "
              f"{rec.first_diff_ar_loop} (kernel rounding: HF's multi-row default kernels)", file=sys.stderr)
    elif kind == "kernel":
        reference = ("dflash is checked against ar-loop" if rec.method == "ar-loop" else
                     "identical to ar-loop" if speculates_on_our_loop(rec.method) else
                     "HF's multi-row default kernels")
        print(f"\nnote: bf16 {rec.method} differs from ar on {where} at position {rec.first_diff} "
              f"(kernel rounding; {reference})", file=sys.stderr)


def _warm_up(methods: dict[str, Method], ids: list[int], sampling: SamplingConfig, stops: list[int]) -> None:
    """One short untimed run per method, so that no timed run pays one-time costs (lazy
    initialisation, first-call allocations) for the others."""
    for method in methods.values():
        method(ids, 4, sampling, stops)


def run_bench(target: Target, methods: dict[str, Method], suites: list[str], num_prompts: int,
              max_new_tokens: int, sampling: SamplingConfig, seed: int, out_dir: Path,
              config: dict, progress: bool = True, max_turns: int | None = None,
              fresh: bool = False, warmup: bool = True) -> dict:
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
    env = _run_environment(out_dir, fresh_start=not done, device=target.device)
    total_turns = sum(len(p.turns) for p in prompts)
    log_path = out_dir / "records.jsonl"
    logged: dict[tuple, Record] = dict(done)       # what records.jsonl holds, in its order
    if warmup and prompts and len(done) < total_turns * len(methods):
        _warm_up(methods, target.encode_prompt([{"role": "user", "content": prompts[0].turns[0]}]),
                 sampling, stops)
    records: list[Record] = []
    spec = next((m for m in methods if m.startswith("dflash")), None)
    names = list(methods)
    with tqdm(total=total_turns * len(methods), disable=not progress, desc="bench") as bar:
        for index, p in enumerate(prompts):
            # interleaved: every method on this turn, each prompt in a rotated order, so that
            # machine drift and whatever one method leaves in the caches hit every method alike
            order = names[index % len(names):] + names[:index % len(names)]
            history: dict[str, list[dict]] = {m: [] for m in methods}
            for turn, text in enumerate(p.turns):
                this_turn: list[Record] = []
                measured: list[Record] = []
                for name in order:
                    messages = history[name] + [{"role": "user", "content": text}]
                    key = (p.suite, p.id, turn, name)
                    rec = done.get(key)   # finished before an interruption
                    if rec is None:
                        r = methods[name](target.encode_prompt(messages), max_new_tokens, sampling, stops)
                        rec = Record(p.suite, p.id, turn, name, len(r.tokens), r.prefill_s, r.decode_s,
                                     r.tokens, r.acceptance_lengths, r.slot_accepted, r.slot_drafted,
                                     first_tokens=r.first_tokens)
                        with log_path.open("a") as log:   # kept at once; checks come at the turn's end
                            log.write(record_line(rec))
                        logged[key] = rec
                        measured.append(rec)
                    this_turn.append(rec)
                    records.append(rec)
                    history[name] = messages + [{"role": "assistant", "content": target.decode(rec.tokens)}]
                    bar.update(1)
                attach_checks(this_turn, sampling.greedy)
                if measured:
                    write_records(log_path, list(logged.values()))   # with this turn's checks
                for rec in measured:
                    _say_mismatch(rec, mismatch_kind(rec, bf16), text)
                summary = summarize(records, bf16)
                if spec is not None:
                    e = summary.get(p.suite, {}).get(spec, {})
                    shown = {"suite": p.suite, "tau": f"{e.get('tau', 0):.2f}"}
                    if "ar" in methods:
                        shown["speedup"] = f"{e.get('speedup_vs_ar') or 0:.2f}x"
                    if e.get("speedup_vs_ar_loop"):     # only when ar-loop runs too
                        shown["vs_ar_loop"] = f"{e['speedup_vs_ar_loop']:.2f}x"
                    bar.set_postfix(shown)
    return write_report(out_dir, records, fingerprint, config, env, expected=len(records))
