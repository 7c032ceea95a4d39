"""The label-skew benchmarks' split: disjoint sites, each holding its classes in even shares."""

from __future__ import annotations

import collections
import importlib
import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

from client.data.records import Record

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CLASSES = ("bottom", "left", "right", "top")


@pytest.fixture(scope="module")
def label_skew() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("label_skew")


def _records(per_class: int) -> list[Record]:
    return [
        Record(id=f"{answer}-{i}", image_path=Path("x.png"), question="where?", answers=(answer,))
        for i in range(per_class)
        for answer in CLASSES
    ]


@pytest.mark.parametrize(("per_site", "sites"), [(1, 8), (2, 6), (2, 14), (3, 9)])
def test_sites_are_disjoint_and_hold_their_classes_evenly(
    label_skew: Any, per_site: int, sites: int
) -> None:
    out = label_skew.skewed_sites(_records(400), per_site, size=60, sites=sites)
    combos = list(itertools.combinations(sorted(CLASSES), per_site))
    assert len(out) == sites
    ids = [r.id for site in out for r in site]
    assert len(ids) == len(set(ids))
    for index, site in enumerate(out):
        counts = collections.Counter(r.answer for r in site)
        assert tuple(sorted(counts)) == combos[index % len(combos)]
        assert set(counts.values()) == {60 // per_site}


def test_default_count_is_every_combination_twice_with_one_class(label_skew: Any) -> None:
    assert len(label_skew.skewed_sites(_records(400), 1)) == 8
    assert len(label_skew.skewed_sites(_records(400), 2)) == 6


def test_too_few_records_of_a_class_is_refused(label_skew: Any) -> None:
    with pytest.raises(ValueError, match="records of"):
        label_skew.skewed_sites(_records(50), 2, size=60, sites=6)
