"""What a site admin needs to know about a dataset before spending any privacy budget.

:func:`check_dataset` reads a dataset the way a release will (``client.data.records.load_dataset``:
every image decoded in full) and describes it without a model: n, the privacy unit and its
groups, the chunks a K-shot plan would cut, image sizes, modes and stored pixel values (and
how each was read: ``client.data.images``), the answers.
:func:`check_with_model` adds what depends on the model: each answer's first token (what
head selection scores) and the share that falls outside the vocabulary (``<unk>``), and the
prompt length of each chunk against the model's context, measured with the model's own
processor and never a forward pass. Both return plain data; :func:`report_lines` renders it.

Nothing here is released: the report is for the site's own eyes, so it may look at record
contents (sizes, answers) that must never steer what is published.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from client.activations.chunking import Chunk, make_chunks, planned_num_chunks
from client.activations.extraction import chunk_prompt, zero_shot_prompt
from client.data.images import PixelScale, PixelSummary, decode_image, summarize_pixels
from client.data.records import SiteDataset, load_dataset
from client.models import LoadedModel, context_length
from dpmtv_common.rng import secret_seed

__all__ = [
    "SMALL_IMAGE_SIDE",
    "AnswerTokens",
    "DataReport",
    "ModelReport",
    "check_dataset",
    "check_with_model",
    "chunk_prompt_lengths",
    "report_lines",
]

SMALL_IMAGE_SIDE = 64
"""Images with a side below this many pixels are reported as small (processors upscale them)."""
_CONVERTED = {
    "I;16": "16-bit greyscale, divided by its bit depth",
    "I": "32-bit integer greyscale, divided by its bit depth",
    "F": "32-bit float greyscale, read by its range",
    "L": "8-bit greyscale, copied to 3 channels",
    "P": "palette, looked up",
    "RGBA": "alpha, composited over white",
    "LA": "greyscale with alpha, composited over white",
}


@dataclass(frozen=True)
class DataReport:
    """The dataset alone (no model).

    Attributes:
        path: The dataset folder.
        task: ``dataset.json``'s task, else the folder name.
        n: Records.
        privacy_unit: ``"example"`` or ``"group"``.
        group_sizes: Records per group (group unit only; empty otherwise).
        shots: K used for the chunk counts.
        num_chunks: m, the chunks a K-shot plan cuts (before any ``max_chunks``).
        modes: Records per PIL mode of the file as stored (before conversion to RGB).
        widths: Image widths in pixels as the model sees them (EXIF orientation applied), in
            record order; ``heights`` likewise.
        answers: Records per primary answer.
        questions: Distinct questions.
        warnings: What the admin should look at before a release.
        pixels: Stored pixel values per mode and reading (ranges, and how each became 0..255).
    """

    path: Path
    task: str
    n: int
    privacy_unit: str
    group_sizes: tuple[int, ...]
    shots: int
    num_chunks: int
    modes: dict[str, int]
    widths: tuple[int, ...]
    heights: tuple[int, ...]
    answers: dict[str, int]
    questions: int
    warnings: tuple[str, ...] = ()
    pixels: tuple[PixelSummary, ...] = ()


@dataclass(frozen=True)
class AnswerTokens:
    """How the model's tokenizer reads one distinct answer."""

    answer: str
    records: int
    first_token: str
    first_id: int
    unknown: bool
    """True when any of its tokens is the unknown token."""


@dataclass(frozen=True)
class ModelReport:
    """What depends on the model: answer tokens and prompt lengths.

    Attributes:
        context: The model's context in tokens (None if its config names none).
        answers: Each distinct answer's tokens, most frequent first.
        unk_first_share: Share of records whose answer's FIRST token is ``<unk>``.
        unk_any_share: Share of records whose answer holds ``<unk>`` anywhere.
        chunk_lengths: ``(query record id, prompt tokens)`` of each measured chunk.
        chunks_total: How many chunks the plan cuts (``chunk_lengths`` may be a sample).
        zero_shot_length: Tokens of a zero-shot prompt (one image), the first query's.
        max_image_crops: The crop cap the prompts were measured under (None: as shipped).
        warnings: What the admin should look at.
        errors: What makes a release fail (prompts beyond the context).
    """

    context: int | None
    answers: tuple[AnswerTokens, ...]
    unk_first_share: float
    unk_any_share: float
    chunk_lengths: tuple[tuple[str, int], ...]
    chunks_total: int
    zero_shot_length: int
    max_image_crops: int | None = None
    warnings: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


def check_dataset(
    path: str | os.PathLike[str], *, shots: int = 4, question: str | None = None
) -> tuple[SiteDataset, DataReport]:
    """Load and check the dataset at ``path`` in full and describe it (no model needed).

    Raises:
        DataError: As :func:`client.data.records.load_dataset` (an unusable record stops the check).
    """
    dataset = load_dataset(path, question=question)
    sizes, modes, decoded = [], Counter[str](), []
    for record in dataset.records:
        image = decode_image(record.image_path)
        sizes.append(image.rgb.size)
        modes[image.mode] += 1
        decoded.append(image.summary())  # no pixels kept
    groups = Counter(r.group for r in dataset.records if r.group is not None)
    report = DataReport(
        path=Path(path),
        task=dataset.task,
        n=len(dataset),
        privacy_unit=dataset.privacy_unit,
        group_sizes=tuple(sorted(groups.values())),
        shots=shots,
        num_chunks=planned_num_chunks(dataset, shots, None),
        modes=dict(modes.most_common()),
        widths=tuple(w for w, _ in sizes),
        heights=tuple(h for _, h in sizes),
        answers=dict(Counter(r.answer for r in dataset.records).most_common()),
        questions=len({r.question for r in dataset.records}),
        pixels=summarize_pixels(decoded),
    )
    return dataset, _with_data_warnings(report)


def _with_data_warnings(report: DataReport) -> DataReport:
    warnings = []
    if report.num_chunks < 1:
        warnings.append(
            f"no {report.shots}-shot chunk can be cut from n = {report.n}: lower --shots "
            "or add data."
        )
    converted = {m: c for m, c in report.modes.items() if m != "RGB"}
    for mode, count in converted.items():
        how = _CONVERTED.get(mode, "converted by PIL")
        warnings.append(f"{count} images are mode {mode} ({how}): the model sees RGB.")
    small = sum(
        min(w, h) < SMALL_IMAGE_SIDE for w, h in zip(report.widths, report.heights, strict=True)
    )
    if small:
        warnings.append(
            f"{small} images have a side under {SMALL_IMAGE_SIDE} px: processors upscale them "
            "(and image splitting may still cut them into several crops)."
        )
    warnings += _pixel_warnings(report.pixels)
    if len(report.answers) == report.n and report.n > 1:
        warnings.append("every answer is distinct: a task vector carries a task, not a lookup.")
    return replace(report, warnings=tuple(warnings))


def _pixel_warnings(pixels: Sequence[PixelSummary]) -> list[str]:
    found = []
    depths = sorted({p.reading for p in pixels if p.scale is PixelScale.BIT_DEPTH})
    if len(depths) > 1:
        found.append(
            f"integer images were read at different bit depths ({'; '.join(depths)}): each "
            "image's depth is the fewest of 8/10/12/14/16 bits that hold its brightest value, "
            "so a dark scan reads brighter than on its scanner's scale."
        )
    several = sum(p.several_frames for p in pixels)
    if several:
        found.append(
            f"{several} images hold several frames (multi-page TIFF, animated GIF or WebP): "
            "the model sees the first frame only."
        )
    for p in pixels:
        if p.scale is PixelScale.OWN_RANGE:
            found.append(
                f"{p.images} mode {p.mode} images hold {p.low:g}..{p.high:g}, outside any "
                "fixed scale: each is stretched from its own range to 0..255, so brightness "
                "is relative within an image."
            )
    return found


def chunk_prompt_lengths(
    loaded: LoadedModel, chunks: Sequence[Chunk], *, instruction: str | None
) -> list[int]:
    """Each chunk's K-shot prompt length in tokens, image tokens included (no forward pass).

    The site can call this before a release to see whether its chunks fit the model's
    context (``client.models.context_length``).
    """
    prompts = [chunk_prompt(chunk) for chunk in chunks]
    return loaded.adapter.prompt_lengths(loaded.processor, prompts, instruction=instruction)


def _answer_tokens(loaded: LoadedModel, answers: dict[str, int]) -> list[AnswerTokens]:
    """Tokenise each distinct answer as head scoring does (first token, no special tokens)."""
    tokenizer = loaded.processor.tokenizer
    unk = tokenizer.unk_token_id
    out = []
    for answer, count in answers.items():
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"] or [-1]
        first = str(tokenizer.convert_ids_to_tokens(ids[0])) if ids[0] >= 0 else "(empty)"
        unknown = unk is not None and unk in ids
        out.append(AnswerTokens(answer, count, first, int(ids[0]), unknown))
    return out


def check_with_model(
    dataset: SiteDataset,
    report: DataReport,
    loaded: LoadedModel,
    *,
    max_chunks: int = 32,
    seed: int | None = None,
) -> ModelReport:
    """Describe the dataset against ``loaded``: answer tokens and chunk prompt lengths.

    Args:
        dataset: From :func:`check_dataset`.
        report: Its report (for the answers and K).
        loaded: The site's model.
        max_chunks: Measure at most this many chunks (the processor runs on each).
        seed: Chunk shuffle key; default a fresh secret one (lengths vary little with it).
    """
    tokens = _answer_tokens(loaded, report.answers)
    n = max(report.n, 1)
    unk_id = loaded.processor.tokenizer.unk_token_id
    unk_first = sum(t.records for t in tokens if unk_id is not None and t.first_id == unk_id) / n
    unk_any = sum(t.records for t in tokens if t.unknown) / n
    lengths: list[tuple[str, int]] = []
    if report.num_chunks >= 1:
        key = secret_seed() if seed is None else seed
        plan = make_chunks(dataset, shots=report.shots, seed=key, max_chunks=max_chunks)
        measured = chunk_prompt_lengths(loaded, plan.chunks, instruction=dataset.instruction)
        lengths = [(c.query.id, length) for c, length in zip(plan.chunks, measured, strict=True)]
    first = dataset.records[0]
    zero_shot = loaded.adapter.prompt_lengths(
        loaded.processor, [zero_shot_prompt(first)], instruction=dataset.instruction
    )[0]
    result = ModelReport(
        context=context_length(loaded.model),
        answers=tuple(tokens),
        unk_first_share=unk_first,
        unk_any_share=unk_any,
        chunk_lengths=tuple(lengths),
        chunks_total=report.num_chunks,
        zero_shot_length=zero_shot,
        max_image_crops=loaded.max_image_crops,
    )
    return _with_model_findings(result)


def _with_model_findings(report: ModelReport) -> ModelReport:
    warnings, errors = [], []
    if report.unk_first_share > 0:
        warnings.append(
            f"{report.unk_first_share:.0%} of answers start with the unknown token: head "
            "selection would score p(<unk>) for them and the model cannot say them. Use a "
            "model whose vocabulary covers the labels, or rename the labels."
        )
    elif report.unk_any_share > 0:
        warnings.append(
            f"{report.unk_any_share:.0%} of answers contain the unknown token after their "
            "first token: generated answers cannot match them exactly."
        )
    firsts = Counter(t.first_id for t in report.answers)
    shared = sorted(t.answer for t in report.answers if firsts[t.first_id] > 1)
    if shared:
        warnings.append(
            f"{len(shared)} distinct answers share a first token with another ({shared[:6]}): "
            "head selection, which scores the first token, cannot tell them apart."
        )
    limit = report.context
    over = [length for _, length in report.chunk_lengths if limit is not None and length > limit]
    if over:
        errors.append(
            f"{len(over)} of {len(report.chunk_lengths)} measured chunk prompts exceed the "
            f"model's context of {report.context} tokens (longest {max(over)}): lower --shots, "
            "use smaller images or fewer crops an image (--max-image-crops, the plan's "
            "max-image-crops)."
        )
    return replace(report, warnings=tuple(warnings), errors=tuple(errors))


def _spread(values: Sequence[int]) -> str:
    if not values:
        return "none"
    return f"min {min(values)}, median {statistics.median(values):g}, max {max(values)}"


def report_lines(data: DataReport, model: ModelReport | None = None) -> list[str]:
    """Render the reports as the lines ``dpmtv-site data check`` prints."""
    lines = [
        f"dataset {data.path} (task {data.task!r})",
        f"  n = {data.n} records, privacy unit: {data.privacy_unit}",
    ]
    if data.group_sizes:
        lines.append(f"  groups: {len(data.group_sizes)} ({_spread(data.group_sizes)} records)")
    lines += [
        f"  chunks at {data.shots} shots: m = {data.num_chunks}",
        f"  images: width {_spread(data.widths)}; height {_spread(data.heights)}",
        "  modes: " + ", ".join(f"{mode} {count}" for mode, count in data.modes.items()),
        *(f"  pixel values: {p.line()}" for p in data.pixels),
        f"  questions: {data.questions} distinct; answers: {len(data.answers)} distinct, top: "
        + ", ".join(f"{a!r} {c}" for a, c in list(data.answers.items())[:5]),
    ]
    if model is not None:
        lines += _model_lines(model)
    findings = [*data.warnings, *(model.warnings if model else ())]
    lines += [f"warning: {w}" for w in findings]
    lines += [f"error: {e}" for e in (model.errors if model else ())]
    return lines


def _model_lines(model: ModelReport) -> list[str]:
    lengths = [length for _, length in model.chunk_lengths]
    context = "unknown" if model.context is None else f"{model.context} tokens"
    crops = (
        "as the processor ships"
        if model.max_image_crops is None
        else f"at most {model.max_image_crops} an image"
    )
    lines = [
        f"  model context: {context}; zero-shot prompt: {model.zero_shot_length} tokens",
        f"  image crops: {crops}",
        f"  chunk prompts ({len(lengths)} of {model.chunks_total} measured): {_spread(lengths)}",
    ]
    longest = sorted(model.chunk_lengths, key=lambda item: -item[1])[:3]
    if longest:
        lines.append("  longest: " + ", ".join(f"query {q}: {n}" for q, n in longest))
    lines.append(
        f"  answers' first tokens (out of vocabulary: {model.unk_first_share:.0%} first, "
        f"{model.unk_any_share:.0%} anywhere):"
    )
    lines += [
        f"    {t.answer!r} x{t.records} -> {t.first_token!r} ({t.first_id})"
        + (" <unk>" if t.unknown else "")
        for t in model.answers[:10]
    ]
    if len(model.answers) > 10:
        lines.append(f"    ... and {len(model.answers) - 10} more")
    return lines
