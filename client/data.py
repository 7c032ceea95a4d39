"""A site's private dataset on disk: records of (image, question, answers), loaded and checked.

:func:`load_dataset` recognises two layouts in a folder ``root``:

* **JSONL manifest** ``root/manifest.jsonl``: one JSON object a line with ``image`` (a path
  relative to ``root``), ``question``, ``answer`` (a string, or a list of human answers whose
  first is the primary answer shown in demonstrations), optional ``id`` (default
  ``"line-<n>"``) and optional ``group`` (who owns the record, e.g. a patient id: the privacy
  unit in group mode). Blank lines are ignored.
* **Image folder** ``root/<class name>/*.png|jpg|jpeg``: every record asks the same question
  and is answered by its class name, underscores read as spaces.

Either layout may add ``root/dataset.json`` = ``{"task", "privacy_unit", "instruction"}``.

A malformed manifest line stops the load with its line number (:mod:`client._manifest`). A
missing or unreadable image is skipped, reported in :attr:`SiteDataset.skipped` and logged,
so one bad file does not sink a site.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from PIL import Image

from client._manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    PrivacyUnitName,
    privacy_unit_from,
    read_manifest,
    read_metadata,
)
from dpmtv_common.errors import ConfigError, DataError

__all__ = [
    "DEFAULT_QUESTION",
    "IMAGE_SUFFIXES",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "PrivacyUnitName",
    "Record",
    "SiteDataset",
    "SkippedRecord",
    "load_dataset",
    "write_jsonl_dataset",
]

_log = logging.getLogger(__name__)

DEFAULT_QUESTION = "What is shown in the image?"
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
_SHOWN_REASONS = 3  # a log line and an error message quote this many skip reasons


@dataclass(frozen=True)
class Record:
    """One private example: an image, a question and its accepted answers.

    Attributes:
        id: Unique within its dataset.
        image_path: Absolute path of the image file.
        question: The question asked about the image.
        answers: Accepted answers, at least one; the first is the primary answer.
        group: Who owns the record (the privacy unit in group mode), or None.
    """

    id: str
    image_path: Path
    question: str
    answers: tuple[str, ...]
    group: str | None = None

    def __post_init__(self) -> None:
        if not self.answers:
            raise DataError(f"answers of record {self.id!r} must not be empty, got ().")

    @property
    def answer(self) -> str:
        """The primary answer, the one a demonstration shows."""
        return self.answers[0]

    def load_image(self) -> Image.Image:
        """Read the image as RGB; the file is closed before this returns."""
        with Image.open(self.image_path) as image:
            return image.convert("RGB")


@dataclass(frozen=True)
class SkippedRecord:
    """A record left out at load time because its image could not be used.

    Attributes:
        source: Where it came from: ``"line <n>"`` of the manifest, or the image's relative path.
        image_path: The image that failed.
        reason: Why it failed.
    """

    source: str
    image_path: Path
    reason: str


@dataclass(frozen=True)
class SiteDataset:
    """A site's loaded dataset and what was left out of it.

    Attributes:
        records: The usable records, in file order.
        task: Name of the task (``dataset.json``, else the folder name).
        privacy_unit: ``"example"``, or ``"group"`` when one owner's records are one unit.
        instruction: Optional text placed before the demonstrations.
        skipped: Records whose image was missing or unreadable.
    """

    records: tuple[Record, ...]
    task: str
    privacy_unit: PrivacyUnitName = "example"
    instruction: str | None = None
    skipped: tuple[SkippedRecord, ...] = ()

    def __post_init__(self) -> None:
        privacy_unit_from(self.privacy_unit, where="privacy_unit")
        if self.privacy_unit == "group":
            ungrouped = next((r.id for r in self.records if r.group is None), None)
            if ungrouped is not None:
                raise DataError(
                    f"privacy_unit 'group' needs a group on every record, "
                    f"got none on record {ungrouped!r}."
                )

    def __len__(self) -> int:
        return len(self.records)


def load_dataset(path: str | os.PathLike[str], *, question: str | None = None) -> SiteDataset:
    """Load a site dataset, detecting its layout, and verify every image once.

    Args:
        path: The dataset folder.
        question: The question of every image-folder record (default
            :data:`DEFAULT_QUESTION`); a manifest brings its own questions and ignores this.

    Raises:
        DataError: The folder, a manifest line or ``dataset.json`` is unusable, or no record
            is left once unreadable images are skipped.
        ConfigError: ``question`` is empty.
    """
    root = Path(path).resolve()
    if not root.is_dir():
        raise DataError(f"dataset path must be an existing folder, got {str(path)!r}.")
    if question is not None and not question.strip():
        raise ConfigError(f"question must be a non-empty string, got {question!r}.")
    meta = read_metadata(root)
    if (root / MANIFEST_NAME).is_file():
        candidates = _manifest_records(root, group_required=meta.privacy_unit == "group")
    else:
        candidates = _scan_image_folder(root, question or DEFAULT_QUESTION)
    records, skipped = _keep_readable(candidates)
    reasons = "; ".join(f"{s.source}: {s.reason}" for s in skipped[:_SHOWN_REASONS])
    if skipped:
        _log.warning(
            "%s: skipped %d of %d records (%s)", root, len(skipped), len(candidates), reasons
        )
    if not records:
        raise DataError(
            f"{root} has no usable record: all {len(skipped)} were skipped ({reasons})."
        )
    return SiteDataset(records, meta.task, meta.privacy_unit, meta.instruction, skipped)


def write_jsonl_dataset(
    path: str | os.PathLike[str],
    records: Iterable[Mapping[str, Any]],
    *,
    task: str,
    privacy_unit: PrivacyUnitName = "example",
    instruction: str | None = None,
) -> Path:
    """Write ``manifest.jsonl`` and ``dataset.json`` into ``path``, each atomically.

    Each file goes to a temporary file first and then replaces the target, so a crash never
    leaves a half-written manifest that :func:`load_dataset` would read. Records are written
    as given; :func:`load_dataset` is what validates them.

    Returns:
        The dataset folder.
    """
    if privacy_unit not in get_args(PrivacyUnitName):
        raise ConfigError(f"privacy_unit must be 'example' or 'group', got {privacy_unit!r}.")
    root = Path(path)
    lines = "".join(json.dumps(dict(record), ensure_ascii=False) + "\n" for record in records)
    metadata = {"task": task, "privacy_unit": privacy_unit, "instruction": instruction}
    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(root / MANIFEST_NAME, lines)
    _write_atomic(root / METADATA_NAME, json.dumps(metadata, indent=2) + "\n")
    return root


def _write_atomic(target: Path, text: str) -> None:
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _manifest_records(root: Path, *, group_required: bool) -> list[tuple[str, Record]]:
    rows = read_manifest(root / MANIFEST_NAME, group_required=group_required)
    return [
        (f"line {r.line_no}", Record(r.id, root / r.image, r.question, r.answers, r.group))
        for r in rows
    ]


def _scan_image_folder(root: Path, question: str) -> list[tuple[str, Record]]:
    found: list[tuple[str, Record]] = []
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for class_dir in class_dirs:
        answer = class_dir.name.replace("_", " ")
        for file in sorted(class_dir.iterdir()):
            if file.suffix.lower() in IMAGE_SUFFIXES and not file.name.startswith("."):
                rel = file.relative_to(root).as_posix()
                found.append((rel, Record(rel, file, question, (answer,))))
    if not found:
        raise DataError(
            f"{root} must hold {MANIFEST_NAME} or class folders of "
            f"{'/'.join(sorted(IMAGE_SUFFIXES))} images, got neither."
        )
    return found


def _keep_readable(
    candidates: list[tuple[str, Record]],
) -> tuple[tuple[Record, ...], tuple[SkippedRecord, ...]]:
    kept: list[Record] = []
    skipped: list[SkippedRecord] = []
    for source, record in candidates:
        problem = _image_problem(record.image_path)
        if problem is None:
            kept.append(record)
        else:
            skipped.append(SkippedRecord(source, record.image_path, problem))
    return tuple(kept), tuple(skipped)


def _image_problem(path: Path) -> str | None:
    if not path.is_file():
        return "image file not found"
    try:
        # verify() checks the file's structure without decoding every pixel: cheap enough for
        # each record once, and it catches truncated or mislabelled files before extraction.
        with Image.open(path) as image:
            image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return f"image cannot be read ({type(exc).__name__}: {exc})"
    return None
