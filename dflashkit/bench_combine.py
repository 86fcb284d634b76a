"""One report from several `dflashkit bench` runs, each covering its own suites.

Why: a full run (six suites, every method, 20 prompts, 256 tokens) takes most of a day on a
2-core CPU, longer than a working session or a machine lease. Split by suite, each part is
one complete run with every method interleaved prompt by prompt on one machine, so every
speedup and every paired comparison inside it stays a same-run, same-machine ratio. The
combined report only puts the parts side by side: it checks they measured the same thing
(target, drafter weights, dtype, prompts, tokens, sampling) and says, per suite, on which
machine and when it ran, because tokens/s compare across suites only on the same machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from .checkpoint import atomic_write
from .report import (details_tables, load_run_folder, lossless_verdict, markdown_table,
                     paired_tables, plot, summarize, _dtype_name)
from .sampling import SamplingConfig
from .suites import STAND_INS

# run.json keys every part must share; suites differ by design, methods may (a part may add
# methods, shown as "-" elsewhere), and the drafter's path differs between machines while its
# weights (drafter_sha256) must not
SHARED_KEYS = ("target", "drafter_sha256", "dtype", "num_prompts", "max_new_tokens", "sampling",
               "seed", "max_turns", "block_size", "fast_path")


class CombineError(ValueError):
    pass


def _load_part(folder: Path) -> dict:
    """One part, read only (its own run may still be writing there)."""
    if not (folder / "run.json").exists() or not (folder / "environment.json").exists():
        raise CombineError(f"{folder} holds no bench run (run.json or environment.json missing): "
                           f"pass folders written by `dflashkit bench --out`")
    part = load_run_folder(folder)
    bf16 = _dtype_name(part["run"]["dtype"]) != "float32"
    return {"folder": folder, "run": part["run"], "env": part["environment"],
            "records": part["records"], "expected": part["expected"],
            "summary": summarize(part["records"], bf16)}


def check_parts(parts: list[dict]) -> None:
    """Refuse parts that did not measure the same thing, naming the key and both values."""
    if not parts:
        raise CombineError("give at least one bench run folder to combine")
    first = parts[0]
    for part in parts[1:]:
        for key in SHARED_KEYS:
            a, b = first["run"].get(key), part["run"].get(key)
            if a != b:
                raise CombineError(f"{part['folder']} differs from {first['folder']} in {key}: "
                                   f"{b!r} vs {a!r}; combine only runs of the same configuration "
                                   f"(rerun that part with the same flags)")
    seen: dict[str, Path] = {}
    for part in parts:
        for suite in part["run"]["suites"]:
            if suite in seen:
                raise CombineError(f"suite {suite!r} is in both {seen[suite]} and {part['folder']}: "
                                   f"each suite must come from exactly one run")
            seen[suite] = part["folder"]


def _commit(env: dict) -> str:
    commit = str(env.get("dflashkit_commit") or "?")
    return commit[:10] + ("+changes" if commit.endswith("+changes") else "")


def _machine(env: dict) -> str:
    resumed = env.get("resumed_at") or []
    return (f"{env['cpu']}, {env['torch_threads']} threads, torch {env['torch']}, transformers "
            f"{env['transformers']}, dflashkit {_commit(env)}, started {env['time']}"
            + (f", resumed {len(resumed)} time(s) ({', '.join(resumed)})" if resumed else ""))


# what makes two parts' tokens/s comparable: the same CPU (by model name and the flags that
# choose kernels), cores and threads; keys a part did not record are not held against it
MACHINE_KEYS = ("cpu", "cpu_features", "cores", "torch_threads", "packed_min_rows")


def machine_differences(parts: list[dict]) -> list[str]:
    keys = []
    for key in MACHINE_KEYS:
        values = {json.dumps(p["env"][key]) for p in parts if key in p["env"]}
        if len(values) > 1:
            keys.append(key)
    return keys


def combine(folders: list[Path], out_dir: Path) -> dict:
    """Write summary.json, report.md and the plots for the parts in ``folders`` to ``out_dir``."""
    parts = [_load_part(Path(f)) for f in folders]
    check_parts(parts)
    if (Path(out_dir) / "run.json").exists():
        raise CombineError(f"--out {out_dir} holds a bench run (one of the parts, or another): its "
                           f"report would be overwritten; write the combined report to another folder")
    methods = list(dict.fromkeys(m for p in parts for m in p["run"]["methods"]))
    suites = [s for p in parts for s in p["run"]["suites"]]
    summary = {s: p["summary"][s] for p in parts for s in p["run"]["suites"] if s in p["summary"]}
    records = [r for p in parts for r in p["records"]]
    run = parts[0]["run"]
    sampling = SamplingConfig(**run["sampling"])
    bf16 = _dtype_name(run["dtype"]) != "float32"
    lossless, verdict = lossless_verdict(records, sampling, bf16)
    paired, paired_md = paired_tables(records, methods)
    done = sum(len(p["records"]) for p in parts)
    expected = sum(p["expected"] for p in parts)
    out_dir.mkdir(parents=True, exist_ok=True)
    rel = {p["folder"]: _relative(p["folder"], out_dir) for p in parts}
    report = {"parts": [{"folder": rel[p["folder"]], "suites": p["run"]["suites"],
                         "methods": p["run"]["methods"], "environment": p["env"],
                         "records": len(p["records"]),
                         "expected_records": p["expected"]} for p in parts],
              "config": {k: run.get(k) for k in SHARED_KEYS},
              "stand_ins": {s: STAND_INS[s] for s in suites}, "summary": summary,
              "lossless": lossless, "records": done, "expected_records": expected}
    if paired:
        report["paired"] = paired
    text = json.dumps(report, indent=2)
    atomic_write(out_dir / "summary.json", lambda tmp: Path(tmp).write_text(text))
    partial = "" if done >= expected else (
        f"**Partial: {done} of {expected} method runs measured so far**; every figure covers only "
        f"the prompts done.\n\n")
    machines = "".join(
        f"- {', '.join(p['run']['suites'])}: [{rel[p['folder']]}]({rel[p['folder']]}/report.md), "
        f"{len(p['records'])} of {p['expected']} runs; {_machine(p['env'])}\n"
        for p in parts)
    differ = machine_differences(parts)
    turns = f", first {run['max_turns']} turn(s) of each prompt only" if run.get("max_turns") else ""
    md = (f"# dflashkit bench (combined)\n\n{partial}Target `{run['target']}`, drafter weights sha256 "
          f"`{str(run.get('drafter_sha256'))[:12]}`, {run['num_prompts']} prompts per suite, max "
          f"{run['max_new_tokens']} new tokens, temperature {sampling.temperature}, seed {run['seed']}, "
          f"{_dtype_name(run['dtype'])} weights"
          f"{turns}.\n\n"
          f"Each suite was measured in one `dflashkit bench` run, every method interleaved prompt "
          f"by prompt on one machine, so each speedup is a same-run ratio. "
          + ("All parts ran on the same kind of machine." if not differ else
             f"**The parts ran on different machines** ({', '.join(differ)} differ): speedups "
             f"compare across suites, tokens/s only between suites measured on the same machine.")
          + f" Parts:\n\n{machines}\n"
          f"Cells: tau (mean tokens committed per target pass), decode tokens/s, pooled decode "
          f"speedup over `ar` (Hugging Face generate) and, in brackets, over `ar-loop` (our own "
          f"plain loop on the same execution path; without `ar`, over `ar-loop` alone). `-`: that method was not run on that suite.\n\n"
          f"{markdown_table(summary, methods)}\n{verdict}"
          + "\nStand-ins:\n" + "".join(f"- `{s}`: {STAND_INS[s]}\n" for s in suites)
          + "\n## Per suite\n\nPlots: `speedup.png`, `acceptance.png`; the records of each part are "
            "in its folder's `records.jsonl`.\n\n" + details_tables(summary, methods)
          + ("\n## Paired comparisons\n\nBootstrap over prompt-turns (4,000 resamples, seed 0); a "
             "ratio above 1 means the first method decoded faster. Each pair is one prompt-turn "
             "of one run; the `all` row pools the suites' pairs"
             + (" (measured on different machines)" if differ else "") + ".\n\n"
             + paired_md if paired else ""))
    atomic_write(out_dir / "report.md", lambda tmp: Path(tmp).write_text(md))
    plot(summary, methods, out_dir)
    return report


def _relative(folder: Path, out_dir: Path) -> str:
    try:
        return str(Path(folder).resolve().relative_to(Path(out_dir).resolve()))
    except ValueError:
        return str(Path(folder).resolve())
