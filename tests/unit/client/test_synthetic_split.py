"""The content split of the synthetic scenes: disjoint, balanced, and honoured by the writers."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

import client.data.synthetic as synthetic
from client.data.synthetic import (
    CODE_WORDS,
    MANY_CLASS_TASKS,
    SCENE_SPLITS,
    TASKS,
    TRAINED_TASKS,
    UNTRAINED_TASKS,
    WORD_TASKS,
    SceneSpec,
    all_scenes,
    draw_scene,
    random_scene,
    scene_split,
    task_family,
    write_task_datasets,
)
from client.models.embedded import EMBEDDED_MODEL_DIRS
from dpmtv_common.errors import ConfigError
from dpmtv_common.rng import make_rng


def test_splits_partition_the_256_scenes_into_64_64_128():
    # Act
    sizes = {split: len(all_scenes(split)) for split in SCENE_SPLITS}
    # Assert
    assert sizes == {"train": 128, "validation": 64, "test": 64}
    assert len(set().union(*(set(all_scenes(split)) for split in SCENE_SPLITS))) == 256


@pytest.mark.parametrize("split", SCENE_SPLITS)
def test_every_answer_of_every_task_is_equally_frequent_in_each_split(split):
    scenes = all_scenes(split)
    for task in TASKS:
        counts = Counter(scene.answer(task) for scene in scenes)
        classes = 2 if task in UNTRAINED_TASKS else 16 if task in MANY_CLASS_TASKS else 4
        assert len(counts) == classes, (task, counts)
        assert len(set(counts.values())) == 1, (task, counts)


# The untrained family, written out independently of the code: attribute, then its two pairs
# and the word each pair answers (client.data.synthetic's module docstring).
MERGES = {
    "colour-merged": ("colour", {("red", "yellow"): "red", ("green", "blue"): "blue"}),
    "shape-merged": ("shape", {("circle", "square"): "circle", ("triangle", "cross"): "triangle"}),
    "count-merged": ("count", {("1", "2"): "1", ("3", "4"): "3"}),
    "position-merged": ("position", {("left", "right"): "left", ("top", "bottom"): "top"}),
}


def test_the_families_partition_the_tasks_and_training_sees_only_the_trained_one():
    assert set(UNTRAINED_TASKS) == set(MERGES)
    families = (TRAINED_TASKS, UNTRAINED_TASKS, WORD_TASKS, MANY_CLASS_TASKS)
    assert set(TASKS) == set().union(*families)
    assert len(TASKS) == sum(len(family) for family in families)
    assert {task_family(t) for t in WORD_TASKS} == {"words"}
    assert {task_family(t) for t in MANY_CLASS_TASKS} == {"many-class"}
    assert {task_family(t) for t in TRAINED_TASKS} == {"trained"}
    assert {task_family(t) for t in UNTRAINED_TASKS} == {"untrained"}
    with pytest.raises(ConfigError, match="task must be one of"):
        task_family("colour-swapped")
    script = (Path(__file__).parents[3] / "scripts" / "train_embedded_model.py").read_text()
    assert "TRAINED_TASKS" in script
    assert re.search(r"(?<![A-Z_])TASKS\b", script) is None  # training never draws all tasks


@pytest.mark.parametrize("task", UNTRAINED_TASKS)
def test_a_merged_answer_is_the_documented_pair_word_and_depends_on_nothing_else(task):
    attribute, pairs = MERGES[task]
    word_of = {value: word for pair, word in pairs.items() for value in pair}
    for scene in all_scenes():
        assert scene.answer(task) == word_of[scene.answer(attribute)], (task, scene)


def test_the_code_book_gives_each_colour_shape_pair_its_own_word():
    pairs = {(s.colour, s.shape): s.answer("colour-shape-code") for s in all_scenes()}
    assert len(pairs) == 16
    assert sorted(set(pairs.values())) == sorted(CODE_WORDS)


def test_the_pair_task_answers_colour_then_shape_in_sixteen_classes():
    answers = {s.answer("colour-shape") for s in all_scenes()}
    assert len(answers) == 16
    for scene in all_scenes():
        assert scene.answer("colour-shape") == f"{scene.colour} {scene.shape}"


@pytest.mark.parametrize("task", UNTRAINED_TASKS)
@pytest.mark.parametrize("size", list(EMBEDDED_MODEL_DIRS))
def test_merged_answers_are_words_of_every_shipped_tokenizer(task, size):
    tokenizer = json.loads((EMBEDDED_MODEL_DIRS[size] / "tokenizer.json").read_text())
    vocabulary = set(tokenizer["model"]["vocab"])
    answers = {scene.answer(task) for scene in all_scenes()}
    assert answers <= vocabulary, answers - vocabulary


@pytest.mark.parametrize(
    ("merge", "message"),
    [
        ({"red": "red", "yellow": "red", "green": "purple", "blue": "purple"}, "map each of"),
        ({"red": "red", "yellow": "red", "green": "red", "blue": "blue"}, "two pairs"),
        ({"red": "red", "yellow": "red", "green": "blue"}, "map each of"),
    ],
)
def test_a_merge_out_of_vocabulary_or_unbalanced_is_refused(monkeypatch, merge, message):
    monkeypatch.setitem(synthetic.MERGED_ANSWERS, "colour-merged", merge)
    with pytest.raises(ConfigError, match=message):
        synthetic._check_merged_answers()


def test_the_documented_rule_decides_the_split():
    assert scene_split(SceneSpec("red", "circle", 1, "left")) == "test"  # 0+0+0+0
    assert scene_split(SceneSpec("green", "circle", 1, "left")) == "validation"  # 1
    assert scene_split(SceneSpec("yellow", "cross", 4, "bottom")) == "test"  # 3+3+3+3 = 12
    assert scene_split(SceneSpec("blue", "circle", 1, "left")) == "train"  # 2


def test_random_scene_of_a_split_stays_in_it():
    rng = make_rng(3)
    drawn = {random_scene(rng, "test") for _ in range(500)}
    assert {scene_split(scene) for scene in drawn} == {"test"}
    assert len(drawn) == 64  # 500 draws of 64: missing one has probability < 64 * e^-7.8


def test_unknown_split_is_refused():
    with pytest.raises(ConfigError, match="split must be one of"):
        all_scenes("holdout")


@pytest.mark.parametrize("task", ["count", "count-merged", "position-merged"])
def test_written_folders_are_content_disjoint(tmp_path, task):
    # Arrange / Act: a manifest holds answers, not scenes, so the writer's scenes are re-drawn
    # here with the same seed and order (a scene, then its image) to check their splits.
    write_task_datasets(
        tmp_path, task=task, sites=2, per_site=30, public=30, test=40, validation=20, seed=5
    )
    rng = make_rng(5)
    expected = []
    for folder, count, split in (
        ("site-0", 30, "train"),
        ("site-1", 30, "train"),
        ("public", 30, "train"),
        ("test", 40, "test"),
        ("validation", 20, "validation"),
    ):
        for _ in range(count):
            scene = random_scene(rng, split)
            draw_scene(scene, rng)
            expected.append((folder, scene))
    # Assert: the manifests hold the answers of exactly those scenes, in that order.
    for folder in ("site-0", "site-1", "public", "test", "validation"):
        lines = (tmp_path / folder / "manifest.jsonl").read_text().splitlines()
        answers = [json.loads(line)["answer"] for line in lines]
        scenes = [scene for name, scene in expected if name == folder]
        assert answers == [scene.answer(task) for scene in scenes]
    held_out = {scene for name, scene in expected if name == "test"}
    seen = {scene for name, scene in expected if name not in ("test", "validation")}
    assert held_out
    assert not held_out & seen


# The word family, written out independently of the code.
WORDS = {
    "count-word": ("count", {"1": "one", "2": "two", "3": "three", "4": "four"}),
    "colour-french": (
        "colour",
        {"red": "rouge", "green": "vert", "blue": "bleu", "yellow": "jaune"},
    ),
    "colour-fruit": (
        "colour",
        {"red": "cherry", "green": "lime", "blue": "blueberry", "yellow": "banana"},
    ),
    "position-opposite": (
        "position",
        {"left": "right", "right": "left", "top": "bottom", "bottom": "top"},
    ),
}


@pytest.mark.parametrize("task", WORD_TASKS)
def test_a_word_answer_is_the_documented_word_of_its_attribute(task):
    attribute, words = WORDS[task]
    for scene in all_scenes():
        assert scene.answer(task) == words[scene.answer(attribute)], (task, scene)
    assert set(WORD_TASKS) == set(WORDS)
