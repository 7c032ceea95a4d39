import hashlib
import stat
from pathlib import Path

import pytest

from dpmtv_common.crypto import KEY_ID_HEX_CHARS, SigningKey, TrustedKeys, VerifyKey
from dpmtv_common.errors import BadSignatureError, ConfigError, UnknownSigningKeyError


def test_signature_verifies_under_matching_key() -> None:
    # Arrange
    key = SigningKey.generate()
    # Act
    signature = key.sign(b"payload")
    # Assert
    key.verify_key.verify(b"payload", signature)
    assert len(signature) == 64


def test_verify_refuses_other_bytes() -> None:
    # Arrange
    key = SigningKey.generate()
    signature = key.sign(b"payload")
    # Act / Assert
    with pytest.raises(BadSignatureError, match=key.key_id):
        key.verify_key.verify(b"payloaD", signature)


def test_verify_refuses_truncated_signature() -> None:
    # Arrange
    key = SigningKey.generate()
    signature = key.sign(b"payload")
    # Act / Assert
    with pytest.raises(BadSignatureError, match="63-byte"):
        key.verify_key.verify(b"payload", signature[:-1])


def test_verify_refuses_signature_of_another_key() -> None:
    # Arrange
    signer, other = SigningKey.generate(), SigningKey.generate()
    # Act / Assert
    with pytest.raises(BadSignatureError):
        other.verify_key.verify(b"payload", signer.sign(b"payload"))


def test_key_id_is_sha256_prefix_of_raw_public_key() -> None:
    # Arrange
    key = SigningKey.generate()
    # Act
    key_id = key.key_id
    # Assert
    expected = hashlib.sha256(key.verify_key.raw_bytes).hexdigest()[:KEY_ID_HEX_CHARS]
    assert key_id == expected
    assert len(key_id) == 16


def test_private_key_file_is_owner_only_and_round_trips(tmp_path: Path) -> None:
    # Arrange
    key = SigningKey.generate()
    path = tmp_path / "signer.pem"
    # Act
    key.save(path)
    loaded = SigningKey.load(path)
    # Assert
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert loaded.key_id == key.key_id
    key.verify_key.verify(b"x", loaded.sign(b"x"))


def test_public_key_file_round_trips(tmp_path: Path) -> None:
    # Arrange
    key = SigningKey.generate().verify_key
    path = tmp_path / "signer.pub.pem"
    # Act
    key.save(path)
    loaded = VerifyKey.load(path)
    # Assert
    assert path.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert loaded == key
    assert loaded.key_id == key.key_id


def test_save_refuses_to_overwrite_existing_key_file(tmp_path: Path) -> None:
    # Arrange
    path = tmp_path / "signer.pem"
    first = SigningKey.generate()
    first.save(path)
    # Act / Assert
    with pytest.raises(ConfigError, match="overwrite=True"):
        SigningKey.generate().save(path)
    assert SigningKey.load(path).key_id == first.key_id


def test_save_with_overwrite_replaces_key_file(tmp_path: Path) -> None:
    # Arrange
    path = tmp_path / "signer.pem"
    SigningKey.generate().save(path)
    second = SigningKey.generate()
    # Act
    second.save(path, overwrite=True)
    # Assert
    assert SigningKey.load(path).key_id == second.key_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["signer.pem"]


def test_load_of_missing_key_file_names_the_path(tmp_path: Path) -> None:
    # Arrange
    path = tmp_path / "absent.pem"
    # Act / Assert
    with pytest.raises(ConfigError, match=r"absent\.pem"):
        SigningKey.load(path)


def test_load_of_garbage_public_key_names_the_path(tmp_path: Path) -> None:
    # Arrange
    path = tmp_path / "garbage.pem"
    path.write_bytes(b"not a key")
    # Act / Assert
    with pytest.raises(ConfigError, match=r"garbage\.pem"):
        VerifyKey.load(path)


def test_private_key_loader_refuses_a_public_key(tmp_path: Path) -> None:
    # Arrange
    path = SigningKey.generate().verify_key.save(tmp_path / "public.pem")
    # Act / Assert
    with pytest.raises(ConfigError, match="private key file"):
        SigningKey.load(path)


def test_from_raw_refuses_wrong_length() -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="32 bytes, got 31"):
        VerifyKey.from_raw(b"\x00" * 31)


def test_from_raw_round_trips_raw_bytes() -> None:
    # Arrange
    key = SigningKey.generate().verify_key
    # Act
    rebuilt = VerifyKey.from_raw(key.raw_bytes)
    # Assert
    assert rebuilt == key
    assert hash(rebuilt) == hash(key)


def test_trusted_keys_from_files_finds_each_key(tmp_path: Path) -> None:
    # Arrange
    keys = [SigningKey.generate().verify_key for _ in range(3)]
    paths = [key.save(tmp_path / f"k{index}.pem") for index, key in enumerate(keys)]
    # Act
    trusted = TrustedKeys.from_files(paths)
    # Assert
    assert len(trusted) == 3
    assert trusted.key_ids == tuple(sorted(key.key_id for key in keys))
    for key in keys:
        assert key.key_id in trusted
        assert trusted.get(key.key_id) == key


def test_trusted_keys_lookup_of_unknown_id_lists_known_ids() -> None:
    # Arrange
    known = SigningKey.generate().verify_key
    trusted = TrustedKeys([known])
    # Act / Assert
    with pytest.raises(UnknownSigningKeyError, match=known.key_id) as caught:
        trusted.get("0123456789abcdef")
    assert "0123456789abcdef" in str(caught.value)


def test_empty_trusted_keys_says_none_are_known() -> None:
    # Act / Assert
    with pytest.raises(UnknownSigningKeyError, match=r"\(none\)"):
        TrustedKeys().get("0123456789abcdef")


def test_trusted_keys_collapse_duplicate_files(tmp_path: Path) -> None:
    # Arrange
    key = SigningKey.generate().verify_key
    paths = [key.save(tmp_path / "a.pem"), key.save(tmp_path / "b.pem")]
    # Act
    trusted = TrustedKeys.from_files(paths)
    # Assert
    assert len(trusted) == 1
    assert repr(trusted) == f"TrustedKeys(key_ids=({key.key_id!r},))"
