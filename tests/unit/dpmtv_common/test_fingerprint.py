import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from dpmtv_common.errors import ConfigError
from dpmtv_common.fingerprint import fingerprint_model_dir


def make_model_dir(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "tiny"}')
    (root / "generation_config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"\x01" * 3000)
    return root


def test_fingerprint_has_sha256_prefix_and_hex_digest(tmp_path: Path) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "model")
    # Act
    fingerprint = fingerprint_model_dir(model)
    # Assert
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", fingerprint)


def test_identical_copies_have_equal_fingerprints(tmp_path: Path) -> None:
    # Arrange
    first = make_model_dir(tmp_path / "a")
    second = make_model_dir(tmp_path / "b")
    # Act / Assert
    assert fingerprint_model_dir(first) == fingerprint_model_dir(second)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d / "model.safetensors").write_bytes(b"\x01" * 2999 + b"\x02"),
        lambda d: (d / "config.json").write_text('{"model_type": "tinY"}'),
        lambda d: (d / "model.safetensors").rename(d / "model2.safetensors"),
        lambda d: (d / "extra.bin").write_bytes(b""),
        lambda d: (d / "tokenizer_config.json").write_text("{}"),
        lambda d: (d / "generation_config.json").unlink(),
    ],
    ids=["weight-byte", "config", "rename", "new-weight-file", "new-json", "removed-json"],
)
def test_any_change_to_covered_files_alters_fingerprint(
    tmp_path: Path, change: Callable[[Path], object]
) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "model")
    before = fingerprint_model_dir(model)
    # Act
    change(model)
    # Assert
    assert fingerprint_model_dir(model) != before


@pytest.mark.parametrize("name", ["README.md", ".hidden.json", "notes.txt"])
def test_uncovered_files_leave_fingerprint_alone(tmp_path: Path, name: str) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "model")
    before = fingerprint_model_dir(model)
    # Act
    (model / name).write_text("irrelevant")
    # Assert
    assert fingerprint_model_dir(model) == before


def test_subdirectories_leave_fingerprint_alone(tmp_path: Path) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "model")
    before = fingerprint_model_dir(model)
    # Act
    (model / "original").mkdir()
    (model / "original" / "consolidated.pth").write_bytes(b"\x00")
    (model / "cache.json").mkdir()
    # Assert
    assert fingerprint_model_dir(model) == before


def test_symlinked_snapshot_fingerprints_like_a_copy(tmp_path: Path) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "model")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for entry in model.iterdir():
        (snapshot / entry.name).symlink_to(entry)
    # Act / Assert
    assert fingerprint_model_dir(snapshot) == fingerprint_model_dir(model)


def test_file_larger_than_one_block_is_hashed_in_full(tmp_path: Path) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "model")
    big = bytearray(3 * (1 << 20) + 5)
    (model / "model.safetensors").write_bytes(bytes(big))
    before = fingerprint_model_dir(model)
    big[-1] = 1
    # Act
    (model / "model.safetensors").write_bytes(bytes(big))
    # Assert
    assert fingerprint_model_dir(model) != before


def test_missing_directory_is_refused_with_its_path(tmp_path: Path) -> None:
    # Arrange
    missing = tmp_path / "nowhere"
    # Act / Assert
    with pytest.raises(ConfigError, match="nowhere"):
        fingerprint_model_dir(missing)


def test_directory_without_config_is_refused_with_its_path(tmp_path: Path) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "weights_only")
    (model / "config.json").unlink()
    # Act / Assert
    with pytest.raises(ConfigError, match=r"config\.json, got .*weights_only"):
        fingerprint_model_dir(model)


def test_cached_fingerprint_equals_the_uncached_one_and_follows_rewrites(tmp_path: Path) -> None:
    # Arrange
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llava"}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"\x01" * 4096)
    cache = tmp_path / "cache"
    # Act
    plain = fingerprint_model_dir(model)
    first = fingerprint_model_dir(model, cache_dir=cache)
    second = fingerprint_model_dir(model, cache_dir=cache)
    weights.write_bytes(b"\x02" * 4096)  # same size: the modification time must invalidate it
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    rewritten = fingerprint_model_dir(model, cache_dir=cache)
    # Assert
    assert plain == first == second
    assert (cache / "fingerprint-digests.json").is_file()
    assert rewritten == fingerprint_model_dir(model)
    assert rewritten != plain


def test_a_damaged_cache_is_ignored(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.bin").write_bytes(b"abc")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fingerprint-digests.json").write_text("not json")
    assert fingerprint_model_dir(model, cache_dir=cache) == fingerprint_model_dir(model)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("chat_template.jinja", "{{ messages }}"),
        ("chat_template.json", '{"chat_template": "{{ messages }}"}'),
        ("tokenizer_config.json", '{"chat_template": "{{ messages }}"}'),
        ("processor_config.json", '{"image_seq_len": 4}'),
        ("preprocessor_config.json", '{"size": {"longest_edge": 56}}'),
        ("tokenizer.json", '{"model": {}}'),
        ("tokenizer.model", "sentencepiece bytes"),
        ("vocab.txt", "a\nb"),
        ("merges.txt", "a b"),
        ("additional_chat_templates/tool_use.jinja", "{{ tools }}"),
    ],
)
def test_every_prompt_shaping_file_enters_the_fingerprint(
    tmp_path: Path, name: str, content: str
) -> None:
    # Arrange: the file exists with one content, then with another
    model = make_model_dir(tmp_path / "model")
    target = model / name
    target.parent.mkdir(exist_ok=True)
    target.write_text(content)
    before = fingerprint_model_dir(model)
    # Act
    target.write_text(content + " ")
    # Assert
    assert fingerprint_model_dir(model) != before


def test_a_chat_template_changes_the_fingerprint_of_a_saved_model(tmp_path: Path) -> None:
    # Arrange: what a site with another prompt format has (issue 11)
    model = make_model_dir(tmp_path / "model")
    (model / "chat_template.jinja").write_text("USER: {{ content }} ASSISTANT:")
    before = fingerprint_model_dir(model)
    # Act
    (model / "chat_template.jinja").write_text("<|im_start|>user {{ content }}<|im_end|>")
    # Assert
    assert fingerprint_model_dir(model) != before


def test_cached_fingerprint_still_rereads_small_prompt_files(tmp_path: Path) -> None:
    # Arrange
    model = make_model_dir(tmp_path / "model")
    template = model / "chat_template.jinja"
    template.write_text("A")
    cache = tmp_path / "cache"
    first = fingerprint_model_dir(model, cache_dir=cache)
    stat = template.stat()
    # Act: same size and timestamps, other content; only a re-read can see it
    template.write_text("B")
    os.utime(template, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # Assert
    assert fingerprint_model_dir(model, cache_dir=cache) != first
