"""Training data from the target itself: regenerate responses and keep their features.

The drafter must predict the TARGET's continuation, so every assistant response is produced
by the target (greedy, non-thinking, its own chat template). Target passes dominate the cost
on a CPU, so the hidden states of the drafter's layers are captured during that same
generation (one pass serves both) and stored beside the tokens:

    OUT/samples.jsonl        one record per sample: ids, prompt length, source, shard
    OUT/features/NNNNNN.safetensors   per-sample features [num_tokens - 1, K*H] (bf16)
    OUT/teacher/...          per-sample top-k of the distribution each response token was
                             picked from (teacher.py; for distillation)
    OUT/config.json          what the data is made of (target + DataConfig), written first:
                             a rerun with another config is refused, never mixed in
    OUT/meta.json            target, layer ids, counts (written when the stage completes)

Writes are resumable: a shard is written atomically BEFORE its records are appended (and
fsynced), so after any interruption a record always has its features, an orphaned shard is
simply rewritten, and a rerun continues with the prompts that have no record.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .checkpoint import atomic_write
from .prompts import interleave, without_addresses
from transformers import DynamicCache

from .shards import ShardReader, read_jsonl, repair_tail
from .target import Target
from .teacher import TeacherStore, top_logprobs


@dataclass
class DataConfig:
    out_dir: str = "runs/data"
    num_code: int = 600
    num_math: int = 300
    num_chat: int = 300
    num_docs: int = 0        # HumanEval-shaped library functions (prompts.library_code_prompts)
    num_apis: int = 0        # the same from more of the stdlib and packages (prompts.api_code_prompts)
    num_pkgs: int = 0        # the same from still more packages (prompts.package_code_prompts)
    num_meths: int = 0       # methods of those modules' classes (prompts.method_code_prompts)
    seed: int = 0
    max_prompt_tokens: int = 640
    max_new_tokens: int = 320
    batch_size: int = 8
    feature_layers: list[int] = field(default_factory=list)  # default: paper spread of 5
    store_features: bool = True
    # top-k of the target's own next-token distribution per response token, kept for
    # distillation (teacher.py); 0 keeps none
    teacher_top_k: int = 16
    # "bfloat16" regenerates on the bf16 fast path (CPUs with AMX): ~118 vs ~93 tokens/s here;
    # the text can differ from fp32 greedy decoding only where two logits tie.
    dtype: str = "float32"
    # where the target runs: auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:N.
    # Not in DATA_KEYS: like the batch size, it changes only kernel rounding where logits tie.
    device: str = "auto"
    # Samples an earlier data stage made: its data folder, its samples.jsonl, or a JSONL(.gz)
    # archive (data/). A prompt found there keeps its response; its features are copied from
    # the folder's feature store when that holds the same layers made in the same dtype, and
    # otherwise cost one forward pass over the whole sequence (~15x less target time than a
    # token-by-token generation).
    # A list of such sources imports from each (an archive and the archives that grew it).
    import_samples: str | list[str] | None = None
    # generate nothing: the mix's prompts that import_samples lacks are left out (a quick data
    # set from earlier samples, for experiments)
    import_only: bool = False
    # Samples (same kinds of source as import_samples) whose prompts this stage skips: it makes
    # only the mix's OTHER samples, e.g. to grow a committed archive by a new part without
    # recomputing what the archive already holds.
    exclude_samples: str | list[str] | None = None


# what changes the samples (out_dir does not; batch size changes only kernel rounding, where two
# logits tie, as a thread count does)
DATA_KEYS = ("num_code", "num_math", "num_chat", "num_docs", "num_apis", "num_pkgs", "num_meths", "seed", "max_prompt_tokens",
             "max_new_tokens", "feature_layers", "store_features", "teacher_top_k", "dtype",
             "import_samples", "import_only", "exclude_samples")


DATA_DEFAULTS = {"import_samples": None, "import_only": False, "exclude_samples": None, "num_apis": 0,
                 "num_pkgs": 0, "num_meths": 0}   # keys added later: folders made before lack them


class DataMismatch(ValueError):
    """The data folder holds samples made with another configuration."""


def data_fingerprint(target_name: str, cfg: DataConfig) -> dict:
    from .fastpath import DTYPES
    out = {"target": str(target_name), **{k: getattr(cfg, k) for k in DATA_KEYS}}
    out["dtype"] = str(DTYPES.get(out["dtype"], out["dtype"])).removeprefix("torch.")  # bf16 = bfloat16
    return out


def check_data_config(out_dir: str | Path, target_name: str, cfg: DataConfig) -> None:
    """Refuse to reuse or extend data made with another configuration (a silent mix of two
    recipes, or a stale stage skipped as "complete"). Folders from before config.json was
    written are checked against meta.json's copy when the stage completed."""
    out = Path(out_dir)
    old = None
    if (out / "config.json").exists():
        old = json.loads((out / "config.json").read_text())
    elif (out / "meta.json").exists():
        meta = json.loads((out / "meta.json").read_text())
        old = {"target": meta.get("target"), **(meta.get("config") or {})}
    if old is None:
        if read_samples(out):
            raise DataMismatch(f"{out} holds samples but no record of the configuration that made "
                               f"them (a run from before dflashkit wrote config.json): delete {out} "
                               f"to regenerate, or point run_dir at a new folder")
        return
    new = data_fingerprint(target_name, cfg)
    if "dtype" in old:
        old = {**old, "dtype": data_fingerprint(target_name, DataConfig(dtype=old["dtype"]))["dtype"]}
    diffs = [f"{k}: {old.get(k, DATA_DEFAULTS.get(k))!r} there, {v!r} in this config"
             for k, v in new.items() if (k in old or k in DATA_DEFAULTS)
             and old.get(k, DATA_DEFAULTS.get(k)) != v and not (k == "feature_layers" and not v)]
    if diffs:
        raise DataMismatch(f"{out} holds data made with another configuration ({'; '.join(diffs)}). "
                           f"Point run_dir at a new folder, restore those settings, or (only if no "
                           f"other run trains on it) delete {out} to regenerate it with this config")


def read_samples(out_dir: str | Path) -> list[dict]:
    """Complete records of samples.jsonl (a torn last line from a crash is ignored)."""
    return read_jsonl(Path(out_dir) / "samples.jsonl")


class FeatureStore(ShardReader):
    """Per-sample features from the data stage's shards (few open at a time, shards.py)."""

    def __init__(self, out_dir: str | Path, max_open: int = 8):
        super().__init__(Path(out_dir) / "features", max_open)

    def get(self, record: dict) -> torch.Tensor:
        return self.tensor(record["shard"], record["id"])


@torch.inference_mode()
def _generate_batch(target: Target, prompts: list[list[int]], cfg: DataConfig, stops: list[int]):
    """Left-padded batched greedy generation; returns per row (response ids, features,
    teacher top-k (ids, log-probs) or None).

    Rows leave the batch as soon as they finish (a stop id or ``max_new_tokens``): their
    cache rows are dropped, so the target never computes tokens nobody will keep. The
    features of every token fed to the target, and the distribution each response token was
    picked from, are kept from the same pass.
    """
    pad, device = target.pad_token_id() or 0, target.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    layers = cfg.feature_layers if cfg.store_features else []
    responses: list[list[int]] = [[] for _ in prompts]
    feats: list[list[torch.Tensor]] = [[] for _ in prompts]
    dists: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    alive = list(range(len(prompts)))      # batch row k holds prompt alive[k]
    cache = DynamicCache(config=target.config)
    inputs = ids
    with target.capturing(layers) as store:
        while alive:
            out = target.model(input_ids=inputs, attention_mask=mask, position_ids=positions,
                               cache=cache, use_cache=True, logits_to_keep=1)
            next_ids = out.logits[:, -1].argmax(-1).tolist()
            if cfg.teacher_top_k:
                top_ids, top_logp = top_logprobs(out.logits[:, -1], cfg.teacher_top_k)
                for k, i in enumerate(alive):
                    dists[i].append((top_ids[k], top_logp[k]))
            if layers:
                step = torch.cat([store[j].pop() for j in layers], dim=-1)
                for k, i in enumerate(alive):
                    row = step[k] if inputs.shape[1] == 1 else step[k, width - len(prompts[i]):]
                    feats[i].append(row.to(torch.bfloat16))
            keep = []
            for k, i in enumerate(alive):
                responses[i].append(next_ids[k])
                if next_ids[k] not in stops and len(responses[i]) < cfg.max_new_tokens:
                    keep.append(k)
            if len(keep) < len(alive):
                if not keep:
                    break
                rows = torch.tensor(keep, device=device)
                cache.batch_select_indices(rows)
                mask, positions = mask[rows], positions[rows]
                alive = [alive[k] for k in keep]
            inputs = torch.tensor([[responses[i][-1]] for i in alive], device=device)
            mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
    rows = []
    for i, p in enumerate(prompts):
        # features of tokens 0 .. n-2: every token except the last one was fed to the target;
        # stored from the CPU whatever device made them
        f = torch.cat(feats[i], dim=0).cpu() if layers else None
        if f is not None and f.shape[0] != len(p) + len(responses[i]) - 1:
            raise AssertionError("feature rows out of step with the tokens")
        teacher = None
        if cfg.teacher_top_k:
            teacher = (torch.stack([d[0] for d in dists[i]]).cpu(), torch.stack([d[1] for d in dists[i]]).cpu())
        rows.append((responses[i], f, teacher))
    return rows


@torch.inference_mode()
def _replay_batch(target: Target, samples: list[tuple[list[int], list[int], dict]], cfg: DataConfig):
    """Features (and teacher top-k) of samples whose response already exists: copied from the
    record's ``store`` (its imported folder's features, when reusable) when there are no teacher
    distributions to make, else one forward pass over each whole sequence (stopping after the
    deepest feature layer when no logits are wanted); rows as ``_generate_batch``."""
    layers = cfg.feature_layers if cfg.store_features else []
    rows = []
    for prompt, response, old in samples:
        store = old.get("store")
        if store is not None and old.get("shard") and not cfg.teacher_top_k:
            f = store.get(old)[:len(prompt) + len(response) - 1].clone()
            rows.append((response, f, None))
            continue
        if not layers and not cfg.teacher_top_k:   # nothing to compute: features come online
            rows.append((response, None, None))
            continue
        ids = torch.tensor([prompt + response], device=target.device)
        if not cfg.teacher_top_k:   # features alone: the pass can stop after the deepest layer
            f = target.features(ids[:, :-1], layers)[0].to("cpu", torch.bfloat16, copy=True)
            rows.append((response, f, None))
            continue
        out = target.forward(ids[:, :-1], 0, None, capture=layers)
        f = out.features[0].to("cpu", torch.bfloat16, copy=True) if layers else None
        # response token i was picked from the logits at len(prompt)-1+i
        teacher = tuple(t.cpu() for t in top_logprobs(out.logits[0, len(prompt) - 1:], cfg.teacher_top_k))
        rows.append((response, f, teacher))
    return rows


def sources(value: str | list[str] | None) -> list[str]:
    """``data.import_samples`` / ``data.exclude_samples`` as a list (one path, several, none)."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def read_import(path: str | Path) -> dict[str, dict]:
    """Samples by id from an earlier data stage: its folder, its JSONL, or a gzipped copy."""
    import gzip
    path = Path(path)
    if path.is_dir():
        path = path / "samples.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"data.import_samples / exclude_samples: {path} does not exist (the data folder of "
                                f"an earlier data stage, its samples.jsonl, or a .gz archive)")
    opener = gzip.open if path.suffix == ".gz" else open
    out = {}
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out[rec["id"]] = {"input_ids": list(rec["input_ids"]), "prompt_len": int(rec["prompt_len"]),
                                  "id": rec["id"], "shard": rec.get("shard")}
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {n}: not a sample record with id, input_ids and "
                                 f"prompt_len ({e})") from None
    return out


def differs_only_in_addresses(target: Target, old_ids: list[int], new_ids: list[int]) -> bool:
    """Whether two prompt encodings differ only by memory addresses in the text (``<function
    f at 0x7f...>``): prompts built before addresses were stripped. Such a sample is stale, not
    a sign of another template, and is regenerated rather than imported."""
    if target.tokenizer is None:
        return False
    decode = target.tokenizer.decode
    old_text, new_text = decode(old_ids), decode(new_ids)
    return old_text != new_text and without_addresses(old_text) == without_addresses(new_text)


def reusable_features(path: str | Path, target_name: str, cfg: DataConfig) -> FeatureStore | None:
    """The feature store of an imported data folder when its features are the ones this
    stage would compute (same target, layers and dtype); None otherwise."""
    path = Path(path)
    if not cfg.store_features or not (path / "config.json").exists():
        return None
    theirs = json.loads((path / "config.json").read_text())
    mine = data_fingerprint(target_name, cfg)
    theirs_dtype = data_fingerprint(target_name, DataConfig(dtype=theirs.get("dtype", "float32")))["dtype"]
    same = (theirs.get("target") == mine["target"] and theirs.get("store_features")
            and list(theirs.get("feature_layers") or []) == list(cfg.feature_layers)
            and theirs_dtype == mine["dtype"])
    return FeatureStore(path) if same else None


def _by_source_in_proportion(todo: list[tuple[dict, list[int]]]) -> list[tuple[dict, list[int]]]:
    """The prompts left to generate, re-interleaved by source (``reasoning-gym:gcd`` counts as
    ``reasoning-gym``). The mix is proportional over ALL its prompts, but what is left is not:
    when an archive (import or exclude) already holds the first part of one pool, that pool's
    new prompts would all come last, and a stage stopped early would lack them entirely."""
    groups: dict[str, list] = {}
    for item in todo:
        groups.setdefault(item[0]["source"].split(":")[0], []).append(item)
    return interleave(groups)


def regenerate(target: Target, prompts: list[dict], cfg: DataConfig, progress: bool = True) -> Path:
    """Run (or resume) the data stage; returns the output folder."""
    out = Path(cfg.out_dir)
    check_data_config(out, target.name, cfg)
    (out / "features").mkdir(parents=True, exist_ok=True)
    if not (out / "config.json").exists():
        text = json.dumps(data_fingerprint(target.name, cfg), indent=2)
        atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(text))
    samples_path = out / "samples.jsonl"
    repair_tail(samples_path)
    done = read_samples(out)
    done_ids = {r["id"] for r in done}
    shard_index = 1 + max((int(r["shard"].split(".")[0]) for r in done if r.get("shard")), default=-1)
    stops = target.stop_token_ids()
    if cfg.import_only and not cfg.import_samples:
        raise ValueError("data.import_only needs data.import_samples (the samples to keep)")
    imported = {}
    for source in sources(cfg.import_samples):
        store = reusable_features(source, target.name, cfg)
        for sid, rec in read_import(source).items():
            imported.setdefault(sid, {**rec, "store": store})
    excluded = {sid for source in sources(cfg.exclude_samples) for sid in read_import(source)}
    todo, replay, stale = [], [], []
    for p in prompts:
        if p["id"] in done_ids or p["id"] in excluded:
            continue
        ids = p.get("input_ids") or target.encode_prompt(p["messages"])
        if len(ids) > cfg.max_prompt_tokens:
            continue
        old = imported.get(p["id"])
        if old is None:
            if not cfg.import_only:
                todo.append((p, ids))
            continue
        old_prompt = old["input_ids"][:old["prompt_len"]]
        if old_prompt != ids:
            if not differs_only_in_addresses(target, old_prompt, ids):
                raise DataMismatch(f"{cfg.import_samples}: sample {p['id']!r} was made from another "
                                   f"prompt encoding than this target's chat template gives now; "
                                   f"import only samples made for this target and template")
            del imported[p["id"]]           # not marked "imported" when regenerated
            stale.append(p["id"])
            if not cfg.import_only:
                todo.append((p, ids))
            continue
        replay.append((p, ids, old["input_ids"][len(ids):][:cfg.max_new_tokens], old))
    todo = _by_source_in_proportion(todo)
    if stale:
        print(f"data: {len(stale)} imported samples were made from a prompt that showed a memory "
              f"address (e.g. {stale[0]}); they are {'left out' if cfg.import_only else 'regenerated'}",
              file=sys.stderr)
    bar = tqdm(total=len(todo) + len(replay), disable=not progress, desc="regenerate", unit="sample")
    teachers = TeacherStore(out)

    def write(batch: list[tuple[dict, list[int]]], rows) -> None:
        """Shard first, then teacher, then the records (fsynced): a record always has both."""
        nonlocal shard_index
        shard = f"{shard_index:06d}.safetensors"
        if cfg.store_features:
            tensors = {p["id"]: f for (p, _), (_, f, _) in zip(batch, rows)}
            atomic_write(out / "features" / shard, lambda tmp: save_file(tensors, tmp))
        if cfg.teacher_top_k:
            teachers.write({p["id"]: t for (p, _), (_, _, t) in zip(batch, rows)})
        for (p, ids), (resp, _, _) in zip(batch, rows):
            rec = {"id": p["id"], "source": p["source"], "kind": p["kind"],
                   "input_ids": ids + resp, "prompt_len": len(ids),
                   "finished": bool(resp) and resp[-1] in stops,
                   "shard": shard if cfg.store_features else None}
            if p["id"] in imported:
                rec["imported"] = True
            log.write(json.dumps(rec) + "\n")
        log.flush()
        os.fsync(log.fileno())
        shard_index += 1
        bar.update(len(batch))

    with samples_path.open("a") as log:
        for b in range(0, len(replay), cfg.batch_size):
            batch = replay[b:b + cfg.batch_size]
            rows = _replay_batch(target, [(ids, resp, old) for _, ids, resp, old in batch], cfg)
            write([(p, ids) for p, ids, _, _ in batch], rows)
        # the rate counts generated responses only, from when generation starts: an imported
        # response costs no decoding (counted, it made the rate read millions of tok/s)
        tokens, t0 = 0, time.perf_counter()
        window = cfg.batch_size * 4  # sort a small window by length: less padding, same mix
        with target.batched_attention():
            for w in range(0, len(todo), window):
                chunk = sorted(todo[w:w + window], key=lambda x: len(x[1]))
                for b in range(0, len(chunk), cfg.batch_size):
                    batch = chunk[b:b + cfg.batch_size]
                    rows = _generate_batch(target, [ids for _, ids in batch], cfg, stops)
                    write(batch, rows)
                    tokens += sum(len(resp) for resp, _, _ in rows)
                    bar.set_postfix(gen_tok_s=f"{tokens / (time.perf_counter() - t0):.1f}")
    bar.close()
    records = read_samples(out)
    meta = {"target": target.name, "feature_layers": cfg.feature_layers,
            "hidden_size": target.hidden_size, "num_samples": len(records),
            "num_tokens": sum(len(r["input_ids"]) for r in records),
            "config": asdict(cfg), "store_features": cfg.store_features,
            "teacher_top_k": cfg.teacher_top_k,
            "num_imported": sum(bool(r.get("imported")) for r in records)}
    if cfg.store_features:
        size = sum(f.stat().st_size for f in (out / "features").glob("*.safetensors"))
        meta["feature_bytes"] = size
        meta["feature_bytes_per_token"] = size / max(1, meta["num_tokens"])
    atomic_write(out / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
    return out
