"""``dpmtv-site audit``: an empirical privacy audit of a release configuration on own data."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli._choices import RELEASE_ORDERS, SELECTION_MODES
from client.cli._common import (
    add_image_crops_option,
    add_model_options,
    check_site_model,
    load_site_model,
    settings_from,
)
from client.cli._types import open_unit_float, positive_float, positive_int
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    from client.audit import AuditReport, CanaryPair

__all__ = ["register"]

_DESCRIPTION = """\
Audit a release configuration empirically on YOUR data, without releasing anything.

One record is replaced by a canary (the candidate, among extreme images with a frequent and a
rare answer, that moves its chunk most); both datasets are cut with the same secret chunk
shuffle and summed ONCE each by the production extraction code (per-layer clipping to C);
then the production Gaussian release of the configuration runs --runs times on each sum with
the production noise source. Reported: the Gaussian-DP mu estimate (outputs projected on the
canary direction) with its confidence interval, next to the claimed mu = 2*C*sqrt(L)/sigma
and to what this canary should show; an empirical epsilon lower bound from mu, and a
non-parametric one (threshold test, Clopper-Pearson); and the same with sigma halved and with
the noise off (planted bugs), which shows what the audit can detect.

Runs are sized for power: by default the fewest that flag sigma halved with probability --power,
as noise not as calibrated or, when the canary is strong enough (its distance over half the
bound) and it needs no more runs, as a violation of the claim; the power reached is printed
either way (with --runs too).
Progress, with an estimate of the time left, goes to stderr (--quiet: none).

What it can show: a broken noise scale or broken clipping (mu above the claim, or mu far from
what the canary's distance implies); that the pipeline leaks with the noise off.
What it cannot show: that the release IS private (an audit only finds violations); anything
about other neighbouring pairs than this canary's (distance/bound says how close it is to the
worst case); the private head selection or the accountant's composition (not audited).
The report is computed from your private data without noise: keep it to yourself. Nothing is
spent or written to the ledger.
"""


def register(sub: Any) -> None:
    """Add the ``audit`` sub-command."""
    parser = sub.add_parser(
        "audit",
        help="empirical privacy audit of a release configuration (canary, GDP mu, eps bound)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(parser)
    parser.add_argument("--data", type=Path, help="your dataset folder (the audited data)")
    parser.add_argument("--epsilon", type=positive_float, default=1.0, help="total (default 1)")
    parser.add_argument("--delta", type=open_unit_float, default=1e-5, help="total (default 1e-5)")
    parser.add_argument("--shots", type=positive_int, default=4, help="K demonstrations a chunk")
    parser.add_argument("--clip-norm", type=positive_float, help="per-layer L2 bound C (public)")
    parser.add_argument("--selection", choices=SELECTION_MODES, default="private")
    parser.add_argument("--order", choices=RELEASE_ORDERS, default="release-first")
    parser.add_argument("--heads", type=positive_int, default=8, help="k (private selection)")
    parser.add_argument("--public-heads", type=Path, help="head list from select-heads")
    parser.add_argument("--selection-share", type=open_unit_float, default=0.3)
    parser.add_argument("--top-r", type=positive_int, help="votes a chunk (default: k)")
    parser.add_argument("--max-chunks", type=positive_int, help="cap on chunks (default: all)")
    add_image_crops_option(parser, purpose="as the audited release's plan would")
    parser.add_argument(
        "--runs",
        type=positive_int,
        help="releases per side (default: the fewest that flag sigma halved with --power)",
    )
    parser.add_argument(
        "--power",
        type=open_unit_float,
        default=0.8,
        help="probability that the runs flag sigma halved, which sizes them (default 0.8)",
    )
    parser.add_argument(
        "--confidence", type=open_unit_float, default=0.95, help="of intervals (default 0.95)"
    )
    parser.add_argument(
        "--no-power", action="store_true", help="skip the sigma-halved and noise-off rows"
    )
    parser.add_argument("--json", dest="json_out", type=Path, help="also write the report here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines or bars (stderr)")
    # What a release takes and an audit does not (the audit plans over every carried head).
    parser.set_defaults(handler=run, release_id="audit", task=None, candidate_heads=None)


def _say(args: argparse.Namespace, text: str) -> None:
    """A progress line on stderr (stdout keeps the report alone)."""
    if not args.quiet:
        print(text, file=sys.stderr, flush=True)


def _format(value: float) -> str:
    return "inf" if math.isinf(value) or value > 1e6 else f"{value:.3g}"


def _print_report(pair: CanaryPair, reports: list[AuditReport]) -> None:
    print(
        f"canary pair: {pair.changed_chunks} chunk changed, m={pair.without.num_chunks}, "
        f"distance {pair.distance:.4g} vs bound 2*C*sqrt(L) = {pair.sensitivity:.4g} "
        f"(canary strength {pair.distance / pair.sensitivity:.2f})"
    )
    print(
        "noise         runs  mu claimed  mu canary  mu_hat [CI]              eps claimed  "
        "eps LB (GDP)  eps LB (CP)"
    )
    for r in reports:
        interval = f"{_format(r.mu_hat)} [{_format(r.mu_low)}, {_format(r.mu_high)}]"
        print(
            f"{r.label:12}  {r.runs:4d}  {r.mu_claimed:10.3g}  {r.mu_canary:9.3g}  "
            f"{interval:24}  {r.epsilon_claimed:11.3g}  {_format(r.epsilon_lower_gdp):>12}  "
            f"{_format(r.epsilon_lower_cp):>11}"
        )
    for r in reports:
        verdict = "VIOLATION of the claimed mu" if r.violates_claim else "no violation found"
        noise = "consistent with" if r.noise_as_calibrated else "NOT consistent with"
        print(
            f"{r.label}: {verdict}; noise {noise} the calibrated sigma (confidence {r.confidence})"
        )


def run(args: argparse.Namespace) -> int:
    """Run the audit and print (and optionally write) its report."""
    settings = settings_from(args)
    if settings.data_path is None:
        raise ConfigError("audit needs --data DIR (the data whose release you audit).")
    if args.json_out is not None and not args.json_out.parent.is_dir():
        raise ConfigError(f"--json must lie in an existing folder, got {str(args.json_out)!r}.")
    # Imported here: the data and model side need PIL, torch and transformers.
    from client.audit import ScaledNoise, audit_pair, make_canary_pair
    from client.audit_power import audit_power
    from client.canary import canary_candidates, choose_canary, plant_canary
    from client.cli.release_command import _check_heads, _plan
    from client.data import load_dataset
    from dpmtv_common.privacy.noise import NoiseSource, secure_noise
    from dpmtv_common.rng import secret_seed

    check_site_model(settings)  # an unusable model is refused before any data is read
    dataset = load_dataset(settings.data_path)
    loaded = load_site_model(settings)
    plan = _plan(args, dataset.task, loaded.fingerprint, privacy_unit=dataset.privacy_unit)
    shape = loaded.adapter.head_shape(loaded.model)
    _check_heads(plan, args, shape.layout())
    if len(dataset.records) < plan.shots + 1:
        raise ConfigError(
            f"--data must hold at least --shots + 1 = {plan.shots + 1} records, "
            f"got {len(dataset.records)}."
        )
    chunk_seed = secret_seed()  # one secret shuffle, the same for both datasets
    with tempfile.TemporaryDirectory(prefix="dpmtv-audit-") as tmp:
        candidates = canary_candidates(dataset, Path(tmp))
        _say(args, f"audit: choosing a canary among {len(candidates)} candidates")
        canary, index, _ = choose_canary(loaded, dataset, candidates, plan, chunk_seed=chunk_seed)
        neighbour = plant_canary(dataset, canary, index=index)
        _say(args, "audit: extracting the two neighbouring sums (with and without the canary)")
        pair = make_canary_pair(loaded, dataset, neighbour, plan, chunk_seed=chunk_seed)
    sized = audit_power(plan, pair, runs=args.runs, power=args.power, confidence=args.confidence)
    _say(args, f"audit: {sized.line()}")
    noise = secure_noise()
    sources: list[tuple[str, NoiseSource]] = [("production", noise)]
    if not args.no_power:
        sources += [("sigma halved", ScaledNoise(noise, 0.5)), ("noise off", ScaledNoise(noise, 0))]
    reports = [
        audit_pair(
            plan,
            pair,
            noise=source,
            runs=sized.runs,
            layout=shape.layout(),
            confidence=args.confidence,
            label=label,
            progress=not args.quiet,
        )
        for label, source in sources
    ]
    _print_report(pair, reports)
    print(sized.line())
    if args.json_out is not None:
        payload: dict[str, Any] = {
            "canary": {"id": canary.id, "answer": canary.answer, "replaces_index": index},
            "changed_chunks": pair.changed_chunks,
            "num_chunks": pair.without.num_chunks,
            "distance": pair.distance,
            "sensitivity": pair.sensitivity,
            "power": {**asdict(sized), "planted_bug": "sigma halved", "asked": args.power},
            "reports": [asdict(r) for r in reports],
        }
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0
