"""Distributed shares through the real secure sum: exact sums, and dropouts counted.

The coordinator side is ``server.secure_sum.SecureSumSession`` over
``server.simulation.InProcessGrid`` (ChaCha20 masks, the protocol's quantiser and modular sum
on the plan's grid); the sites are the site service's real handlers on stand-in sites
(``tests.flower_harness.StandInSite``) that answer with ``encode_site_share``. Each site's
encoding is deterministic in its index (seeded noise and rounding), so the test recomputes
every site's integers and demands that the decoded sum equal their exact sum divided by γ,
bit for bit: the parameters of ``DistributedNoise`` make the whole path integer-exact. The
shares' statistics (production sampler) are in test_distributed_noise.py; these checks are
deterministic (false-failure rate 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpmtv_common.aliases import Float64Array
from dpmtv_common.privacy.distributed import (
    activation_noise,
    decode_noisy_sum,
    encode_site_share,
    release_epsilon,
)
from dpmtv_common.privacy.testing import SeededNoise
from protocol import SecureSumRequest, SumInstructions, SumRanges
from server.coordinator import build_plan
from server.messaging import Exchange
from server.secure_sum import SecureSumSession, SumResult
from server.settings import RunConfig
from server.simulation import InProcessGrid
from tests.flower_harness import (
    FIRST_NODE_ID,
    advertised_keys,
    flower_process_state,
    stand_in_apps,
    stand_in_sites,
)

# Deterministic, not statistical: it lives here beside the distributed-noise statistics.
pytestmark = pytest.mark.integration

DIM = 256
PARAMS = activation_noise(
    clip_norm=1.0,
    num_layers_in_scope=4,
    dimension=DIM,
    max_chunks_per_site=50,
    noise_multiplier=4.5,
    min_honest=2,
    max_sites=5,
)
RANGES = SumRanges(
    clipping_range=PARAMS.clipping_range,
    quantization_range=PARAMS.quantization_range,
    modulus_range=PARAMS.modulus_range,
)
REQUEST = SecureSumRequest(
    release_id="distributed", stage="extract", heads=None, clip_norm=1.0, score_top_r=None
)


def site_encoding(index: int) -> Float64Array:
    """Site ``index``'s encoded share: deterministic, so the test can recompute it."""
    x = np.random.default_rng(1000 + index).uniform(-50.0, 50.0, size=DIM)
    rounding = np.random.default_rng(2000 + index).random
    return encode_site_share(x, params=PARAMS, noise=SeededNoise(index), rounding=rounding)


def stand_in_share(index: int, request: SecureSumRequest) -> list[np.ndarray]:
    return [site_encoding(index)]


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    with flower_process_state():
        yield


def run_sum(tmp_path: Path, num_sites: int, drops: dict[int, set[str]] | None = None) -> SumResult:
    plan = build_plan(
        RunConfig(
            model_fingerprint="sha256:stand-in",
            release_id="distributed",
            clip_norm=1.0,
            selection="all",
            noise_mode="distributed",
            max_chunks_per_site=50,
            max_sites=PARAMS.max_sites,
            min_sites=2,  # a sum of two sites is measured too
        )
    )
    sites = stand_in_sites(tmp_path, num_sites, stand_in_share)
    grid = InProcessGrid(stand_in_apps(sites), num_nodes=num_sites, drops=drops)
    adverts = advertised_keys(grid, plan)
    session = SecureSumSession(Exchange(grid, timeout=60.0), plan.release_id, adverts, 2)
    return session.run_sum(SumInstructions(sum_index=0, request=REQUEST, ranges=RANGES))


@pytest.mark.parametrize("num_sites", [2, 5])
def test_decoded_secure_sum_is_the_exact_sum_of_the_encoded_shares(
    tmp_path: Path, num_sites: int
) -> None:
    # Act
    result = run_sum(tmp_path, num_sites)
    decoded = decode_noisy_sum(result.total, params=PARAMS, num_sites=len(result.survivors))
    # Assert: bit for bit, at the scale of a real sum (|values| up to ~1e8 grid units).
    expected = np.sum([site_encoding(i) for i in range(num_sites)], axis=0) / PARAMS.scale
    assert len(result.survivors) == num_sites
    assert np.array_equal(decoded, expected)


@pytest.mark.parametrize(
    ("message_type", "present"),
    [
        ("query.sum_shares", [0, 1, 2]),
        # Lost at unmask, its masked vector (share included) is already in the sum.
        ("query.sum_unmask", [0, 1, 2, 3]),
    ],
)
def test_a_lost_site_is_in_the_sum_iff_its_masked_vector_arrived(
    tmp_path: Path, message_type: str, present: list[int]
) -> None:
    # Act: site 3 of 4 is lost at ``message_type``.
    result = run_sum(tmp_path, 4, drops={FIRST_NODE_ID + 3: {message_type}})
    decoded = decode_noisy_sum(result.total, params=PARAMS, num_sites=len(result.survivors))
    # Assert: the shares present are exactly the survivors', and the manifest's ε is for them.
    expected = np.sum([site_encoding(i) for i in present], axis=0) / PARAMS.scale
    assert np.array_equal(decoded, expected)
    assert result.survivors == tuple(FIRST_NODE_ID + i for i in present)
    at_t = release_epsilon(PARAMS, None, honest_shares=2, delta=1e-5).epsilon
    present_eps = release_epsilon(PARAMS, None, honest_shares=len(result.survivors), delta=1e-5)
    assert present_eps.epsilon < at_t
