"""Known answers for the secure sum's key agreement, seed derivation and share boxes."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dpmtv_common.crypto.key_agreement import (
    PUBLIC_KEY_BYTES,
    SEED_BYTES,
    AgreementKey,
    open_box,
    pair_mask_seed,
    seal_box,
    share_box_key,
)
from dpmtv_common.errors import ConfigError, IntegrityError

# RFC 7748 section 6.1 (X25519).
ALICE_PRIVATE = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
ALICE_PUBLIC = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
BOB_PRIVATE = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
BOB_PUBLIC = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
SHARED = bytes.fromhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")

# Pinned outputs for SHARED (a change here changes every seed: it needs a new protocol version).
PAIR_SEED_R1_SUM0 = "82bcbbd8fa3de8d4629fa64173b8a748d0bc881ac54afb1af1e12ee4ca8ccd6a"
PAIR_SEED_R1_SUM1 = "7aa9696402ada62ef4acbd2c5f64bc170dc2538e53527de3586928790c3e7af4"
BOX_KEY_R1 = "0d89439079a923775b8407ab1ba84cf02f6a32776bc7ad0ecc9ab346502ed07f"

KEY = bytes(range(32))
CONTEXT = b"r1|sender|receiver"


def reference_hkdf_sha256(secret: bytes, *, salt: bytes, info: bytes) -> bytes:
    """RFC 5869 extract-then-expand, 32 bytes (one HMAC block), written out with hmac."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def length_prefixed(*parts: bytes) -> bytes:
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


# ----------------------------------------------------------------- X25519


def test_x25519_matches_rfc_7748_section_6_1() -> None:
    # Arrange
    alice = AgreementKey(X25519PrivateKey.from_private_bytes(ALICE_PRIVATE))
    bob = AgreementKey(X25519PrivateKey.from_private_bytes(BOB_PRIVATE))

    # Act
    from_alice = alice.shared_secret(bob.public_bytes)
    from_bob = bob.shared_secret(alice.public_bytes)

    # Assert
    assert alice.public_bytes == ALICE_PUBLIC
    assert bob.public_bytes == BOB_PUBLIC
    assert from_alice == from_bob == SHARED


def test_generated_keys_are_fresh_and_32_bytes() -> None:
    # Act
    first, second = AgreementKey.generate(), AgreementKey.generate()

    # Assert
    assert len(first.public_bytes) == PUBLIC_KEY_BYTES
    assert first.public_bytes != second.public_bytes


@pytest.mark.parametrize(
    "point",
    [bytes(32), (1).to_bytes(32, "little")],  # u = 0 and u = 1: the secret would be all zeros
    ids=["zero", "one"],
)
def test_a_low_order_public_key_is_refused(point: bytes) -> None:
    # Act / Assert
    with pytest.raises(IntegrityError, match="must not be low-order"):
        AgreementKey.generate().shared_secret(point)


@pytest.mark.parametrize(("peer", "shown"), [(bytes(31), "31"), ("a" * 32, "'a")])
def test_a_public_key_that_is_not_32_bytes_is_refused(peer: object, shown: str) -> None:
    # Act / Assert
    with pytest.raises(IntegrityError, match=f"must be 32 bytes, got {shown}"):
        AgreementKey.generate().shared_secret(peer)  # type: ignore[arg-type]


# ----------------------------------------------------------------- derivation


def test_the_reference_hkdf_matches_rfc_5869_test_case_1() -> None:
    # Arrange: RFC 5869 A.1 (its OKM is 42 bytes; one block gives the first 32).
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")

    # Act
    okm = reference_hkdf_sha256(ikm, salt=salt, info=info)

    # Assert
    assert okm.hex() == "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"


def test_pair_mask_seeds_and_box_keys_are_pinned() -> None:
    # Act
    sum0 = pair_mask_seed(SHARED, release_id="r1", sum_index=0, nodes=(1000, 1001))
    sum1 = pair_mask_seed(SHARED, release_id="r1", sum_index=1, nodes=(1000, 1001))
    box = share_box_key(SHARED, release_id="r1")

    # Assert
    assert (sum0.hex(), sum1.hex(), box.hex()) == (PAIR_SEED_R1_SUM0, PAIR_SEED_R1_SUM1, BOX_KEY_R1)
    assert len(sum0) == len(box) == SEED_BYTES


def test_the_derivation_is_hkdf_sha256_over_length_prefixed_fields() -> None:
    # Arrange: salt, label, release, then 8-byte big-endian sum index and sorted node ids.
    salt = b"dpmtv/secure-sum/v1"
    fields = [b"pair-mask", b"r1", *(n.to_bytes(8, "big") for n in (0, 1000, 1001))]

    # Act
    seed = pair_mask_seed(SHARED, release_id="r1", sum_index=0, nodes=(1001, 1000))

    # Assert
    expected = reference_hkdf_sha256(SHARED, salt=salt, info=length_prefixed(*fields))
    assert seed == expected
    box_info = length_prefixed(b"share-box", b"r1")
    assert share_box_key(SHARED, release_id="r1") == reference_hkdf_sha256(
        SHARED, salt=salt, info=box_info
    )


def test_both_neighbours_derive_the_same_seed_whatever_the_node_order() -> None:
    # Act
    low_first = pair_mask_seed(SHARED, release_id="r1", sum_index=2, nodes=(5, 9))
    high_first = pair_mask_seed(SHARED, release_id="r1", sum_index=2, nodes=(9, 5))

    # Assert
    assert low_first == high_first


def test_each_sum_release_pair_and_purpose_gets_its_own_seed() -> None:
    # Arrange
    base = {"release_id": "r1", "sum_index": 0, "nodes": (1000, 1001)}
    variants = [
        base,
        {**base, "sum_index": 1},
        {**base, "release_id": "r2"},
        {**base, "nodes": (1000, 1002)},
    ]

    # Act
    seeds = [pair_mask_seed(SHARED, **variant) for variant in variants]  # type: ignore[arg-type]
    seeds.append(share_box_key(SHARED, release_id="r1"))
    seeds.append(pair_mask_seed(bytes(32), **base))  # type: ignore[arg-type]

    # Assert
    assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"release_id": ""}, "release_id must be a non-empty str, got ''"),
        ({"sum_index": -1}, r"derivation index must be an int in \[0, 2\^64\), got -1"),
        ({"sum_index": True}, "got True"),
        ({"sum_index": 2**64}, "got 18446744073709551616"),
        ({"nodes": (1, 2.0)}, "got 2.0"),
    ],
)
def test_bad_derivation_fields_are_refused(options: dict[str, object], match: str) -> None:
    # Arrange
    fields: dict[str, object] = {"release_id": "r1", "sum_index": 0, "nodes": (1, 2), **options}

    # Act / Assert
    with pytest.raises(ConfigError, match=match):
        pair_mask_seed(SHARED, **fields)  # type: ignore[arg-type]


# ----------------------------------------------------------------- share boxes


@pytest.mark.parametrize("plaintext", [b"", b"shares", bytes(1000)])
def test_a_sealed_box_opens_to_its_plaintext(plaintext: bytes) -> None:
    # Act
    box = seal_box(KEY, plaintext, associated=CONTEXT)

    # Assert: 12-byte nonce and 16-byte tag around the ciphertext
    assert len(box) == 12 + len(plaintext) + 16
    assert open_box(KEY, box, associated=CONTEXT) == plaintext


def test_each_seal_draws_a_fresh_nonce() -> None:
    # Act
    first = seal_box(KEY, b"shares", associated=CONTEXT)
    second = seal_box(KEY, b"shares", associated=CONTEXT)

    # Assert
    assert first[:12] != second[:12]
    assert first != second


@pytest.mark.parametrize("position", [0, 11, 12, -1], ids=["nonce", "nonce-end", "body", "tag"])
def test_a_box_with_a_flipped_bit_is_refused(position: int) -> None:
    # Arrange
    box = bytearray(seal_box(KEY, b"shares", associated=CONTEXT))
    box[position] ^= 0x01

    # Act / Assert
    with pytest.raises(IntegrityError, match="must authenticate"):
        open_box(KEY, bytes(box), associated=CONTEXT)


def test_a_box_opened_for_other_associated_data_or_key_is_refused() -> None:
    # Arrange: another sender, receiver or release changes the associated data.
    box = seal_box(KEY, b"shares", associated=CONTEXT)

    # Act / Assert
    with pytest.raises(IntegrityError, match="must authenticate"):
        open_box(KEY, box, associated=b"r1|receiver|sender")
    with pytest.raises(IntegrityError, match="must authenticate"):
        open_box(bytes(32), box, associated=CONTEXT)


@pytest.mark.parametrize("box", [b"", bytes(27), "not bytes"])
def test_a_box_too_short_to_hold_a_nonce_and_a_tag_is_refused(box: object) -> None:
    # Act / Assert
    with pytest.raises(IntegrityError, match="must hold a nonce and a tag"):
        open_box(KEY, box, associated=CONTEXT)  # type: ignore[arg-type]
