import json
import logging
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from client.data import (
    DEFAULT_QUESTION,
    Record,
    SiteDataset,
    load_dataset,
    write_jsonl_dataset,
)
from dpmtv_common.errors import ConfigError, DataError


def _draw(path: Path, colour: str = "red") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with Image.new("RGB", (8, 8), "white") as image:
        ImageDraw.Draw(image).ellipse((1, 1, 6, 6), fill=colour)
        image.save(path)
    return path


def _write_lines(root: Path, lines: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


GOOD = json.dumps({"image": "a.png", "question": "Colour?", "answer": "red"})


def test_load_dataset_reads_a_good_manifest_with_metadata(tmp_path):
    # Arrange
    _draw(tmp_path / "a.png")
    _draw(tmp_path / "img" / "b.png", "blue")
    rows: list[dict[str, object]] = [
        {"image": "a.png", "question": "Colour?", "answer": "red"},
        {"id": "q2", "image": "img/b.png", "question": "Colour?", "answer": ["blue", "navy"]},
    ]
    write_jsonl_dataset(tmp_path, rows, task="colours", instruction="Answer briefly.")

    # Act
    dataset = load_dataset(tmp_path)

    # Assert
    assert (dataset.task, dataset.privacy_unit, dataset.instruction) == (
        "colours",
        "example",
        "Answer briefly.",
    )
    first, second = dataset.records
    assert first.id == "line-1"
    assert first.answers == ("red",)
    assert second.id == "q2"
    assert second.answers == ("blue", "navy")
    assert second.answer == "blue"
    assert second.image_path == (tmp_path / "img" / "b.png").resolve()
    assert second.image_path.is_absolute()
    assert dataset.skipped == ()
    assert len(dataset) == 2


def test_record_load_image_returns_rgb_and_closes_the_file(tmp_path):
    path = tmp_path / "grey.png"
    with Image.new("L", (5, 3), 128) as image:
        image.save(path)
    record = Record("x", path, "q?", ("a",))

    with record.load_image() as loaded:
        assert (loaded.mode, loaded.size) == ("RGB", (5, 3))


def test_load_dataset_without_metadata_defaults_to_folder_name(tmp_path):
    _draw(tmp_path / "site" / "a.png")
    _write_lines(tmp_path / "site", [GOOD])

    dataset = load_dataset(tmp_path / "site")

    assert (dataset.task, dataset.privacy_unit, dataset.instruction) == ("site", "example", None)


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"image": "a.png", "answer": "red"}', "'question' is missing"),
        ('{"image": "a.png", "question": "Q?"}', "'answer' must be"),
        ('{"image": "a.png", "question": 5, "answer": "red"}', "'question' must be"),
        ('{"image": "a.png", "question": "Q?", "answer": ["a", 3]}', "'answer' must be"),
        ('{"image": "a.png", "question": "Q?", "answer": []}', "'answer' must be"),
        ('{"image": "a.png", "question": "Q?", "answer": "a", "label": 1}', "unknown keys"),
        ('{"image": "/etc/a.png", "question": "Q?", "answer": "a"}', "'image' must be"),
        ('{"image": "../a.png", "question": "Q?", "answer": "a"}', "'image' must be"),
        ('{"question": "Q?", "answer": "a"}', "'image' must be"),
        ('{"image": "a.png", "question": "Q?", "answer": "a", "id": 7}', "'id' must be"),
    ],
)
def test_bad_manifest_line_reports_its_line_number_problem_and_text(tmp_path, bad_line, problem):
    # Arrange: a blank line 2 still counts, so the bad line is line 3.
    _draw(tmp_path / "a.png")
    _write_lines(tmp_path, [GOOD, "", bad_line, "{also bad"])

    # Act
    with pytest.raises(DataError) as caught:
        load_dataset(tmp_path)

    # Assert
    message = str(caught.value)
    assert "line 3:" in message
    assert problem in message
    assert repr(bad_line) in message


def test_bad_manifest_line_quote_is_shortened(tmp_path):
    long_line = json.dumps({"image": "a.png", "question": "Q" * 500, "answer": 1})
    _write_lines(tmp_path, [long_line])

    with pytest.raises(DataError, match=r"line 1:") as caught:
        load_dataset(tmp_path)

    assert "Q" * 200 not in str(caught.value)
    assert "..." in str(caught.value)


def test_duplicate_id_names_both_lines(tmp_path):
    row = {"id": "same", "image": "a.png", "question": "Q?", "answer": "a"}
    _write_lines(tmp_path, [json.dumps(row), GOOD, json.dumps(row)])

    with pytest.raises(DataError, match=r"line 3: id 'same' is already used on line 1"):
        load_dataset(tmp_path)


def test_group_privacy_unit_requires_a_group_on_every_line(tmp_path):
    rows = [
        {"image": "a.png", "question": "Q?", "answer": "a", "group": "p1"},
        {"image": "a.png", "question": "Q?", "answer": "a"},
    ]
    write_jsonl_dataset(tmp_path, rows, task="t", privacy_unit="group")

    with pytest.raises(DataError, match=r"line 2: 'group' is missing"):
        load_dataset(tmp_path)


def test_group_dataset_keeps_groups(tmp_path):
    _draw(tmp_path / "a.png")
    rows = [{"image": "a.png", "question": "Q?", "answer": "a", "group": "p1"}]
    write_jsonl_dataset(tmp_path, rows, task="t", privacy_unit="group")

    dataset = load_dataset(tmp_path)

    assert dataset.privacy_unit == "group"
    assert dataset.records[0].group == "p1"


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ('{"task": "t", "privacy_unit": "patient"}', "privacy_unit must be"),
        ('{"task": "t", "extra": 1}', "must be an object with keys"),
        ('{"task": ""}', "task must be"),
        ('{"instruction": 3}', "instruction must be"),
        ("{oops", "valid UTF-8 JSON"),
    ],
)
def test_bad_metadata_is_a_data_error(tmp_path, metadata, problem):
    _write_lines(tmp_path, [GOOD])
    (tmp_path / "dataset.json").write_text(metadata, encoding="utf-8")

    with pytest.raises(DataError, match=problem):
        load_dataset(tmp_path)


def test_image_folder_layout_uses_class_names_as_answers(tmp_path):
    # Arrange
    _draw(tmp_path / "cat" / "1.png")
    _draw(tmp_path / "snow_leopard" / "2.JPG")
    _draw(tmp_path / "snow_leopard" / "3.jpeg")
    (tmp_path / "cat" / "notes.txt").write_text("not an image", encoding="utf-8")

    # Act
    default = load_dataset(tmp_path)
    custom = load_dataset(tmp_path, question="Which animal?")

    # Assert
    assert [r.id for r in default.records] == [
        "cat/1.png",
        "snow_leopard/2.JPG",
        "snow_leopard/3.jpeg",
    ]
    assert [r.answer for r in default.records] == ["cat", "snow leopard", "snow leopard"]
    assert {r.question for r in default.records} == {DEFAULT_QUESTION}
    assert {r.question for r in custom.records} == {"Which animal?"}
    assert default.privacy_unit == "example"


def test_corrupt_and_missing_images_are_skipped_and_reported(tmp_path, caplog):
    # Arrange
    _draw(tmp_path / "good.png")
    (tmp_path / "corrupt.png").write_bytes(b"definitely not a png")
    rows = [
        {"image": "good.png", "question": "Q?", "answer": "a"},
        {"image": "corrupt.png", "question": "Q?", "answer": "b"},
        {"image": "missing.png", "question": "Q?", "answer": "c"},
    ]
    write_jsonl_dataset(tmp_path, rows, task="t")

    # Act
    with caplog.at_level(logging.WARNING, logger="client.data"):
        dataset = load_dataset(tmp_path)

    # Assert
    assert [r.answer for r in dataset.records] == ["a"]
    assert [s.source for s in dataset.skipped] == ["line 2", "line 3"]
    assert "cannot be read" in dataset.skipped[0].reason
    assert dataset.skipped[1].reason == "image file not found"
    assert dataset.skipped[1].image_path == (tmp_path / "missing.png").resolve()
    assert "skipped 2 of 3 records" in caplog.text


def test_dataset_with_every_image_skipped_is_a_data_error(tmp_path):
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG garbage")
    rows = [
        {"image": "corrupt.png", "question": "Q?", "answer": "a"},
        {"image": "gone.png", "question": "Q?", "answer": "b"},
    ]
    write_jsonl_dataset(tmp_path, rows, task="t")

    with pytest.raises(
        DataError, match=r"all 2 were skipped.*line 1.*line 2: image file not found"
    ):
        load_dataset(tmp_path)


@pytest.mark.parametrize("content", [None, ""])
def test_folder_without_records_is_a_data_error(tmp_path, content):
    if content is not None:
        (tmp_path / "manifest.jsonl").write_text(content, encoding="utf-8")

    with pytest.raises(DataError, match=r"must hold"):
        load_dataset(tmp_path)


def test_missing_folder_and_empty_question_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"existing folder"):
        load_dataset(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"question must be"):
        load_dataset(tmp_path, question=" ")


def test_write_jsonl_dataset_leaves_no_temporary_files(tmp_path):
    rows = [{"image": "a.png", "question": "Q?", "answer": "ä"}]

    root = write_jsonl_dataset(tmp_path / "new", rows, task="t", privacy_unit="example")

    assert sorted(p.name for p in root.iterdir()) == ["dataset.json", "manifest.jsonl"]
    assert json.loads((root / "manifest.jsonl").read_text(encoding="utf-8")) == rows[0]


def test_write_jsonl_dataset_refuses_an_unknown_privacy_unit(tmp_path):
    with pytest.raises(ConfigError, match=r"privacy_unit must be"):
        write_jsonl_dataset(tmp_path, [], task="t", privacy_unit="person")  # type: ignore[arg-type]


def test_site_dataset_refuses_ungrouped_records_in_group_mode():
    record = Record("r1", Path("/x.png"), "Q?", ("a",))

    with pytest.raises(DataError, match=r"got none on record 'r1'"):
        SiteDataset((record,), task="t", privacy_unit="group")


def test_record_refuses_empty_answers():
    with pytest.raises(DataError, match=r"must not be empty"):
        Record("r1", Path("/x.png"), "Q?", ())
