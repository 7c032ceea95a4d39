"""Fingerprints of local model directories, so an artifact is only applied to its own model.

The fingerprint covers the files ``from_pretrained`` reads to build the network: every
``*.json`` (config, generation, processor and tokenizer configs, safetensors index) and the
full bytes of every weight file. Only the top level of the directory is walked, as
``from_pretrained`` does, so caches (``.cache/``) and extra copies (``original/``) that one
site downloaded and another did not leave the fingerprint alone. Symbolic links are followed,
so a Hugging Face cache snapshot (links into ``blobs/``) fingerprints like a plain copy.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dpmtv_common.errors import ConfigError

__all__ = ["FINGERPRINT_SUFFIXES", "fingerprint_model_dir"]

FINGERPRINT_SUFFIXES = frozenset({".json", ".safetensors", ".bin", ".gguf", ".pt", ".pth"})
"""File name suffixes that enter the fingerprint."""

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


def _fingerprinted_files(directory: Path) -> list[Path]:
    return sorted(
        (
            entry
            for entry in directory.iterdir()
            if entry.suffix in FINGERPRINT_SUFFIXES
            and not entry.name.startswith(".")
            and entry.is_file()
        ),
        key=lambda entry: os.fsencode(entry.name),
    )


def fingerprint_model_dir(path: str | os.PathLike[str]) -> str:
    """Return ``"sha256:<hex>"`` over a model directory's configs and weights.

    Each file is framed as (name relative to the directory, size, SHA-256 of its content),
    in byte order of the names, so renaming, adding, removing or changing any covered file
    changes the fingerprint. Files are read in 1 MiB blocks.

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
    outer = hashlib.sha256(_DOMAIN)
    for entry in _fingerprinted_files(directory):
        size, digest = _hash_file(entry)
        outer.update(_frame(entry.name, size, digest))
    return f"sha256:{outer.hexdigest()}"
