"""The site's own record of each release: the state machine the site decides refunds from.

A site takes nothing on the coordinator's word. What it accepted, what of its data left it
and what it received are kept here, one JSON file per release under the site's state folder,
written atomically (temporary file, fsync, rename) *before* the corresponding reply leaves::

    planned ──contribute──▶ contributed ──finish──▶ released
       │                        │
       └────────abort───────────┴──────abort──────▶ aborted

    (the ledger state each may stand beside, and how it settles: client.release.states)

A contribution is recorded once per secure-sum stage (``select``, ``extract``) of the plan;
a second one for the same stage is refused. The record never decides a refund by itself:
which ledger state (``reserved``, ``exposed``, ``committed``, ``aborted``) may stand beside
each record state, and what the ledger does when a record becomes released or aborted, is
the table in :mod:`client.release.states`. The site marks the ledger exposed before any
masked contribution is handed to SecAgg+.

Release ids are checked tokens (``protocol.plan.ReleaseId``), so a file name built from one
never leaves the records folder.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from dpmtv_common.aliases import LayerHead
from dpmtv_common.errors import LedgerError
from dpmtv_common.files import write_atomic
from dpmtv_common.heads import HeadLayout
from protocol import ReleasePlan, StageOrderError, plan_hash

__all__ = ["ReleaseRecord", "ReleaseRecordStore", "SiteReleaseState"]


class SiteReleaseState(StrEnum):
    """Where one release stands, as the site itself saw it."""

    PLANNED = "planned"
    CONTRIBUTED = "contributed"
    RELEASED = "released"
    ABORTED = "aborted"


_FINAL = (SiteReleaseState.RELEASED, SiteReleaseState.ABORTED)


class ReleaseRecord(BaseModel):
    """One release as the site accepted and served it.

    Attributes:
        release_id: The release (a checked token).
        run_id: The Flower run that planned it; messages of other runs are refused.
        plan_json: The accepted plan, canonical JSON.
        plan_hash: ``protocol.plan_hash`` of that plan.
        num_chunks: m_i the site promised.
        num_layers: L of the site's model; num_heads: H; head_dim: D.
        head_layers: The decoder layers that carry heads (a hybrid's linear-attention or
            convolution layers carry none); None: every layer (also in records written before
            hybrids were served). The site's "all heads" are the heads of these layers.
        model_dtype: The dtype the site extracts in (an artifact of another is refused).
        prompt_template_sha256: Digest of the chat template the site renders prompts with
            (an artifact of another is refused); None in records written before the field.
        instruction_sha256: Digest of the task instruction the site's prompts carry
            (``client.models.instruction_digest``; an artifact of another is refused, and the
            site contributes only while its data still carries it); None in records written
            before the field.
        sent: Secure-sum stages whose (masked) contribution left the site, in order.
        extract_heads: The heads of the activation sum the site contributed (None: all).
        reference_sha256: Hash of the noisy all-head vector received (release-first order).
        artifact_sha256: Hash of the tensors of the artifact the site stored.
        state: See the module docstring.
        updated: ISO-8601 time of the last change, in UTC.
        note: Why the record reached its state, for the site admin.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    run_id: int
    plan_json: str
    plan_hash: str
    num_chunks: int
    num_layers: int
    num_heads: int
    head_dim: int
    head_layers: tuple[int, ...] | None = None
    model_dtype: str | None = None
    prompt_template_sha256: str | None = None
    instruction_sha256: str | None = None
    sent: tuple[str, ...] = ()
    extract_heads: tuple[LayerHead, ...] | None = None
    reference_sha256: str | None = None
    artifact_sha256: str | None = None
    state: SiteReleaseState = SiteReleaseState.PLANNED
    updated: str = ""
    note: str = ""

    @property
    def plan(self) -> ReleasePlan:
        """The accepted plan."""
        return ReleasePlan.model_validate_json(self.plan_json)

    @property
    def layout(self) -> HeadLayout:
        """The model's head layout as accepted: which layers carry heads."""
        return HeadLayout(self.num_layers, self.num_heads, self.head_layers)

    @property
    def finished(self) -> bool:
        """Whether the release is released or aborted (no further message is served)."""
        return self.state in _FINAL

    @classmethod
    def planned(
        cls,
        plan: ReleasePlan,
        *,
        run_id: int,
        num_chunks: int,
        layout: HeadLayout,
        head_dim: int,
        model_dtype: str | None = None,
        prompt_template_sha256: str | None = None,
        instruction_sha256: str | None = None,
    ) -> ReleaseRecord:
        """The record of a plan just accepted, on a model of ``layout`` with ``head_dim``."""
        return cls(
            model_dtype=model_dtype,
            prompt_template_sha256=prompt_template_sha256,
            instruction_sha256=instruction_sha256,
            release_id=plan.release_id,
            run_id=run_id,
            plan_json=plan.model_dump_json(),
            plan_hash=plan_hash(plan),
            num_chunks=num_chunks,
            num_layers=layout.num_layers,
            num_heads=layout.num_heads,
            head_dim=head_dim,
            head_layers=layout.head_layers,
            updated=_now(),
        )

    def changed(self, **updates: object) -> ReleaseRecord:
        """A copy with ``updates`` and a fresh ``updated`` time."""
        return self.model_copy(update={**updates, "updated": _now()})

    def require_open(self, run_id: int, action: str) -> None:
        """Refuse ``action`` unless this record is unfinished and belongs to ``run_id``.

        Raises:
            StageOrderError: The release is finished, or belongs to another run.
        """
        if run_id != self.run_id:
            raise StageOrderError(
                f"{action} for release {self.release_id!r} must come from run {self.run_id}, "
                f"got run {run_id}."
            )
        if self.finished:
            raise StageOrderError(
                f"{action} needs an open release, got {self.release_id!r} {self.state.value}."
            )


class ReleaseRecordStore:
    """One JSON file per release in ``folder``; every write is atomic and durable."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, release_id: str) -> Path:
        # ReleaseId is a token without '/' or '..' (checked by the plan and every message),
        # and this check keeps the store safe for any caller.
        path = self.folder / f"{release_id}.json"
        if path.parent != self.folder or release_id in ("", ".", ".."):
            raise LedgerError(f"release_id must be a plain token, got {release_id!r}.")
        return path

    def get(self, release_id: str) -> ReleaseRecord | None:
        """The record of ``release_id``, or None if the site never accepted it."""
        path = self._path(release_id)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return ReleaseRecord.model_validate_json(text)
        except ValidationError as exc:
            raise LedgerError(f"release record {path} must be valid, got: {exc}") from exc

    def require(self, release_id: str) -> ReleaseRecord:
        """The record of ``release_id``.

        Raises:
            StageOrderError: The site never accepted a plan of that id.
        """
        record = self.get(release_id)
        if record is None:
            raise StageOrderError(
                f"release_id must name a plan this site accepted, got {release_id!r}."
            )
        return record

    def create(self, record: ReleaseRecord) -> None:
        """Write a new record; an existing one of the same id is never replaced."""
        if self._path(record.release_id).exists():
            raise LedgerError(
                f"release_id must be new to this site, got {record.release_id!r} (recorded)."
            )
        self.save(record)

    def save(self, record: ReleaseRecord) -> None:
        """Write ``record`` atomically: either the old or the new file survives a crash."""
        path = self._path(record.release_id)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        text = json.dumps(record.model_dump(mode="json"), sort_keys=True, indent=1)
        write_atomic(path, text)

    def open_records(self) -> list[ReleaseRecord]:
        """Every record that is neither released nor aborted."""
        if not self.folder.is_dir():
            return []
        records = (self.get(path.stem) for path in sorted(self.folder.glob("*.json")))
        return [record for record in records if record is not None and not record.finished]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
