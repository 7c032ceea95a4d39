"""The consortium roster: its file, its fingerprint, and who it lets sign."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from dpmtv_common.crypto import SigningKey, VerifyKey
from dpmtv_common.errors import ConfigError, PolicyError
from dpmtv_common.roster import Roster

KEYS = {name: SigningKey.generate() for name in ("hospital-a", "hospital-b", "clinic.c")}


def roster(**members: VerifyKey) -> Roster:
    return Roster("derm-2026", members or {name: key.verify_key for name, key in KEYS.items()})


def member_table(name: str, key: bytes | str) -> str:
    encoded = key if isinstance(key, str) else base64.b64encode(key).decode()
    return f'[[member]]\nname = "{name}"\nidentity_key = "{encoded}"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "roster.toml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------- file


def test_a_roster_survives_its_file(tmp_path: Path) -> None:
    # Arrange
    original = roster()

    # Act
    loaded = Roster.load(write(tmp_path, original.to_toml()))

    # Assert
    assert loaded == original
    assert loaded.fingerprint == original.fingerprint
    assert original.fingerprint in original.to_toml()  # printed for the out-of-band check


def test_the_file_lists_members_sorted_by_name() -> None:
    # Act
    text = roster().to_toml()

    # Assert
    names = [line.split('"')[1] for line in text.splitlines() if line.startswith("name = ")]
    assert names == ["clinic.c", "hospital-a", "hospital-b"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("consortium = [", "must be TOML"),
        ('consortium = "x"\nextra = 1\n', r"must hold only consortium and member, got \['extra'\]"),
        ('consortium = "x"\n', "must list \\[\\[member\\]\\] tables, got NoneType"),
        (
            'consortium = "x"\n[[member]]\nname = "a"\nidentity_key = "AA=="\nnote = 1\n',
            "must hold exactly name and identity_key",
        ),
        (
            'consortium = "x"\n' + member_table("a", "not base64!"),
            "identity_key must be base64",
        ),
        (
            'consortium = "x"\n' + member_table("a", bytes(31)),
            "identity_key must be an Ed25519 key",
        ),
    ],
)
def test_a_file_that_is_not_a_roster_is_refused(tmp_path: Path, text: str, match: str) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match=match):
        Roster.load(write(tmp_path, text))


def test_a_missing_file_is_refused_with_its_path(tmp_path: Path) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match=r"nowhere\.toml' must be readable"):
        Roster.load(tmp_path / "nowhere.toml")


def test_a_member_named_twice_in_the_file_is_refused(tmp_path: Path) -> None:
    # Arrange
    first, second = SigningKey.generate(), SigningKey.generate()
    text = (
        'consortium = "x"\n'
        + member_table("a", first.verify_key.raw_bytes)
        + member_table("a", second.verify_key.raw_bytes)
    )

    # Act / Assert
    with pytest.raises(ConfigError, match="must name each member once, got 'a' twice"):
        Roster.load(write(tmp_path, text))


# ----------------------------------------------------------------- fingerprint


def test_the_fingerprint_ignores_member_order(tmp_path: Path) -> None:
    # Arrange
    forward = {name: key.verify_key for name, key in KEYS.items()}
    backward = dict(reversed(forward.items()))
    shuffled = 'consortium = "derm-2026"\n' + "".join(
        member_table(name, key.raw_bytes) for name, key in backward.items()
    )

    # Act
    fingerprints = {
        roster(**forward).fingerprint,
        roster(**backward).fingerprint,
        Roster.load(write(tmp_path, shuffled)).fingerprint,
    }

    # Assert
    assert len(fingerprints) == 1
    assert len(fingerprints.pop()) == 64


def test_any_change_of_a_name_a_key_or_the_consortium_changes_the_fingerprint() -> None:
    # Arrange
    members = {name: key.verify_key for name, key in KEYS.items()}
    renamed = {("hospital-z" if n == "hospital-a" else n): k for n, k in members.items()}
    rekeyed = {**members, "hospital-a": SigningKey.generate().verify_key}
    grown = {**members, "lab-d": SigningKey.generate().verify_key}

    # Act
    fingerprints = [
        roster(**members).fingerprint,
        roster(**renamed).fingerprint,
        roster(**rekeyed).fingerprint,
        roster(**grown).fingerprint,
        Roster("derm-2027", members).fingerprint,
    ]

    # Assert
    assert len(set(fingerprints)) == len(fingerprints)


# ----------------------------------------------------------------- validation


def test_one_key_for_two_members_is_refused() -> None:
    # Arrange: one site would count twice in every sum.
    key = SigningKey.generate().verify_key

    # Act / Assert
    with pytest.raises(ConfigError, match="distinct identity keys, got one key for 'a' and 'b'"):
        Roster("x", {"a": key, "b": key})


@pytest.mark.parametrize("count", [0, 1])
def test_fewer_than_two_members_are_refused(count: int) -> None:
    # Arrange
    members = {f"m{i}": SigningKey.generate().verify_key for i in range(count)}

    # Act / Assert
    with pytest.raises(ConfigError, match=f"at least 2 members .* got {count}"):
        Roster("x", members)


@pytest.mark.parametrize(("consortium", "name"), [("bad name", "a"), ("x", "-a"), ("x", "a/b")])
def test_names_outside_the_pattern_are_refused(consortium: str, name: str) -> None:
    # Arrange
    members = {name: SigningKey.generate().verify_key, "b": SigningKey.generate().verify_key}

    # Act / Assert
    with pytest.raises(ConfigError, match="must match"):
        Roster(consortium, members)


def test_the_members_cannot_be_changed_after_construction() -> None:
    # Arrange
    members = {name: key.verify_key for name, key in KEYS.items()}
    built = Roster("x", members)
    before = built.fingerprint

    # Act
    members["intruder"] = SigningKey.generate().verify_key

    # Assert
    assert "intruder" not in built.members
    assert built.fingerprint == before
    with pytest.raises(TypeError):
        built.members["intruder"] = members["intruder"]  # type: ignore[index]


# ----------------------------------------------------------------- verify


def test_a_member_s_signature_verifies() -> None:
    # Arrange
    data = b"statement"
    signature = KEYS["hospital-b"].sign(data)

    # Act / Assert
    roster().verify("hospital-b", data, signature)
    assert roster().identity("hospital-b") == KEYS["hospital-b"].verify_key


def test_a_non_member_is_refused() -> None:
    # Arrange
    outsider = SigningKey.generate()

    # Act / Assert
    with pytest.raises(PolicyError, match=r"must be a member of roster .* got 'mallory'"):
        roster().verify("mallory", b"statement", outsider.sign(b"statement"))


@pytest.mark.parametrize("forgery", ["other member's key", "other bytes", "short"])
def test_a_signature_that_does_not_verify_is_refused(forgery: str) -> None:
    # Arrange
    data = b"statement"
    signature = {
        "other member's key": KEYS["hospital-a"].sign(data),
        "other bytes": KEYS["hospital-b"].sign(b"another statement"),
        "short": KEYS["hospital-b"].sign(data)[:32],
    }[forgery]

    # Act / Assert
    with pytest.raises(PolicyError, match="'hospital-b' must sign with its roster identity key"):
        roster().verify("hospital-b", data, signature)


@pytest.mark.parametrize("where", ["member", "consortium"])
def test_a_name_with_a_trailing_newline_is_refused(where: str) -> None:
    # Arrange
    members = {"site-a": SigningKey.generate().verify_key, "b": SigningKey.generate().verify_key}
    consortium = "x"
    if where == "member":
        members["site-a\n"] = SigningKey.generate().verify_key
    else:
        consortium = "x\n"

    # Act / Assert
    with pytest.raises(ConfigError, match="must match"):
        Roster(consortium, members)


def test_the_fingerprint_is_computed_once_per_roster(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every advertisement of every sum is compared with it: recomputing it (one pass over the
    # members each time) made a thousand-site sum's checks grow with the cube of the sites.
    import dpmtv_common.roster as roster_module

    encoded: list[bytes] = []
    real = roster_module._b64

    def counting(raw: bytes) -> str:
        encoded.append(raw)
        return real(raw)

    monkeypatch.setattr(roster_module, "_b64", counting)
    members = roster()

    first = members.fingerprint
    again = [members.fingerprint for _ in range(10)]

    assert again == [first] * 10
    assert len(encoded) == len(KEYS)  # one pass over the members, for the first read only
