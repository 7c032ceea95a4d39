"""dpmtv_common.crypto.shamir against Flower's own Shamir sharing, share for share."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable

import Crypto.Protocol.SecretSharing as pycryptodome_sharing
import pytest
from flwr.common.secure_aggregation.crypto import shamir as flower
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmtv_common.crypto.shamir import combine_shares, create_shares
from dpmtv_common.errors import ConfigError, InsufficientSharesError, IntegrityError

# (secret length, threshold, shares): a SecAgg+ mask seed (32 bytes) and private key (~240),
# block edges, a threshold of one, and a large neighbourhood.
CASES = [
    (0, 1, 1),
    (15, 2, 3),
    (16, 2, 3),
    (32, 3, 5),
    (32, 21, 31),
    (241, 7, 10),
    (47, 3, 300),
]


def seeded_bytes(seed: int) -> Callable[[int], bytes]:
    generator = random.Random(seed)
    return lambda size: generator.randbytes(size)


@pytest.fixture
def flower_shares(monkeypatch: pytest.MonkeyPatch) -> Callable[[bytes, int, int, int], list[bytes]]:
    """Flower's create_shares drawing its coefficients from a seeded stream.

    One worker thread, so the blocks draw in order (Flower splits them on a thread pool).
    """

    def make(secret: bytes, threshold: int, num: int, seed: int) -> list[bytes]:
        monkeypatch.setattr(pycryptodome_sharing, "rng", seeded_bytes(seed))
        monkeypatch.setattr(os, "cpu_count", lambda: 1)
        return flower.create_shares(secret, threshold, num)

    return make


@pytest.mark.parametrize(("length", "threshold", "num"), CASES)
def test_shares_equal_flowers_share_for_share(flower_shares, length, threshold, num) -> None:
    # Arrange
    secret = random.Random(length).randbytes(length)

    # Act
    ours = create_shares(secret, threshold, num, random_bytes=seeded_bytes(7))
    theirs = flower_shares(secret, threshold, num, 7)

    # Assert
    assert ours == theirs


def test_a_pinned_vector_of_flower_1_42() -> None:
    # Arrange: PyCryptodome drew bytes(range(16)) as the degree-1 coefficient
    draws = iter([bytes(range(16))])

    # Act
    shares = create_shares(b"dpmtv", 2, 3, random_bytes=lambda size: next(draws))

    # Assert
    assert [share.hex() for share in shares] == [
        "0100000064716f77720e0d0c0302010007060504",
        "02000000647269727e0107051b191f1d13111715",
        "0300000064736b717a040102131015161f1c191a",
    ]


@pytest.mark.parametrize(("length", "threshold", "num"), CASES)
def test_reconstruction_equals_flowers_on_every_subset_tried(length, threshold, num) -> None:
    # Arrange: Flower's shares, with its own randomness
    secret = os.urandom(length)
    shares = flower.create_shares(secret, threshold, num)
    order = random.Random(num)
    subsets = [shares[:threshold], order.sample(shares, threshold), shares[-threshold - 1 :][::-1]]
    if num <= 31:  # Flower interpolates over every share given: 300 take it half a minute
        subsets += [shares, shares[::-1]]

    # Act
    rebuilt = [(combine_shares(subset), flower.combine_shares(subset)) for subset in subsets]

    # Assert
    assert all(ours == theirs == secret for ours, theirs in rebuilt)


def test_flower_rebuilds_what_we_share() -> None:
    # Arrange
    secret = os.urandom(241)

    # Act
    shares = create_shares(secret, 5, 9)

    # Assert
    for subset in itertools.islice(itertools.combinations(shares, 5), 20):
        assert flower.combine_shares(list(subset)) == secret


@settings(max_examples=40, deadline=None)
@given(
    secret=st.binary(max_size=80),
    threshold=st.integers(1, 8),
    extra=st.integers(0, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_threshold_of_shares_rebuilds_the_secret(secret, threshold, extra, seed) -> None:
    # Arrange
    shares = create_shares(secret, threshold, threshold + extra)
    chosen = random.Random(seed).sample(shares, threshold)

    # Act / Assert
    assert combine_shares(chosen) == secret


@settings(max_examples=40, deadline=None)
@given(secret=st.binary(min_size=1, max_size=48), threshold=st.integers(2, 8))
def test_fewer_than_the_threshold_do_not_rebuild_the_secret(secret, threshold) -> None:
    # Arrange
    shares = create_shares(secret, threshold, threshold + 2)[: threshold - 1]

    # Act: bytes that are not the secret, or a refusal (a wrong block rarely pads well)
    try:
        rebuilt = combine_shares(shares)
    except IntegrityError:
        return

    # Assert: equal only with probability 2^-128
    assert rebuilt != secret


def test_a_repeated_index_is_refused() -> None:
    # Arrange
    shares = create_shares(b"seed", 2, 3)

    # Act / Assert
    with pytest.raises(IntegrityError, match=r"share indices must be distinct, got \[1\]"):
        combine_shares([shares[0], shares[0], shares[1]])


@pytest.mark.parametrize(
    "shares",
    [
        pytest.param(
            [b"\x01\x00\x00\x00" + bytes(16), b"\x02\x00\x00\x00" + bytes(32)], id="mixed"
        ),
        pytest.param([b"\x01\x00\x00\x00" + bytes(15)], id="short"),
        pytest.param([b"\x01\x00\x00\x00" + bytes(17)], id="ragged"),
    ],
)
def test_malformed_shares_are_refused(shares: list[bytes]) -> None:
    # Act / Assert
    with pytest.raises(IntegrityError, match="shares must be 4 \\+ 16k bytes long"):
        combine_shares(shares)


def test_no_shares_are_refused() -> None:
    # Act / Assert
    with pytest.raises(InsufficientSharesError, match="got none"):
        combine_shares([])


def test_shares_that_rebuild_no_padding_are_refused() -> None:
    # Arrange: one share of a threshold-2 secret whose block is not padding
    (share,) = create_shares(b"x" * 16, 1, 1)
    corrupted = share[:-1] + bytes([share[-1] ^ 0xFF])

    # Act / Assert
    with pytest.raises(IntegrityError, match="shares must rebuild a padded secret"):
        combine_shares([corrupted])


@pytest.mark.parametrize(
    ("threshold", "num"), [(0, 3), (4, 3), (2, 0), (True, 3), (2.0, 3), (1, 2**32)]
)
def test_counts_out_of_range_are_refused(threshold: object, num: object) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="must"):
        create_shares(b"seed", threshold, num)  # type: ignore[arg-type]


def test_shares_in_any_order_reuse_one_interpolation() -> None:
    # Arrange: the order in which neighbours' shares arrive differs from site to site
    from dpmtv_common.crypto import shamir

    shares = create_shares(os.urandom(32), 4, 7)
    shuffled = random.Random(3).sample(shares, len(shares))
    shamir._interpolation_matrix.cache_clear()

    # Act
    rebuilt = {combine_shares(shares), combine_shares(shuffled), combine_shares(shares[::-1])}

    # Assert
    assert len(rebuilt) == 1
    assert shamir._interpolation_matrix.cache_info().misses == 1
