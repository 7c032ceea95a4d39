"""A site's side of a federated release: every decision about its data, made on its own record.

How this connects: the site service (:mod:`client.service`) owns one :class:`Site` for its
whole life and calls one method per message; the Flower relay that delivers the messages is
untrusted. Each method checks the message against the plan the site accepted and its own
record (:mod:`client.release.policy`, :mod:`client.release.record`) before anything moves:

* ``check_data`` (at service start): every record decoded, the answers checked.
* ``accept_plan``: the plan must fit the site's policy, model and data (records listed, never
  decoded: taking part never depends on a record's content); only then is the cost reserved
  and m_i announced (a public count, from n). A record that fails later costs its chunk only.
* ``contribution``: one secure sum of the plan, once, as the plan says; the ledger is marked
  exposed and the record updated *before* the arrays go to SecAgg+ masking.
* ``store_reference``: the noisy all-head vector of a release-first plan, kept to score
  against and to check the artifact's values later.
* ``finish``: a signed artifact that matches the plan as the site recomputes it is stored
  under the site's own artifacts folder (never replacing anything); the ledger commits if
  anything of the site's data left, and refunds if nothing did.
* ``abort`` and ``sweep``: the site resolves a release from its own record — nothing sent:
  refund; anything sent: counted — whatever a notice says, also when no notice ever comes.

Which record state may stand beside which ledger state, and how each pair is settled, is one
table: :mod:`client.release.states`. A further step on a pair outside it is refused; a
settlement never refunds a pair in which anything of the site's data may have left.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from client.activations.chunking import make_chunks, planned_num_chunks
from client.activations.scoring import check_answer_vocabulary
from client.data.records import SiteDataset, load_dataset
from client.models import (
    LoadedModel,
    default_fingerprint_cache_dir,
    instruction_digest,
    prompt_template_digest,
)
from client.models.shared import shared_model
from client.release.graph_draws import GraphDrawLog
from client.release.ledgers import check_one_ledger
from client.release.policy import (
    ModelShape,
    check_artifact,
    check_plan,
    check_reference,
    check_secure_sum,
    distributed_grid,
)
from client.release.record import ReleaseRecord, ReleaseRecordStore, SiteReleaseState
from client.release.single_holder import LocalSums
from client.release.states import Settlement, in_step, require_in_step, settlement
from client.settings import SiteSettings
from dpmtv_common.aliases import Float64Array
from dpmtv_common.artifact import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    TENSORS_FILE,
    clean_stale_staging,
    load_artifact,
)
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError, DataError, LedgerError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.distributed import encode_site_share
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.privacy.noise import require_cryptographic, secure_noise
from dpmtv_common.rng import secret_seed
from protocol import (
    DPMTV_VERSION,
    AbortNotice,
    PlanAccept,
    ReleaseAck,
    ReleasePlan,
    ReleaseRequest,
    SecureSumRequest,
    StageOrderError,
    check_plan_centre,
    reserve_plan,
)
from protocol.secure_sum import SumRanges

__all__ = ["Site", "cached_model"]

_log = logging.getLogger(__name__)


def cached_model(settings: SiteSettings) -> LoadedModel:
    """The site's model: one read-only copy per process for every site that names it.

    The service keeps it loaded between messages; sites simulated in one process share it
    (:mod:`client.models.shared`: keyed on folder, device and dtype, never written).
    """
    if settings.model_path is None:
        raise ConfigError("the site needs --model (or DPMTV_CLIENT_MODEL_PATH).")
    return shared_model(
        settings.model_path,
        device=settings.device,
        dtype=settings.dtype,
        device_map=settings.device_map,
        attn_implementation=settings.attn_implementation,
        fingerprint_cache=settings.cache_dir or default_fingerprint_cache_dir(),
    )


@dataclass
class Site:
    """One data holder's handlers; ``settings`` never come from the coordinator.

    Attributes:
        settings: The site admin's settings.
        seeds: Secret chunk seed of each open release (memory only: a restarted service
            cannot contribute to a release it accepted before, and resolves it instead).
        centres: The public centre of each open centred release, checked against its plan
            (memory only, like the seeds).
        references: The noisy all-head vector of each open release-first release.
        last_seen: When a message of each run last arrived (idle releases are resolved).
    """

    settings: SiteSettings
    seeds: dict[str, int] = field(default_factory=dict)
    centres: dict[str, ActivationCentre] = field(default_factory=dict)
    references: dict[str, Float64Array] = field(default_factory=dict)
    last_seen: dict[int, float] = field(default_factory=dict)

    def touch(self, run_id: int) -> None:
        """Note a message of ``run_id`` now: its releases are not idle.

        Every message of a run renews all of that run's releases, whatever it names.
        """
        self.last_seen[run_id] = time.time()

    @property
    def records(self) -> ReleaseRecordStore:
        """The site's release records."""
        return ReleaseRecordStore(self.settings.releases_folder)

    def model(self) -> LoadedModel:
        """The site's model (loaded once per process, shared read-only with its other sites)."""
        return cached_model(self.settings)

    def shape(self) -> ModelShape:
        """The site model's head layout (which layers carry heads) and head width D."""
        loaded = self.model()
        head_shape = loaded.adapter.head_shape(loaded.model)
        return ModelShape(head_shape.layout(), head_shape.head_dim)

    def check_data(self) -> SiteDataset:
        """Decode every record and check the answers against the model: at service start.

        Raises:
            DataError: A record is unusable (all counted), or no answer is in the vocabulary.
        """
        if self.settings.data_path is None:
            raise ConfigError("the site needs --data (or DPMTV_CLIENT_DATA_PATH).")
        dataset = load_dataset(self.settings.data_path)
        check_answer_vocabulary(self.model(), [record.answer for record in dataset.records])
        return dataset

    def _listed_dataset(self) -> SiteDataset:
        """The records, listed without opening any image (content never decides a plan)."""
        if self.settings.data_path is None:
            raise ConfigError("the site needs --data (or DPMTV_CLIENT_DATA_PATH).")
        return load_dataset(self.settings.data_path, check_images=False)

    def ledger(self) -> PrivacyLedger:
        """The site's own ledger (open it in a ``with`` block)."""
        return PrivacyLedger.open(self.settings.ledger_file, self.settings.budget)

    def accept_plan(
        self, plan: ReleasePlan, *, run_id: int, centre: Float64Array | None = None
    ) -> PlanAccept:
        """Check the plan against this site, reserve its cost, and report m_i.

        ``centre`` is the flat public centre that rode beside a centred plan: refused unless
        its digest is the plan's and its shape the site model's (before any reservation).
        """
        if self.records.get(plan.release_id) is not None:
            raise StageOrderError(f"release_id must be new to this site, got {plan.release_id!r}.")
        loaded, shape = self.model(), self.shape()
        loaded = loaded.with_image_crops(plan.max_image_crops)  # refused here, before any cost
        checked_centre = self._checked_centre(plan, centre, loaded)
        # Listed, not decoded: a record's content (an image that no longer decodes, its answer)
        # must never decide whether this site takes part; check_data ran at service start.
        dataset = self._listed_dataset()
        check_plan(
            plan,
            settings=self.settings,
            fingerprint=loaded.fingerprint,
            shape=shape,
            data_unit=dataset.privacy_unit,
        )
        chunks = planned_num_chunks(dataset, plan.shots, plan.max_chunks_per_site)
        if chunks < 1:
            raise DataError(f"the site must hold at least one chunk of K+1={plan.shots + 1}.")
        template_sha256 = prompt_template_digest(loaded)
        instruction_sha256 = instruction_digest(dataset.instruction)
        for line in check_one_ledger(self.settings, remember=False):  # never a split budget
            _log.warning(line)
        with self.ledger() as ledger:
            reserve_plan(ledger, plan)  # owned by this (long-lived) process
        self.records.create(
            ReleaseRecord.planned(
                plan,
                run_id=run_id,
                num_chunks=chunks,
                layout=shape.layout,
                head_dim=shape.head_dim,
                model_dtype=loaded.dtype_name,
                prompt_template_sha256=template_sha256,
                instruction_sha256=instruction_sha256,
            )
        )
        self.seeds[plan.release_id] = secret_seed()
        if checked_centre is not None:
            self.centres[plan.release_id] = checked_centre
        _log.info(
            "release %s: plan accepted (run %d, epsilon=%g, delta=%g per %s, m_i=%d, selection=%s)",
            plan.release_id,
            run_id,
            plan.epsilon,
            plan.delta,
            plan.privacy_unit.value,
            chunks,
            plan.selection.value,
        )
        return PlanAccept(
            release_id=plan.release_id,
            site_name=self.settings.name,
            num_chunks=chunks,
            num_layers=shape.layout.num_layers,
            num_heads=shape.layout.num_heads,
            head_dim=shape.head_dim,
            model_dtype=loaded.dtype_name,
            head_layers=shape.layout.head_layers,
            prompt_template_sha256=template_sha256,
            instruction_sha256=instruction_sha256,
            dpmtv_version=DPMTV_VERSION,
        )

    def _checked_centre(
        self, plan: ReleasePlan, flat: Float64Array | None, loaded: LoadedModel
    ) -> ActivationCentre | None:
        """The centre a centred plan pins, rebuilt for this site's model; None otherwise.

        Raises:
            PlanMismatchError: A centre without a centred plan, none for one, or another
                digest than the plan's.
            ConfigError: The values do not fit the site model's (L, H, D) or are not finite.
        """
        if flat is None:
            check_plan_centre(plan, None)
            return None
        shape = loaded.adapter.head_shape(loaded.model)
        centre = ActivationCentre.from_flat(
            flat, shape=(shape.num_layers, shape.num_heads, shape.head_dim)
        )
        check_plan_centre(plan, centre)
        return centre

    def note_graph_draw(self, release_id: str, *, run_id: int) -> None:
        """Count one secure-sum graph draw for an open release, or refuse it (before the nonce).

        Raises:
            StageOrderError: No open release of this run.
            PolicyError: A second draw for the release, or the site's
                ``secagg_max_graph_draws`` in the window are spent (``client.release.graph_draws``).
        """
        self._open_record(release_id, run_id, "graph draw")
        GraphDrawLog(self.settings.graph_draws_file).record(
            release_id,
            now=time.time(),
            limit=self.settings.secagg_max_graph_draws,
            window_seconds=self.settings.secagg_graph_draw_window_seconds,
        )
        _log.info("release %s: secure-sum graph draw counted", release_id)

    def contribution(
        self, request: SecureSumRequest, *, run_id: int, ranges: SumRanges | None = None
    ) -> list[np.ndarray]:
        """[flattened sum, [m_i]] for one secure sum of the accepted plan, exactly once.

        In distributed noise mode the sum is this site's encoded noisy share, and ``ranges``
        (the SecAgg+ grid the coordinator set up) must be the plan's.
        """
        record = self._open_record(request.release_id, run_id, "secure sum")
        check_secure_sum(record, request)
        grid = distributed_grid(record, request, ranges)
        seed = self.seeds.get(record.release_id)
        if seed is None:
            raise StageOrderError(
                f"release {record.release_id!r} was accepted by an earlier run of this service;"
                " its secret chunk seed is gone, so the site cannot contribute to it."
            )
        arrays = self._compute(record, request, seed)
        if grid is not None:  # the site's own noise share, from the CSPRNG, inside the sum
            noise = secure_noise()
            require_cryptographic(noise)
            arrays[0] = encode_site_share(arrays[0], params=grid, noise=noise)
        self._mark_sent(record, request)
        return arrays

    def _compute(
        self, record: ReleaseRecord, request: SecureSumRequest, seed: int
    ) -> list[np.ndarray]:
        plan = record.plan
        # A record that does not decode (now) must cost its chunk (zeros), never this site's
        # place in the sum: list, do not re-check, images. The data is read again here, so
        # its instruction must still be the one the site reported with the plan.
        dataset = self._listed_dataset()
        _check_same_instruction(record, dataset)
        chunk_plan = make_chunks(
            dataset, shots=plan.shots, seed=seed, max_chunks=plan.max_chunks_per_site
        )
        sums = LocalSums(
            self.model(),
            chunk_plan.chunks,
            plan,
            batch_size=self.settings.batch_size,
            instruction=dataset.instruction,
            progress=False,
            centre=self._centre_of(record),
        )
        if request.stage == "extract":
            heads = record.layout.all_heads()  # None: every head the model carries
            if request.heads is not None:
                heads = HeadSet(request.heads)
            summed = sums.activation_sum(heads)
            count = summed.num_chunks
            total = summed.total.ravel()
        else:
            votes = sums.vote_sum(self.references.get(record.release_id))
            count, total = votes.num_chunks, votes.total
        if count != record.num_chunks:  # m_i is public: it must be what the plan stage said
            raise DataError(f"the site must contribute {record.num_chunks} chunks, got {count}.")
        return [total, np.array([float(count)])]

    def _centre_of(self, record: ReleaseRecord) -> ActivationCentre | None:
        """The centre kept at acceptance; a centred plan without it cannot be served."""
        centre = self.centres.get(record.release_id)
        check_plan_centre(record.plan, centre)  # fail closed: never clip uncentred by mistake
        return centre

    def _mark_sent(self, record: ReleaseRecord, request: SecureSumRequest) -> None:
        # Durable before the arrays are handed to SecAgg+: from here on they may leave. The
        # ledger goes first, so a stop between the two writes leaves the release counted.
        with self.ledger() as ledger:
            if _state_of(ledger, record.release_id) is ReleaseState.RESERVED:
                ledger.mark_exposed(record.release_id)
        heads = request.heads if request.stage == "extract" else record.extract_heads
        self.records.save(
            record.changed(
                sent=(*record.sent, request.stage),
                extract_heads=heads,
                state=SiteReleaseState.CONTRIBUTED,
            )
        )
        _log.info("release %s: contributed to the %s secure sum", record.release_id, request.stage)

    def store_reference(
        self, release_id: str, heads: HeadSet, values: Float64Array, *, run_id: int
    ) -> None:
        """Keep the noisy all-head vector of a release-first plan (once, after extract)."""
        record = self._open_record(release_id, run_id, "noisy vector")
        check_reference(record, heads.heads, values)
        array = np.asarray(values, dtype=np.float64)
        self.references[release_id] = array
        digest = hashlib.sha256(array.tobytes()).hexdigest()
        self.records.save(record.changed(reference_sha256=digest))

    def finish(self, request: ReleaseRequest, *, run_id: int) -> ReleaseAck:
        """Verify, check against the plan, store the artifact; resolve the ledger."""
        record = self._open_record(request.release_id, run_id, "release")
        folder = self.settings.artifacts_folder
        folder.mkdir(parents=True, exist_ok=True)
        clean_stale_staging(folder)  # what a killed service left half-written
        target = folder / record.release_id  # a checked token: stays inside the folder
        if target.exists() or target.is_symlink():
            raise StageOrderError(f"artifact {record.release_id!r} is already stored; kept as is.")
        with tempfile.TemporaryDirectory(prefix=".incoming-", dir=folder) as tmp:
            staged = Path(tmp) / "artifact"
            _write_staged(staged, request)
            artifact = load_artifact(
                staged,
                trusted_keys=TrustedKeys.from_files(self.settings.trusted_keys),
                expected_model_fingerprint=self.model().fingerprint,
            )
            check_artifact(record, artifact, self.references.get(record.release_id))
            staged.rename(target)
        digest = hashlib.sha256(request.tensors).hexdigest()
        self._resolve(record, SiteReleaseState.RELEASED, "artifact stored", digest)
        return ReleaseAck(
            release_id=record.release_id, site_name=self.settings.name, artifact_sha256=digest
        )

    def abort(self, notice: AbortNotice, *, run_id: int) -> None:
        """Resolve the release from the site's own record; the notice's claims are only logged."""
        record = self.records.require(notice.release_id)
        if record.finished and record.run_id == run_id:
            return  # aborts are idempotent
        record.require_open(run_id, "abort")
        _log.info(
            "release %s: coordinator abort (says noisy_output=%s): %.200r",
            record.release_id,
            notice.noisy_output,
            notice.reason,
        )
        self._resolve(record, SiteReleaseState.ABORTED, "aborted by the coordinator")

    def sweep(self, *, now: float | None = None, everything: bool = False) -> list[str]:
        """Resolve open releases idle past the site's limit (or all, at start and stop).

        Raises:
            LedgerError: A release the table cannot settle (its data left but the ledger
                refunded it, or the ledger lacks it); it stays open, the others are resolved.
        """
        limit = self.settings.idle_release_seconds
        moment = time.time() if now is None else now
        resolved: list[str] = []
        refused: list[str] = []
        for record in self.records.open_records():
            changed = datetime.fromisoformat(record.updated).timestamp()
            idle = moment - max(changed, self.last_seen.get(record.run_id, 0.0))
            orphan = record.release_id not in self.seeds
            if not (everything or orphan or idle > limit):
                continue
            why = "service stopped" if everything else "no message from the coordinator"
            why = "accepted by an earlier service run" if orphan and not everything else why
            try:
                self._resolve(record, SiteReleaseState.ABORTED, why)
            except LedgerError as exc:
                # One release the site cannot count must not keep the others open.
                _log.error("release %s: left open: %s", record.release_id, exc)
                refused.append(str(exc))
                continue
            resolved.append(record.release_id)
        if refused:  # fail closed: at start this stops the service until an admin looks
            raise LedgerError(" ".join(refused))
        return resolved

    def _open_record(self, release_id: str, run_id: int, action: str) -> ReleaseRecord:
        """The open record of ``release_id``, standing beside its ledger entry as it must.

        Raises:
            StageOrderError: No such release here, finished, or of another run.
            LedgerError: Record and ledger out of step (``client.release.states.BESIDE``).
        """
        record = self.records.require(release_id)
        record.require_open(run_id, action)
        with self.ledger() as ledger:
            require_in_step(record, _state_of(ledger, release_id), action)
        return record

    def _resolve(
        self,
        record: ReleaseRecord,
        state: SiteReleaseState,
        why: str,
        artifact_sha256: str | None = None,
    ) -> None:
        counted = self._settle_ledger(record)
        verdict = "counted (its data may have left)" if counted else "refunded (nothing left)"
        self.records.save(
            record.changed(state=state, note=f"{why}; {verdict}", artifact_sha256=artifact_sha256)
        )
        self.seeds.pop(record.release_id, None)
        self.references.pop(record.release_id, None)
        self.centres.pop(record.release_id, None)
        _log.info("release %s: %s: %s; budget %s", record.release_id, state.value, why, verdict)

    def _settle_ledger(self, record: ReleaseRecord) -> bool:
        """Settle the ledger by ``client.release.states.SETTLEMENT``; return whether it counts.

        The ledger is settled before the record is saved, so a stop in between leaves a pair
        the next sweep settles again without changing it (committed or refunded stays so).
        """
        with self.ledger() as ledger:
            state = _state_of(ledger, record.release_id)
            rule = settlement(record, state)  # LedgerError where the table has no row
            if not in_step(record, state):
                _log.warning(
                    "release %s: record %s beside ledger %s is out of step; ledger: %s",
                    record.release_id,
                    record.state.value,
                    state,
                    rule.value,
                )
            if rule is Settlement.COMMIT:
                ledger.commit(record.release_id)
            elif rule is Settlement.REFUND:
                ledger.abort(record.release_id, "no data of this site left it")
            return rule.counts


def _check_same_instruction(record: ReleaseRecord, dataset: SiteDataset) -> None:
    """Refuse to contribute under another instruction than the one the site reported.

    The data is read again at every secure sum; an edited ``dataset.json`` would otherwise
    prompt the chunks unlike the digest the coordinator checked and the manifest records.
    """
    found = instruction_digest(dataset.instruction)
    if record.instruction_sha256 is not None and found != record.instruction_sha256:
        raise DataError(
            f"the dataset's instruction must be the one reported when release "
            f"{record.release_id!r} was accepted (sha256 {record.instruction_sha256}), got "
            f"sha256 {found}; restore its dataset.json 'instruction'."
        )


def _write_staged(staged: Path, request: ReleaseRequest) -> None:
    staged.mkdir()
    (staged / MANIFEST_FILE).write_text(request.manifest_json, encoding="utf-8")
    (staged / TENSORS_FILE).write_bytes(request.tensors)
    (staged / SIGNATURE_FILE).write_bytes(request.signature)


def _state_of(ledger: PrivacyLedger, release_id: str) -> ReleaseState | None:
    for entry in ledger.releases():
        if entry.release_id == release_id:
            return entry.state
    return None
