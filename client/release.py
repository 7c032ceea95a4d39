"""A release by one data holder (the DP-MTV paper's own setting), end to end.

The holder's chunks feed :func:`protocol.run_release` through :class:`LocalSums`; the holder's
ledger reserves the plan's cost before any work, marks the release exposed just before the
first noisy output, and commits once the signed artifact is on disk. Any failure before the
first noisy output aborts the reservation (nothing spent); after it, the release counts as
spent even if writing the artifact fails (fail closed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.chunking import Chunk
from client.extraction import extract_clipped_sum
from client.models import LoadedModel
from client.scoring import ScoreMethod, chunk_head_votes
from dpmtv_common.aliases import Float64Array
from dpmtv_common.artifact import (
    ArtifactManifest,
    load_artifact,
    write_artifact,
)
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError, ModelMismatchError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.noise import NoiseSource
from protocol import (
    ActivationSum,
    ReleaseOutcome,
    ReleasePlan,
    VoteSum,
    release_description,
    reserve_plan,
    run_release,
)

__all__ = ["LocalSums", "SingleHolderRelease", "run_single_holder_release"]


@dataclass
class LocalSums:
    """:class:`protocol.ReleaseSums` over one holder's chunks, computed on its own model."""

    loaded: LoadedModel
    chunks: Sequence[Chunk]
    plan: ReleasePlan
    score_method: ScoreMethod = ScoreMethod.SHIFT
    batch_size: int = 4
    instruction: str | None = None
    progress: bool = True

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        """Clipped activation sum of every chunk over ``heads``."""
        summed = extract_clipped_sum(
            self.loaded,
            self.chunks,
            heads=heads,
            clip_norm=self.plan.clip_norm,
            batch_size=self.batch_size,
            instruction=self.instruction,
            progress=self.progress,
        )
        return ActivationSum(summed.heads, summed.total, summed.num_chunks)

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        """Top-r vote sum of every chunk (attribution against ``reference`` when given)."""
        method = self.score_method if reference is None else ScoreMethod.ATTRIBUTION
        votes = chunk_head_votes(
            self.loaded,
            self.chunks,
            top_r=self.plan.score_top_r,
            method=method,
            reference=reference,
            batch_size=self.batch_size,
            instruction=self.instruction,
            progress=self.progress,
        )
        return VoteSum(votes.total, votes.num_chunks)


@dataclass(frozen=True)
class SingleHolderRelease:
    """The artifact a release wrote and how it came about."""

    artifact: Path
    manifest: ArtifactManifest
    outcome: ReleaseOutcome


def run_single_holder_release(
    plan: ReleasePlan,
    *,
    sums: LocalSums,
    ledger: PrivacyLedger,
    signing_key: SigningKey,
    output: Path,
    noise: NoiseSource,
) -> SingleHolderRelease:
    """Reserve, release, sign, write, commit; see the module docstring."""
    loaded = sums.loaded
    if plan.model_fingerprint != loaded.fingerprint:
        raise ModelMismatchError(
            f"plan model_fingerprint must match the loaded model {loaded.fingerprint!r}, "
            f"got {plan.model_fingerprint!r}."
        )
    if not sums.chunks:
        raise ConfigError("chunks must hold at least one chunk, got none.")
    reserve_plan(ledger, plan)
    exposed = False

    def mark_exposed() -> None:
        nonlocal exposed
        ledger.mark_exposed(plan.release_id)
        exposed = True

    shape = loaded.adapter.head_shape(loaded.model)
    try:
        outcome = run_release(
            plan,
            sums=sums,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            noise=noise,
            on_first_noise=mark_exposed,
        )
        path = write_artifact(
            output,
            heads=outcome.heads,
            values=np.asarray(outcome.values),
            release=release_description(plan, outcome),
            signing_key=signing_key,
        )
    except BaseException as exc:
        if exposed:
            ledger.commit(plan.release_id)  # noise may have left: counted as spent
        else:
            ledger.abort(plan.release_id, f"failed before any noisy output: {exc!r}"[:500])
        raise
    ledger.commit(plan.release_id)
    trusted = TrustedKeys([signing_key.verify_key])
    manifest = load_artifact(
        path, trusted_keys=trusted, expected_model_fingerprint=loaded.fingerprint
    ).manifest
    return SingleHolderRelease(path, manifest, outcome)
