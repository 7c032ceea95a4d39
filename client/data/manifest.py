"""Parse and check ``manifest.jsonl`` and ``dataset.json`` (no image I/O).

Kept apart from :mod:`client.data.records` so the line-by-line validation, which owns every error
message about a manifest, reads as one unit. A bad line stops the parse with its 1-based
line number, the problem and the start of the line: it is an export bug to fix, and guessing
around it would silently change n.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dpmtv_common.errors import DataError

__all__ = [
    "MANIFEST_NAME",
    "METADATA_NAME",
    "DatasetLayout",
    "ManifestRow",
    "Metadata",
    "PrivacyUnitName",
    "privacy_unit_from",
    "read_manifest",
    "read_metadata",
]

MANIFEST_NAME = "manifest.jsonl"
METADATA_NAME = "dataset.json"

#: The values of ``protocol.PrivacyUnit``, spelt out so the data layer needs no protocol import.
PrivacyUnitName = Literal["example", "group"]

#: How a dataset folder is laid out (see :mod:`client.data.records`).
DatasetLayout = Literal["manifest", "image-folder"]

_MANIFEST_KEYS = frozenset({"id", "image", "question", "answer", "group"})
_METADATA_KEYS = frozenset({"task", "privacy_unit", "instruction", "layout", "question"})
_QUOTED_CHARS = 80  # enough of a bad line to recognise it, without flooding the log


@dataclass(frozen=True)
class ManifestRow:
    """One checked manifest line; ``image`` is normalised and relative to the folder."""

    line_no: int
    id: str
    image: str
    question: str
    answers: tuple[str, ...]
    group: str | None


@dataclass(frozen=True)
class Metadata:
    """The contents of ``dataset.json``, or its defaults when the file is absent.

    Attributes:
        task: Name of the task (default: the folder's name).
        privacy_unit: ``"example"`` (default) or ``"group"``.
        instruction: Text placed before the demonstrations, or None.
        layout: ``"manifest"`` (default) or ``"image-folder"``, which must be asked for.
        question: The image-folder layout's question, or None for the default one.
    """

    task: str
    privacy_unit: PrivacyUnitName
    instruction: str | None
    layout: DatasetLayout = "manifest"
    question: str | None = None


def privacy_unit_from(value: object, *, where: str) -> PrivacyUnitName:
    """Narrow ``value`` to a privacy unit name, or raise DataError naming ``where``."""
    if value == "example":
        return "example"
    if value == "group":
        return "group"
    raise DataError(f"{where} must be 'example' or 'group', got {value!r}.")


def read_metadata(root: Path) -> Metadata:
    """Read ``root/dataset.json``; without it, the defaults of :class:`Metadata`."""
    path = root / METADATA_NAME
    if not path.is_file():
        return Metadata(root.name, "example", None)
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} must be valid UTF-8 JSON: {exc}") from exc
    if not isinstance(meta, dict) or set(meta) - _METADATA_KEYS:
        raise DataError(
            f"{path} must be an object with keys {sorted(_METADATA_KEYS)}, got {meta!r}."
        )
    task = meta.get("task", root.name)
    instruction = meta.get("instruction")
    if not isinstance(task, str) or not task.strip():
        raise DataError(f"{path}: task must be a non-empty string, got {task!r}.")
    if instruction is not None and not isinstance(instruction, str):
        raise DataError(f"{path}: instruction must be a string or null, got {instruction!r}.")
    unit = privacy_unit_from(meta.get("privacy_unit", "example"), where=f"{path}: privacy_unit")
    layout = meta.get("layout", "manifest")
    if layout not in ("manifest", "image-folder"):
        raise DataError(f"{path}: layout must be 'manifest' or 'image-folder', got {layout!r}.")
    question = meta.get("question")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise DataError(f"{path}: question must be a non-empty string or null, got {question!r}.")
    return Metadata(
        task, unit, instruction, "manifest" if layout == "manifest" else "image-folder", question
    )


class _FieldError(Exception):
    """A manifest object's field is wrong; the caller adds the line number."""


def read_manifest(manifest: Path, *, group_required: bool) -> list[ManifestRow]:
    """Parse every non-blank line of ``manifest``, stopping at the first bad one.

    Raises:
        DataError: A line is not a JSON object with the right fields, an id repeats (both
            lines are named), a group is missing while ``group_required``, or there is no line.
    """
    rows: list[ManifestRow] = []
    first_line_of: dict[str, int] = {}
    with manifest.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            text = _decode_line(manifest, line_no, raw)
            if not text.strip():
                continue
            row = _parse_line(manifest, line_no, text.rstrip("\r\n"), group_required)
            if row.id in first_line_of:
                raise DataError(
                    f"{manifest} line {line_no}: id {row.id!r} is already used on line "
                    f"{first_line_of[row.id]}; ids must be unique."
                )
            first_line_of[row.id] = line_no
            rows.append(row)
    if not rows:
        raise DataError(f"{manifest} must hold at least one record, got an empty file.")
    return rows


def _decode_line(manifest: Path, line_no: int, raw: bytes) -> str:
    """One line as text; a byte that is not UTF-8 is an error naming the line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{manifest} line {line_no} must be UTF-8, got byte {raw[exc.start]:#04x} at "
            f"column {exc.start + 1}; re-export the manifest as UTF-8."
        ) from exc


def _parse_line(manifest: Path, line_no: int, text: str, group_required: bool) -> ManifestRow:
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise _FieldError(f"must be a JSON object, got {type(obj).__name__}")
        return _row_from_object(obj, line_no, group_required)
    except (json.JSONDecodeError, _FieldError) as exc:
        problem = f"not valid JSON ({exc.msg})" if isinstance(exc, json.JSONDecodeError) else exc
        quoted = text if len(text) <= _QUOTED_CHARS else text[: _QUOTED_CHARS - 3] + "..."
        raise DataError(f"{manifest} line {line_no}: {problem}; line: {quoted!r}") from exc


def _row_from_object(obj: dict[str, Any], line_no: int, group_required: bool) -> ManifestRow:
    unknown = sorted(set(obj) - _MANIFEST_KEYS)
    if unknown:
        raise _FieldError(f"unknown keys {unknown} (allowed: {sorted(_MANIFEST_KEYS)})")
    image = _text_field(obj, "image")
    # A manifest must not reach outside its folder: a site's data stays where it was reviewed.
    if image is None or os.path.isabs(image) or os.path.normpath(image).startswith(".."):
        raise _FieldError(f"'image' must be a relative path inside the folder, got {image!r}")
    question = _text_field(obj, "question")
    if question is None:
        raise _FieldError("'question' is missing")
    group = _text_field(obj, "group")
    if group is None and group_required:
        raise _FieldError("'group' is missing, but dataset.json sets privacy_unit 'group'")
    record_id = _text_field(obj, "id")
    return ManifestRow(
        line_no=line_no,
        id=f"line-{line_no}" if record_id is None else record_id,
        image=os.path.normpath(image),
        question=question,
        answers=_answers_field(obj),
        group=group,
    )


def _text_field(obj: dict[str, Any], key: str) -> str | None:
    """The non-blank string at ``key``, or None when the key is absent."""
    if key not in obj:
        return None
    value = obj[key]
    if not isinstance(value, str) or not value.strip():
        raise _FieldError(f"{key!r} must be a non-empty string, got {value!r}")
    return value


def _answers_field(obj: dict[str, Any]) -> tuple[str, ...]:
    value = obj.get("answer")
    if isinstance(value, str) and value.strip():
        return (value,)
    if isinstance(value, list) and value and all(isinstance(a, str) and a.strip() for a in value):
        return tuple(value)
    shown = "it is missing" if "answer" not in obj else f"got {value!r}"
    raise _FieldError(f"'answer' must be a non-empty string or list of them, {shown}")
