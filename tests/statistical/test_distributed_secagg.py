"""Distributed shares through the real Flower SecAgg+ path: exact sums, and dropouts counted.

The coordinator side is ``server.secagg.secure_sum`` over ``server.simulation.InProcessGrid``
(ChaCha20 masks, Flower's quantiser and modular sum, average times survivors); the sites are a
stub ``ClientApp`` under ``secaggplus_mod`` that answers with ``encode_site_share`` through
``client.secagg.secure_sum_reply``. Each site's encoding is deterministic in its index
(seeded noise and rounding), so the test recomputes every site's integers and demands that
the decoded sum equal their exact sum divided by γ, bit for bit: the parameters of
``DistributedNoise`` make the whole path integer-exact. The shares' statistics (production
sampler) are in test_distributed_noise.py; these checks are deterministic (false-failure
rate 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

from collections.abc import Iterator

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from client.secagg import install_secure_mask_prg as install_site_mask_prg
from client.secagg import secaggplus_clipping_range, secure_sum_reply
from dpmtv_common.aliases import Float64Array
from dpmtv_common.privacy.distributed import (
    activation_noise,
    decode_noisy_sum,
    encode_site_share,
    release_epsilon,
)
from dpmtv_common.privacy.testing import SeededNoise
from server.secagg import (
    SecureSumResult,
    SecureSumSettings,
    install_secure_mask_prg,
    secure_sum,
)
from server.simulation import InProcessGrid, make_server_context
from tests.flower_harness import FIRST_NODE_ID, flower_process_state

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


def site_encoding(index: int) -> Float64Array:
    """Site ``index``'s encoded share: deterministic, so the test can recompute it."""
    x = np.random.default_rng(1000 + index).uniform(-50.0, 50.0, size=DIM)
    rounding = np.random.default_rng(2000 + index).random
    return encode_site_share(x, params=PARAMS, noise=SeededNoise(index), rounding=rounding)


stub_app = ClientApp()


@stub_app.train(mods=[secaggplus_mod])
def stub_share(msg: Message, context: Context) -> Message:
    encoded = site_encoding(int(context.node_config["partition-id"]))
    return secure_sum_reply(msg, [encoded], clipping_range=secaggplus_clipping_range(context))


@pytest.fixture(autouse=True)
def _restore_flower_state() -> Iterator[None]:
    with flower_process_state():
        install_site_mask_prg()
        install_secure_mask_prg()
        yield


def run_sum(num_sites: int, drops: dict[int, set[str]] | None = None) -> SecureSumResult:
    grid = InProcessGrid(stub_app, num_nodes=num_sites, drops=drops)
    settings = SecureSumSettings(
        clipping_range=PARAMS.clipping_range,
        quantization_range=PARAMS.quantization_range,
        modulus_range=PARAMS.modulus_range,
        timeout=60.0,
        max_sites=PARAMS.max_sites,
    )
    result = secure_sum(
        grid,
        make_server_context(),
        grid.get_node_ids(),
        {},
        round_id=0,
        settings=settings,
        min_sites=2,
    )
    assert result is not None
    return result


@pytest.mark.parametrize("num_sites", [2, 5])
def test_decoded_secure_sum_is_the_exact_sum_of_the_encoded_shares(num_sites):
    # Act
    result = run_sum(num_sites)
    decoded = decode_noisy_sum(result.arrays[0], params=PARAMS, num_sites=result.num_sites)
    # Assert: bit for bit, at the scale of a real sum (|values| up to ~1e8 grid units).
    expected = np.sum([site_encoding(i) for i in range(num_sites)], axis=0) / PARAMS.scale
    assert result.num_sites == num_sites
    assert np.array_equal(decoded, expected)


@pytest.mark.parametrize(
    ("stage", "present"),
    [
        ("collect_masked_vectors", [0, 1, 2]),
        # Lost at unmask, its masked vector (share included) is already in the sum.
        ("unmask", [0, 1, 2, 3]),
    ],
)
def test_a_lost_site_is_in_the_sum_iff_its_masked_vector_arrived(stage, present):
    # Act: site 3 of 4 is lost at ``stage``.
    result = run_sum(4, drops={FIRST_NODE_ID + 3: {stage}})
    decoded = decode_noisy_sum(result.arrays[0], params=PARAMS, num_sites=result.num_sites)
    # Assert: the shares present are exactly the survivors', and the manifest's ε is for them.
    expected = np.sum([site_encoding(i) for i in present], axis=0) / PARAMS.scale
    assert np.array_equal(decoded, expected)
    assert result.num_sites == len(present)
    at_t = release_epsilon(PARAMS, None, honest_shares=2, delta=1e-5).epsilon
    present_eps = release_epsilon(PARAMS, None, honest_shares=result.num_sites, delta=1e-5)
    assert present_eps.epsilon < at_t
