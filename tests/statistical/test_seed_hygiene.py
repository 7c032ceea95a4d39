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


# Any use of numpy's, torch's or the stdlib's generators, seeded or not: an unseeded
# default_rng() is as unfit for DP noise as a seeded one (not a CSPRNG, and not exact).
FORBIDDEN = re.compile(
    r"np\.random\.|numpy\.random|from numpy import random|torch\.(randn|rand|normal|manual_seed)|"
    r"^\s*import random|^\s*from random import|random\.\w+\(|default_rng\b|RandomState|"
    r"\bPCG64|\bMT19937|\bPhilox|\bSFC64"
)


def test_production_noise_draws_nothing_from_numpy_s_generators(monkeypatch):
    # Arrange: numpy's generator constructors and its global functions all refuse to run
    # (numpy's own code, not ours, is replaced). The CSPRNG source must not need them.
    def refuse(*args, **kwargs):
        raise AssertionError("production noise drew from numpy.random")

    for name in ("default_rng", "Generator", "RandomState", "normal", "standard_normal"):
        monkeypatch.setattr(np.random, name, refuse)
    noise = secure_noise()
    # Act
    values = noise.add_gaussian(np.zeros(64), noise_std=1.0)
    shares = noise.discrete_gaussian(64, noise_std=3.0)
    # Assert: real draws came back (all zero would mean no noise at all).
    assert np.count_nonzero(values) == 64
    assert shares.shape == (64,)


def test_the_hygiene_scan_sees_an_unseeded_generator():
    # The scan below must flag the quiet mutation: an unseeded numpy generator.
    for line in (
        "    rng = np.random.default_rng()",
        "from numpy.random import default_rng",
        "    noisy = flat + default_rng().normal(0.0, noise_std, flat.size)",
        "    return np.random.normal(size=3)",
    ):
        assert FORBIDDEN.search(line), line


def test_dp_modules_draw_no_randomness_outside_the_test_sampler():
    # noise.py is scanned too: its draws come from OpenDP (OpenSSL) and os.urandom only.
    allowed = {"testing.py"}
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "dpmtv_common" / "privacy").rglob("*.py"))
        if path.name not in allowed
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if FORBIDDEN.search(line)
    ]
    assert offenders == []
