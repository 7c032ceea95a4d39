"""A site's side of a federated release, independent of Flower's message plumbing.

How this connects: ``client.app`` decodes each message with ``protocol``'s codec and calls
one method of :class:`Site` per stage; what a method returns is encoded back, and a typed
error becomes an ``ErrorReply`` (data, never a pickle). The site decides everything about its
own data from its own settings — the coordinator only proposes a plan:

* ``accept_plan``: check version, model fingerprint, data size and the site's own budget;
  reserve the plan's cost in the site ledger (owned by the run, so it survives the fresh
  process Flower starts for each message) and keep a secret chunk seed in the run state.
* ``contribution``: the site's clipped activation sum or vote sum for one secure sum, plus
  its chunk count; the arrays go straight into SecAgg+ masking.
* ``finish``: verify the signed artifact (trusted coordinator key, this model's fingerprint),
  store it, commit the ledger. ``abort``: refund if no noisy output exists, else commit.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from client.chunking import make_chunks, num_chunks
from client.data import SiteDataset, load_dataset
from client.models import LoadedModel, load_model
from client.release import LocalSums
from client.settings import SiteSettings
from dpmtv_common.artifact import MANIFEST_FILE, SIGNATURE_FILE, TENSORS_FILE, load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError, DataError, ModelMismatchError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from protocol import (
    AbortNotice,
    PlanAccept,
    ReleaseAck,
    ReleasePlan,
    ReleaseRequest,
    SecureSumRequest,
    check_compatible,
    reserve_plan,
)

__all__ = ["Site", "cached_model"]


@lru_cache(maxsize=2)
def cached_model(
    path: Path, device: str | None, dtype: str | None, cache_dir: Path | None
) -> LoadedModel:
    """Load once per process (simulation and in-process grids reuse one process)."""
    return load_model(path, device=device, dtype=dtype, fingerprint_cache=cache_dir)


@dataclass
class Site:
    """One data holder's handlers; ``settings`` never come from the coordinator."""

    settings: SiteSettings

    def model(self) -> LoadedModel:
        """The site's model (loaded once per process)."""
        if self.settings.model_path is None:
            raise ConfigError("the site needs model-path (node config) or DPMTV_CLIENT_MODEL_PATH.")
        settings = self.settings
        return cached_model(
            settings.model_path, settings.device, settings.dtype, settings.cache_dir
        )

    def dataset(self) -> SiteDataset:
        """The site's private dataset."""
        if self.settings.data_path is None:
            raise ConfigError("the site needs data-path (node config) or DPMTV_CLIENT_DATA_PATH.")
        return load_dataset(self.settings.data_path)

    def ledger(self) -> PrivacyLedger:
        """The site's own ledger (open it in a ``with`` block)."""
        return PrivacyLedger.open(self.settings.ledger_path, self.settings.budget)

    def accept_plan(self, plan: ReleasePlan) -> PlanAccept:
        """Check the plan against this site, reserve its cost, and report m_i."""
        check_compatible(plan.protocol_version)
        fingerprint = self.model().fingerprint  # before the data: a wrong model costs nothing
        if plan.model_fingerprint != fingerprint:
            raise ModelMismatchError(
                f"plan model_fingerprint must be this site's {fingerprint!r}, "
                f"got {plan.model_fingerprint!r}."
            )
        available = num_chunks(len(self.dataset().records), plan.shots)
        chunks = min(available, plan.max_chunks_per_site or available)
        if chunks < 1:
            raise DataError(f"the site must hold at least K+1={plan.shots + 1} examples.")
        with self.ledger() as ledger:
            reserve_plan(ledger, plan, owned_by_run=True)
        shape = self.model().adapter.head_shape(self.model().model)
        return PlanAccept(
            release_id=plan.release_id,
            site_name=self.settings.name,
            num_chunks=chunks,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            head_dim=shape.head_dim,
        )

    def contribution(
        self,
        plan: ReleasePlan,
        request: SecureSumRequest,
        *,
        seed: int,
        reference: np.ndarray | None,
    ) -> list[np.ndarray]:
        """[flattened sum, [m_i]] for one secure sum (activations or votes)."""
        if request.release_id != plan.release_id:
            raise ConfigError(
                f"secure sum release_id must be {plan.release_id!r}, got {request.release_id!r}."
            )
        loaded = self.model()
        dataset = self.dataset()  # read and verified once per message, not per use
        chunk_plan = make_chunks(
            dataset, shots=plan.shots, seed=seed, max_chunks=plan.max_chunks_per_site
        )
        sums = LocalSums(
            loaded,
            chunk_plan.chunks,
            plan,
            batch_size=self.settings.batch_size,
            instruction=dataset.instruction,
            progress=False,
        )
        if request.stage == "extract":
            heads = HeadSet(request.heads) if request.heads is not None else self._all_heads(loaded)
            summed = sums.activation_sum(heads)
            return [summed.total.ravel(), np.array([float(summed.num_chunks)])]
        votes = sums.vote_sum(reference)
        return [votes.total, np.array([float(votes.num_chunks)])]

    @staticmethod
    def _all_heads(loaded: LoadedModel) -> HeadSet:
        shape = loaded.adapter.head_shape(loaded.model)
        return HeadSet.all_heads(num_layers=shape.num_layers, num_heads=shape.num_heads)

    def finish(self, request: ReleaseRequest) -> ReleaseAck:
        """Verify and store the signed artifact, then commit this release in the ledger."""
        keys = TrustedKeys.from_files(self.settings.trusted_keys)
        target = self.settings.artifacts_dir / request.release_id
        with tempfile.TemporaryDirectory(prefix=".incoming-", dir=_parent(target)) as tmp:
            staged = Path(tmp) / "artifact"
            staged.mkdir()
            (staged / MANIFEST_FILE).write_text(request.manifest_json)
            (staged / TENSORS_FILE).write_bytes(request.tensors)
            (staged / SIGNATURE_FILE).write_bytes(request.signature)
            load_artifact(
                staged, trusted_keys=keys, expected_model_fingerprint=self.model().fingerprint
            )
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
        with self.ledger() as ledger:
            ledger.commit(request.release_id)
        digest = hashlib.sha256(request.tensors).hexdigest()
        return ReleaseAck(
            release_id=request.release_id, site_name=self.settings.name, artifact_sha256=digest
        )

    def abort(self, notice: AbortNotice) -> None:
        """Refund the reservation when nothing noisy exists; else count it as spent."""
        with self.ledger() as ledger:
            state = _state_of(ledger, notice.release_id)
            if state not in (ReleaseState.RESERVED, ReleaseState.EXPOSED):
                return  # already resolved: aborts are idempotent
            if notice.noisy_output:
                ledger.commit(notice.release_id)
            else:
                ledger.abort(notice.release_id, f"coordinator aborted: {notice.reason}"[:500])


def _parent(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent


def _state_of(ledger: PrivacyLedger, release_id: str) -> ReleaseState | None:
    for entry in ledger.releases():
        if entry.release_id == release_id:
            return entry.state
    return None
