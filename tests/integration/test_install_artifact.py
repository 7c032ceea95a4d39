"""Serve what you released: ``install-artifact`` checks an artifact, puts it where it is served.

The README's single-holder steps run as written (``release --release-id colour-1``,
``install-artifact``, the token line, ``serve --http``), then docs/deployment.md's OpenAI
example runs verbatim but for its port (a test cannot count on 8080 being free) against the
model id those steps produce. Refusals: another model, an untrusted signer, a manifest its own
plan does not produce, a second install of one release id.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from client.cli import main
from dpmtv_common.artifact import ReleaseDescription, load_artifact, write_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.heads import HeadSet
from tests.integration.test_site_cli import Workspace, clean_site_env, workspace  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def site_env(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: F811
    clean_site_env(monkeypatch, tmp_path)  # each test in its own folder, as a site admin's


def _release(ws: Workspace, out: Path, release_id: str = "colour-1") -> None:
    code = main(
        [
            "release", *ws.model_args(), "--data", str(ws.private), "--out", str(out),
            "--release-id", release_id, "--selection", "all", "--clip-norm", "1.0",
            "--shots", "2", "--quiet", "--signing-key", str(ws.signing_key),
        ]
    )  # fmt: skip
    assert code == 0


def _install(ws: Workspace, artifact: Path, *extra: str) -> int:
    return main(
        ["install-artifact", str(artifact), *ws.model_args(), "--trusted-key", str(ws.public_key),
         *extra]
    )  # fmt: skip


def _openai_example() -> str:
    text = (REPO / "docs" / "deployment.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    (example,) = [str(block) for block in blocks if "from openai import OpenAI" in block]
    return example


def test_the_docs_steps_serve_a_single_holder_release_to_the_openai_example(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ws = workspace
    # The README's steps: a release, installed for the service
    _release(ws, tmp_path / "artifact")
    assert _install(ws, tmp_path / "artifact") == 0
    printed = capsys.readouterr().out
    assert "served as model 'colour-1'" in printed
    # ... the token line, verbatim ...
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    token_line = next(
        line
        for line in readme.splitlines()
        if line.endswith("> http.token && chmod 600 http.token")
    )
    subprocess.run(
        ["bash", "-c", token_line.replace("python ", f"{sys.executable} ", 1)],
        check=True,
        cwd=tmp_path,
    )
    # ... and the service with the README's options (port 0: a free one)
    command = [
        sys.executable, "-m", "client.cli", "serve", *ws.model_args(), "--data", str(ws.private),
        "--trusted-key", str(ws.public_key), "--socket", str(tmp_path / "s.sock"),
        "--threads", "1", "--http", "127.0.0.1:0", "--http-token-file", "http.token",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("HTTP endpoint on" in line for line in list(lines)):
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        url = next(line for line in lines if "HTTP endpoint on" in line).rsplit(" ", 1)[1].strip()
        token = (tmp_path / "http.token").read_text().strip()
        # Assert: /v1/models lists the installed release
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert "colour-1" in [entry["id"] for entry in models.json()["data"]]
        # ... and the docs' example answers with it, verbatim but for the port
        (tmp_path / "scan.png").write_bytes((ws.test / "200.png").read_bytes())
        example = _openai_example().replace("http://127.0.0.1:8080", url)
        answered = subprocess.run(
            [sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip
        assert answered.returncode == 0, answered.stderr
        assert answered.stdout.strip() != ""
    finally:
        process.terminate()
        process.wait(timeout=60)
        reader.join(timeout=10)
        if process.stderr is not None:
            process.stderr.close()


def test_an_installed_release_is_never_replaced(workspace, tmp_path, capsys):  # noqa: F811
    _release(workspace, tmp_path / "artifact")
    assert _install(workspace, tmp_path / "artifact") == 0
    capsys.readouterr()
    assert _install(workspace, tmp_path / "artifact") == 2
    assert "an installed artifact is never replaced" in capsys.readouterr().err


def test_an_artifact_for_another_model_is_not_installed(workspace, tmp_path, capsys):  # noqa: F811
    _release(workspace, tmp_path / "artifact")
    code = _install(workspace, tmp_path / "artifact", "--model", str(workspace.other_model))
    assert code == 2
    assert "made for another model" in capsys.readouterr().err
    assert not list((Path(os.environ["XDG_DATA_HOME"]) / "dpmtv" / "site").glob("artifacts/*"))


def test_an_artifact_of_an_untrusted_signer_is_not_installed(workspace, tmp_path, capsys):  # noqa: F811
    _release(workspace, tmp_path / "artifact")
    code = main(
        ["install-artifact", str(tmp_path / "artifact"), *workspace.model_args(),
         "--trusted-key", str(workspace.stranger_key)]
    )  # fmt: skip
    assert code == 2
    assert "signing" in capsys.readouterr().err.lower()


def test_a_signed_manifest_its_own_plan_does_not_produce_is_not_installed(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Arrange: a real release, re-signed by the trusted key with a smaller epsilon stated
    _release(workspace, tmp_path / "artifact")
    real = load_artifact(
        tmp_path / "artifact",
        trusted_keys=TrustedKeys.from_files([workspace.public_key]),
        expected_model_fingerprint=None,
    )
    fields = {name: getattr(real.manifest, name) for name in ReleaseDescription.model_fields} | {
        "epsilon": real.manifest.epsilon / 10
    }
    write_artifact(
        tmp_path / "forged",
        heads=HeadSet(real.heads.heads),
        values=np.asarray(real.values),
        release=ReleaseDescription(**fields),
        signing_key=SigningKey.load(workspace.signing_key),
    )
    # Act
    code = _install(workspace, tmp_path / "forged")
    # Assert
    assert code == 2
    assert "artifact epsilon must be" in capsys.readouterr().err
    assert not list((Path(os.environ["XDG_DATA_HOME"]) / "dpmtv" / "site").glob("artifacts/*"))
