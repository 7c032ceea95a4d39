"""Distributed noise: each site adds its own discrete-Gaussian share inside SecAgg+'s sum.

In ``distributed`` noise mode nobody, the coordinator included, ever holds an un-noised sum:
every site scales its clipped sum by a public power of two γ, rounds it to integers
(randomised rounding from the CSPRNG), adds a share N_Z(0, σ_l²)^d from OpenDP's exact
discrete Gaussian, and hands the integers to the secure sum (``protocol.secure_sum``) as
float64 values on a grid of step 1 (exact in its quantiser, verified in tests); the
coordinator divides the sum by γ.

API (what the lead's site service and coordinator call)::

    # both sides, from the plan (identical numbers everywhere); a site first checks t
    check_min_honest(plan_min_honest=t, site_min_honest=t_site, min_sites=n_min)
    cal = calibrate_distributed(epsilon=ε, delta=δ, selection_share=s_or_None)
    act = activation_noise(                  # -> SecAgg+ c, Q, M; or SecAggRangeError
        clip_norm=C, num_layers_in_scope=L, dimension=d, max_chunks_per_site=m_max,
        noise_multiplier=cal.activation_noise_multiplier, min_honest=t, max_sites=n_max)
    votes = vote_noise(
        top_r=r, num_heads=H, max_chunks_per_site=m_max,
        noise_multiplier=cal.selection_noise_multiplier, min_honest=t, max_sites=n_max)
    # site, inside the SecAgg+ handler (c = act.clipping_range, Q = act.quantization_range)
    y = encode_site_share(site_sum, params=act, noise=secure_noise())
    # coordinator, on the sum SecAgg+ returns for n survivors
    noisy_sum = decode_noisy_sum(secure_sum, params=act, num_sites=n)
    heads = top_k_from_noisy_votes(decode_noisy_sum(vote_sum, params=votes, num_sites=n), k=k)
    # manifest: ε for the noise actually present (survivors, minus any assumed fakes)
    bound = release_epsilon(act, votes, honest_shares=n_h, delta=δ)
    # ledgers: store act.event(n_h) (distributed_event_to_json); compose a population's
    # central and distributed releases with combined_epsilon_bound

Mechanism: discrete Gaussian, not Skellam. Both are accounted by the same KLS21/AKL21-style
zCDP bound at the σ_l used here (≫ 1 grid unit: τ < 1e-15, and Skellam's extra terms are
equally negligible), but only the discrete Gaussian has an exact, CSPRNG-backed sampler on
PyPI (OpenDP's CKS20 sampler over OpenSSL); Skellam would need a Poisson sampler, and the
ones available are inexact or seeded from a clock (TF Privacy). No random rotation: KLS21 use
one to bound every coordinate with few bits; the secure sum gives 30 bits per site, enough to bound
the worst coordinate of an un-rotated site sum (|x_j| ≤ m_max·C), see ``_params``.

Privacy unit: one example (or group); relation: replace-one (a chunk changes); Δ₂ = 2·C·√L_scope
for activations, √(2r) for top-r votes, inflated to Δ̃ = γΔ₂ + √d by rounding (votes are not
rounded). Noise: each share is N_Z(0, σ_l²)^d with σ_l = z·Δ̃/√t, sized for t = ``min_honest``
honest shares (t ≥ 2 by default; t = 1: a site protects itself alone). Accounting: KLS21
Thm 1 as zCDP, composed in RDP (``_accounting`` says why no PLD is claimed). Overflow: a share
beyond the secure sum's ±c aborts the round (probability ≤ p = ``overflow_probability`` per sum;
(1 + e^ε)·p of δ, :func:`mechanism_delta`).

Dropouts and t (the choice made here): the *plan* fixes t, so every share is sized σ²/t, and
fixes ``min_sites`` ≥ t; the coordinator aborts below ``min_sites`` survivors (nothing is
decoded or released). A site accepts only if :func:`check_min_honest` passes: the plan's t is
at most its own t setting (the honest participants it assumes among the survivors) and at most
``min_sites``. More noise per site up front means a smaller t. A site counts as present iff its
masked vector entered the sum (SecAgg+ still unmasks a site lost after that stage, so its
share stays in). The site's ε holds while ≥ t honest shares land; :func:`release_epsilon`
gives ε for any number of honest shares, and the manifest states it for t (the guarantee)
and for the survivors (if all are honest).
"""

from __future__ import annotations

from dpmtv_common.privacy.distributed._accounting import (
    XI_RESERVE,
    DistributedCalibration,
    DistributedGaussianEvent,
    calibrate_distributed,
    distributed_epsilon_bound,
    kls21_tau,
    kls21_tau_upper_bound,
    mechanism_delta,
)
from dpmtv_common.privacy.distributed._codec import (
    decode_noisy_sum,
    encode_site_share,
    top_k_from_noisy_votes,
)
from dpmtv_common.privacy.distributed._composition import (
    combined_epsilon_bound,
    distributed_event_from_json,
    distributed_event_to_json,
    release_events_epsilon_bound,
)
from dpmtv_common.privacy.distributed._params import (
    MAX_MODULUS_RANGE,
    MAX_QUANTIZATION_RANGE,
    DistributedNoise,
    SecAggRangeError,
    activation_noise,
    check_min_honest,
    distributed_noise_for,
    vote_noise,
)
from dpmtv_common.privacy.distributed._release import release_epsilon

__all__ = [
    "DistributedCalibration",
    "DistributedGaussianEvent",
    "DistributedNoise",
    "MAX_MODULUS_RANGE",
    "MAX_QUANTIZATION_RANGE",
    "SecAggRangeError",
    "XI_RESERVE",
    "activation_noise",
    "calibrate_distributed",
    "check_min_honest",
    "combined_epsilon_bound",
    "decode_noisy_sum",
    "distributed_epsilon_bound",
    "distributed_event_from_json",
    "distributed_event_to_json",
    "distributed_noise_for",
    "encode_site_share",
    "kls21_tau",
    "kls21_tau_upper_bound",
    "mechanism_delta",
    "release_epsilon",
    "release_events_epsilon_bound",
    "top_k_from_noisy_votes",
    "vote_noise",
]
