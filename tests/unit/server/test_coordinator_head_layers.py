"""The coordinator derives "all heads" from the sites' head_layers and refuses a disagreement."""

from __future__ import annotations

import pytest

from dpmtv_common.errors import ConfigError
from protocol import PlanAccept
from server.settings import RunConfig
from tests.unit.server.coordinator_world import planned

RUN = RunConfig.from_context(
    {
        "model-fingerprint": "sha256:abc",
        "release-id": "r1",
        "clip-norm": 1.0,
        "min-sites": 2,
        "expected-sites": 3,
        "max-chunks-per-site": 0,  # the plan's own round trip (FixedExchange answers it)
    }
)


def accept(site: int, head_layers: tuple[int, ...] | None) -> PlanAccept:
    return PlanAccept(
        release_id="r1",
        site_name=f"site-{site}",
        num_chunks=5,
        num_layers=3,
        num_heads=4,
        head_dim=16,
        head_layers=head_layers,
        prompt_template_sha256="a" * 64,
        instruction_sha256="b" * 64,
        dpmtv_version="0.1.0",
    )


def plan_stage(monkeypatch: pytest.MonkeyPatch, layers: list[tuple[int, ...] | None]):
    accepts = [accept(i, head_layers) for i, head_layers in enumerate(layers)]
    coordinator, _ = planned(monkeypatch, RUN, accepts)
    return coordinator


@pytest.mark.parametrize(
    "layers",
    [
        [(1, 2), (1, 2), (0, 1, 2)],  # one site counts layer 0 as carrying heads
        [(1, 2), (1, 2), (2,)],
        [None, (0, 1, 2), (0, 2)],  # None means every layer
    ],
)
def test_sites_that_disagree_on_head_layers_are_refused(monkeypatch, layers):
    with pytest.raises(ConfigError, match="sites must agree on the layers that carry heads"):
        plan_stage(monkeypatch, layers)


def test_agreeing_sites_give_the_release_their_carried_heads(monkeypatch):
    coordinator = plan_stage(monkeypatch, [(1, 2), (1, 2), (1, 2)])

    (layout,) = {a.layout() for a in coordinator.accepted.values()}
    assert layout.carried_layers == (1, 2)


def test_an_old_site_without_head_layers_agrees_with_one_naming_every_layer(monkeypatch):
    coordinator = plan_stage(monkeypatch, [None, (0, 1, 2), None])

    assert len(coordinator.accepted) == 3
