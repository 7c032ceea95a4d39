"""Whether scripts/setup installs torch, or keeps the torch already in the environment.

Prints ``keep <version>`` when a torch that meets the project's requirement (``torch>=X.Y`` in
pyproject.toml) is installed, whatever its build (CUDA, ROCm, CPU): a site that installed a
CUDA torch (docs/gpu.md) must not lose it to the CPU pin. Prints ``install`` otherwise. Reads
package metadata only: importing torch would take seconds and could fail on a driver issue
that has nothing to do with whether it is installed.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def required_minimum(pyproject: Path = PYPROJECT) -> tuple[int, int]:
    """(major, minor) of the project's ``torch>=X.Y`` dependency."""
    found = re.search(r'"torch>=(\d+)\.(\d+)', pyproject.read_text(encoding="utf-8"))
    if found is None:
        raise SystemExit(f"torch_choice: no torch>=X.Y dependency in {pyproject}")
    return int(found.group(1)), int(found.group(2))


def installed_torch() -> str | None:
    """The installed torch's version (``2.13.0+cu128``), or None."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def choice(installed: str | None, minimum: tuple[int, int]) -> str:
    """``keep <version>`` if ``installed`` meets ``minimum``, else ``install``."""
    if installed is None:
        return "install"
    parts = re.match(r"(\d+)\.(\d+)", installed)
    if parts is None or (int(parts.group(1)), int(parts.group(2))) < minimum:
        return "install"
    return f"keep {installed}"


def main() -> int:
    print(choice(installed_torch(), required_minimum()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
