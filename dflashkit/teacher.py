"""The target's own next-token distributions over each response, for distillation.

The regenerated response is the target's greedy text, so its hard labels are the argmax of
these distributions; the rest of each distribution (which tokens came close, by how much) is
information a drafter trained on a few thousand samples otherwise never sees. Only the top k
log-probabilities per token are kept (k = 16: 96 bytes per token against ~9 KB of features).

They are captured during regeneration at no extra cost (the target computes those logits to
pick each token anyway; ``regenerate.py``), or backfilled for data made without them by one
forward pass per sample (``backfill``). Layout, beside the features:

    DATA/teacher/NNNNNN.safetensors   per sample: "<id>.ids" [n, k] int32, "<id>.logp" [n, k] fp16
    DATA/teacher/index.jsonl          one {"id", "shard"} line per sample, appended after its shard

Row i of a sample is the distribution of response token i (the token at position
``prompt_len + i``). A shard is written atomically before its index lines, so an index line
always has its tensors, and an interrupted backfill continues with the samples it lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .checkpoint import atomic_write
from .shards import ShardReader, read_jsonl, repair_tail


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [n, V] -> the k most likely ids [n, k] (int32) and their log-probs (fp16)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


class TeacherStore:
    """Append and read per-sample top-k distributions (a few shards open at a time)."""

    def __init__(self, data_dir: str | Path, max_open: int = 8):
        self.dir = Path(data_dir) / "teacher"
        self.index_path = self.dir / "index.jsonl"
        self.shards = ShardReader(self.dir, max_open)
        self._index: dict[str, str] | None = None

    def index(self) -> dict[str, str]:
        """sample id -> shard."""
        if self._index is None:
            self._index = {e["id"]: e["shard"] for e in read_jsonl(self.index_path)}
        return self._index

    def write(self, rows: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One shard for ``rows`` (sample id -> (ids, logp)), then its index lines."""
        if not rows:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        index = self.index()
        shard = f"{1 + max((int(s.split('.')[0]) for s in index.values()), default=-1):06d}.safetensors"
        tensors = {}
        for sid, (ids, logp) in rows.items():
            tensors[f"{sid}.ids"] = ids.to(torch.int32).contiguous()
            tensors[f"{sid}.logp"] = logp.to(torch.float16).contiguous()
        atomic_write(self.dir / shard, lambda tmp: save_file(tensors, tmp))
        repair_tail(self.index_path)
        with self.index_path.open("a") as f:
            for sid in rows:
                f.write(json.dumps({"id": sid, "shard": shard}) + "\n")
                index[sid] = shard
            f.flush()
            os.fsync(f.fileno())

    def get(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.index().get(sample_id)
        if shard is None:
            raise KeyError(f"no teacher distributions for sample {sample_id!r} in {self.dir}")
        return self.shards.tensor(shard, f"{sample_id}.ids"), self.shards.tensor(shard, f"{sample_id}.logp")

    def missing(self, records: list[dict]) -> list[dict]:
        index = self.index()
        return [r for r in records if r["id"] not in index]


@torch.inference_mode()
def response_logprobs(target, record: dict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs of every response token of ``record`` from one forward pass: the logits
    at position p predict the token at p + 1, so the response needs the last n + 1 positions
    but one."""
    ids = record["input_ids"]
    n = len(ids) - record["prompt_len"]
    out = target.model(input_ids=torch.tensor([ids], device=target.device), use_cache=False,
                       logits_to_keep=n + 1)
    return tuple(t.cpu() for t in top_logprobs(out.logits[0, :n], k))


def backfill(target, data_dir: str | Path, records: list[dict], k: int, per_shard: int = 32,
             progress: bool = True) -> int:
    """Compute the distributions of the samples that have none yet; returns how many."""
    store = TeacherStore(data_dir)
    todo = store.missing(records)
    bar = tqdm(total=len(todo), disable=not progress, desc="teacher", unit="sample")
    for start in range(0, len(todo), per_shard):
        chunk = todo[start:start + per_shard]
        store.write({r["id"]: response_logprobs(target, r, k) for r in chunk})
        bar.update(len(chunk))
    bar.close()
    return len(todo)


def sequence_distributions(store: TeacherStore, record: dict,
                           length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of the (truncated) sequence: teacher ids [length, k] (-1 where none: the
    prompt) and log-probs [length, k] (float32)."""
    ids, logp = store.get(record["id"])
    n = len(record["input_ids"]) - record["prompt_len"]
    if ids.shape[0] != n:
        raise ValueError(f"teacher distributions of sample {record['id']!r} cover {ids.shape[0]} "
                         f"tokens, its response has {n}: the data changed after they were made; "
                         f"delete {store.dir} and rerun the teacher stage")
    k = ids.shape[1]
    out_ids = torch.full((length, k), -1, dtype=torch.long)
    out_logp = torch.full((length, k), float("-inf"))
    start = record["prompt_len"]
    rows = max(0, min(n, length - start))
    out_ids[start:start + rows] = ids[:rows].long()
    out_logp[start:start + rows] = logp[:rows].float()
    return out_ids, out_logp
