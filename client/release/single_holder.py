"""A release by one data holder (the DP-MTV paper's own setting), end to end.

The holder's chunks feed :func:`protocol.run_release` through :class:`LocalSums`; the holder's
ledger reserves the plan's cost before any work, marks the release exposed just before the
first noisy output, and commits once the signed artifact is on disk. Any failure before the
first noisy output aborts the reservation (nothing spent); after it, the release counts as
spent even if writing the artifact fails (fail closed).

**Validate before spending.** Every check that can fail on the caller's input runs before
the ledger reservation (:func:`check_release_inputs`): the model fingerprint, the chunks, the
heads and top-r against the model, the accountant's calibration, and the output path (free,
inside a folder, writable; replacing an existing artifact needs ``overwrite=True``). So a
typo costs no epsilon; what can still fail after the first noisy output is I/O, and then the
release is counted, never silently lost.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.activations.chunking import Chunk
from client.activations.extraction import check_centre_shape, extract_clipped_sum
from client.activations.scoring import ScoreMethod, check_answer_vocabulary, chunk_head_votes
from client.models import LoadedModel, instruction_digest, prompt_template_digest
from dpmtv_common.aliases import Float64Array
from dpmtv_common.artifact import (
    ArtifactManifest,
    check_artifact_target,
    load_artifact,
    write_artifact,
)
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError, ModelMismatchError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.noise import NoiseSource
from protocol import (
    DPMTV_VERSION,
    ActivationSum,
    ReleaseOutcome,
    ReleasePlan,
    VoteSum,
    check_plan_centre,
    check_plan_scope,
    plan_calibration,
    release_description,
    reserve_plan,
    run_release,
    vote_slots,
)

__all__ = ["LocalSums", "SingleHolderRelease", "check_release_inputs", "run_single_holder_release"]


@dataclass
class LocalSums:
    """:class:`protocol.ReleaseSums` over one holder's chunks, computed on its own model.

    Chunks run in fixed-shape batches (so no record moves another chunk's activations) and
    a failed chunk contributes the public fallback (zeros) while still counting in m
    (``client.activations.extraction``), so both sums have ``num_chunks == len(chunks)`` whatever
    the records hold.

    The model's processor is capped to the plan's ``max_image_crops`` here, so every sum of
    the plan prompts its chunks with the crops the plan fixed, whoever built the sums.

    Attributes:
        loaded: The holder's model, its processor under the plan's crop cap.
        batch_size: Chunks a forward pass in extraction and shift scoring (a speed setting:
            the fixed padded shape makes each chunk's result independent of its batch-mates).
        centre: The public centre of a centred plan, subtracted from each chunk before its
            clip (``dpmtv_common.centre``); None for a plain plan.

    Raises:
        ConfigError: The model's processor cannot meet the plan's ``max_image_crops``.
    """

    loaded: LoadedModel
    chunks: Sequence[Chunk]
    plan: ReleasePlan
    score_method: ScoreMethod = ScoreMethod.SHIFT
    batch_size: int = 4
    instruction: str | None = None
    progress: bool = True
    centre: ActivationCentre | None = None

    def __post_init__(self) -> None:
        self.loaded = self.loaded.with_image_crops(self.plan.max_image_crops)

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
            centre=self.centre,
        )
        return ActivationSum(summed.heads, summed.total, summed.num_chunks)

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        """Top-r vote sum of every chunk (attribution against ``reference`` when given).

        Each chunk votes among the plan's candidate heads (``protocol.vote_slots``).
        """
        method = self.score_method if reference is None else ScoreMethod.ATTRIBUTION
        layout = self.loaded.adapter.head_shape(self.loaded.model).layout()
        votes = chunk_head_votes(
            self.loaded,
            self.chunks,
            top_r=self.plan.score_top_r,
            method=method,
            reference=reference,
            batch_size=self.batch_size,
            instruction=self.instruction,
            progress=self.progress,
            among=vote_slots(self.plan, layout),
        )
        return VoteSum(votes.total, votes.num_chunks)


@dataclass(frozen=True)
class SingleHolderRelease:
    """The artifact a release wrote and how it came about."""

    artifact: Path
    manifest: ArtifactManifest
    outcome: ReleaseOutcome


def check_release_inputs(
    plan: ReleasePlan, *, sums: LocalSums, output: Path, overwrite: bool = False
) -> None:
    """Every check that can fail on the inputs of a release, run before any reservation.

    Raises:
        ModelMismatchError: The plan names another model.
        PlanMismatchError: The centre is not the one the plan pins.
        ConfigError: No chunks; heads, k or top-r do not fit the heads the model carries
            (:func:`protocol.check_plan_scope`: none in a headless layer); a centre of
            another shape than the model's (L, H, D); the output path
            exists (without ``overwrite``), is not a folder, lies under a file or cannot be
            written; or the plan cannot be calibrated.
    """
    loaded = sums.loaded
    if plan.model_fingerprint != loaded.fingerprint:
        raise ModelMismatchError(
            f"plan model_fingerprint must match the loaded model {loaded.fingerprint!r}, "
            f"got {plan.model_fingerprint!r}."
        )
    if not sums.chunks:
        raise ConfigError("chunks must hold at least one chunk, got none.")
    check_plan_scope(plan, loaded.adapter.head_shape(loaded.model).layout())
    check_plan_centre(plan, sums.centre)
    if sums.centre is not None:
        check_centre_shape(loaded, sums.centre)
    answers = [record.answer for chunk in sums.chunks for record in chunk.records]
    check_answer_vocabulary(loaded, answers)
    _check_output(output, overwrite=overwrite)
    plan_calibration(plan)  # the accountant's answer is cached: run_release reuses it


def _check_output(output: Path, *, overwrite: bool) -> None:
    target = Path(output)
    # The rule write_artifact applies, checked here so it cannot fail after noise.
    check_artifact_target(
        target,
        overwrite=overwrite,
        name="output",
        remedy="choose a new path, or allow replacing it (overwrite)",
    )
    parent = target.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"output must lie inside a folder, got {str(target)!r} under the file {str(parent)!r}."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"output must be writable, got {str(target)!r} in {str(parent)!r}, which this user "
            "cannot write."
        )


def run_single_holder_release(
    plan: ReleasePlan,
    *,
    sums: LocalSums,
    ledger: PrivacyLedger,
    signing_key: SigningKey,
    output: Path,
    noise: NoiseSource,
    overwrite: bool = False,
) -> SingleHolderRelease:
    """Check, reserve, release, sign, write, commit; see the module docstring.

    Args:
        plan: The release plan (its cost is reserved in ``ledger``).
        sums: The holder's chunks on its model.
        ledger: The holder's privacy ledger.
        signing_key: Signs the artifact.
        output: The artifact folder to create.
        noise: The DP noise source.
        overwrite: Replace an existing artifact folder at ``output``.
    """
    check_release_inputs(plan, sums=sums, output=output, overwrite=overwrite)
    loaded = sums.loaded
    reserve_plan(ledger, plan)
    exposed = False

    def mark_exposed() -> None:
        nonlocal exposed
        ledger.mark_exposed(plan.release_id)
        exposed = True

    layout = loaded.adapter.head_shape(loaded.model).layout()
    try:
        outcome = run_release(
            plan,
            sums=sums,
            layout=layout,
            noise=noise,
            on_first_noise=mark_exposed,
            centre=sums.centre,
        )
        path = write_artifact(
            output,
            heads=outcome.heads,
            values=np.asarray(outcome.values),
            release=release_description(
                plan,
                outcome,
                prompt_template_sha256=prompt_template_digest(loaded),
                instruction_sha256=instruction_digest(sums.instruction),
                dpmtv_versions=[DPMTV_VERSION],
            ),
            signing_key=signing_key,
            overwrite=overwrite,
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
