"""HeadSet.rows_of: where a subset's heads sit among a set's rows."""

from __future__ import annotations

import pytest

from dpmtv_common.heads import HeadSet


def test_rows_of_gives_each_subset_head_its_row_in_the_set():
    every = HeadSet.of([(0, 0), (0, 1), (1, 0), (1, 1), (2, 3)])

    assert every.rows_of(HeadSet.of([(0, 1), (2, 3)])) == [1, 4]
    assert every.rows_of(every) == [0, 1, 2, 3, 4]


def test_rows_of_refuses_a_head_the_set_lacks():
    with pytest.raises(KeyError):
        HeadSet.of([(0, 0)]).rows_of(HeadSet.of([(1, 1)]))
