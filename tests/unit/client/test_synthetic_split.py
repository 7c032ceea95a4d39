"""The content split of the synthetic scenes: disjoint, balanced, and honoured by the writers."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from client.synthetic import (
    SCENE_SPLITS,
    TASKS,
    SceneSpec,
    all_scenes,
    draw_scene,
    random_scene,
    scene_split,
    write_task_datasets,
)
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
        assert len(counts) == 4
        assert len(set(counts.values())) == 1, (task, counts)


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


def test_written_folders_are_content_disjoint(tmp_path):
    # Arrange / Act: a manifest holds answers, not scenes, so the writer's scenes are re-drawn
    # here with the same seed and order (a scene, then its image) to check their splits.
    write_task_datasets(
        tmp_path, task="count", sites=2, per_site=30, public=30, test=40, validation=20, seed=5
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
        assert answers == [scene.answer("count") for scene in scenes]
    held_out = {scene for name, scene in expected if name == "test"}
    seen = {scene for name, scene in expected if name not in ("test", "validation")}
    assert held_out
    assert not held_out & seen
