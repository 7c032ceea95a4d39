"""Write and load signed task-vector artifacts.

An artifact is a directory of three files:

- ``tensors.safetensors``: ``heads`` (int64, ``(n, 2)``, :meth:`HeadSet.to_array`) and
  ``values`` (float32, ``(n, d_head)``, the released mean activation of each head);
- ``manifest.json``: an :class:`ArtifactManifest`, pretty-printed with sorted keys;
- ``signature``: the raw 64-byte Ed25519 signature over
  :func:`manifest_to_canonical_bytes`. The manifest holds the SHA-256 of the tensors file, so
  the one signature covers the tensors too.

Loading checks, in order, and stops at the first failure: the files and manifest parse
(:class:`ArtifactFormatError`); the signing key is trusted (:class:`UnknownSigningKeyError`);
the signature verifies (:class:`BadSignatureError`); the tensors hash matches
(:class:`IntegrityError`); the tensors match the manifest (:class:`ArtifactFormatError`); the
model fingerprint matches (:class:`ModelMismatchError`).

Writing stages the files in a hidden sibling folder and renames it into place. A process
killed in between leaves that folder behind; the next :func:`write_artifact` in the same
parent folder tidies such leftovers once they are older than :data:`STALE_AFTER_S` (see
:func:`clean_stale_staging`): an incomplete one is deleted, a complete one (which may be the
only copy of a release whose privacy cost is already counted) is renamed to a visible
``*.recovered`` folder and reported, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import safetensors
import safetensors.numpy
from pydantic import ValidationError

from dpmtv_common.artifact._publish import check_replaceable, publish_directory
from dpmtv_common.artifact.manifest import (
    FORMAT_VERSION,
    ArtifactManifest,
    ReleaseDescription,
    hash_plan,
    manifest_to_canonical_bytes,
)
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import (
    ArtifactFormatError,
    ConfigError,
    IntegrityError,
    ModelMismatchError,
)
from dpmtv_common.heads import HeadSet

__all__ = [
    "MANIFEST_FILE",
    "SIGNATURE_FILE",
    "STALE_AFTER_S",
    "StagingCleanup",
    "TENSORS_FILE",
    "TaskVectorArtifact",
    "check_artifact_target",
    "clean_stale_staging",
    "load_artifact",
    "write_artifact",
]

TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "signature"
_FILES = (TENSORS_FILE, MANIFEST_FILE, SIGNATURE_FILE)

STALE_AFTER_S = 600.0
"""Age (seconds since last change) after which a staging folder counts as left by a dead
process: a live write stages for well under a second."""

# Hidden staging folders: ``.NAME.tmp-HEX`` and ``.NAME.old-HEX`` (``_publish``: publishing and
# replacing) and ``.incoming-XXXX`` (client/release/site.py receiving a broadcast artifact into
# ``.incoming-XXXX/artifact``).
_STAGING = re.compile(r"^\..+\.(?:tmp|old)-[0-9a-f]{16}$|^\.incoming-[A-Za-z0-9_]+$")
_SITE_SUBFOLDER = "artifact"

_log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class TaskVectorArtifact:
    """A loaded, verified artifact. Compare fields, not objects: ``values`` is an array.

    Attributes:
        manifest: The signed manifest.
        heads: The heads, in row order of ``values``.
        values: Read-only float32 array of shape ``(len(heads), manifest.d_head)``.
    """

    manifest: ArtifactManifest
    heads: HeadSet
    values: npt.NDArray[np.float32]


def _values_to_float32(heads: HeadSet, values: npt.NDArray[np.generic]) -> npt.NDArray[np.float32]:
    if len(heads) == 0:
        raise ConfigError("heads must hold at least one head, got an empty HeadSet.")
    if not np.issubdtype(values.dtype, np.floating):
        raise ConfigError(f"values must have a floating dtype, got {values.dtype}.")
    if values.ndim != 2 or values.shape[0] != len(heads) or values.shape[1] < 1:
        raise ConfigError(
            f"values must have shape ({len(heads)}, d_head) with d_head >= 1, got {values.shape!r}."
        )
    with np.errstate(over="ignore"):  # values beyond float32 become inf, refused just below
        as_float32 = np.ascontiguousarray(values, dtype=np.float32)
    if not np.isfinite(as_float32).all():
        raise ConfigError("values must be finite in float32, got NaN or infinity.")
    return as_float32


def check_artifact_target(
    target: Path,
    *,
    overwrite: bool,
    name: str = "artifact directory",
    remedy: str = "pass overwrite=True to replace it",
) -> bool:
    """The rule :func:`write_artifact` applies to its target, for callers to check it first.

    Returns whether ``target`` exists. Callers that must not fail after spending (a release)
    check here before anything is reserved; ``name``/``remedy`` word the error for them.

    Raises:
        ConfigError: ``target`` exists without ``overwrite``, is not a folder, or holds other
            entries than artifact files.
    """
    return check_replaceable(
        target, frozenset(_FILES), overwrite=overwrite, name=name, remedy=remedy
    )


def write_artifact(
    directory: str | os.PathLike[str],
    *,
    heads: HeadSet,
    values: npt.NDArray[np.generic],
    release: ReleaseDescription,
    signing_key: SigningKey,
    overwrite: bool = False,
) -> Path:
    """Sign and write an artifact directory atomically; return its path.

    Args:
        directory: The artifact directory to create. Its parent is created if missing.
        heads: The released heads; row ``i`` of ``values`` belongs to ``heads.heads[i]``.
        values: Released (already noised) mean activations, shape ``(len(heads), d_head)``;
            any floating dtype, stored as float32.
        release: What was released and its privacy cost; the layout fields, plan hash and
            key id are derived here so they cannot disagree with the tensors.
        signing_key: The key that signs the manifest.
        overwrite: Replace an existing artifact at ``directory``.

    Raises:
        ConfigError: Bad ``heads`` or ``values``, or ``directory`` exists (see ``overwrite``).
    """
    values32 = _values_to_float32(heads, values)
    tensors = safetensors.numpy.save({"heads": heads.to_array(), "values": values32})
    manifest = ArtifactManifest(
        **release.model_dump(),
        format_version=FORMAT_VERSION,
        plan_hash=hash_plan(release.plan),
        num_heads=len(heads),
        d_head=int(values32.shape[1]),
        num_layers_in_scope=heads.num_layers_in_scope,
        tensors_sha256=hashlib.sha256(tensors).hexdigest(),
        signing_key_id=signing_key.key_id,
    )
    signature = signing_key.sign(manifest_to_canonical_bytes(manifest))
    readable = json.dumps(manifest.model_dump(mode="json"), sort_keys=True, indent=2) + "\n"
    target = Path(directory)
    files = {TENSORS_FILE: tensors, MANIFEST_FILE: readable.encode(), SIGNATURE_FILE: signature}
    clean_stale_staging(target.absolute().parent)
    publish_directory(target, files, overwrite=overwrite)
    return target


@dataclass(frozen=True)
class StagingCleanup:
    """What :func:`clean_stale_staging` did.

    Attributes:
        removed: Incomplete staging folders deleted.
        recovered: Complete artifacts moved from hidden staging to visible ``*.recovered``.
        kept: Stale staging folders left alone because they hold files of other names.
    """

    removed: tuple[Path, ...] = ()
    recovered: tuple[Path, ...] = ()
    kept: tuple[Path, ...] = ()


def _artifact_folder(staging: Path) -> Path:
    """The folder that would hold the artifact files (a site stages one level deeper)."""
    inner = staging / _SITE_SUBFOLDER
    return inner if inner.is_dir() and not inner.is_symlink() else staging


def _only_artifact_files(staging: Path, folder: Path) -> bool:
    outer = {entry.name for entry in staging.iterdir()}
    allowed = set(_FILES) | ({_SITE_SUBFOLDER} if folder != staging else set())
    return outer <= allowed and {entry.name for entry in folder.iterdir()} <= set(_FILES)


def _tidy(staging: Path) -> tuple[str, Path]:
    """Delete, recover or keep one stale staging folder; say which and where it is now."""
    folder = _artifact_folder(staging)
    if not _only_artifact_files(staging, folder):
        return "kept", staging  # never delete what dpmtv did not write
    if not all((folder / name).is_file() for name in _FILES):
        shutil.rmtree(staging)
        return "removed", staging
    # Complete: it may be the only copy of a release already counted in a ledger.
    recovered = staging.with_name(f"{staging.name.lstrip('.')}.recovered")
    os.rename(folder, recovered)
    if folder != staging:
        shutil.rmtree(staging)
    return "recovered", recovered


def clean_stale_staging(
    parent: str | os.PathLike[str], *, older_than_s: float = STALE_AFTER_S
) -> StagingCleanup:
    """Tidy hidden staging folders that a killed write left in ``parent``.

    A staging folder whose last change is older than ``older_than_s`` is taken as left by a
    dead process (a live write renames its staging away within a second). Incomplete ones
    are deleted; complete ones are renamed to a visible ``<name>.recovered`` folder and
    logged as a warning (their signature still holds, so they can be checked and used);
    ones holding files dpmtv did not write are logged and left alone.
    """
    folder = Path(parent)
    if not folder.is_dir():
        return StagingCleanup()
    cutoff = time.time() - older_than_s
    done: dict[str, list[Path]] = {"removed": [], "recovered": [], "kept": []}
    for entry in sorted(folder.iterdir()):
        if not _STAGING.match(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        if entry.stat().st_mtime > cutoff:
            continue  # possibly a write in progress
        what, where = _tidy(entry)
        done[what].append(where)
    for path in done["recovered"]:
        _log.warning("a killed write left a complete artifact; moved it to %s", path)
    for path in done["kept"]:
        _log.warning("stale staging folder %s holds unexpected files; left in place", path)
    return StagingCleanup(tuple(done["removed"]), tuple(done["recovered"]), tuple(done["kept"]))


def _read_files(path: Path) -> dict[str, bytes]:
    if not path.is_dir():
        raise ArtifactFormatError(f"artifact path must be a directory, got {str(path)!r}.")
    missing = [name for name in _FILES if not (path / name).is_file()]
    if missing:
        raise ArtifactFormatError(
            f"artifact directory must hold {list(_FILES)}, got {str(path)!r} missing {missing}."
        )
    return {name: (path / name).read_bytes() for name in _FILES}


def _parse_manifest(path: Path, raw: bytes) -> ArtifactManifest:
    where = f"{str(path / MANIFEST_FILE)!r}"
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactFormatError(f"{where} must be JSON, got unparsable bytes ({exc}).") from exc
    if not isinstance(document, dict):
        raise ArtifactFormatError(f"{where} must be a JSON object, got {type(document).__name__}.")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactFormatError(
            f"format_version must be {FORMAT_VERSION}, got {version!r} in {where}. "
            "A newer dpmtv may read it."
        )
    try:
        return ArtifactManifest.model_validate_json(raw)
    except ValidationError as exc:
        raise ArtifactFormatError(f"{where} must be a valid manifest, got:\n{exc}") from exc


def _check_tensors_hash(path: Path, tensors: bytes, manifest: ArtifactManifest) -> None:
    actual = hashlib.sha256(tensors).hexdigest()
    if actual != manifest.tensors_sha256:
        raise IntegrityError(
            f"{TENSORS_FILE} must have the signed sha256 {manifest.tensors_sha256}, "
            f"got {actual} in {str(path)!r}: the tensors were changed after signing."
        )


def _check_tensor(
    name: str, array: npt.NDArray[np.generic], dtype: type, shape: tuple[int, int]
) -> None:
    if array.dtype != dtype or array.shape != shape:
        raise ArtifactFormatError(
            f"tensor {name!r} must be {np.dtype(dtype)} of shape {shape}, "
            f"got {array.dtype} of shape {array.shape}."
        )


def _parse_tensors(
    tensors: bytes, manifest: ArtifactManifest
) -> tuple[HeadSet, npt.NDArray[np.float32]]:
    try:
        arrays = safetensors.numpy.load(tensors)
    except safetensors.SafetensorError as exc:
        raise ArtifactFormatError(f"{TENSORS_FILE} must be safetensors, got ({exc}).") from exc
    if sorted(arrays) != ["heads", "values"]:
        raise ArtifactFormatError(
            f"{TENSORS_FILE} must hold tensors ['heads', 'values'], got {sorted(arrays)}."
        )
    _check_tensor("heads", arrays["heads"], np.int64, (manifest.num_heads, 2))
    _check_tensor("values", arrays["values"], np.float32, (manifest.num_heads, manifest.d_head))
    try:
        heads = HeadSet.from_array(arrays["heads"])
    except ConfigError as exc:
        raise ArtifactFormatError(f"tensor 'heads' must be a valid head set: {exc}") from exc
    if heads.num_layers_in_scope != manifest.num_layers_in_scope:
        raise ArtifactFormatError(
            f"num_layers_in_scope must match the heads' {heads.num_layers_in_scope} layers, "
            f"got {manifest.num_layers_in_scope}."
        )
    values = np.array(arrays["values"], dtype=np.float32)
    if not np.isfinite(values).all():
        raise ArtifactFormatError("tensor 'values' must be finite, got NaN or infinity.")
    values.flags.writeable = False
    return heads, values


def _check_model(manifest: ArtifactManifest, expected: str | None) -> None:
    if expected is not None and manifest.model_fingerprint != expected:
        raise ModelMismatchError(
            f"model_fingerprint must equal the loaded model's {expected!r}, "
            f"got {manifest.model_fingerprint!r}: the artifact was made for another model."
        )


def load_artifact(
    directory: str | os.PathLike[str],
    *,
    trusted_keys: TrustedKeys,
    expected_model_fingerprint: str | None,
) -> TaskVectorArtifact:
    """Load an artifact after checking its format, signature, integrity and model.

    Args:
        directory: The artifact directory.
        trusted_keys: Keys whose signatures are accepted.
        expected_model_fingerprint: ``fingerprint_model_dir`` of the model the vector will
            be applied to; ``None`` skips the check (inspection only, never before use).

    Raises:
        ArtifactFormatError: A file is missing or malformed.
        UnknownSigningKeyError: The signer is not in ``trusted_keys``.
        BadSignatureError: The signature does not cover this manifest.
        IntegrityError: The tensors file differs from the signed hash.
        ModelMismatchError: The artifact was made for another model.
    """
    path = Path(directory)
    files = _read_files(path)
    manifest = _parse_manifest(path, files[MANIFEST_FILE])
    verify_key = trusted_keys.get(manifest.signing_key_id)
    verify_key.verify(manifest_to_canonical_bytes(manifest), files[SIGNATURE_FILE])
    _check_tensors_hash(path, files[TENSORS_FILE], manifest)
    heads, values = _parse_tensors(files[TENSORS_FILE], manifest)
    _check_model(manifest, expected_model_fingerprint)
    return TaskVectorArtifact(manifest=manifest, heads=heads, values=values)
