"""The HTTP endpoint's idle connections: bounded per client and in total, oldest out first."""

from __future__ import annotations

import asyncio

import pytest

from client.service.http_server import HttpSettings, IdleConnections


def connections(count: int) -> list[asyncio.BaseProtocol]:
    return [asyncio.BaseProtocol() for _ in range(count)]


def test_a_client_past_its_bound_loses_its_oldest_idle_connection() -> None:
    # Arrange
    idle = IdleConnections(total=10, per_client=2)
    first, second, third = connections(3)

    # Act
    assert idle.idle(first, "10.0.0.1") == []
    assert idle.idle(second, "10.0.0.1") == []
    evicted = idle.idle(third, "10.0.0.1")

    # Assert
    assert evicted == [first]
    assert len(idle) == 2


def test_past_the_total_the_oldest_idle_connection_of_anyone_goes() -> None:
    # Arrange
    idle = IdleConnections(total=2, per_client=2)
    a, b, c = connections(3)
    idle.idle(a, "one")
    idle.idle(b, "two")

    # Act
    evicted = idle.idle(c, "three")

    # Assert
    assert evicted == [a]


def test_a_connection_with_a_request_under_way_is_never_closed_for_a_newcomer() -> None:
    # Arrange: the first connection's request head arrived.
    idle = IdleConnections(total=1, per_client=1)
    working, waiting, newcomer = connections(3)
    idle.idle(working, "one")
    idle.busy(working)
    idle.idle(waiting, "one")

    # Act
    evicted = idle.idle(newcomer, "one")

    # Assert
    assert evicted == [waiting]
    idle.busy(newcomer)
    assert len(idle) == 0


@pytest.mark.parametrize(
    ("settings", "bounds"),
    [
        (HttpSettings("127.0.0.1:0", token_file=None), (64, 16)),  # type: ignore[arg-type]
        (HttpSettings("127.0.0.1:0", None, max_connections=48), (12, 3)),  # type: ignore[arg-type]
        (HttpSettings("127.0.0.1:0", None, max_idle=5, max_idle_per_client=5), (5, 5)),  # type: ignore[arg-type]
    ],
)
def test_the_bounds_default_to_a_share_of_the_connections(
    settings: HttpSettings, bounds: tuple[int, int]
) -> None:
    # Act / Assert
    assert settings.idle_bounds() == bounds
