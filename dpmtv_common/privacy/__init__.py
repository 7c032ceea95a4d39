"""Differential-privacy building blocks: mechanisms, noise, accounting, budgets, ledger, audit."""

from __future__ import annotations

from dpmtv_common.privacy.accounting import (
    Calibration,
    EpsilonBound,
    analytic_noise_multiplier,
    calibrate_noise_multiplier,
    central_epsilon_bound,
    epsilon_per_pick_from_share,
)
from dpmtv_common.privacy.auditing import (
    clopper_pearson_epsilon,
    detection_power,
    epsilon_of_gdp,
    mu_estimate,
    runs_for_power,
)
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.calibration import ReleaseCalibration
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import LedgerEntry, PrivacyLedger, ReleaseState, Reservation
from dpmtv_common.privacy.ledger_files import COUNTED_STATES, LedgerFile, read_ledger_file
from dpmtv_common.privacy.mechanisms import (
    GaussianSumMechanism,
    GumbelTopKMechanism,
    clip_per_layer,
    clip_scores,
    sum_clipped_contributions,
)
from dpmtv_common.privacy.noise import NoiseSource, SecureNoise, require_cryptographic, secure_noise

__all__ = [
    "COUNTED_STATES",
    "Calibration",
    "EpsilonBound",
    "GaussianSumMechanism",
    "GumbelTopKMechanism",
    "LedgerEntry",
    "LedgerFile",
    "NoiseSource",
    "PrivacyBudget",
    "PrivacyLedger",
    "ReleaseCalibration",
    "ReleaseEvent",
    "ReleaseState",
    "Reservation",
    "SecureNoise",
    "analytic_noise_multiplier",
    "calibrate_noise_multiplier",
    "central_epsilon_bound",
    "clip_per_layer",
    "clip_scores",
    "clopper_pearson_epsilon",
    "detection_power",
    "epsilon_bound",
    "epsilon_of_gdp",
    "epsilon_per_pick_from_share",
    "mu_estimate",
    "read_ledger_file",
    "require_cryptographic",
    "runs_for_power",
    "secure_noise",
    "sum_clipped_contributions",
]
