"""Procedurally drawn image tasks, written in the real site-data format.

Every image shows one to four shapes of one kind and one colour, grouped on one side of the
canvas. Four tasks ask about the same images with the same question; only the answer differs:

* ``colour`` — the shapes' colour (red, green, blue, yellow);
* ``shape`` — their kind (circle, square, triangle, cross);
* ``count`` — how many there are (1 to 4, as digits);
* ``position`` — where they are grouped (left, right, top, bottom).

So a model can tell the task only from the demonstrations' answers: zero-shot it must guess,
with K shots (or a task vector) it can know. These are ``TRAINED_TASKS``: the embedded models
are trained on them. Each site, the public set and the test set are separate folders
(``manifest.jsonl`` + images) that ``client.data.records.load_dataset`` reads.

**Untrained family** (``UNTRAINED_TASKS``, never shown in training): ``<attribute>-merged``
merges the attribute's four values pairwise into two answer words of its own vocabulary
(``MERGED_ANSWERS``): colour warm/cool (red, yellow -> red; green, blue -> blue), shape
(circle, square -> circle; triangle, cross -> triangle), count (1, 2 -> 1; 3, 4 -> 3), position
by axis (left, right -> left; top, bottom -> top). The demonstrations carry what zero-shot
cannot (which two words answer), and it is harder: a model that answers the trained attribute
is right on exactly half the queries, so only accuracy above 0.5 shows the new rule learned in
context. Its answers are words the embedded tokenizer already has (checked at import).

**Word family** (``WORD_TASKS``, for a model with a real vocabulary such as
``client.models.pretrained``): each attribute's four values map to four *other* words (count
as a word, colour in French or as a fruit, the opposite position). No model here was trained
to say them for an image, so only in-context learning can give them.

**Many-class family** (``MANY_CLASS_TASKS``): ``colour-shape-code`` answers one of sixteen
words (``CODE_WORDS``) for each colour-shape pair, a code book with no rule behind it;
``colour-shape`` answers the pair itself in two words ("red circle"), sixteen classes with a
rule a model can read off the image. Its first token names only the colour, so it is scored
by the whole answer (``client.evaluation.run.evaluate``), not by the first token.

**Content-disjoint splits (public rule).** A scene is one of 4 x 4 x 4 x 4 = 256 attribute
combinations. With each attribute's index (colour, shape and position in the order of
``COLOURS``, ``SHAPES``, ``POSITIONS``; count - 1), a scene's split is
``(colour + shape + (count - 1) + position) mod 4``: 0 is ``test``, 1 is ``validation``, 2 and 3
are ``train``. So 64 scenes are test, 64 validation and 128 train, and inside every split each
value of each attribute appears equally often (every task's answers are balanced). The embedded
models are trained on ``train`` scenes only; sites and public data are drawn from ``train``
scenes; validation queries (for choices: order, rescaling, C) from ``validation`` scenes; test
queries from ``test`` scenes, which neither the model, nor any site, nor public data ever shows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from client.data.records import write_jsonl_dataset
from dpmtv_common.errors import ConfigError
from dpmtv_common.rng import make_rng

__all__ = [
    "CODE_WORDS",
    "MANY_CLASS_TASKS",
    "MERGED_ANSWERS",
    "QUESTION",
    "SCENE_SPLITS",
    "TASKS",
    "TRAINED_TASKS",
    "UNTRAINED_TASKS",
    "WORD_ANSWERS",
    "WORD_TASKS",
    "SceneSpec",
    "all_scenes",
    "draw_scene",
    "random_scene",
    "scene_split",
    "task_family",
    "write_task_datasets",
]

QUESTION = "What is the answer for this image?"
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
SHAPES = ("circle", "square", "triangle", "cross")
POSITIONS = ("left", "right", "top", "bottom")
TRAINED_TASKS = ("colour", "shape", "count", "position")
# Each untrained task merges an attribute's values pairwise; the word answered is one of the
# attribute's own words, so the shipped tokenizers need no new token (module docstring).
MERGED_ANSWERS: dict[str, dict[str, str]] = {
    "colour-merged": {"red": "red", "yellow": "red", "green": "blue", "blue": "blue"},
    "shape-merged": {
        "circle": "circle",
        "square": "circle",
        "triangle": "triangle",
        "cross": "triangle",
    },
    "count-merged": {"1": "1", "2": "1", "3": "3", "4": "3"},
    "position-merged": {"left": "left", "right": "left", "top": "top", "bottom": "top"},
}
UNTRAINED_TASKS = tuple(MERGED_ANSWERS)
# Each word task maps an attribute's four values to four words that no model here was
# trained to say for an image (the pretrained-decoder model's projector saw only the attribute
# words; the word-level embedded models cannot say them at all): a gain over zero-shot is the
# decoder's in-context learning, not recall. ``position-opposite`` uses seen words in a new map.
WORD_ANSWERS: dict[str, dict[str, str]] = {
    "count-word": {"1": "one", "2": "two", "3": "three", "4": "four"},
    "colour-french": {"red": "rouge", "green": "vert", "blue": "bleu", "yellow": "jaune"},
    "colour-fruit": {"red": "cherry", "green": "lime", "blue": "blueberry", "yellow": "banana"},
    "position-opposite": {"left": "right", "right": "left", "top": "bottom", "bottom": "top"},
}
WORD_TASKS = tuple(WORD_ANSWERS)
# A many-class task: each of the 16 colour-shape pairs answers its own word, with no rule a
# model could read off the image (a code book): four demonstrations show at most four of the
# sixteen entries, so only many examples can teach it (``benchmarks/weak_site_candidates.py``).
CODE_WORDS = (
    "cat", "dog", "fish", "bird", "horse", "cow", "lion", "tiger",
    "bear", "wolf", "fox", "frog", "duck", "goat", "sheep", "mouse",
)  # fmt: skip
MANY_CLASS_TASKS = ("colour-shape-code", "colour-shape")
TASKS = TRAINED_TASKS + UNTRAINED_TASKS + WORD_TASKS + MANY_CLASS_TASKS
IMAGE_SIZE = 64
SCENE_SPLITS = ("train", "validation", "test")
_SPLIT_OF_RESIDUE = ("test", "validation", "train", "train")


@dataclass(frozen=True)
class SceneSpec:
    """What one image shows."""

    colour: str
    shape: str
    count: int
    position: str

    def answer(self, task: str) -> str:
        """The answer to ``task`` for this scene."""
        answers = {
            "colour": self.colour,
            "shape": self.shape,
            "count": str(self.count),
            "position": self.position,
        }
        if task in MERGED_ANSWERS:
            attribute = task.removesuffix("-merged")
            return MERGED_ANSWERS[task][answers[attribute]]
        if task in WORD_ANSWERS:
            attribute = task.split("-", 1)[0]
            return WORD_ANSWERS[task][answers[attribute]]
        if task == "colour-shape":
            return f"{self.colour} {self.shape}"
        if task == "colour-shape-code":
            return CODE_WORDS[4 * list(COLOURS).index(self.colour) + SHAPES.index(self.shape)]
        if task not in answers:
            raise ConfigError(f"task must be one of {list(TASKS)}, got {task!r}.")
        return answers[task]


def task_family(task: str) -> str:
    """``trained``, ``untrained`` (merged), ``words`` or ``many-class`` (sixteen classes)."""
    if task in TRAINED_TASKS:
        return "trained"
    if task in UNTRAINED_TASKS:
        return "untrained"
    if task in WORD_TASKS:
        return "words"
    if task in MANY_CLASS_TASKS:
        return "many-class"
    raise ConfigError(f"task must be one of {list(TASKS)}, got {task!r}.")


def _check_merged_answers() -> None:
    """Refuse a merge whose words are not the attribute's own (the tokenizer's vocabulary)."""
    words = {
        "colour": tuple(COLOURS),
        "shape": SHAPES,
        "count": ("1", "2", "3", "4"),
        "position": POSITIONS,
    }
    for task, merge in MERGED_ANSWERS.items():
        own = words[task.removesuffix("-merged")]
        if set(merge) != set(own) or not set(merge.values()) <= set(own):
            raise ConfigError(f"{task} must map each of {list(own)} to one of them, got {merge!r}.")
        if sorted(Counter(merge.values()).values()) != [2, 2]:
            raise ConfigError(f"{task} must merge its four values in two pairs, got {merge!r}.")


_check_merged_answers()


def scene_split(scene: SceneSpec) -> str:
    """The split (``train``, ``validation`` or ``test``) that ``scene`` belongs to (module doc)."""
    residue = (
        list(COLOURS).index(scene.colour)
        + SHAPES.index(scene.shape)
        + (scene.count - 1)
        + POSITIONS.index(scene.position)
    ) % 4
    return _SPLIT_OF_RESIDUE[residue]


def all_scenes(split: str | None = None) -> tuple[SceneSpec, ...]:
    """Every scene (in a fixed order), or only those of ``split``."""
    if split is not None and split not in SCENE_SPLITS:
        raise ConfigError(f"split must be one of {list(SCENE_SPLITS)} or None, got {split!r}.")
    scenes = (
        SceneSpec(colour, shape, count, position)
        for colour in COLOURS
        for shape in SHAPES
        for count in range(1, 5)
        for position in POSITIONS
    )
    return tuple(s for s in scenes if split is None or scene_split(s) == split)


def random_scene(rng: np.random.Generator, split: str | None = None) -> SceneSpec:
    """A uniformly random scene, of ``split`` when given (otherwise of the whole space)."""
    scenes = all_scenes(split)
    return scenes[int(rng.integers(len(scenes)))]


def _region(position: str) -> tuple[int, int, int, int]:
    half = IMAGE_SIZE // 2
    return {
        "left": (0, 0, half, IMAGE_SIZE),
        "right": (half, 0, IMAGE_SIZE, IMAGE_SIZE),
        "top": (0, 0, IMAGE_SIZE, half),
        "bottom": (0, half, IMAGE_SIZE, IMAGE_SIZE),
    }[position]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, ...], fill: Any) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
    else:
        third = (x1 - x0) // 3
        draw.rectangle((x0 + third, y0, x1 - third, y1), fill=fill)
        draw.rectangle((x0, y0 + third, x1, y1 - third), fill=fill)


def _slots(region: tuple[int, int, int, int], count: int) -> Iterator[tuple[int, ...]]:
    """Up to four non-overlapping boxes in a 2x2 grid inside ``region``."""
    x0, y0, x1, y1 = region
    width, height = (x1 - x0) // 2, (y1 - y0) // 2
    size = min(width, height) - 4
    for index in range(count):
        column, row = index % 2, index // 2
        left = x0 + column * width + (width - size) // 2
        top = y0 + row * height + (height - size) // 2
        yield (left, top, left + size, top + size)


def draw_scene(scene: SceneSpec, rng: np.random.Generator) -> Image.Image:
    """Render ``scene`` on a light, slightly noisy background."""
    background = rng.integers(225, 256, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    image = Image.fromarray(background, "RGB")
    draw = ImageDraw.Draw(image)
    for box in _slots(_region(scene.position), scene.count):
        _draw_shape(draw, scene.shape, box, COLOURS[scene.colour])
    return image


def _write_split(
    root: Path, task: str, count: int, rng: np.random.Generator, prefix: str, split: str
) -> None:
    (root / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(count):
        scene = random_scene(rng, split)
        name = f"images/{prefix}-{index:05d}.png"
        draw_scene(scene, rng).save(root / name)
        records.append(
            {
                "id": f"{prefix}-{index}",
                "image": name,
                "question": QUESTION,
                "answer": scene.answer(task),
            }
        )
    write_jsonl_dataset(root, records, task=task, privacy_unit="example", instruction=None)


def write_task_datasets(
    root: Path,
    *,
    task: str,
    sites: int,
    per_site: int,
    public: int,
    test: int,
    seed: int,
    validation: int = 0,
) -> dict[str, Path]:
    """Write ``site-0`` … ``site-{sites-1}``, ``public``, ``validation``, ``test`` in ``root``.

    Sites and public data show ``train`` scenes only, ``validation`` its own scenes and ``test``
    scenes no other folder (and no embedded model's training) ever shows: the split is by
    content, not only by record (module docstring). A folder of size 0 is not written.
    """
    if task not in TASKS:
        raise ConfigError(f"task must be one of {list(TASKS)}, got {task!r}.")
    if sites < 0 or (sites > 0 and per_site < 1):
        raise ConfigError(f"sites must be >= 0 and per_site >= 1, got {sites!r} and {per_site!r}.")
    rng = make_rng(seed)
    folders = {f"site-{i}": (per_site, "train") for i in range(sites)} | {
        "public": (public, "train"),
        "test": (test, "test"),
        "validation": (validation, "validation"),
    }
    written = {}
    for name, (count, split) in folders.items():
        if count > 0:
            _write_split(root / name, task, count, rng, name, split)
            written[name] = root / name
    return written
