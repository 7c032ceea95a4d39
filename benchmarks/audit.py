"""The privacy audit of the headline release configuration, through the site's own commands.

Writes a site's synthetic data (``train`` scenes) and a public set, asks ``dpmtv-site
select-heads`` for the public clip norm, then runs ``dpmtv-site audit`` on the site's data for
the headline configuration (eps = 1, delta = 1e-5, K = 4, private selection, release-first)
and keeps its JSON report in docs/benchmarks/audit-<size>.json for benchmarks/report.py.

    .venv/bin/python benchmarks/audit.py --size small
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

from client.data.synthetic import write_task_datasets
from client.models.embedded import embedded_model_path


def _site(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "client.cli", *arguments]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=("small", "deep"), default="small")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--examples", type=int, default=200, help="site examples (m = n/5)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or REPO / "docs" / "benchmarks" / f"audit-{args.size}.json"
    model = embedded_model_path(args.size)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dpmtv-audit-bench-") as tmp:
        root = Path(tmp)
        write_task_datasets(
            root, task="shape", sites=1, per_site=args.examples, public=150, test=0, seed=3
        )
        select = _site(
            "select-heads",
            "--model",
            str(model),
            "--data",
            str(root / "public"),
            "--out",
            str(root / "heads.json"),
            "--k",
            "4",
            "--device",
            "cpu",
        )
        subprocess.run(select, check=True, cwd=REPO, env=env)  # noqa: S603 (our own CLI)
        clip = json.loads((root / "heads.json").read_text())["clip_norm_suggestion"]
        audit = _site(
            "audit",
            "--model",
            str(model),
            "--data",
            str(root / "site-0"),
            "--device",
            "cpu",
            "--clip-norm",
            f"{clip:.6g}",
            "--epsilon",
            "1",
            "--delta",
            "1e-5",
            "--shots",
            "4",
            "--selection",
            "private",
            "--order",
            "release-first",
            "--heads",
            "4",
            "--runs",
            str(args.runs),
            "--json",
            str(root / "audit.json"),
        )
        shown = subprocess.run(  # noqa: S603 (our own CLI, fixed arguments)
            audit, check=True, cwd=REPO, env=env, capture_output=True, text=True
        )
        print(shown.stdout)
        report = json.loads((root / "audit.json").read_text())
    report["commands"] = [
        "dpmtv-site "
        + " ".join(select[3:]).replace(str(root), "$DATA").replace(str(REPO) + "/", ""),
        "dpmtv-site "
        + " ".join(audit[3:]).replace(str(root), "$DATA").replace(str(REPO) + "/", ""),
    ]
    report["printed"] = shown.stdout
    report["seconds"] = time.monotonic() - started
    report["command"] = (
        f".venv/bin/python benchmarks/audit.py --size {args.size} --runs {args.runs}"
    )
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
