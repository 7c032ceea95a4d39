"""Keep every package's declared surface honest (httpx-style): sorted, complete, importable."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_PACKAGES = ["dpmtv_common", "dpmtv_common.privacy", "protocol"]


def _public_modules(package_name: str):
    package = importlib.import_module(package_name)
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_") and info.name not in {"testing"}:
            yield importlib.import_module(f"{package_name}.{info.name}")


@pytest.mark.parametrize("package_name", SHARED_PACKAGES)
def test_all_is_sorted_and_every_name_exists(package_name):
    package = importlib.import_module(package_name)
    assert package.__all__ == sorted(package.__all__)
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == []


@pytest.mark.parametrize("package_name", ["dpmtv_common.privacy", "protocol"])
def test_package_exports_every_public_name_of_its_modules(package_name):
    package = importlib.import_module(package_name)
    unexported = [
        f"{module.__name__}.{name}"
        for module in _public_modules(package_name)
        if not hasattr(module, "__path__")
        for name in getattr(module, "__all__", [])
        if name not in package.__all__
    ]
    assert unexported == []


@pytest.mark.parametrize("modules", ["dpmtv_common, protocol", "client.service.http_front"])
def test_shared_layers_and_the_http_front_import_without_torch_transformers_or_flower(modules):
    # The HTTP front is started again whenever it dies: it loads no model library, nor Flower
    code = (
        f"import sys, {modules};"
        "print(sorted(m for m in ('torch', 'transformers', 'flwr') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
