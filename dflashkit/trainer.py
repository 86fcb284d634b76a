"""Train a DFlash drafter on regenerated data: single process or ``torchrun`` (data parallel).

Determinism is by construction, so interrupted runs resume to the same weights and N
processes match one: the sequences of optimizer step s are a seeded permutation slice, each
sequence's anchors come from a generator seeded by (seed, step, index), and the loss of every
part of a global batch is divided by the weight sum of the WHOLE global batch (computed
identically on every rank from token ids alone). Gradients are summed across ranks with one
all-reduce per parameter group; rank 0 writes checkpoints (atomically) and logs.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from .checkpoint import atomic_write, save_drafter
from .drafter import DFlashDrafter, config_for_target, init_drafter, warm_start_from_target
from .fastpath import DTYPES
from .objective import (Blocks, anchor_candidates, build_blocks, default_gamma, dflash_loss,
                        expected_acceptance_length, sample_anchors, vocabulary_index)
from .regenerate import FeatureStore, read_samples
from .tfeval import greedy_walk

# memory for held-out features kept across evaluations in online mode (24 sequences of 1024
# tokens x 5 layers x 896 in bf16 are 220 MB)
HELDOUT_FEATURE_BYTES = 1 << 30


@dataclass
class DrafterSpec:
    num_layers: int = 1
    block_size: int = 8
    intermediate_size: int | None = None
    target_layer_ids: list[int] | None = None   # default: every layer stored in the data
    mask_token_id: int | None = None
    # "random" (seeded normal init); "target": start from the target's layers above the
    # highest feature layer (drafter.warm_start_from_target says what is copied and why); or the
    # folder of a trained drafter to grow: its layers first, extra layers starting as the
    # identity (drafter.warm_start_from_drafter)
    init: str = "random"


@dataclass
class TrainConfig:
    epochs: float = 4.0
    global_batch: int = 8            # sequences per optimizer step (all ranks together)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    num_anchors: int = 64
    gamma: float | None = None       # default from the block size (7 for 16, 4 for 8)
    max_length: int = 1024
    seed: int = 0
    # start the seeded sample order this many optimizer steps in: a run that continues an
    # earlier one (drafter.init = its drafter, same data and seed) trains on the samples that
    # run did not reach instead of repeating its first ones
    data_offset_steps: int = 0
    draft_vocab: str = "data"        # "data": score only tokens seen in training; "full"
    heldout: int = 24                # held-out regenerated sequences for the acceptance estimate
    heldout_anchors: int = 32
    # the greedy-walk estimate (tfeval.py) scores a block at every one of the first
    # heldout_walk_tokens answer positions of each held-out sequence; 0 turns it off
    heldout_walk_tokens: int = 256
    eval_every: int = 50
    save_every: int = 20
    logits_chunk: int = 1024
    features: str = "stored"         # "stored" (from the data stage) or "online" (target forward)
    # the target's dtype for online features: None = the data stage's data.dtype (what stored
    # features would have been made in); "bfloat16" is ~3x faster on CPUs with AMX
    target_dtype: str | None = None
    attention: str = "auto"          # "sdpa" (dense mask), "flex" (BlockMask, CUDA only); auto: sdpa
    # "auto": cuda (cuda:LOCAL_RANK under torchrun, NCCL) when torch sees a GPU, else the CPU
    # (gloo); "cpu"; "cuda". Data and features stay on the CPU side and move per sequence.
    device: str = "auto"
    threads: int | None = None
    max_steps: int | None = None     # stop early (tests); the schedule still spans all steps
    # "bfloat16": forward and backward under bf16 autocast (master weights and AdamW stay fp32);
    # on CPUs with AMX the matmuls run several times faster. "float32": plain fp32.
    autocast: str = "float32"
    # Weight of the cross-entropy against the target's own distributions (teacher.py) in each
    # slot's loss; 0 is the plain DFlash objective. Needs the teacher stage's output.
    distill: float = 0.0
    # the LM-head cross-entropy through torch.compile (objective.compiled_ce_chunk): on a CPU
    # about 1.5x faster for that part, the largest of a step; needs a C++ compiler. An
    # execution choice like device: a run may resume with it switched.
    compile_loss: bool = False


# The part of a drafter's model card that export rewrites (measured results added by hand
# around it are kept).
CARD_START, CARD_END = "<!-- dflashkit train: generated -->", "<!-- /dflashkit train: generated -->"


def _cxx_compiler() -> str | None:
    import shutil
    return next((c for c in (os.environ.get("CXX"), "g++", "c++") if c and shutil.which(c)), None)


# --- distributed ---------------------------------------------------------------------------

def resolve_device(name: str) -> torch.device:
    """The training device: one GPU per process (``cuda:LOCAL_RANK`` under torchrun) or the CPU."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device must be auto, cpu or cuda, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("train.device: cuda, but torch sees no GPU (a CPU build of torch, or no "
                         "driver); use train.device: cpu or auto")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s): start at "
                         f"most one process per GPU (torchrun --nproc_per_node)")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def under_torchrun() -> bool:
    """torchrun (or any env:// launcher) set this process's rank and rendezvous; a group of
    one counts, so the all-reduce path runs on a one-GPU machine too."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > 1 or ("MASTER_ADDR" in os.environ and "RANK" in os.environ)


def init_distributed(device: torch.device | None = None) -> tuple[int, int]:
    """The process group of a torchrun job: NCCL when the trainer's tensors live on GPUs
    (NCCL reduces device memory only), gloo when they live on the CPU."""
    if under_torchrun() and not dist.is_initialized():
        if device is not None and device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier():
    if dist.is_initialized():
        dist.barrier()


# --- data ----------------------------------------------------------------------------------

def _is_heldout(record_id: str, n_percent_bucket: int = 1000) -> int:
    return int(hashlib.sha1(record_id.encode()).hexdigest(), 16) % n_percent_bucket


def split_records(records: list[dict], heldout: int) -> tuple[list[dict], list[dict]]:
    """Deterministic held-out set: the ``heldout`` records with the smallest id hash."""
    ranked = sorted(records, key=lambda r: (_is_heldout(r["id"]), r["id"]))
    held = {r["id"] for r in ranked[:heldout]}
    return [r for r in records if r["id"] not in held], [r for r in records if r["id"] in held]


def draft_vocabulary(records: list[dict], vocab_size: int) -> torch.Tensor:
    """Sorted token ids that occur in the training responses (what the drafter may propose).

    Scoring only these rows of the 152k-row LM head is the drafter's main CPU saving; the
    target still verifies over its full vocabulary, so decoding stays lossless.
    """
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for r in records:
        seen[torch.tensor(r["input_ids"][r["prompt_len"]:], dtype=torch.long)] = True
    return torch.nonzero(seen).flatten()


def _sequence(record: dict, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(record["input_ids"][:max_length], dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    loss_mask[record["prompt_len"]:] = 1
    return ids, loss_mask


def _seeded(*parts) -> torch.Generator:
    h = int(hashlib.sha1(repr(parts).encode()).hexdigest()[:15], 16)
    return torch.Generator().manual_seed(h)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine to 0."""
    warm = max(1, math.ceil(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def data_meta(data_dirs: list[Path]) -> dict:
    """The data stages' meta.json (the first's), after checking that the folders can train one
    drafter together: every stage complete, the same target, the same stored layers."""
    metas = []
    for d in data_dirs:
        if not (d / "meta.json").exists():
            raise FileNotFoundError(f"{d}: the data stage is not complete (no meta.json); "
                                    f"run `dflashkit train --config ... --stages data` first")
        metas.append(json.loads((d / "meta.json").read_text()))
    for d, meta in zip(data_dirs[1:], metas[1:]):
        for key in ("target", "feature_layers", "hidden_size", "store_features"):
            if meta.get(key) != metas[0].get(key):
                raise ValueError(f"data_dir: {d} and {data_dirs[0]} differ in {key} ({meta.get(key)!r} "
                                 f"vs {metas[0].get(key)!r}); folders trained together need the same "
                                 f"target and stored feature layers")
    return metas[0]


def read_training_records(data_dirs: list[Path]) -> list[dict]:
    """Every folder's samples, each marked with the folder that holds its features. A sample id
    in two folders (the same prompt regenerated twice) trains once, from the first folder."""
    records, seen, repeats = [], set(), 0
    for d in data_dirs:
        for r in read_samples(d):
            if r["id"] in seen:
                repeats += 1
                continue
            seen.add(r["id"])
            records.append({**r, "data_dir": str(d)})
    if repeats:
        print(f"data: {repeats} samples appear in more than one data_dir folder; each trains once, "
              f"from the first folder that holds it", file=sys.stderr)
    return records


# --- the trainer ---------------------------------------------------------------------------

@dataclass
class TrainState:
    step: int = 0
    elapsed_s: float = 0.0    # optimizer steps only
    eval_s: float = 0.0       # held-out evaluations, kept apart so throughput stays comparable
    history: list = field(default_factory=list)


class Trainer:
    def __init__(self, target_name: str, data_dir: str | Path, out_dir: str | Path,
                 drafter_spec: DrafterSpec, cfg: TrainConfig, progress: bool = True):
        from .target import load_target, load_target_head
        self.device = resolve_device(cfg.device)
        self.rank, self.world = init_distributed(self.device)
        if cfg.global_batch % self.world:
            # each sequence runs its own forward/backward (gradients accumulate over them), so a
            # step needs the same number of sequences on every process
            raise ValueError(f"global_batch ({cfg.global_batch}) must be a multiple of the number "
                             f"of processes ({self.world})")
        if cfg.data_offset_steps < 0:
            raise ValueError(f"train.data_offset_steps must be 0 or more, got {cfg.data_offset_steps}")
        if cfg.features not in ("stored", "online"):
            raise ValueError(f"train.features must be 'stored' or 'online', got {cfg.features!r}")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"train.attention must be auto, sdpa or flex, got {cfg.attention!r}")
        # auto is the dense mask + SDPA everywhere (one path, tested on both); flex attention
        # has no backward pass on the CPU in this torch, so it is for CUDA only
        self.attention = "sdpa" if cfg.attention == "auto" else cfg.attention
        if self.attention == "flex" and self.device.type != "cuda":
            raise ValueError("train.attention: flex has no backward pass on the CPU in this torch; "
                             "use sdpa (or auto), or train on a GPU (train.device: cuda)")
        self.cfg, self.spec, self.progress = cfg, drafter_spec, progress and self.rank == 0
        self.data_dirs = [Path(d) for d in (data_dir if isinstance(data_dir, (list, tuple)) else [data_dir])]
        self.data_dir, self.out_dir = self.data_dirs[0], Path(out_dir)
        self.meta = data_meta(self.data_dirs)
        self.feature_layers = list(self.meta["feature_layers"])
        layer_ids = drafter_spec.target_layer_ids or self.feature_layers
        missing = [j for j in layer_ids if j not in self.feature_layers]
        if missing and cfg.features == "stored":
            raise ValueError(f"drafter target_layer_ids {missing} are not in the stored features "
                             f"{self.feature_layers}; pick from those or use train.features: online")
        self.columns = [self.feature_layers.index(j) for j in layer_ids] if cfg.features == "stored" else None
        # online: the dtype the data stage would have stored features in, unless told otherwise
        target_dtype = cfg.target_dtype or self.meta.get("config", {}).get("dtype", "float32")
        if cfg.features == "online" and target_dtype not in DTYPES:
            raise ValueError(f"train.target_dtype must be 'float32' or 'bfloat16', got {target_dtype!r}")
        # the embedding and LM head the drafter borrows stay fp32 whatever runs the target
        self.head = load_target_head(target_name)
        self.embed, head_weight = self.head.embed, self.head.head_weight
        if cfg.features == "online":
            # straight onto the device: a CPU target's packed fast-path weights cannot move
            self.target = load_target(target_name, dtype=target_dtype, progress=False, device=self.device)
        else:
            self.stores = {str(d): FeatureStore(d) for d in self.data_dirs}
        records = [r for r in read_training_records(self.data_dirs) if len(r["input_ids"]) - r["prompt_len"] >= 2]
        self.train_records, self.heldout_records = split_records(records, cfg.heldout)
        self._heldout_features: dict[str, torch.Tensor] = {}   # online: each computed once per run
        if not self.train_records:
            raise ValueError(f"{', '.join(map(str, self.data_dirs))}: no usable training samples")
        dcfg = config_for_target(self.head, num_layers=drafter_spec.num_layers,
                                 block_size=drafter_spec.block_size, target_layer_ids=layer_ids,
                                 mask_token_id=drafter_spec.mask_token_id,
                                 intermediate_size=drafter_spec.intermediate_size)
        self.drafter: DFlashDrafter = init_drafter(dcfg, seed=cfg.seed).train()
        self.init_source_layers: int | None = None   # depth of a drafter.init FOLDER (model card)
        init_vocab = None                            # that folder's proposal vocabulary, if any
        if drafter_spec.init == "target":
            from .target import read_target_tensors
            warm_start_from_target(self.drafter, lambda names: read_target_tensors(target_name, names))
        elif drafter_spec.init != "random":
            source = Path(drafter_spec.init)
            if not (source / "config.json").exists():
                raise ValueError(f"drafter.init must be 'random', 'target' or the folder of a trained "
                                 f"drafter (with config.json), got {drafter_spec.init!r}")
            from .checkpoint import load_drafter
            from .drafter import warm_start_from_drafter
            source_drafter = load_drafter(source)
            warm_start_from_drafter(self.drafter, source_drafter)
            self.init_source_layers = source_drafter.config.num_hidden_layers
            init_vocab = source_drafter.draft_vocab
        self.gamma = cfg.gamma or default_gamma(dcfg.block_size)
        vocab = self.head.num_embeddings
        if cfg.draft_vocab == "data":
            self.vocab = draft_vocabulary(self.train_records, vocab)
            if init_vocab is not None:   # continuing on new data never takes tokens away from it
                self.vocab = torch.unique(torch.cat([self.vocab, init_vocab]))
        elif cfg.draft_vocab == "full":
            self.vocab = torch.arange(vocab)
        else:
            raise ValueError(f"train.draft_vocab must be 'data' or 'full', got {cfg.draft_vocab!r}")
        if not 0.0 <= cfg.distill <= 1.0:
            raise ValueError(f"train.distill must be between 0 and 1, got {cfg.distill!r}")
        self.teacher = None
        if cfg.distill > 0:
            from .teacher import TeacherStore
            self.teacher = {str(d): TeacherStore(d) for d in self.data_dirs}
            missing = [m for d, store in self.teacher.items()
                       for m in store.missing([r for r in records if r["data_dir"] == d])]
            if missing:
                raise ValueError(f"train.distill needs the target's distributions for every sample; "
                                 f"{len(missing)} of {len(records)} in {', '.join(map(str, self.data_dirs))} "
                                 f"have none: run "
                                 f"`dflashkit train --config ... --stages teacher` (one forward pass "
                                 f"per sample), or set train.distill: 0")
        if cfg.compile_loss and self.device.type == "cpu" and not _cxx_compiler():
            raise ValueError("train.compile_loss: torch.compile needs a C++ compiler on the CPU and "
                             "none was found (g++, c++ or $CXX); install one, or set "
                             "train.compile_loss: false")
        if cfg.autocast not in ("float32", "bfloat16"):
            raise ValueError(f"train.autocast must be 'float32' or 'bfloat16', got {cfg.autocast!r}")
        # everything a step touches lives on the device; records and stored features stay on
        # the CPU and move one sequence at a time
        self.drafter.to(self.device)
        self.head.embedding.to(self.device)
        self.vocab_index = vocabulary_index(self.vocab, vocab).to(self.device)
        self.head_rows = head_weight[self.vocab].contiguous().to(self.device)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay, eps=1e-8)
        self.steps_per_epoch = max(1, len(self.train_records) // cfg.global_batch)
        self.total_steps = max(1, int(round(cfg.epochs * self.steps_per_epoch)))
        self.state = TrainState()
        self.ckpt_path = self.out_dir / "last.pt"
        self.log_path = self.out_dir / "log.csv"

    # --- batches -------------------------------------------------------------------------
    def step_records(self, step: int) -> list[dict]:
        epoch, k = divmod(step + self.cfg.data_offset_steps, self.steps_per_epoch)
        perm = torch.randperm(len(self.train_records), generator=_seeded(self.cfg.seed, "epoch", epoch))
        G = self.cfg.global_batch
        return [self.train_records[i] for i in perm[k * G:(k + 1) * G].tolist()]

    def _blocks(self, record: dict, anchors: torch.Tensor) -> tuple[torch.Tensor, Blocks]:
        ids, lm = _sequence(record, self.cfg.max_length)
        blocks = build_blocks(ids[None], lm[None], [anchors], self.drafter.block_size,
                              self.drafter.mask_token_id, self.gamma)
        if self.teacher is not None:   # the target's distribution at every label position
            from .teacher import sequence_distributions
            t_ids, t_logp = sequence_distributions(self.teacher[record["data_dir"]], record, ids.numel())
            at = blocks.positions[0].clamp(max=ids.numel() - 1)
            blocks.teacher_ids, blocks.teacher_logp = t_ids[at][None], t_logp[at][None]
        return ids, blocks.to(self.device)

    def _weights_in_vocab(self, blocks: Blocks) -> float:
        return float((blocks.weights * (self.vocab_index[blocks.labels] >= 0)).sum())

    def _features(self, record: dict, ids: torch.Tensor) -> torch.Tensor:
        L = ids.numel()
        if self.cfg.features == "online":
            # out of inference mode: autograd may save it
            return self._target_features(ids).to(torch.float32, copy=True)
        f = self.stores[record["data_dir"]].get(record)
        H = self.head.hidden_size
        f = torch.cat([f[:, c * H:(c + 1) * H] for c in self.columns], dim=-1)
        if f.shape[0] < L:   # the final token never has features (it is never a context token)
            f = torch.cat([f, f.new_zeros(L - f.shape[0], f.shape[1])])
        return f[:L][None].to(self.device).float()

    def _target_features(self, ids: torch.Tensor) -> torch.Tensor:
        """Online: the target's pass over ``ids``, in its dtype; it stops after the deepest
        captured layer."""
        return self.target.features(ids[None].to(self.device), self.drafter.target_layer_ids)

    def _heldout_feats(self, record: dict, ids: torch.Tensor) -> torch.Tensor:
        """A held-out sequence's features are the same at every evaluation (and in both of its
        passes): online, the target computes them once and they are kept in its own dtype
        (lossless), up to HELDOUT_FEATURE_BYTES in all; past that they are recomputed."""
        if self.cfg.features != "online":
            return self._features(record, ids)
        f = self._heldout_features.get(record["id"])
        if f is None:
            f = self._target_features(ids)
            kept = sum(t.numel() * t.element_size() for t in self._heldout_features.values())
            if kept + f.numel() * f.element_size() <= HELDOUT_FEATURE_BYTES:
                self._heldout_features[record["id"]] = f
        return f.to(torch.float32, copy=True)

    def _plan(self, step: int) -> list[tuple[dict, torch.Tensor, Blocks]]:
        plan = []
        for i, rec in enumerate(self.step_records(step)):
            ids, lm = _sequence(rec, self.cfg.max_length)
            anchors = sample_anchors(lm, self.cfg.num_anchors, _seeded(self.cfg.seed, "anchors", step, i))
            plan.append((rec, *self._blocks(rec, anchors)))
        return plan

    def _autocast(self):
        device = self.head_rows.device.type
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.cfg.autocast == "bfloat16")

    # --- one optimizer step --------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        plan = self._plan(step)
        normaliser = max(sum(self._weights_in_vocab(b) for _, _, b in plan), 1e-9)
        mine = plan[self.rank::self.world]
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"ce": 0.0, "w": 0.0, "tokens": 0, "blocks": 0, "queries": 0}
        B = self.drafter.block_size
        correct, total = torch.zeros(B), torch.zeros(B)
        for rec, ids, blocks in mine:
            features = self._features(rec, ids)
            with self._autocast():
                out = dflash_loss(self.drafter, self.embed, self.head_rows, self.vocab_index,
                                  features, blocks, normaliser=normaliser,
                                  logits_chunk=cfg.logits_chunk, attention=self.attention,
                                  distill=cfg.distill, compile_ce=cfg.compile_loss)
            out.loss.backward()
            stats["ce"] += out.weighted_ce_sum
            stats["w"] += out.weight_sum
            stats["tokens"] += ids.numel()
            stats["blocks"] += int(blocks.valid.sum())
            stats["queries"] += out.num_queries
            correct += out.slot_correct
            total += out.slot_total
        params = [p for p in self.drafter.parameters()]
        if dist.is_initialized():
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None
                              else torch.zeros(p.numel(), device=p.device) for p in params])
            packed = torch.cat([flat, torch.tensor([stats["ce"], stats["w"], stats["tokens"],
                                                    stats["blocks"]], dtype=flat.dtype, device=flat.device),
                                correct.to(flat.device), total.to(flat.device)])
            dist.all_reduce(packed)
            off = 0
            for p in params:
                n = p.numel()
                g = packed[off:off + n].view_as(p)
                p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
                off += n
            stats["ce"], stats["w"], stats["tokens"], stats["blocks"] = packed[off:off + 4].tolist()
            correct, total = packed[off + 4:off + 4 + B].cpu(), packed[off + 4 + B:].cpu()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        lr = lr_at(step, self.total_steps, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        acc = (correct / total.clamp(min=1)).tolist()
        return {"loss": stats["ce"] / max(stats["w"], 1e-9), "grad_norm": grad_norm, "lr": lr,
                "tokens": stats["tokens"], "blocks": stats["blocks"], "slot_acc": acc}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss, per-slot accuracy and the teacher-forced acceptance estimate."""
        self.drafter.eval()
        ce = w = 0.0
        B = self.drafter.block_size
        correct, total, lead = torch.zeros(B), torch.zeros(B), []
        for i, rec in enumerate(self.heldout_records):
            ids, lm = _sequence(rec, self.cfg.max_length)
            anchors = sample_anchors(lm, self.cfg.heldout_anchors, _seeded(self.cfg.seed, "heldout", i))
            _, blocks = self._blocks(rec, anchors)
            out = dflash_loss(self.drafter, self.embed, self.head_rows, self.vocab_index,
                              self._heldout_feats(rec, ids), blocks, logits_chunk=self.cfg.logits_chunk,
                              attention=self.attention)
            ce += out.weighted_ce_sum
            w += out.weight_sum
            correct += out.slot_correct
            total += out.slot_total
            lead.append(out.leading_correct)
        walked = self._heldout_walk()
        self.drafter.train()
        return {"heldout_loss": ce / max(w, 1e-9),
                "heldout_tau": expected_acceptance_length(torch.cat(lead)) if lead else math.nan,
                "heldout_walk_tau": 1 + sum(walked) / len(walked) if walked else math.nan,
                "heldout_slot_acc": (correct / total.clamp(min=1)).tolist()}

    def _heldout_walk(self) -> list[int]:
        """Accepted drafts at each step greedy decoding would take through the held-out answers
        (they are the target's greedy output, so this is decoding's tau on those prompts, up to
        bf16 features). Random anchors (``heldout_tau``) read higher: decoding lands right after
        each rejection, where the next tokens are harder."""
        n = self.cfg.heldout_walk_tokens
        walked = []
        for rec in self.heldout_records if n > 0 else []:
            ids, lm = _sequence(rec, self.cfg.max_length)
            anchors = anchor_candidates(lm)
            anchors = anchors[anchors < rec["prompt_len"] + n]
            if anchors.numel() == 0:
                continue
            _, blocks = self._blocks(rec, anchors)
            out = dflash_loss(self.drafter, self.embed, self.head_rows, self.vocab_index,
                              self._heldout_feats(rec, ids), blocks, logits_chunk=self.cfg.logits_chunk,
                              attention=self.attention)
            walked += greedy_walk(anchors, out.leading_correct)
        return walked

    # --- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        blob = {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                "state": asdict(self.state), "config": asdict(self.cfg), "spec": asdict(self.spec),
                "drafter_config": asdict(self.drafter.config), "vocab": self.vocab}
        atomic_write(self.ckpt_path, lambda tmp: torch.save(blob, tmp))

    def try_resume(self) -> bool:
        if not self.ckpt_path.exists():
            return False
        blob = torch.load(self.ckpt_path, weights_only=False, map_location="cpu")
        # fields a later version dropped (micro_batch, which never changed a step) are not
        # held against a checkpoint, nor fields it added while they keep their defaults;
        # max_steps may grow to train on, and a run may move to another device or switch
        # compile_loss (the same loss up to rounding)
        defaults = asdict(TrainConfig())
        now = {k: v for k, v in asdict(self.cfg).items() if k not in ("max_steps", "device", "compile_loss")}
        same = all(blob["config"].get(k, defaults[k]) == v for k, v in now.items())
        if not same or blob["spec"] != asdict(self.spec):
            raise ValueError(f"{self.ckpt_path} was written by a different train/drafter config; "
                             f"move it away to start afresh, or restore the original config")
        self.drafter.load_state_dict(blob["drafter"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.state = TrainState(**blob["state"])
        return True

    def _log(self, row: dict) -> None:
        if self.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        new = not self.log_path.exists()
        with self.log_path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._log_fields(), extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)

    def _log_fields(self) -> list[str]:
        B = self.drafter.block_size
        return (["step", "epoch", "lr", "loss", "grad_norm", "tokens_per_s", "blocks_per_s",
                 "heldout_loss", "heldout_tau", "heldout_walk_tau", "elapsed_s"]
                + [f"acc_{k}" for k in range(1, B)] + [f"heldout_acc_{k}" for k in range(1, B)])

    def _truncate_log(self, last_step: int) -> None:
        """After a resume, drop log rows of steps that will be redone. The kept rows are written
        under this version's columns (a log begun by an older dflashkit gains the new ones)."""
        if self.rank != 0 or not self.log_path.exists():
            return
        with self.log_path.open() as f:
            rows = list(csv.DictReader(f))
        keep = [r for r in rows if r.get("step") and int(r["step"]) <= last_step]
        if not keep:   # nothing to keep (or killed while writing the header): start the log over
            self.log_path.unlink()
            return
        tmp = self.log_path.with_suffix(".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._log_fields(), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(keep)
        os.replace(tmp, self.log_path)

    # --- the loop --------------------------------------------------------------------------
    def fit(self) -> DFlashDrafter:
        cfg = self.cfg
        if self.try_resume() and self.rank == 0:
            print(f"resumed from {self.ckpt_path} at step {self.state.step}")
        if self.rank == 0:
            group = (f", gradients summed by {dist.get_backend()} all-reduce over {self.world} "
                     f"process(es)" if dist.is_initialized() else "")
            print(f"train: {self._hardware()}{group}", flush=True)
        self._truncate_log(self.state.step - 1)
        last = self.total_steps if cfg.max_steps is None else min(self.total_steps, cfg.max_steps)
        bar = tqdm(total=last, initial=self.state.step, disable=not self.progress, desc="train")
        while self.state.step < last:
            step = self.state.step
            t0 = time.perf_counter()
            m = self.train_step(step)
            dt = time.perf_counter() - t0
            self.state.elapsed_s += dt
            self.state.step += 1
            row = {"step": step, "epoch": step / self.steps_per_epoch, "lr": m["lr"], "loss": m["loss"],
                   "grad_norm": m["grad_norm"], "tokens_per_s": m["tokens"] / dt,
                   "blocks_per_s": m["blocks"] / dt, "elapsed_s": self.state.elapsed_s,
                   **{f"acc_{k}": a for k, a in enumerate(m["slot_acc"]) if k > 0}}
            done = self.state.step == last
            if self.heldout_records and (self.state.step % cfg.eval_every == 0 or done):
                t_eval = time.perf_counter()
                ev = self.evaluate()
                self.state.eval_s += time.perf_counter() - t_eval
                row.update(heldout_loss=ev["heldout_loss"], heldout_tau=ev["heldout_tau"],
                           heldout_walk_tau=ev["heldout_walk_tau"],
                           **{f"heldout_acc_{k}": a for k, a in enumerate(ev["heldout_slot_acc"]) if k > 0})
                if self.rank == 0:
                    tqdm.write(f"step {self.state.step}: held-out loss {ev['heldout_loss']:.3f}, "
                               f"expected acceptance length {ev['heldout_tau']:.2f} (random anchors), "
                               f"{ev['heldout_walk_tau']:.2f} (greedy walk)")
            self._log(row)
            bar.update(1)
            acc = "/".join(f"{a:.2f}" for a in m["slot_acc"][1:4])
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=acc, tok_s=f"{row['tokens_per_s']:.0f}",
                            blk_s=f"{row['blocks_per_s']:.1f}")
            if self.state.step % cfg.save_every == 0 or done:
                self.save_checkpoint()
                _barrier()
        bar.close()
        return self.drafter

    def export(self, path: str | Path) -> Path:
        """The trained drafter in the interoperable format, plus its draft vocabulary."""
        if self.rank != 0:
            return Path(path)
        cfg = self.drafter.config
        cfg.extra["dflashkit"] = {"trained": True, "steps": self.state.step,
                                  "train_seconds": round(self.state.elapsed_s, 1),
                                  "heldout_eval_seconds": round(self.state.eval_s, 1),
                                  "draft_vocab_size": int(self.vocab.numel())}
        out = save_drafter(self.drafter, path)
        if self.cfg.draft_vocab == "data":
            from .checkpoint import save_draft_vocab
            save_draft_vocab(self.vocab, out)
        card = out / "README.md"
        generated = f"{CARD_START}\n{self.model_card()}{CARD_END}\n"
        if not card.exists():
            text = generated
        else:   # the generated block follows the weights; what people wrote around it stays
            old = card.read_text()
            if CARD_START in old and CARD_END in old:
                head, rest = old.split(CARD_START, 1)
                text = head + generated + rest.split(CARD_END, 1)[1].lstrip("\n")
            else:
                text = None
                print(f"export: kept {card} (written before generated blocks were marked); "
                      f"delete it to regenerate its data and recipe", file=sys.stderr)
        if text is not None:
            atomic_write(card, lambda tmp: Path(tmp).write_text(text))
        return out

    def _hardware(self) -> str:
        if self.device.type == "cuda":
            return f"{self.world} x {torch.cuda.get_device_name(self.device)}"
        return f"{os.cpu_count()} CPU cores" + (f", {self.world} processes" if self.world > 1 else "")

    def _start_line(self) -> str:
        """Where the drafter's weights started: noise, the target, or a trained drafter (grown in
        depth, or continued as it was)."""
        if self.spec.init == "random":
            return f"random init (seed {self.cfg.seed})"
        if self.spec.init == "target":
            return "the target's own layers (drafter.init: target)"
        depth = len(self.drafter.layers)
        if self.init_source_layers == depth:
            return f"continued from the trained drafter {self.spec.init} (drafter.init, same depth)"
        return (f"grown from the trained drafter {self.spec.init} (drafter.init, "
                f"{self.init_source_layers} -> {depth} layers)")

    def model_card(self) -> str:
        """Data, recipe and training time; measured decoding results are added after a bench."""
        from collections import Counter
        cfg, dc = self.cfg, self.drafter.config
        sources = Counter(r["source"] for r in self.train_records)
        tokens = sum(len(r["input_ids"]) for r in self.train_records)
        resp = sum(len(r["input_ids"]) - r["prompt_len"] for r in self.train_records)
        lines = [
            f"# DFlash drafter for {self.head.name}",
            "",
            "Trained with dflashkit (`dflashkit train`). Format: z-lab DFlash / SGLang / vLLM "
            "(`config.json` + bf16 `model.safetensors`); `draft_vocab.safetensors` is dflashkit's "
            "optional restricted proposal vocabulary (engines ignore it).",
            "",
            "## Drafter",
            f"- {dc.num_hidden_layers} layer(s), hidden {dc.hidden_size}, intermediate {dc.intermediate_size}, "
            f"{dc.num_attention_heads} heads / {dc.num_key_value_heads} KV heads, block size {dc.block_size}",
            f"- target layers {dc.target_layer_ids} of {dc.num_target_layers}; mask token id {dc.mask_token_id}",
            f"- {sum(p.numel() for p in self.drafter.parameters()) / 1e6:.1f}M trained parameters; "
            f"draft vocabulary {int(self.vocab.numel())} tokens",
            "",
            "## Data (every response regenerated by the target, greedy, its chat template)",
            f"- {len(self.train_records)} training sequences ({tokens} tokens, {resp} response tokens), "
            f"{len(self.heldout_records)} held out"
            + (f", from {len(self.data_dirs)} data stages trained together" if len(self.data_dirs) > 1 else ""),
        ] + [f"- {n} from {src}" for src, n in sorted(sources.items())] + [
            "",
            "## Recipe",
            "- start: " + self._start_line(),
            f"- {cfg.epochs} epochs = {self.total_steps} steps of {cfg.global_batch} sequences; "
            f"{cfg.num_anchors} anchors per sequence; gamma {self.gamma}; max length {cfg.max_length}"
            + (f"; sample order started {cfg.data_offset_steps} steps in (train.data_offset_steps)"
               if cfg.data_offset_steps else ""),
            "- objective: "
            + (f"{1 - cfg.distill:g} x CE on the regenerated tokens + {cfg.distill:g} x CE on the "
               f"target's own top-k distributions (distillation)" if cfg.distill
               else "CE on the regenerated tokens"),
            f"- AdamW lr {cfg.lr}, betas {tuple(cfg.betas)}, weight decay {cfg.weight_decay}, "
            f"{cfg.warmup_ratio:.0%} warmup then cosine, grad clip {cfg.grad_clip}; seed {cfg.seed}",
            f"- features: {cfg.features}; attention: {self.attention}; arithmetic: "
            f"{'bf16 autocast, fp32 master weights' if cfg.autocast == 'bfloat16' else 'fp32'}",
            f"- training time on this machine: {self.state.elapsed_s / 60:.1f} min of optimizer steps"
            + (f", plus {self.state.eval_s / 60:.1f} min of held-out evaluations" if self.state.eval_s else "")
            + f" ({self._hardware()})",
            "",
        ]
        last = None
        if self.log_path.exists():
            with self.log_path.open() as f:
                rows = [r for r in csv.DictReader(f) if r.get("heldout_tau")]
            last = rows[-1] if rows else None
        if last:
            walk = last.get("heldout_walk_tau")
            lines += ["## Held-out estimate (teacher-forced, at the end of training)",
                      f"- loss {float(last['heldout_loss']):.3f}, expected acceptance length "
                      f"{float(last['heldout_tau']):.2f} over random anchors"
                      + (f", {float(walk):.2f} along greedy decoding's walk (first "
                         f"{cfg.heldout_walk_tokens} answer tokens)" if walk else ""), ""]
        return "\n".join(lines) + "\n"
