"""Tests of the HTTP endpoint's edge checks: address, token file, chat mapping (no model)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from client.service.chat_format import ChatRequest, chat_request_from_json, parse_chat
from client.service.http_server import HttpSettings, parse_address, read_token
from dpmtv_common.errors import ConfigError, DataError


def png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def turn(role: str, text: str, image: bool) -> dict[str, object]:
    parts: list[dict[str, object]] = [{"type": "text", "text": text}]
    if image:
        parts.append({"type": "image_url", "image_url": {"url": png()}})
    return {"role": role, "content": parts}


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("localhost:0", ("127.0.0.1", 0)),
        ("[::1]:9000", ("::1", 9000)),
        ("unix:/run/dpmtv/http.sock", Path("/run/dpmtv/http.sock")),
    ],
)
def test_parse_address_accepts_loopback_and_unix_sockets(address, expected):
    assert parse_address(address, allow_remote=False) == expected


@pytest.mark.parametrize(
    ("address", "match"),
    [
        ("0.0.0.0:8080", "loopback"),
        ("10.1.2.3:8080", "loopback"),
        ("example.org:8080", "IP address or localhost"),
        ("127.0.0.1", "HOST:PORT"),
        ("127.0.0.1:99999", "HOST:PORT"),
        ("unix:relative.sock", "absolute"),
    ],
)
def test_parse_address_refuses_remote_or_malformed_addresses(address, match):
    with pytest.raises(ConfigError, match=match):
        parse_address(address, allow_remote=False)


def test_parse_address_allows_a_remote_host_only_when_asked():
    assert parse_address("10.1.2.3:8080", allow_remote=True) == ("10.1.2.3", 8080)


def test_read_token_needs_an_owner_only_file_with_a_long_token(tmp_path):
    # Arrange
    token = tmp_path / "token"
    token.write_text("a" * 32 + "\n")
    # Act / Assert
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token(token)
    token.chmod(0o600)
    assert read_token(token) == b"a" * 32
    token.write_text("short")
    with pytest.raises(ConfigError, match="at least 24"):
        read_token(token)
    with pytest.raises(ConfigError, match="readable"):
        read_token(tmp_path / "missing")


def test_a_conversation_maps_to_instruction_demonstrations_and_query():
    # Arrange
    request = ChatRequest.model_validate(
        {
            "model": "r1",
            "messages": [
                {"role": "system", "content": "Answer in one word."},
                turn("user", "Colour?", image=True),
                {"role": "assistant", "content": "red"},
                turn("user", "And this one?", image=True),
            ],
        }
    )
    # Act
    parsed = parse_chat(request)
    # Assert
    assert parsed.instruction == "Answer in one word."
    assert parsed.questions == ("Colour?", "And this one?")
    assert parsed.answers == ("red",)
    assert len(parsed.images) == 2


NINE_IMAGES = [
    *[turn("user", "Colour?", image=True), {"role": "assistant", "content": "red"}] * 8,
    turn("user", "Colour?", image=True),
]


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([turn("user", "Colour?", image=False)], ConfigError, "exactly one image_url"),
        ([turn("assistant", "red", image=False)], ConfigError, "end with a user message"),
        (
            [turn("user", "a", image=True), turn("user", "b", image=True)],
            ConfigError,
            "must be 'assistant'",
        ),
        ([turn("user", "", image=True)], ConfigError, "inference limits"),
        (NINE_IMAGES, ConfigError, "inference limits"),
    ],
)
def test_conversations_the_model_cannot_answer_are_refused(messages, error, match):
    request = ChatRequest.model_validate({"model": "r1", "messages": messages})
    with pytest.raises(error, match=match):
        parse_chat(request)


def test_an_image_url_that_is_not_a_data_uri_is_refused_without_fetching():
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Colour?"},
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        ],
    }
    request = ChatRequest.model_validate({"model": "r1", "messages": [message]})
    with pytest.raises(DataError, match="fetches no URL"):
        parse_chat(request)


@pytest.mark.parametrize(
    "extra",
    [{"n": 2}, {"top_p": 0.5}, {"tools": []}, {"max_tokens": 10_000}, {"temperature": -1}],
)
def test_settings_the_service_does_not_apply_are_refused(extra):
    body = {"model": "r1", "messages": [turn("user", "Colour?", image=True)], **extra}

    with pytest.raises(ConfigError, match="chat-completions request"):
        chat_request_from_json(json.dumps(body).encode())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--http", "127.0.0.1:8080"], "--http-token-file must be given with --http"),
        (["--http", "0.0.0.0:8080", "--http-token-file", "TOKEN"], "loopback"),
        (["--http-token-file", "TOKEN"], "must come with --http"),
        (["--http", "127.0.0.1:8080", "--http-token-file", "TOKEN", "--http-max-request-mib",
          "0"], "--http-max-request-mib"),
    ],
)  # fmt: skip
def test_serve_refuses_bad_http_flags_before_loading_anything(tmp_path, capsys, flags, message):
    # Arrange
    from client.cli.main import main

    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    argv = ["serve", "--model", str(tmp_path / "no-model"), "--state-dir", str(tmp_path)]
    # Act
    code = main(argv + [str(token) if flag == "TOKEN" else flag for flag in flags])
    # Assert
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ledger.sqlite").exists()


def _settings_of(tmp_path: Path, *flags: str) -> Any:
    """The endpoint's settings ``dpmtv-site serve --http 127.0.0.1:0 ... FLAGS`` gives."""
    import argparse

    from client.cli.http_options import add_http_options, check_http

    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    parser = argparse.ArgumentParser()
    add_http_options(parser)
    args = parser.parse_args(["--http", "127.0.0.1:0", "--http-token-file", str(token), *flags])
    settings = check_http(args)
    assert settings is not None
    return settings


@pytest.mark.parametrize(("flags", "invariant"), [([], False), (["--http-batch-invariant"], True)])
def test_batch_invariant_answers_are_a_site_option_off_by_default(tmp_path, flags, invariant):
    assert _settings_of(tmp_path, *flags).batch_invariant is invariant


@pytest.mark.parametrize(("flags", "expected"), [([], 1 << 30), (["--http-max-request-mib", "64"],
                                                                 64 << 20)])  # fmt: skip
def test_the_request_memory_bound_reaches_the_endpoint_s_settings(tmp_path, flags, expected):
    assert _settings_of(tmp_path, *flags).max_request_memory == expected
    assert HttpSettings("127.0.0.1:0", tmp_path).max_request_memory == 1 << 30  # one default
