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

from pydantic import ValidationError

from client.cli._choices import (
    DEFAULT_SELECTION_SHARE,
    ORDER_HELP,
    RELEASE_ORDERS,
    SELECTION_MODES,
)
from client.cli._common import (
    add_image_crops_option,
    add_model_options,
    check_site_model,
    load_site_model,
    settings_from,
)
from client.cli._errors import validation_line
from client.cli._types import open_unit_float, positive_float, positive_int
from dpmtv_common.errors import ConfigError

if TYPE_CHECKING:
    from client.audit.empirical import AuditReport, CanaryPair
    from client.data.records import SiteDataset
    from client.settings import SiteSettings
    from protocol import ReleasePlan

__all__ = ["register"]

_DESCRIPTION = """\
Audit a release configuration empirically on YOUR data, without releasing anything.

One record is replaced by a canary (the candidate, among extreme images with a frequent and a
rare answer, that moves its chunk most); both datasets are cut with the same secret chunk
shuffle and summed ONCE each by the production extraction code (per-layer clipping to C);
then the production release of the configuration runs --runs times on each sum with the
production noise source. In central noise mode that is the coordinator's one Gaussian draw;
with --noise-mode distributed it is the secure sum of this site's share, encoded by the
production code (the plan's integer grid, CSPRNG rounding, a discrete-Gaussian share), and
the shares of the other honest sites, exactly --min-honest honest shares in all (the fewest
the plan's guarantee holds for), decoded as the coordinator decodes it. Reported: the
Gaussian-DP mu estimate (outputs projected on the canary direction) with its confidence
interval, next to the claimed mu (central: 2*C*sqrt(L)/sigma; distributed: sqrt(2 rho) of
the accounting's zCDP at min-honest shares) and to what this canary should show; an
empirical epsilon lower bound from mu, and a non-parametric one (threshold test, Clopper-
Pearson); and the same with sigma halved and with the noise off (planted bugs; in distributed
mode every share is scaled), which shows what the audit can detect.

Runs are sized for power: by default the fewest that flag sigma halved with probability --power,
as noise not as calibrated or, when the canary is strong enough (its distance over half the
bound) and it needs no more runs, as a violation of the claim; the power reached is printed
either way (with --runs too).
Progress, with an estimate of the time left, goes to stderr (--quiet: none).

What it can show: a broken noise scale or broken clipping (mu above the claim, or mu far from
what the canary's distance implies); that the pipeline leaks with the noise off.
What it cannot show: that the release IS private (an audit only finds violations); anything
about other neighbouring pairs than this canary's (distance/bound says how close it is to the
worst case); the private head selection or the accountant's composition (not audited). In
distributed mode: a sum with fewer than min-honest honest shares (the plan claims nothing
then), and SecAgg+'s masking, dropouts and aborts (the audit adds the shares in the clear).
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
    parser.add_argument("--order", choices=RELEASE_ORDERS, help=ORDER_HELP)
    parser.add_argument("--heads", type=positive_int, default=8, help="k (private selection)")
    parser.add_argument("--public-heads", type=Path, help="head list from select-heads")
    parser.add_argument("--selection-share", type=open_unit_float, default=DEFAULT_SELECTION_SHARE)
    parser.add_argument("--top-r", type=positive_int, help="votes a chunk (default: k)")
    parser.add_argument(
        "--max-chunks",
        type=positive_int,
        help="cap on chunks (default: all; in distributed mode the plan's cap, default this "
        "data's chunk count)",
    )
    parser.add_argument(
        "--noise-mode",
        choices=("central", "distributed"),
        help="the audited plan's noise mode (default: this site's noise-mode setting, "
        "DPMTV_CLIENT_NOISE_MODE, else central)",
    )
    parser.add_argument(
        "--min-honest",
        type=positive_int,
        help="distributed mode: t, the honest shares each share is sized for and the audit "
        "sums (default: this site's min-honest setting, else 2)",
    )
    parser.add_argument(
        "--max-sites",
        type=positive_int,
        help="distributed mode: most sites in a sum, which sizes the grid (default: "
        "max(3, --min-honest), the coordinator's default)",
    )
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


# Plan fields the distributed options set, for error lines that name what to change.
_PLAN_OPTIONS = {"min_honest": "--min-honest", "max_sites": "--max-sites"}


def _audited_plan(
    plan: ReleasePlan, args: argparse.Namespace, settings: SiteSettings, dataset: SiteDataset
) -> ReleasePlan:
    """``plan`` in the settings' noise mode: distributed sizes its grid as a federation would."""
    if settings.noise_mode == "central":
        return plan
    from client.activations.chunking import planned_num_chunks
    from protocol import NoiseMode, ReleasePlan

    honest = settings.min_honest
    max_sites = args.max_sites or max(3, honest)
    if max_sites < max(2, honest):
        raise ConfigError(
            f"--max-sites must be at least max(2, --min-honest) = {max(2, honest)}, "
            f"got {max_sites}."
        )
    # A distributed plan must cap a site's chunks (it bounds the site's sum on the grid);
    # this data's own count is the cap its sum meets.
    max_chunks = plan.max_chunks_per_site or planned_num_chunks(dataset, plan.shots, None)
    fields = dict(plan) | {
        "noise_mode": NoiseMode.DISTRIBUTED,
        "min_honest": honest,
        "min_sites": honest,
        "max_sites": max_sites,
        "max_chunks_per_site": max_chunks,
    }
    try:
        return ReleasePlan(**fields)
    except ValidationError as exc:
        raise ConfigError(validation_line(exc, options=_PLAN_OPTIONS)) from exc


def _mode_line(report: AuditReport) -> str:
    if report.honest_shares is None:
        return "audited noise mode: central (one Gaussian draw on the sum, by the coordinator)"
    return (
        f"audited noise mode: distributed (this site's share and {report.honest_shares - 1} "
        f"other honest share(s), {report.honest_shares} = min-honest in all: the fewest the "
        "plan's guarantee holds for; each share drawn by the production encoder)"
    )


def _print_report(pair: CanaryPair, reports: list[AuditReport], unit: str) -> None:
    print(_mode_line(reports[0]))
    print(f"privacy unit: {unit} (the canary replaces one {unit}; every epsilon is per {unit})")
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
    from client.audit.canary import canary_candidates, choose_canary, plant_canary
    from client.audit.empirical import ScaledNoise, audit_pair, make_canary_pair
    from client.audit.power import audit_power
    from client.cli.release_command import _check_heads, _plan
    from client.data.records import load_dataset
    from dpmtv_common.privacy.noise import NoiseSource, secure_noise
    from dpmtv_common.rng import secret_seed

    check_site_model(settings)  # an unusable model is refused before any data is read
    dataset = load_dataset(settings.data_path)
    loaded = load_site_model(settings)
    plan = _plan(args, dataset.task, loaded.fingerprint, privacy_unit=dataset.privacy_unit)
    plan = _audited_plan(plan, args, settings, dataset)
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
    sized = audit_power(
        plan,
        pair,
        runs=args.runs,
        power=args.power,
        confidence=args.confidence,
        layout=shape.layout(),
    )
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
    _print_report(pair, reports, plan.privacy_unit.value)
    print(sized.line())
    if args.json_out is not None:
        payload: dict[str, Any] = {
            "noise_mode": plan.noise_mode.value,
            "privacy_unit": plan.privacy_unit.value,
            "min_honest": reports[0].honest_shares,  # None in central mode
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
