"""Global seeding must not fix production noise (notes/dp.md §4.3 test 8)."""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpmtv_common.privacy.noise import secure_noise

pytestmark = pytest.mark.statistical

REPO = Path(__file__).resolve().parents[2]
SIZE = 4096


def _draw() -> np.ndarray:
    return secure_noise().add_gaussian(np.zeros(SIZE), noise_std=1.0)


def test_global_seeding_does_not_repeat_production_noise():
    random.seed(0)
    np.random.seed(0)
    first = _draw()
    random.seed(0)
    np.random.seed(0)
    second = _draw()
    # |corr| of independent draws has std 1/sqrt(SIZE); 5.33/sqrt(SIZE) is a 1e-7 tail.
    assert abs(np.corrcoef(first, second)[0, 1]) < 5.33 / math.sqrt(SIZE)


def test_two_processes_with_identical_arguments_draw_different_noise():
    code = (
        "import numpy as np; np.random.seed(0);"
        "from dpmtv_common.privacy.noise import secure_noise;"
        "print(secure_noise().add_gaussian(np.zeros(8), noise_std=1.0).tolist())"
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert outputs[0] != outputs[1]


FORBIDDEN = re.compile(
    r"np\.random\.|numpy\.random|torch\.(randn|rand|normal|manual_seed)|"
    r"^\s*import random|random\.(gauss|random|seed)\(|default_rng\(\s*\d"
)


def test_dp_modules_draw_no_randomness_outside_the_noise_module():
    allowed = {"testing.py", "noise.py"}
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "dpmtv_common" / "privacy").rglob("*.py"))
        if path.name not in allowed
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if FORBIDDEN.search(line)
    ]
    assert offenders == []
