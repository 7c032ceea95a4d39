"""The HTTP endpoint's idle connections: bounded per client, oldest out first, bursts spared."""

from __future__ import annotations

import asyncio

import pytest

from client.service.http_guard import IdleConnections
from client.service.http_server import HttpSettings


def connections(count: int) -> list[asyncio.BaseProtocol]:
    return [asyncio.BaseProtocol() for _ in range(count)]


def test_a_client_past_its_bound_loses_its_oldest_idle_connection() -> None:
    # Arrange: two idle a client; the first has been idle for two seconds.
    idle = IdleConnections(per_client=2, grace_s=1.0)
    first, second, third = connections(3)
    idle.idle(first, "10.0.0.1", now=0.0)
    idle.idle(second, "10.0.0.1", now=1.5)

    # Act
    evicted = idle.idle(third, "10.0.0.1", now=2.0)

    # Assert
    assert evicted == [first]
    assert len(idle) == 2


def test_a_burst_of_fresh_connections_from_one_client_is_left_alone() -> None:
    # Arrange: a client opens 24 connections at once, each about to send its request.
    idle = IdleConnections(per_client=3, grace_s=1.0)

    # Act
    evicted = [idle.idle(connection, "127.0.0.1", now=0.01) for connection in connections(24)]

    # Assert
    assert evicted == [[]] * 24
    assert len(idle) == 24


def test_other_clients_connections_do_not_count_against_a_client() -> None:
    # Arrange
    idle = IdleConnections(per_client=1, grace_s=0.0)
    a, b = connections(2)
    idle.idle(a, "one", now=0.0)

    # Act / Assert
    assert idle.idle(b, "two", now=5.0) == []


def test_at_the_limit_the_oldest_idle_connection_of_anyone_goes_never_a_working_one() -> None:
    # Arrange: the first connection's request head arrived (it is working).
    idle = IdleConnections(per_client=10, grace_s=1.0)
    working, waiting, newcomer = connections(3)
    idle.idle(working, "one", now=0.0)
    idle.busy(working)
    idle.idle(waiting, "two", now=0.5)
    idle.idle(newcomer, "three", now=0.6)

    # Act
    oldest = idle.oldest(besides=newcomer)

    # Assert: the idle one goes, whatever its age; then nothing but the newcomer is idle.
    assert oldest is waiting
    assert idle.oldest(besides=newcomer) is None


@pytest.mark.parametrize(
    ("settings", "bound"),
    [
        (HttpSettings("127.0.0.1:0", token_file=None), 64),  # type: ignore[arg-type]
        (HttpSettings("127.0.0.1:0", None, max_connections=48), 12),  # type: ignore[arg-type]
        (HttpSettings("127.0.0.1:0", None, max_idle_per_client=5), 5),  # type: ignore[arg-type]
    ],
)
def test_the_per_client_bound_defaults_to_a_quarter_of_the_connections(
    settings: HttpSettings, bound: int
) -> None:
    # Act / Assert
    assert settings.idle_per_client() == bound
