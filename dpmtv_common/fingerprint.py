"""Fingerprints of local model directories, so an artifact is only applied to its own model.

The fingerprint covers every file ``from_pretrained`` reads that shapes what the model sees
or computes: every ``*.json`` (config, generation, processor, preprocessor and tokenizer
configs, ``chat_template.json``, safetensors index), the chat template files
(``chat_template.jinja`` and ``additional_chat_templates/*.jinja``; the template inside
``tokenizer_config.json`` is covered with that file), the tokenizer's vocabulary files
(``tokenizer.model``, ``*.tiktoken``, ``vocab.txt``, ``merges.txt``) and the full bytes of
every weight file. Two sites whose model files render prompts differently therefore never
share a fingerprint. A directory that ships no chat template is rendered with a template from
the code (a dpmtv adapter or a plugin), which no file here holds: sites pin that one by its
digest (``prompt_template_sha256``, reported at plan time and recorded in the manifest), as
they pin the task instruction their data puts in every prompt (``instruction_sha256``).
Apart from ``additional_chat_templates/``, only the top level of the directory is walked, as
``from_pretrained`` does, so caches (``.cache/``) and extra copies (``original/``)
that one site downloaded and another did not leave the fingerprint alone. Symbolic links are
followed, so a Hugging Face cache snapshot (links into ``blobs/``) fingerprints like a plain
copy.

Hashing multi-GB weights on every load is slow, and a deployed site loads its model for every
Flower message. With ``cache_dir``, each weight file's digest is remembered under its
(device, inode, size, modification time in ns); any rewrite of the file changes that key. The
cache guards against honest mistakes (the wrong model), like the fingerprint itself: whoever
can rewrite a site's weights while keeping size and timestamps can also change its code.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dpmtv_common.errors import ConfigError
from dpmtv_common.files import write_atomic

__all__ = ["FINGERPRINT_NAMES", "FINGERPRINT_SUFFIXES", "fingerprint_model_dir"]

FINGERPRINT_SUFFIXES = frozenset(
    {".json", ".safetensors", ".bin", ".gguf", ".pt", ".pth", ".jinja", ".model", ".tiktoken"}
)
"""File name suffixes that enter the fingerprint."""
FINGERPRINT_NAMES = frozenset({"vocab.txt", "merges.txt"})
"""Further file names that enter it (tokenizer vocabularies with a generic suffix)."""
_TEMPLATE_FOLDER = "additional_chat_templates"  # transformers reads named templates from here
_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".gguf", ".pt", ".pth", ".model"})

_BLOCK_BYTES = 1 << 20  # stream: weight files are many GB
_DOMAIN = b"dpmtv-model-fingerprint-v1\x00"


def _hash_file(path: Path) -> tuple[int, bytes]:
    """Return the size and SHA-256 of the bytes actually read (not a racy ``stat``)."""
    digest = hashlib.sha256()
    size = 0
    try:
        with path.open("rb") as handle:
            while block := handle.read(_BLOCK_BYTES):
                digest.update(block)
                size += len(block)
    except OSError as exc:
        raise ConfigError(f"model file must be readable, got {str(path)!r}: {exc}.") from exc
    return size, digest.digest()


def _frame(name: str, size: int, digest: bytes) -> bytes:
    """Length-prefix every part so that no two file lists frame to the same bytes."""
    encoded = os.fsencode(name)
    return len(encoded).to_bytes(8, "big") + encoded + size.to_bytes(8, "big") + digest


def _covered(entry: Path) -> bool:
    named = entry.suffix in FINGERPRINT_SUFFIXES or entry.name in FINGERPRINT_NAMES
    return named and not entry.name.startswith(".") and entry.is_file()


def _fingerprinted_files(directory: Path) -> list[tuple[str, Path]]:
    """``(name relative to directory, path)`` of every covered file, in byte order of names."""
    files = [(entry.name, entry) for entry in directory.iterdir() if _covered(entry)]
    templates = directory / _TEMPLATE_FOLDER
    if templates.is_dir():
        files += [
            (f"{_TEMPLATE_FOLDER}/{entry.name}", entry)
            for entry in templates.iterdir()
            if entry.suffix == ".jinja" and _covered(entry)
        ]
    return sorted(files, key=lambda item: os.fsencode(item[0]))


_CACHE_FILE = "fingerprint-digests.json"


def _stat_key(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}"


def _read_cache(cache_dir: Path) -> dict[str, str]:
    try:
        data = json.loads((cache_dir / _CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: recompute
    return data if isinstance(data, dict) else {}


def _write_cache(cache_dir: Path, cache: dict[str, str]) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(cache_dir / _CACHE_FILE, json.dumps(cache), durable=False)
    except OSError:
        pass  # a read-only cache only costs time, never correctness


def _cached_hash(entry: Path, cache: dict[str, str]) -> tuple[int, bytes]:
    key = f"{entry.resolve()}|{_stat_key(entry)}"
    if key in cache:
        size_text, digest_hex = cache[key].split(":")
        return int(size_text), bytes.fromhex(digest_hex)
    size, digest = _hash_file(entry)
    cache[key] = f"{size}:{digest.hex()}"
    return size, digest


def fingerprint_model_dir(
    path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> str:
    """Return ``"sha256:<hex>"`` over a model directory's configs and weights.

    Each file is framed as (name relative to the directory, size, SHA-256 of its content),
    in byte order of the names, so renaming, adding, removing or changing any covered file
    changes the fingerprint. Files are read in 1 MiB blocks; with ``cache_dir``, the digests
    of unchanged weight files are reused (see the module docstring).

    Raises:
        ConfigError: ``path`` is not a directory, holds no ``config.json``, or a covered file
            cannot be read.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"model directory must exist, got {str(directory)!r}.")
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model directory must hold config.json, got {str(directory)!r} without one. "
            "Point it at the folder save_pretrained wrote (or a Hugging Face snapshot)."
        )
    cache = _read_cache(Path(cache_dir)) if cache_dir is not None else None
    outer = hashlib.sha256(_DOMAIN)
    for name, entry in _fingerprinted_files(directory):
        if cache is None or entry.suffix not in _WEIGHT_SUFFIXES:
            size, digest = _hash_file(entry)  # small files: always re-read, never trusted
        else:
            size, digest = _cached_hash(entry, cache)
        outer.update(_frame(name, size, digest))
    if cache is not None and cache_dir is not None:
        _write_cache(Path(cache_dir), cache)
    return f"sha256:{outer.hexdigest()}"
