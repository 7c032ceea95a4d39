import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from client.data.records import (
    DEFAULT_QUESTION,
    Record,
    SiteDataset,
    load_dataset,
    to_rgb,
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

    # Act
    default = load_dataset(tmp_path, layout="image-folder")
    custom = load_dataset(tmp_path, question="Which animal?", layout="image-folder")

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


def test_image_folder_layout_and_question_can_be_declared_in_dataset_json(tmp_path):
    _draw(tmp_path / "cat" / "1.png")
    metadata = {"task": "pets", "layout": "image-folder", "question": "Which pet?"}
    (tmp_path / "dataset.json").write_text(json.dumps(metadata), encoding="utf-8")

    dataset = load_dataset(tmp_path)

    assert [(r.answer, r.question) for r in dataset.records] == [("cat", "Which pet?")]


def test_class_folders_without_an_explicit_layout_are_refused_not_read_as_labels(tmp_path):
    # A missing manifest must never quietly turn folder names into answers.
    _draw(tmp_path / "cat" / "1.png")
    (tmp_path / "dataset.json").write_text('{"task": "t"}', encoding="utf-8")

    with pytest.raises(DataError, match=r"must hold manifest\.jsonl.*\"layout\": \"image-folder\""):
        load_dataset(tmp_path)


def test_a_manifest_with_the_image_folder_layout_is_ambiguous(tmp_path):
    _draw(tmp_path / "a.png")
    _write_lines(tmp_path, [GOOD])

    with pytest.raises(DataError, match=r"layout must be 'manifest'"):
        load_dataset(tmp_path, layout="image-folder")


def test_an_unknown_layout_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"layout must be"):
        load_dataset(tmp_path, layout="folders")  # type: ignore[arg-type]


def test_a_non_utf8_manifest_names_the_line_and_column(tmp_path):
    _draw(tmp_path / "a.png")
    bad = GOOD.replace("Colour?", "Colour\xe9?").encode("latin-1")
    (tmp_path / "manifest.jsonl").write_bytes(GOOD.encode() + b"\n" + bad + b"\n")

    with pytest.raises(DataError, match=r"line 2 must be UTF-8, got byte 0xe9 at column"):
        load_dataset(tmp_path)


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (its data is one empty block)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def _truncated_jpeg(path: Path) -> Path:
    """A JPEG cut short: PIL's verify() accepts it, a full decode does not."""
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, "JPEG", quality=95)
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    return path


def test_a_truncated_jpeg_that_passes_verify_fails_the_load(tmp_path):
    # Arrange: the precondition that made the old check useless
    path = _truncated_jpeg(tmp_path / "cut.jpg")
    with Image.open(path) as image:
        image.verify()
    write_jsonl_dataset(tmp_path, [{"image": "cut.jpg", "question": "Q?", "answer": "a"}], task="t")

    # Act / Assert
    with pytest.raises(DataError, match=r"1 of 1 records unusable.*1 unreadable.*line 1: cut\.jpg"):
        load_dataset(tmp_path)


@pytest.mark.parametrize(
    ("size", "kind"),
    [((40000, 40000), "1 too large"), ((10000, 10000), "1 too large")],
    ids=["bomb-error", "bomb-warning"],
)
def test_a_header_claiming_a_huge_image_is_a_data_error_not_a_warning(tmp_path, size, kind):
    # 1.6e9 pixels raises DecompressionBombError; 1e8 only warns, which must stop the load too.
    (tmp_path / "huge.png").write_bytes(_png_claiming(*size))
    write_jsonl_dataset(
        tmp_path, [{"image": "huge.png", "question": "Q?", "answer": "a"}], task="t"
    )

    with pytest.raises(DataError, match=kind):
        load_dataset(tmp_path)


def test_an_image_symlinked_outside_the_folder_is_refused(tmp_path):
    outside = _draw(tmp_path / "elsewhere" / "secret.png")
    root = tmp_path / "site"
    root.mkdir()
    (root / "link.png").symlink_to(outside)
    write_jsonl_dataset(root, [{"image": "link.png", "question": "Q?", "answer": "a"}], task="t")

    with pytest.raises(DataError, match=r"1 outside the folder.*link\.png: resolves to"):
        load_dataset(root)


def test_a_listed_record_never_reads_an_image_symlinked_outside_the_folder(tmp_path):
    # Arrange: listed without decoding (as a site does at the plan stage), then linked out
    root = tmp_path / "site"
    _draw(root / "a.png")
    write_jsonl_dataset(root, [{"image": "a.png", "question": "Q?", "answer": "a"}], task="t")
    (record,) = load_dataset(root, check_images=False).records
    (root / "a.png").unlink()
    (root / "a.png").symlink_to(_draw(tmp_path / "elsewhere" / "secret.png"))

    # Act / Assert: extraction's read refuses it (that chunk contributes zeros)
    with pytest.raises(DataError, match=r"image of record 'line-1' must lie inside"):
        record.load_image()


def test_every_bad_record_is_counted_and_none_is_skipped(tmp_path):
    # Arrange: one good record and three bad ones of different kinds
    _draw(tmp_path / "good.png")
    (tmp_path / "corrupt.png").write_bytes(b"definitely not a png")
    _truncated_jpeg(tmp_path / "cut.jpg")
    rows = [
        {"image": "good.png", "question": "Q?", "answer": "a"},
        {"image": "corrupt.png", "question": "Q?", "answer": "b"},
        {"image": "missing.png", "question": "Q?", "answer": "c"},
        {"image": "cut.jpg", "question": "Q?", "answer": "d"},
    ]
    write_jsonl_dataset(tmp_path, rows, task="t")

    # Act
    with pytest.raises(DataError) as caught:
        load_dataset(tmp_path)

    # Assert
    message = str(caught.value)
    assert "got 3 of 4 records unusable" in message
    assert "1 missing, 2 unreadable" in message
    assert "line 2: corrupt.png: cannot be decoded" in message
    assert "line 3: missing.png: image file not found" in message
    assert "line 4: cut.jpg" in message
    assert "never skipped" in message


def test_the_error_names_the_first_five_bad_records_and_counts_the_rest(tmp_path):
    rows = [{"image": f"gone{i}.png", "question": "Q?", "answer": "a"} for i in range(8)]
    write_jsonl_dataset(tmp_path, rows, task="t")

    with pytest.raises(DataError, match=r"8 of 8 records.*line 5: gone4.png.*; and 3 more\."):
        load_dataset(tmp_path)


# ---------------------------------------------------------------- faithful RGB


def _saved(image: Image.Image, path: Path) -> Record:
    image.save(path)
    return Record("x", path, "q?", ("a",))


def test_sixteen_bit_greyscale_is_scaled_to_eight_bits_not_thresholded(tmp_path):
    # Arrange: a ramp over the whole 16-bit range, saved as a 16-bit PNG
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    record = _saved(Image.fromarray(ramp), tmp_path / "ramp16.png")
    with Image.open(record.image_path) as raw:
        assert raw.mode == "I;16"

    # Act
    rgb = np.asarray(record.load_image())

    # Assert: every channel is the ramp divided by 257, to the nearest integer
    expected = np.rint(ramp / 257).astype(np.uint8)
    for channel in range(3):
        np.testing.assert_array_equal(rgb[..., channel], expected)
    assert (rgb == 255).mean() < 0.01  # PIL's own convert puts 99 % of this ramp at 255


def test_mode_i_within_16_bits_is_read_by_its_bit_depth(tmp_path):
    values = np.array([[0, 257, 32896, 65535]], dtype=np.int32)

    rgb = np.asarray(to_rgb(Image.fromarray(values)))

    np.testing.assert_array_equal(rgb[0, :, 0], [0, 1, 128, 255])


def test_palette_image_maps_its_colours(tmp_path):
    image = Image.new("P", (4, 2))
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    image.putdata([0, 1] * 4)
    record = _saved(image, tmp_path / "palette.png")

    rgb = np.asarray(record.load_image())

    assert rgb[0, 0].tolist() == [255, 0, 0]
    assert rgb[0, 1].tolist() == [0, 0, 255]


def test_palette_transparency_shows_white_not_the_hidden_colour(tmp_path):
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    image.putdata([0, 1])
    image.info["transparency"] = 0  # index 0 (black) is transparent
    record = _saved(image, tmp_path / "transparent.png")

    rgb = np.asarray(record.load_image())

    assert rgb[0].tolist() == [[255, 255, 255], [0, 255, 0]]


@pytest.mark.parametrize(
    ("mode", "pixel", "expected"),
    [
        ("LA", (100, 255), [100, 100, 100]),
        ("LA", (0, 0), [255, 255, 255]),
        ("LA", (0, 128), [127, 127, 127]),
        ("RGBA", (255, 0, 0, 0), [255, 255, 255]),
        ("RGBA", (10, 20, 30, 255), [10, 20, 30]),
    ],
)
def test_alpha_is_composited_over_white(tmp_path, mode, pixel, expected):
    record = _saved(Image.new(mode, (3, 2), pixel), tmp_path / f"{mode}.png")

    rgb = np.asarray(record.load_image())

    assert rgb.shape == (2, 3, 3)
    assert rgb[1, 2].tolist() == expected


def test_pa_image_uses_its_palette_and_its_alpha():
    image = Image.new("PA", (2, 1))
    image.putpalette([200, 10, 10] + [0] * 765)
    image.putdata([(0, 255), (0, 0)])

    rgb = np.asarray(to_rgb(image))

    assert rgb[0].tolist() == [[200, 10, 10], [255, 255, 255]]


def test_cmyk_jpeg_is_converted_to_rgb(tmp_path):
    # Pure cyan ink: no red, full green and blue (JPEG compression allows a few levels).
    record = _saved(Image.new("CMYK", (16, 16), (255, 0, 0, 0)), tmp_path / "cmyk.jpg")
    with Image.open(record.image_path) as raw:
        assert raw.mode == "CMYK"

    rgb = np.asarray(record.load_image()).astype(int)

    np.testing.assert_allclose(rgb[8, 8], [0, 255, 255], atol=3)


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


def test_check_images_false_lists_the_records_without_opening_them(tmp_path):
    # Within one release the site re-reads a dataset it checked at plan time: a record that
    # broke since then must not stop the load (extraction zeroes its chunk instead).
    _draw(tmp_path / "good.png")
    rows = [
        {"image": "good.png", "question": "Q?", "answer": "a"},
        {"image": "gone.png", "question": "Q?", "answer": "b"},
    ]
    write_jsonl_dataset(tmp_path, rows, task="t")

    dataset = load_dataset(tmp_path, check_images=False)

    assert [r.answer for r in dataset.records] == ["a", "b"]
    with pytest.raises(DataError, match=r"1 of 2 records unusable"):
        load_dataset(tmp_path)


def test_exif_orientation_is_applied(tmp_path):
    # Arrange: a 4 x 2 photo whose EXIF says "rotate 90 degrees clockwise to view" (6)
    image = Image.new("RGB", (4, 2), "white")
    image.putpixel((0, 0), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "photo.png"
    image.save(path, exif=exif)

    # Act
    rgb = np.asarray(Record("x", path, "q?", ("a",)).load_image())

    # Assert: shown upright it is 2 wide and 4 tall, the red corner now top right
    assert rgb.shape == (4, 2, 3)
    assert rgb[0, 1].tolist() == [255, 0, 0]
