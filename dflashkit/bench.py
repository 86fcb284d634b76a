"""``dflashkit bench``: every method on the same prompts, interleaved, in one run.

Methods run prompt by prompt in turn (so machine drift hits all alike) through the same
target weights; each run becomes one record in ``records.jsonl``, written as it finishes, so
an interrupted run resumes where it stopped. What the records mean (tau, speedup, the
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
from .costs import cpu_model
from .decoding import DFlashProposer, speculative_generate
from .report import Record, attach_checks, mismatch_kind, summarize, write_report
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


def environment() -> dict:
    import transformers
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


# --- the run -------------------------------------------------------------------------------

def _same_run(old: dict | None, new: dict) -> bool:
    """Whether a resumed run measures what the interrupted one did. A drafter is the same by
    content: its path may differ (another checkout, a copy) when the sha256 agrees."""
    if old is None:
        return False
    if old.get("drafter_sha256") and old.get("drafter_sha256") == new.get("drafter_sha256"):
        old, new = {**old, "drafter": None}, {**new, "drafter": None}
    return old == new


def _resume(out_dir: Path, fingerprint: dict, fresh: bool) -> dict[tuple, Record]:
    """Records of an interrupted run with the same configuration, keyed by
    (suite, prompt, turn, method); a different configuration in the same folder is an error."""
    run_file, log_file = out_dir / "run.json", out_dir / "records.jsonl"
    if fresh or not log_file.exists():
        atomic_write(run_file, lambda tmp: Path(tmp).write_text(json.dumps(fingerprint, indent=1)))
        log_file.write_text("")
        return {}
    old = json.loads(run_file.read_text()) if run_file.exists() else None
    if not _same_run(old, fingerprint):
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


def _say_mismatch(rec: Record, kind: str | None, text: str) -> None:
    if kind == "failure":
        print(f"\n\033[31mLOSSLESS CHECK FAILED\033[0m: {rec.method} differs from "
              f"{'ar-loop' if rec.identical_to_ar_loop is False else 'ar'} on {rec.suite}/"
              f"{rec.prompt_id} turn {rec.turn} (first difference from ar at generated position "
              f"{rec.first_diff}); prompt: {text[:120]!r}", file=sys.stderr)
    elif kind == "kernel" and rec.method == "ar-loop":
        print(f"\nnote: bf16 ar-loop differs from ar on {rec.suite}/{rec.prompt_id} turn {rec.turn} "
              f"at position {rec.first_diff} (one-row kernel rounding; dflash is checked against "
              f"ar-loop)", file=sys.stderr)


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
    names = list(methods)
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
                rec = done.get((p.suite, p.id, turn, name))   # finished before an interruption
                if rec is None:
                    r = methods[name](target.encode_prompt(messages), max_new_tokens, sampling, stops)
                    rec = Record(p.suite, p.id, turn, name, len(r.tokens), r.prefill_s, r.decode_s,
                                 r.tokens, r.acceptance_lengths, r.slot_accepted, r.slot_drafted)
                    attach_checks(this_turn + [rec], sampling.greedy)   # against references so far
                    log.write(json.dumps(asdict(rec)) + "\n")
                    log.flush()
                    measured.append(rec)
                this_turn.append(rec)
                records.append(rec)
                history[name] = messages + [{"role": "assistant", "content": target.decode(rec.tokens)}]
                bar.update(1)
            attach_checks(this_turn, sampling.greedy)
            for rec in measured:
                _say_mismatch(rec, mismatch_kind(rec, bf16), text)
            summary = summarize(records, bf16)
            if spec is not None:
                e = summary.get(p.suite, {}).get(spec, {})
                bar.set_postfix(suite=p.suite, tau=f"{e.get('tau', 0):.2f}",
                                speedup=f"{e.get('speedup_vs_ar') or 0:.2f}x")
    bar.close()
    log.close()
    return write_report(out_dir, records, fingerprint, config, env, expected=len(records))
