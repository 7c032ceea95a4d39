"""KeyStream: the ChaCha20 stream behind the secret chunk permutation (dpmtv_common.rng)."""

from __future__ import annotations

import pytest

from dpmtv_common.errors import ConfigError
from dpmtv_common.rng import SEED_BITS, KeyStream, secret_seed


def test_secret_seed_has_256_bits_of_range():
    seeds = [secret_seed() for _ in range(64)]

    assert all(0 <= seed < 2**SEED_BITS for seed in seeds)
    assert SEED_BITS == 256
    assert max(seeds) >= 2**200  # probability of failing: 64 * 2**-56
    assert len(set(seeds)) == 64


def test_the_same_seed_and_label_give_the_same_stream_and_others_do_not():
    first = KeyStream(7, b"a").read(64)

    assert KeyStream(7, b"a").read(64) == first
    assert KeyStream(8, b"a").read(64) != first
    assert KeyStream(7, b"b").read(64) != first


def test_reads_continue_the_stream_whatever_their_sizes():
    whole = KeyStream(3, b"x").read(10_000)
    stream = KeyStream(3, b"x")

    parts = [stream.read(size) for size in (1, 4095, 3, 5000, 901)]

    assert b"".join(parts) == whole


def test_the_stream_is_chacha20_keyed_by_the_seed_in_full():
    # A seed and the same seed with a bit set above 2**128 must give different streams.
    assert KeyStream(1, b"x").read(32) != KeyStream(1 + 2**255, b"x").read(32)


@pytest.mark.parametrize("n", [0, 1, 2, 10, 1000])
def test_permutation_holds_every_index_once(n):
    order = KeyStream(11, b"p").permutation(n)

    assert sorted(order) == list(range(n))


@pytest.mark.parametrize("bound", [1, 2, 3, 255, 256, 257, 2**40 + 3])
def test_below_stays_below_its_bound(bound):
    stream = KeyStream(5, b"b")

    values = [stream.below(bound) for _ in range(200)]

    assert all(0 <= v < bound for v in values)


@pytest.mark.parametrize("seed", [-1, 2**256, 1.5, True, "7"])
def test_a_seed_outside_256_bits_is_refused(seed):
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*256\)"):
        KeyStream(seed, b"x")


def test_bad_bounds_and_sizes_are_refused():
    stream = KeyStream(1, b"x")

    with pytest.raises(ConfigError, match=r"bound must be >= 1, got 0"):
        stream.below(0)
    with pytest.raises(ConfigError, match=r"n must be >= 0"):
        stream.permutation(-1)
    with pytest.raises(ConfigError, match=r"size must be >= 0"):
        stream.read(-2)
