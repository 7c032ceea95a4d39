"""The signal/noise report's order warning: public heads released release-first."""

from __future__ import annotations

import pytest

from client.checks.signal import signal_report
from client.models import HeadShape
from protocol import ReleaseOrder, SelectionMode
from tests.unit.protocol.test_signal_estimate import _plan

SHAPE = HeadShape(num_layers=4, num_heads=4, head_dim=8)


def test_public_heads_released_release_first_are_warned_with_the_select_first_figure():
    first = signal_report(
        _plan(SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST), num_chunks=500, shape=SHAPE
    )
    later = signal_report(
        _plan(SelectionMode.PUBLIC, ReleaseOrder.RELEASE_FIRST), num_chunks=500, shape=SHAPE
    )
    assert first.order_warning is None
    assert later.order_warning is not None
    assert later.order_warning in later.warnings
    assert f"{first.estimate.signal_to_noise:.3g} instead of" in later.order_warning
    assert first.estimate.signal_to_noise > later.estimate.signal_to_noise


@pytest.mark.parametrize(
    ("selection", "order"),
    [
        (SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST),  # selects after the release
        (SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST),
        (SelectionMode.ALL, ReleaseOrder.RELEASE_FIRST),  # every head either way
    ],
)
def test_no_order_warning_where_the_order_does_not_only_add_noise(selection, order):
    report = signal_report(_plan(selection, order), num_chunks=500, shape=SHAPE)
    assert report.order_warning is None
