"""A site's private dataset on disk: records of (image, question, answers), loaded and checked.

:func:`load_dataset` reads one of two layouts in a folder ``root``:

* **JSONL manifest** (``"manifest"``, the default) ``root/manifest.jsonl``: one JSON object a
  line with ``image`` (a path relative to ``root``), ``question``, ``answer`` (a string, or a
  list of human answers whose first is the primary answer shown in demonstrations), optional
  ``id`` (default ``"line-<n>"``) and optional ``group`` (who owns the record, e.g. a patient
  id: the privacy unit in group mode). Blank lines are ignored.
* **Image folder** (``"image-folder"``, only when asked for) ``root/<class name>/<image>``:
  every record asks the same question (``question`` of ``dataset.json``, else
  :data:`DEFAULT_QUESTION`) and is answered by its class name, underscores read as spaces.
  Every file PIL reads is an image (:data:`~client.data.images.IMAGE_SUFFIXES`: ``.png``,
  ``.jpg``, ``.tif``, ``.bmp``, ``.webp``, ...). Nothing is dropped without a word: any other
  file or a sub-folder in a class folder, or an image beside the class folders, is an error
  (hidden files, whose names start with ``.``, are not records).

Either layout may add ``root/dataset.json`` =
``{"task", "privacy_unit", "instruction", "layout", "question"}``. The image-folder layout must
be chosen explicitly (``"layout": "image-folder"`` there, or ``layout=`` here): a missing
manifest is an error, never a quiet switch to folder names as answers.

**Every record is checked in full at load** (unless ``check_images=False``). Each image is
decoded completely, the way extraction will read it (:func:`~client.data.images.read_rgb`:
bit depth, float ranges and the rest are read from what the file holds), and must lie inside
``root`` once symlinks are resolved. Any missing, unreadable, oversized (a decompression
bomb), unfaithfully readable or outside image stops the load with a
:class:`~dpmtv_common.errors.DataError` that counts the bad records and names the first ones.
No record is ever skipped: n, and with it the published chunk count m, must never depend on
a record's content (docs/data.md). A site service checks in full when it starts; once it has
started, a record that fails to decode costs its own chunk (it contributes zeros) and never
the site's place in a release.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from PIL import Image

from client.data.images import IMAGE_SUFFIXES, read_rgb, to_rgb
from client.data.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    DatasetLayout,
    PrivacyUnitName,
    privacy_unit_from,
    read_manifest,
    read_metadata,
)
from dpmtv_common.errors import ConfigError, DataError
from dpmtv_common.files import write_atomic

__all__ = [
    "DEFAULT_QUESTION",
    "IMAGE_SUFFIXES",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "DatasetLayout",
    "PrivacyUnitName",
    "Record",
    "SiteDataset",
    "load_dataset",
    "read_rgb",
    "to_rgb",
    "write_jsonl_dataset",
]

DEFAULT_QUESTION = "What is shown in the image?"
_SHOWN_PROBLEMS = 5  # an error message quotes this many bad records


@dataclass(frozen=True)
class Record:
    """One private example: an image, a question and its accepted answers.

    Attributes:
        id: Unique within its dataset.
        image_path: Absolute path of the image file.
        question: The question asked about the image.
        answers: Accepted answers, at least one; the first is the primary answer.
        group: Who owns the record (the privacy unit in group mode), or None.
        root: The dataset folder the image must lie in once symlinks are resolved (None:
            not checked, for records built in code).
    """

    id: str
    image_path: Path
    question: str
    answers: tuple[str, ...]
    group: str | None = None
    root: Path | None = None

    def __post_init__(self) -> None:
        if not self.answers:
            raise DataError(f"answers of record {self.id!r} must not be empty, got ().")

    @property
    def answer(self) -> str:
        """The primary answer, the one a demonstration shows."""
        return self.answers[0]

    def load_image(self) -> Image.Image:
        """Read the image as faithful RGB (:func:`read_rgb`); the file is closed on return.

        Raises:
            DataError: The image resolves outside ``root`` (a symlink placed after the load).
        """
        outside = self.root is not None and not self.image_path.resolve().is_relative_to(self.root)
        if outside and self.image_path.exists():  # a missing file is the decoder's to report
            raise DataError(
                f"image of record {self.id!r} must lie inside {self.root}, got "
                f"{self.image_path.resolve()}."
            )
        return read_rgb(self.image_path)


@dataclass(frozen=True)
class SiteDataset:
    """A site's loaded dataset, every record checked.

    Attributes:
        records: The records, in file order.
        task: Name of the task (``dataset.json``, else the folder name).
        privacy_unit: ``"example"``, or ``"group"`` when one owner's records are one unit
            (see ``client.activations.chunking`` for how each unit maps to chunks).
        instruction: Optional text placed before the demonstrations.
    """

    records: tuple[Record, ...]
    task: str
    privacy_unit: PrivacyUnitName = "example"
    instruction: str | None = None

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


def load_dataset(
    path: str | os.PathLike[str],
    *,
    question: str | None = None,
    layout: DatasetLayout | None = None,
    check_images: bool = True,
) -> SiteDataset:
    """Load a site dataset and check every record in full; see the module docstring.

    Args:
        path: The dataset folder.
        question: The question of every image-folder record (overrides ``dataset.json``;
            default :data:`DEFAULT_QUESTION`); a manifest brings its own questions.
        layout: ``"manifest"`` or ``"image-folder"``; default: ``dataset.json``'s ``layout``,
            else ``"manifest"``.
        check_images: Decode and check every image (the default, and what a site must do
            before it accepts a plan). False lists the records without opening any image:
            for re-reading, within one release, a dataset already checked at plan time, where
            a record that fails since then must cost its own chunk only (it contributes zero
            in extraction) rather than stop the site.

    Raises:
        DataError: The folder, a manifest line or ``dataset.json`` is unusable, the chosen
            layout's files are missing, or any record's image is missing, unreadable, too
            large or outside the folder (all of them counted, the first few named).
        ConfigError: ``question`` is empty or ``layout`` unknown.
    """
    root = Path(path).resolve()
    if not root.is_dir():
        raise DataError(f"dataset path must be an existing folder, got {str(path)!r}.")
    if question is not None and not question.strip():
        raise ConfigError(f"question must be a non-empty string, got {question!r}.")
    if layout is not None and layout not in get_args(DatasetLayout):
        raise ConfigError(f"layout must be 'manifest' or 'image-folder', got {layout!r}.")
    meta = read_metadata(root)
    chosen = layout or meta.layout
    has_manifest = (root / MANIFEST_NAME).is_file()
    if chosen == "manifest":
        if not has_manifest:
            raise DataError(
                f"{root} must hold {MANIFEST_NAME}, got none. For class folders answered by "
                f'their names, set "layout": "image-folder" in {METADATA_NAME}.'
            )
        candidates = _manifest_records(root, group_required=meta.privacy_unit == "group")
    else:
        if has_manifest:
            raise DataError(
                f"{root} holds {MANIFEST_NAME}, so layout must be 'manifest', got "
                f"'image-folder'; remove one of them."
            )
        candidates = _scan_image_folder(root, question or meta.question or DEFAULT_QUESTION)
    if check_images:
        _check_images(root, candidates)
    records = tuple(record for _, record in candidates)
    return SiteDataset(records, meta.task, meta.privacy_unit, meta.instruction)


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
    write_atomic(root / MANIFEST_NAME, lines)
    write_atomic(root / METADATA_NAME, json.dumps(metadata, indent=2) + "\n")
    return root


def _manifest_records(root: Path, *, group_required: bool) -> list[tuple[str, Record]]:
    rows = read_manifest(root / MANIFEST_NAME, group_required=group_required)
    return [
        (f"line {r.line_no}", Record(r.id, root / r.image, r.question, r.answers, r.group, root))
        for r in rows
    ]


def _scan_image_folder(root: Path, question: str) -> list[tuple[str, Record]]:
    found: list[tuple[str, Record]] = []
    stray: list[str] = []  # what a scan would otherwise drop without a word
    for entry in sorted(_visible(root)):
        if entry.is_file() and entry.suffix.lower() in IMAGE_SUFFIXES:
            stray.append(f"{entry.name} (an image outside any class folder)")
        if not entry.is_dir():
            continue
        answer = entry.name.replace("_", " ")
        for file in sorted(_visible(entry)):
            rel = file.relative_to(root).as_posix()
            if file.is_dir():
                stray.append(f"{rel}/ (a folder inside a class folder)")
            elif file.suffix.lower() not in IMAGE_SUFFIXES:
                stray.append(f"{rel} (not a format PIL reads)")
            else:
                found.append((rel, Record(rel, file, question, (answer,), root=root)))
    if stray:
        shown = "; ".join(stray[:_SHOWN_PROBLEMS])
        more = f"; and {len(stray) - _SHOWN_PROBLEMS} more" if len(stray) > _SHOWN_PROBLEMS else ""
        raise DataError(
            f"layout 'image-folder' must hold only class folders of images, got {len(stray)} "
            f"other entries in {root}: {shown}{more}. Move them out: no file is dropped "
            "without a word."
        )
    if not found:
        raise DataError(
            f"{root} must hold class folders of images (e.g. .png, .jpg, .tif) "
            "for layout 'image-folder', got none."
        )
    return found


def _visible(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if not p.name.startswith(".")]


def _check_images(root: Path, candidates: list[tuple[str, Record]]) -> None:
    """Raise one DataError counting every record whose image cannot be used."""
    problems: list[tuple[str, str, str]] = []  # (kind, source, detail)
    for source, record in candidates:
        problem = _image_problem(root, record.image_path)
        if problem is not None:
            problems.append((problem[0], source, problem[1]))
    if not problems:
        return
    kinds = Counter(kind for kind, _, _ in problems)
    summary = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    shown = "; ".join(
        detail if detail.startswith(f"{source}: ") else f"{source}: {detail}"
        for _, source, detail in problems[:_SHOWN_PROBLEMS]
    )
    more = (
        f"; and {len(problems) - _SHOWN_PROBLEMS} more" if len(problems) > _SHOWN_PROBLEMS else ""
    )
    raise DataError(
        f"every record's image must be readable, got {len(problems)} of {len(candidates)} "
        f"records unusable in {root} ({summary}): {shown}{more}. Fix or remove them: records "
        "are never skipped, since n must not depend on their content."
    )


def _image_problem(root: Path, path: Path) -> tuple[str, str] | None:
    """``(kind, detail)`` of what is wrong with the image at ``path``, or None."""
    name = os.path.relpath(path, root)
    if not path.is_file():
        return "missing", f"{name}: image file not found"
    real = path.resolve()
    # The manifest's text check cannot see symlinks: the real file must be in the folder too.
    if not real.is_relative_to(root):
        return "outside the folder", f"{name}: resolves to {real}, outside the folder"
    try:
        read_rgb(real)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        return "too large", f"{name}: {exc}"
    except DataError as exc:  # decodes, but its values cannot be read faithfully
        return "refused", f"{name}: {exc}"
    # Any failure while decoding is the file's fault (PIL plugins raise many types on
    # malformed input): report it rather than end in a traceback.
    except Exception as exc:
        return "unreadable", f"{name}: cannot be decoded ({type(exc).__name__}: {exc})"
    return None
