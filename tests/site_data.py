"""A small labelled site dataset drawn with PIL, shared by the client pipeline tests."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

from client.data.records import SiteDataset, load_dataset, write_jsonl_dataset

COLOURS = ("red", "blue", "green", "yellow")
QUESTION = "What colour is the shape?"


def write_site(root: Path, count: int) -> SiteDataset:
    """``count`` coloured shapes (varying size, so batches need padding) as a site dataset."""
    rows = []
    for i in range(count):
        colour = COLOURS[i % len(COLOURS)]
        image = Image.new("RGB", (56 + 7 * (i % 3), 56), "white")
        draw = ImageDraw.Draw(image)
        if i % 2:
            draw.rectangle((6, 8, 40, 44), fill=colour)
        else:
            draw.ellipse((6, 8, 40, 44), fill=colour)
        image.save(root / f"img{i}.png")
        rows.append({"id": f"r{i}", "image": f"img{i}.png", "question": QUESTION, "answer": colour})
    write_jsonl_dataset(root, rows, task="shapes")
    return load_dataset(root)
