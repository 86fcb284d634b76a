"""``dflashkit train --config``: data (+ features) -> teacher -> training -> export, stage by stage.

Each stage writes its outputs under ``run_dir`` and is skipped when they are complete, so
rerunning the same command after an interruption resumes where the work stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from .regenerate import DataConfig
from .trainer import DrafterSpec, TrainConfig


class ConfigError(ValueError):
    """A training config that cannot be run as written."""


def _build(cls, raw: dict | None, where: str):
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known keys: {sorted(known)}")
    return cls(**raw)


@dataclass
class PipelineConfig:
    target: str
    run_dir: str
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    export_dir: str | None = None
    # train on another run's data (comparing recipes), or on several runs' data together
    shared_data_dir: str | list[str] | None = None
    raw: dict = field(default_factory=dict)

    @property
    def train_dir(self) -> Path:
        return Path(self.run_dir) / "train"

    @property
    def drafter_dir(self) -> Path:
        return Path(self.export_dir) if self.export_dir else Path(self.run_dir) / "drafter"

    @property
    def data_dirs(self) -> list[Path]:
        if not self.shared_data_dir:
            return [Path(self.run_dir) / "data"]
        if isinstance(self.shared_data_dir, (list, tuple)):
            return [Path(d) for d in self.shared_data_dir]
        return [Path(self.shared_data_dir)]

    @property
    def data_dir(self) -> Path:
        """The data folder a data or teacher stage writes (the first when training on several)."""
        return self.data_dirs[0]


def _merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``: sections merge key by key, anything else (lists too) replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """One config file as a mapping, its ``base:`` chain merged in (so experiments state only what differs)."""
    if not path.exists():
        where = (f" (the base of {chain[-1]}; a base is relative to the folder of the config that "
                 f"names it)") if chain else " (see configs/ for examples)"
        raise ConfigError(f"{path}: no such config file{where}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (target, run_dir, data, drafter, "
                          f"train, ...), got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base must be the path of another config file, got {base!r}")
    base_path = path.parent / base   # an absolute base stays as it is
    if base_path.resolve() in {p.resolve() for p in chain + (path,)}:
        names = " -> ".join(str(p) for p in chain + (path, base_path))
        raise ConfigError(f"{path}: base chain loops back on itself ({names}); remove one base")
    return _merge(_read_yaml(base_path, chain + (path,)), raw)


def load_config(path: str | Path) -> PipelineConfig:
    path = Path(path)
    raw = _read_yaml(path)
    for key in ("target", "run_dir"):
        if key not in raw:
            raise ConfigError(f"{path}: missing required key {key!r}")
    extra = sorted(set(raw) - {"target", "run_dir", "data", "drafter", "train", "export_dir", "data_dir"})
    if extra:
        raise ConfigError(f"{path}: unknown top-level keys {extra}")
    shared = raw.get("data_dir")
    if shared is not None:
        several = isinstance(shared, list)
        if not (isinstance(shared, str) and shared) and not (
                several and shared and all(isinstance(d, str) and d for d in shared)):
            raise ConfigError(f"{path}: data_dir must be a folder, or a list of folders to train on "
                              f"together, got {shared!r}")
        if several and len(shared) > 1 and "data" in raw:
            raise ConfigError(f"{path}: data_dir lists {len(shared)} folders and the config has a data "
                              f"section; several folders are trained on as they are (each made by its "
                              f"own config's data stage), so remove the data section")
        if several and len(set(shared)) != len(shared):
            raise ConfigError(f"{path}: data_dir lists a folder twice: {shared}")
    train = _build(TrainConfig, raw.get("train"), f"{path}: train")
    train.betas = tuple(train.betas)
    cfg = PipelineConfig(target=raw["target"], run_dir=raw["run_dir"],
                         data=_build(DataConfig, raw.get("data"), f"{path}: data"),
                         drafter=_build(DrafterSpec, raw.get("drafter"), f"{path}: drafter"),
                         train=train, export_dir=raw.get("export_dir"),
                         shared_data_dir=raw.get("data_dir"), raw=raw)
    cfg.data.out_dir = str(cfg.data_dir)
    from .fastpath import DTYPES
    if cfg.data.dtype not in DTYPES:
        raise ConfigError(f"{path}: data.dtype must be one of {sorted(DTYPES)}, got {cfg.data.dtype!r}")
    return cfg


def run_data_stage(cfg: PipelineConfig, target=None, progress: bool = True) -> Path:
    from .prompts import training_prompts
    from .regenerate import regenerate
    from .target import load_target
    from .regenerate import check_data_config
    if len(cfg.data_dirs) > 1:   # several finished stages, trained on together
        for d in cfg.data_dirs:
            if not (d / "meta.json").exists():
                raise ConfigError(f"data_dir: {d} is not a complete data stage (no meta.json); make "
                                  f"it with its own config (`dflashkit train --config ... --stages "
                                  f"data`) before training on several folders together")
            print(f"data: complete ({json.loads((d / 'meta.json').read_text())['num_samples']} samples) in {d}")
        return cfg.data_dir
    meta = cfg.data_dir / "meta.json"
    if not (cfg.shared_data_dir and "data" not in cfg.raw):   # another run's data, as it is
        check_data_config(cfg.data_dir, cfg.target, cfg.data)
    if meta.exists():
        print(f"data: complete ({json.loads(meta.read_text())['num_samples']} samples) in {cfg.data_dir}")
        return cfg.data_dir
    target = target or load_target(cfg.target, dtype=cfg.data.dtype, progress=progress,
                                   device=cfg.data.device)
    if not cfg.data.feature_layers:
        from .drafter import default_target_layer_ids
        cfg.data.feature_layers = default_target_layer_ids(target.num_layers, 5)
    d = cfg.data
    prompts = training_prompts(d.num_code, d.num_math, d.num_chat, seed=d.seed, num_docs=d.num_docs,
                               num_apis=d.num_apis, num_pkgs=d.num_pkgs,
                               num_meths=d.num_meths)
    return regenerate(target, prompts, d, progress=progress)


def run_teacher_stage(cfg: PipelineConfig, target=None, forced: bool = False,
                      progress: bool = True, per_shard: int = 32) -> int:
    """The target's top-k distributions for every sample that lacks them (data made before
    the data stage kept them, or with ``data.teacher_top_k: 0``); runs when ``train.distill`` > 0
    or when asked for by name. Returns how many samples it computed."""
    from .regenerate import read_samples
    from .teacher import TeacherStore, backfill
    if cfg.train.distill <= 0 and not forced:
        return 0
    done = 0
    for data_dir in cfg.data_dirs:
        if not (data_dir / "meta.json").exists():
            raise ConfigError(f"{data_dir}: the data stage is not complete; run it first (--stages data)")
        records = read_samples(data_dir)
        if not TeacherStore(data_dir).missing(records):
            print(f"teacher: complete ({len(records)} samples) in {data_dir}")
            continue
        from .target import load_target
        target = target or load_target(cfg.target, dtype=cfg.data.dtype, progress=progress,
                                       device=cfg.data.device)
        k = cfg.data.teacher_top_k or 16
        done += backfill(target, data_dir, records, k, per_shard=per_shard, progress=progress)
    return done


def _data_complete(cfg: PipelineConfig) -> bool:
    return all((d / "meta.json").exists() for d in cfg.data_dirs)


def _teacher_complete(cfg: PipelineConfig) -> bool:
    from .regenerate import read_samples
    from .teacher import TeacherStore
    return _data_complete(cfg) and not any(TeacherStore(d).missing(read_samples(d)) for d in cfg.data_dirs)


WAIT_POLL_S = 10.0


def wait_for(done, what: str) -> None:
    """Block until ``done()``: the other processes of a torchrun job while rank 0 runs a data
    stage (hours, longer than a process group's barrier timeout; torchrun stops every rank
    if rank 0 fails, so no wait outlives it)."""
    told = False
    while not done():
        if not told:
            print(f"rank {os.environ.get('RANK', '?')}: waiting for rank 0's {what}", flush=True)
            told = True
        time.sleep(WAIT_POLL_S)


def run_stages(cfg: PipelineConfig, stages: list[str], force_teacher: bool = False,
               progress: bool = True) -> None:
    """The stages asked for, in order. Under torchrun the target-bound stages (data, teacher)
    run once, on rank 0, while the other ranks wait; training then runs data-parallel."""
    rank = int(os.environ.get("RANK", "0"))
    if "data" in stages:
        if rank == 0:
            run_data_stage(cfg, progress=progress)
        else:
            wait_for(lambda: _data_complete(cfg), "data stage")
    if "teacher" in stages and (cfg.train.distill > 0 or force_teacher):
        if rank == 0:
            run_teacher_stage(cfg, forced=force_teacher, progress=progress)
        else:
            wait_for(lambda: _teacher_complete(cfg), "teacher stage")
    if "train" in stages or "export" in stages:
        run_train_and_export(cfg, progress=progress, export="export" in stages)


def run_train_and_export(cfg: PipelineConfig, progress: bool = True, export: bool = True) -> Path | None:
    """Train (resuming from the last checkpoint) and write the interoperable drafter."""
    from .trainer import Trainer
    trainer = Trainer(cfg.target, cfg.data_dirs, cfg.train_dir, cfg.drafter, cfg.train, progress=progress)
    trainer.fit()
    if not export:
        return None
    out = trainer.export(cfg.drafter_dir)
    if trainer.rank == 0:
        print(f"export: wrote {out}")
    return out
