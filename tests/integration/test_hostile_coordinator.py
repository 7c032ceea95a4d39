"""A hostile coordinator against real site services: what it asks for, and what it gets.

Each test plays the coordinator by hand — crafted plans, secure sums, notices and artifacts
sent through ``InProcessGrid`` to real relays and real site services (tiny random LLaVA,
L = 2, H = 4, D = 16; three sites of 15 records, K = 2, so m_i = 5) — and checks that the
site refuses with a typed, fixed-text error and loses nothing: no budget refunded after its
data left, nothing stored or deleted outside its own folder, no second contribution.
Secure sums run the coordinator's own ``server.secure_sum.SecureSumSession`` over the key
advertisements the sites sent with their plan acceptances (the in-process sites share one
generated roster); ``test_roster_secure_sum`` forges the secure sum's own messages.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import functools
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common import Array

from client.data.synthetic import write_task_datasets
from client.models import instruction_digest, load_model, prompt_template_digest, save_tiny_model
from client.release.record import SiteReleaseState
from client.service.inprocess import open_in_process_sites
from client.service.server import SiteService
from client.settings import SiteSettings
from dpmtv_common.artifact import MANIFEST_FILE, SIGNATURE_FILE, TENSORS_FILE, write_artifact
from dpmtv_common.crypto import SigningKey
from dpmtv_common.crypto.key_agreement import AgreementKey
from dpmtv_common.errors import DataError, InsufficientSharesError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.roster import Roster
from protocol import (
    PROTOCOL_VERSION,
    AbortNotice,
    ErrorCode,
    ErrorReply,
    NoiseMode,
    PlanAccept,
    PlanRequest,
    PrivacyUnit,
    ReleaseAck,
    ReleaseOrder,
    ReleasePlan,
    ReleaseRequest,
    SecureSumRequest,
    SelectionMode,
    message_from_record,
    message_to_record,
    plan_calibration,
)
from protocol.codec import array_from_record, with_array
from protocol.secure_sum import (
    MASKED_ARRAY_KEY,
    REFERENCE_ARRAY_KEY,
    SumInstructions,
    SumRanges,
    SumSharesRequest,
    ranges_for,
)
from protocol.sum_keys import KeyAdvert, advert_signed_bytes
from server.messaging import Exchange
from server.secure_sum import SecureSumSession, SumResult
from server.simulation import FIRST_NODE_ID, InProcessGrid
from tests.flower_harness import flower_process_state
from tests.plans import make_plan as base_plan

pytestmark = pytest.mark.integration

SHOTS, RECORDS, SITES = 2, 15, 3
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 4, 16
M_I = RECORDS // (SHOTS + 1)


@dataclass(frozen=True)
class World:
    root: Path
    model: Path
    fingerprint: str
    key: SigningKey
    verify_key: Path


def make_world(root: Path) -> World:
    """Three sites of 15 records, a tiny random LLaVA and the coordinator's key pair."""
    write_task_datasets(
        root / "data", task="colour", sites=SITES, per_site=RECORDS, public=0, test=0, seed=0
    )
    save_tiny_model("llava", root / "model", seed=0)
    key = SigningKey.generate()
    key.save(root / "coordinator.key")
    key.verify_key.save(root / "coordinator.pub")
    return World(
        root, root / "model", fingerprint_model_dir(root / "model"), key, root / "coordinator.pub"
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("hostile"))


class HostileGrid(InProcessGrid):
    """The in-process grid, with the coordinator's outgoing records rewritten on the way.

    ``edits[message_type]`` changes the content of every message of that type before it is
    delivered: how a test makes the coordinator's own secure sum carry forged arrays.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.edits: dict[str, Callable[[RecordDict], None]] = {}

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        sent = list(messages)
        for message in sent:
            edit = self.edits.get(message.metadata.message_type)
            if edit is not None:
                edit(message.content)
        return super().send_and_receive(sent, timeout=timeout)


@dataclass
class Consortium:
    """Three site services behind relays, and a grid the hostile coordinator drives."""

    world: World
    tmp: Path
    services: list[SiteService]
    grid: HostileGrid
    adverts: dict[int, KeyAdvert] = field(default_factory=dict)
    session: SecureSumSession | None = None

    def node(self, index: int) -> int:
        return FIRST_NODE_ID + index

    def settings(self, index: int) -> SiteSettings:
        return self.services[index].settings

    def ask(self, index: int, message_type: str, body: Any) -> Any:
        record = message_to_record(body)
        message = self.grid.create_message(record, message_type, self.node(index), "hostile")
        (reply,) = self.grid.send_and_receive([message])
        return message_from_record(reply.content)

    def plan(self, plan: ReleasePlan, sites: range = range(SITES)) -> list[Any]:
        """Send the plan; keep the key each accepting site advertised with its acceptance."""
        replies = [self.ask(i, "query.plan", PlanRequest(plan=plan)) for i in sites]
        for index, reply in zip(sites, replies, strict=True):
            if isinstance(reply, PlanAccept) and reply.keys is not None:
                self.adverts[self.node(index)] = reply.keys
        self.session = None
        return replies

    def secure_sum(
        self,
        request: SecureSumRequest,
        *,
        sites: int = SITES,
        reference: np.ndarray | None = None,
        ranges: SumRanges | None = None,
        new_agreement: bool = False,
    ) -> SumResult | None:
        """The next secure sum of the release, by the coordinator's own session.

        The first sum (or ``new_agreement``) starts a key agreement over the first ``sites``
        sites' advertisements. The coordinator gives up only below two survivors, so what
        is tested is what each site refuses. None when the sum failed.
        """
        try:
            if self.session is None or new_agreement:
                nodes = [self.node(i) for i in range(sites)]
                adverts = {node: self.adverts[node] for node in nodes if node in self.adverts}
                self.session = SecureSumSession(
                    Exchange(self.grid, timeout=30.0), request.release_id, adverts, min_sites=2
                )
            instructions = SumInstructions(
                sum_index=self.session.next_sum,
                request=request,
                ranges=ranges or ranges_for(64.0, sites),
            )
            flat = None if reference is None else np.asarray(reference, np.float64).ravel()
            return self.session.run_sum(instructions, flat)
        except InsufficientSharesError:
            return None

    def ledger_state(self, index: int, release_id: str) -> ReleaseState | None:
        settings = self.settings(index)
        with PrivacyLedger.open(settings.ledger_file, settings.budget) as ledger:
            states = {entry.release_id: entry.state for entry in ledger.releases()}
        return states.get(release_id)

    def record_state(self, index: int, release_id: str) -> SiteReleaseState | None:
        record = self.services[index].site.records.get(release_id)
        return None if record is None else record.state

    def answers(self, message_type: str) -> dict[int, Any]:
        """Every site's last decoded reply to ``message_type``, by node."""
        return {
            node: message_from_record(reply.content)
            for node, stage, reply in self.grid.replies
            if stage == message_type
        }


@contextmanager
def open_consortium(world: World, tmp: Path, **overrides: Any) -> Iterator[Consortium]:
    """Three site services (``overrides`` on their settings) and a hostile grid."""
    settings = [
        SiteSettings(
            **{
                "name": f"site-{i}",
                "model_path": world.model,
                "data_path": world.root / "data" / f"site-{i}",
                "state_dir": tmp / f"site-{i}",
                "trusted_keys": (world.verify_key,),
                "device": "cpu",
                "min_sites": 3,
                **overrides,
            }
        )
        for i in range(SITES)
    ]
    with flower_process_state():
        sites = open_in_process_sites(settings)
        grid = HostileGrid(sites.relays, num_nodes=SITES)
        yield Consortium(world, tmp, sites.services, grid)


@pytest.fixture
def consortium(world: World, tmp_path: Path) -> Iterator[Consortium]:
    with open_consortium(world, tmp_path) as opened:
        yield opened


def make_plan(world: World, release_id: str = "r1", **overrides: Any) -> ReleasePlan:
    fields: dict[str, Any] = {
        "release_id": release_id,
        "model_fingerprint": world.fingerprint,
        "shots": SHOTS,
        "min_sites": 3,
        "max_chunks_per_site": None,
    }
    return base_plan(**(fields | overrides))


def extract_request(release_id: str = "r1", **overrides: Any) -> SecureSumRequest:
    fields: dict[str, Any] = {
        "release_id": release_id,
        "stage": "extract",
        "heads": None,
        "clip_norm": 1.0,
        "score_top_r": None,
    }
    fields.update(overrides)
    return SecureSumRequest(**fields)


@functools.cache
def sites_template_sha256(model: Path) -> str:
    """The prompt template digest every site reports for ``model``, as a coordinator records it."""
    return prompt_template_digest(load_model(model, device="cpu"))


def signed_request(
    world: World,
    tmp: Path,
    plan: ReleasePlan,
    *,
    epsilon: float | None = None,
    noise_std: float | None = None,
    heads: HeadSet | None = None,
    key: SigningKey | None = None,
    release_id: str | None = None,
    model_dtype: str | None = None,
    prompt_template_sha256: str | None = "",
    instruction_sha256: str | None = "",
    values: np.ndarray | None = None,
    model_fingerprint: str | None = None,
) -> ReleaseRequest:
    """An artifact as a coordinator would sign it; fields may be forged.

    A digest left empty is the sites' own (their data carry no instruction); None leaves it
    out.
    """
    from dpmtv_common.artifact import ReleaseDescription

    calibration = plan_calibration(plan)
    scope = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    sigma = calibration.gaussian(clip_norm=plan.clip_norm, heads=scope).noise_std
    released = heads or scope
    description = ReleaseDescription(
        protocol_version=PROTOCOL_VERSION,
        release_id=release_id or plan.release_id,
        model_fingerprint=model_fingerprint or plan.model_fingerprint,
        task=plan.task,
        plan=plan.model_dump(mode="json"),
        epsilon=epsilon or calibration.bound.epsilon,
        delta=plan.delta,
        accountant=calibration.bound.accountant,
        accountant_parameters={
            **calibration.event.to_dict(),
            "neighbouring": plan.neighbouring.value,
            "privacy_unit": plan.privacy_unit.value,
        },
        num_chunks=SITES * M_I,
        shots=plan.shots,
        clip_norm=plan.clip_norm,
        noise_std=noise_std or sigma,
        model_dtype=model_dtype,
        prompt_template_sha256=(
            sites_template_sha256(world.model)
            if prompt_template_sha256 == ""
            else prompt_template_sha256
        ),
        instruction_sha256=(
            instruction_digest(None) if instruction_sha256 == "" else instruction_sha256
        ),
    )
    path = write_artifact(
        tmp / f"artifact-{len(list(tmp.glob('artifact-*')))}",
        heads=released,
        values=np.zeros((len(released), HEAD_DIM)) if values is None else values,
        release=description,
        signing_key=key or world.key,
    )
    return ReleaseRequest(
        release_id=release_id or plan.release_id,
        manifest_json=(path / MANIFEST_FILE).read_text(),
        tensors=(path / TENSORS_FILE).read_bytes(),
        signature=(path / SIGNATURE_FILE).read_bytes(),
    )


def error_code(reply: Any) -> ErrorCode | None:
    return reply.code if isinstance(reply, ErrorReply) else None


# ---------------------------------------------------------------- plan checks


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"privacy_unit": PrivacyUnit.GROUP}, ErrorCode.POLICY),  # per-example data
        ({"min_sites": 2}, ErrorCode.POLICY),  # below the site's own minimum of 3
        ({"epsilon": 50.0}, ErrorCode.POLICY),  # above the site's per-release cap of 8
        ({"delta": 1e-3}, ErrorCode.POLICY),
        (
            {"noise_mode": NoiseMode.DISTRIBUTED, "max_sites": 3, "max_chunks_per_site": 5},
            ErrorCode.POLICY,
        ),  # the site runs central only
        ({"selection": SelectionMode.PRIVATE, "num_selected_heads": 100}, ErrorCode.BAD_REQUEST),
        ({"selection": SelectionMode.PRIVATE, "score_top_r": 9}, ErrorCode.BAD_REQUEST),
        (
            {"selection": SelectionMode.PUBLIC, "num_selected_heads": 1, "public_heads": ((7, 0),)},
            ErrorCode.BAD_REQUEST,
        ),
        ({"model_fingerprint": "sha256:" + "0" * 64}, ErrorCode.MODEL_MISMATCH),
    ],
)
def test_a_plan_outside_the_site_is_refused_before_any_reservation(
    consortium: Consortium, overrides: dict[str, Any], code: ErrorCode
) -> None:
    # Act
    (reply,) = consortium.plan(make_plan(consortium.world, **overrides), range(1))
    # Assert
    assert error_code(reply) is code
    assert consortium.ledger_state(0, "r1") is None
    assert consortium.services[0].site.records.get("r1") is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("release_id", ".."),
        ("release_id", "../../x"),
        ("release_id", "/etc"),
        ("release_id", "x" * 1_000_000),
        ("task", "t" * 8_000_000),
        ("epsilon", 1e6),
        ("public_heads", [[layer, 0] for layer in range(100_000)]),
    ],
)
def test_an_unbounded_or_path_like_plan_never_decodes(
    consortium: Consortium, field: str, value: object
) -> None:
    # Arrange: a forged plan body, bypassing ReleasePlan's own checks on the sender's side.
    body = json.loads(make_plan(consortium.world).model_dump_json())
    body[field] = value
    record = message_to_record(PlanRequest(plan=make_plan(consortium.world)))
    envelope = record.config_records["dpmtv"]
    envelope["body"] = json.dumps({"kind": "plan-request", "plan": body})
    message = consortium.grid.create_message(record, "query.plan", consortium.node(0), "g")
    # Act
    (reply,) = consortium.grid.send_and_receive([message])
    # Assert
    assert error_code(message_from_record(reply.content)) is ErrorCode.BAD_REQUEST
    settings = consortium.settings(0)
    assert not settings.ledger_file.exists() or consortium.ledger_state(0, "r1") is None
    assert all(path.name.startswith("site-") for path in consortium.tmp.iterdir())


def test_error_replies_never_quote_a_private_record(consortium: Consortium) -> None:
    # Arrange: site 0's manifest gets a broken line that quotes a "patient".
    manifest = consortium.settings(0).data_path / "manifest.jsonl"  # type: ignore[operator]
    original = manifest.read_text()
    manifest.write_text(original + '{"image": "patient-0042 malignant stage II"\n')
    try:
        # Act
        (reply,) = consortium.plan(make_plan(consortium.world), range(1))
    finally:
        manifest.write_text(original)
    # Assert
    assert error_code(reply) is ErrorCode.INSUFFICIENT_DATA
    assert "patient" not in reply.model_dump_json()
    assert "malignant" not in reply.model_dump_json()


# ---------------------------------------------------------------- contributions


def select_request(plan: ReleasePlan, **overrides: Any) -> SecureSumRequest:
    fields: dict[str, Any] = {
        "release_id": plan.release_id,
        "stage": "select",
        "heads": None,
        "clip_norm": plan.clip_norm,
        "score_top_r": plan.score_top_r,
    }
    fields.update(overrides)
    return SecureSumRequest(**fields)


def planned(consortium: Consortium, **overrides: Any) -> ReleasePlan:
    plan = make_plan(consortium.world, **overrides)
    replies = consortium.plan(plan)
    assert all(isinstance(reply, PlanAccept) for reply in replies), replies
    return plan


def test_one_plan_buys_one_contribution_per_stage(consortium: Consortium) -> None:
    # Arrange
    planned(consortium)
    first = consortium.secure_sum(extract_request())
    # Act: the same secure sum again (same plan, same stage), as a fresh first sum.
    second = consortium.secure_sum(extract_request(), new_agreement=True)
    # Assert
    assert first is not None
    assert len(first.survivors) == SITES
    assert second is None  # every site refused: nothing to unmask
    assert all(error_code(reply) is ErrorCode.STAGE_ORDER for reply in sum_replies(consortium))
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.EXPOSED
        assert consortium.services[index].site.records.require("r1").sent == ("extract",)


def test_a_later_sum_cannot_buy_a_second_contribution_to_a_stage(
    consortium: Consortium,
) -> None:
    # Arrange: a private plan runs two sums (votes, then activations); the votes are in.
    plan = planned(consortium, selection=SelectionMode.PRIVATE)
    assert consortium.secure_sum(select_request(plan)) is not None
    # Act: the second sum asks for the votes again.
    result = consortium.secure_sum(select_request(plan))
    # Assert
    assert result is None
    assert all(error_code(reply) is ErrorCode.STAGE_ORDER for reply in sum_replies(consortium))
    for index in range(SITES):
        assert consortium.services[index].site.records.require("r1").sent == ("select",)


def sum_replies(consortium: Consortium) -> list[Any]:
    """The replies of the latest collect round (first or later sum), one a site."""
    collects = [
        (stage, reply)
        for _, stage, reply in consortium.grid.replies
        if stage in ("query.sum_shares", "query.sum_collect")
    ]
    return [message_from_record(reply.content) for _, reply in collects[-SITES:]]


@pytest.mark.parametrize(
    ("forged", "code"),
    [
        # a larger clip norm breaks the sensitivity the plan priced
        ({"clip_norm": 100.0}, ErrorCode.PLAN_MISMATCH),
        ({"heads": ((0, 0),)}, ErrorCode.PLAN_MISMATCH),  # another head scope
        # a stage the plan (selection all) never runs
        ({"stage": "select", "score_top_r": 2}, ErrorCode.STAGE_ORDER),
    ],
)
def test_a_secure_sum_unlike_the_plan_gets_nothing(
    consortium: Consortium, forged: dict[str, Any], code: ErrorCode
) -> None:
    # Arrange
    planned(consortium)
    # Act
    result = consortium.secure_sum(extract_request(**forged))
    # Assert
    assert result is None
    assert [error_code(reply) for reply in sum_replies(consortium)] == [code] * SITES
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.RESERVED
        assert consortium.services[index].site.records.require("r1").sent == ()


def test_no_contribution_after_a_refund(consortium: Consortium) -> None:
    # Arrange: r1 refunded by an abort before any sum.
    planned(consortium)
    for index in range(SITES):
        consortium.ask(
            index, "query.abort", AbortNotice(release_id="r1", reason="x", noisy_output=False)
        )
    # Act
    result = consortium.secure_sum(extract_request())
    # Assert: the abort dropped the release's keys, so no site has a sum to join.
    assert result is None
    assert all(error_code(reply) is ErrorCode.STAGE_ORDER for reply in sum_replies(consortium))
    assert all(consortium.ledger_state(i, "r1") is ReleaseState.ABORTED for i in range(SITES))


def test_an_abort_notice_cannot_refund_what_already_left(consortium: Consortium) -> None:
    # Arrange: the sites' clipped sums went into a secure sum.
    planned(consortium)
    assert consortium.secure_sum(extract_request()) is not None
    # Act: the coordinator claims no noise was drawn, asking for a refund.
    notice = AbortNotice(release_id="r1", reason="no noise yet", noisy_output=False)
    replies = [consortium.ask(i, "query.abort", notice) for i in range(SITES)]
    # Assert
    assert all(isinstance(reply, AbortNotice) for reply in replies)
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.COMMITTED
        assert consortium.record_state(index, "r1") is SiteReleaseState.ABORTED


def test_an_abort_from_another_run_is_refused(consortium: Consortium) -> None:
    # Arrange: r1 planned in run 1; run 2 sends an abort for it.
    planned(consortium)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = 2
    # Act
    reply = consortium.ask(
        0, "query.abort", AbortNotice(release_id="r1", reason="x", noisy_output=False)
    )
    # Assert
    assert error_code(reply) is ErrorCode.STAGE_ORDER
    assert consortium.ledger_state(0, "r1") is ReleaseState.RESERVED


# ---------------------------------------------------------------- artifacts


def contributed(consortium: Consortium) -> ReleasePlan:
    plan = planned(consortium)
    assert consortium.secure_sum(extract_request()) is not None
    return plan


@pytest.mark.parametrize(
    "forgery",
    [
        "epsilon",
        "noise_std",
        "other-plan",
        "untrusted-key",
        "heads",
        "dtype",
        "prompt-template",
        "no-prompt-template",
        "instruction",
        "no-instruction",
    ],
)
def test_an_artifact_unlike_the_plan_is_refused_and_nothing_is_stored(
    consortium: Consortium, forgery: str
) -> None:
    # Arrange
    plan = contributed(consortium)
    world, tmp = consortium.world, consortium.tmp / "forged"
    tmp.mkdir()
    forged = {
        "epsilon": lambda: signed_request(world, tmp, plan, epsilon=0.01),
        "noise_std": lambda: signed_request(world, tmp, plan, noise_std=1e-9),
        "other-plan": lambda: signed_request(
            world, tmp, make_plan(world, epsilon=2.0), release_id="r1"
        ),
        "untrusted-key": lambda: signed_request(world, tmp, plan, key=SigningKey.generate()),
        "heads": lambda: signed_request(world, tmp, plan, heads=HeadSet.of([(0, 0)])),
        "dtype": lambda: signed_request(world, tmp, plan, model_dtype="bfloat16"),
        "prompt-template": lambda: signed_request(
            world, tmp, plan, prompt_template_sha256="0" * 64
        ),
        "no-prompt-template": lambda: signed_request(world, tmp, plan, prompt_template_sha256=None),
        "instruction": lambda: signed_request(
            world, tmp, plan, instruction_sha256=instruction_digest("Answer with one word.")
        ),
        "no-instruction": lambda: signed_request(world, tmp, plan, instruction_sha256=None),
    }[forgery]()
    # Act
    reply = consortium.ask(0, "query.release", forged)
    # Assert
    assert isinstance(reply, ErrorReply)
    assert not (consortium.settings(0).artifacts_folder / "r1").exists()
    assert consortium.ledger_state(0, "r1") is ReleaseState.EXPOSED
    assert consortium.record_state(0, "r1") is SiteReleaseState.CONTRIBUTED


def test_an_artifact_stamped_for_another_model_is_never_stored_and_its_ledger_not_committed(
    consortium: Consortium, caplog: pytest.LogCaptureFixture
) -> None:
    # Arrange: the plan's own artifact, validly signed, every field right but the model it
    # names (a vector no site of this model could ever apply).
    plan = contributed(consortium)
    forged = signed_request(
        consortium.world, consortium.tmp, plan, model_fingerprint="sha256:" + "1" * 64
    )
    # Act
    with caplog.at_level(logging.WARNING, logger="client.service.server"):
        reply = consortium.ask(0, "query.release", forged)
    # Assert: the model check at storing refused it (its own words in the site's log) ...
    assert isinstance(reply, ErrorReply)
    assert "the artifact was made for another model" in caplog.text
    assert not (consortium.settings(0).artifacts_folder / "r1").exists()
    # ... and storing it committed nothing: the ledger stays exposed, as before the artifact.
    assert consortium.ledger_state(0, "r1") is ReleaseState.EXPOSED
    assert consortium.record_state(0, "r1") is SiteReleaseState.CONTRIBUTED
    # The release is then settled by the site's own record, never by the artifact: its
    # clipped sum went into a secure sum, so it counts whether or not a usable vector came.
    notice = AbortNotice(release_id="r1", reason="no usable artifact", noisy_output=False)
    assert isinstance(consortium.ask(0, "query.abort", notice), AbortNotice)
    assert consortium.ledger_state(0, "r1") is ReleaseState.COMMITTED


def test_the_plan_hash_alone_refuses_an_artifact_of_a_plan_unlike_the_accepted_one(
    consortium: Consortium, caplog: pytest.LogCaptureFixture
) -> None:
    # Arrange: a plan that differs from the accepted one only where no other check looks
    # (its timestamp and task name): same id, ε, δ, C, K, heads, unit and digests, so ε and
    # σ recompute identically and the plan hash is the one check that can refuse it.
    plan = contributed(consortium)
    other = make_plan(consortium.world, created="2001-01-01T00:00:00+00:00", task="other-task")
    assert (other.epsilon, other.clip_norm, other.shots) == (plan.epsilon, plan.clip_norm, 2)
    forged = signed_request(consortium.world, consortium.tmp, other)
    # Act
    with caplog.at_level(logging.WARNING, logger="client.service.server"):
        reply = consortium.ask(0, "query.release", forged)
    # Assert
    assert isinstance(reply, ErrorReply)
    assert "artifact plan_hash must be the accepted plan's" in caplog.text
    assert not (consortium.settings(0).artifacts_folder / "r1").exists()
    assert consortium.ledger_state(0, "r1") is ReleaseState.EXPOSED


def test_the_plan_s_own_artifact_is_stored_once_and_commits(consortium: Consortium) -> None:
    plan = contributed(consortium)
    request = signed_request(consortium.world, consortium.tmp, plan)
    # Act
    first = consortium.ask(0, "query.release", request)
    again = consortium.ask(0, "query.release", request)
    # Assert
    assert isinstance(first, ReleaseAck)
    assert error_code(again) is ErrorCode.STAGE_ORDER
    assert consortium.ledger_state(0, "r1") is ReleaseState.COMMITTED
    assert (consortium.settings(0).artifacts_folder / "r1" / MANIFEST_FILE).is_file()
    # and no secure sum after the release: every site finishes, then one more is asked
    for index in (1, 2):
        assert isinstance(consortium.ask(index, "query.release", request), ReleaseAck)
    assert consortium.secure_sum(extract_request(), new_agreement=True) is None
    assert all(error_code(reply) is ErrorCode.STAGE_ORDER for reply in sum_replies(consortium))


def test_a_site_that_never_contributed_refunds_when_the_artifact_comes(
    consortium: Consortium,
) -> None:
    plan = planned(consortium)
    reply = consortium.ask(
        0, "query.release", signed_request(consortium.world, consortium.tmp, plan)
    )
    assert isinstance(reply, ReleaseAck)
    assert consortium.ledger_state(0, "r1") is ReleaseState.ABORTED  # nothing of it left


# ---------------------------------------------------------------- what the relay sees


def test_the_relay_sees_masked_integers_never_the_clipped_sum(consortium: Consortium) -> None:
    # Arrange: record every reply that passes through the grid (the relay's view).
    planned(consortium)
    # Act
    result = consortium.secure_sum(extract_request())
    # Assert: the sum is right, yet each site's masked input looks uniform mod M.
    assert result is not None
    collect = [r for _, stage, r in consortium.grid.replies if stage == "query.sum_shares"]
    assert len(collect) == SITES
    modulus_bits = ranges_for(64.0, SITES).modulus_range.bit_length() - 1
    for reply in collect:
        masked = np.asarray(
            array_from_record(reply.content, MASKED_ARRAY_KEY, dtype="int64"), dtype=np.int64
        )
        # Masks uniform on [0, M) make the top byte uniform over 256 values; an unmasked
        # quantised value lies in [0, Q], Q = 2^30 = M / 2^32, so its top byte is 0.
        # 129 uniform values put 13 or more in one bin with probability < 1e-12.
        top_byte = (masked >> (modulus_bits - 8)) & 0xFF
        counts = np.bincount(top_byte, minlength=256)
        assert counts.max() < 13


def test_the_relay_never_carries_the_site_s_paths(consortium: Consortium) -> None:
    planned(consortium)
    consortium.secure_sum(extract_request())
    from flwr.common.serde import message_to_proto

    wire = b"".join(
        message_to_proto(message).SerializeToString() for _, _, message in consortium.grid.replies
    )
    for index in range(SITES):
        settings = consortium.settings(index)
        for secret in (settings.data_path, settings.ledger_file, settings.state_dir):
            assert str(secret).encode() not in wire


# ---------------------------------------------------------------- secure-sum policy


def test_a_secure_sum_over_fewer_sites_than_the_site_s_minimum_is_refused(
    consortium: Consortium,
) -> None:
    # Arrange: every site accepted a plan of min-sites 3 (each site's own minimum is 3).
    planned(consortium)
    # Act: the coordinator runs the sum over two of them (two advertisements).
    result = consortium.secure_sum(extract_request(), sites=2)
    # Assert: both refused when they saw the advertisements, before any data left.
    assert result is None
    answers = consortium.answers("query.sum_shares")
    assert sorted(answers) == [consortium.node(0), consortium.node(1)]
    assert all(error_code(answer) is ErrorCode.POLICY for answer in answers.values())
    for index in range(2):
        assert consortium.ledger_state(index, "r1") is ReleaseState.RESERVED
        assert consortium.services[index].site.records.require("r1").sent == ()


def test_a_site_sends_its_exact_clipped_sum_and_no_noise_of_its_own(
    consortium: Consortium,
) -> None:
    # Arrange: in central mode the coordinator adds the one noise draw; a site that added its
    # own would change the sum (and the accounting). Recompute each site's contribution from
    # its secret chunk seed with the production extraction.
    from client.activations.chunking import make_chunks
    from client.data.records import load_dataset
    from client.release.single_holder import LocalSums

    plan = planned(consortium)
    seeds = [service.site.seeds["r1"] for service in consortium.services]
    all_heads = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    expected = np.zeros(len(all_heads) * HEAD_DIM)
    for service, seed in zip(consortium.services, seeds, strict=True):
        data = service.settings.data_path
        assert data is not None
        chunks = make_chunks(load_dataset(data), shots=SHOTS, seed=seed).chunks
        sums = LocalSums(service.site.model(), chunks, plan, progress=False)
        expected += sums.activation_sum(all_heads).total.ravel()
    # Act
    result = consortium.secure_sum(extract_request())
    # Assert: equal up to the grid's rounding (3 sites x c/Q = 3 x 64 / 2^30 < 1e-6).
    assert result is not None
    np.testing.assert_allclose(result.total[:-1], expected, rtol=0, atol=1e-6)


def test_a_record_that_breaks_after_the_plan_costs_its_chunk_not_the_site(
    consortium: Consortium,
) -> None:
    # Arrange: every record decoded when site 0 accepted; then one of its images is truncated.
    planned(consortium)
    data = consortium.settings(0).data_path
    assert data is not None
    image = sorted((data / "images").glob("*.png"))[0]
    original = image.read_bytes()
    image.write_bytes(original[: len(original) // 3])
    try:
        # Act
        result = consortium.secure_sum(extract_request())
    finally:
        image.write_bytes(original)
    # Assert: all three sites are in the sum and m is the planned 3 x 5 (the broken record's
    # chunk contributed zeros; which sites take part never depends on a record's content).
    assert result is not None
    assert len(result.survivors) == SITES
    assert round(float(result.total[-1])) == SITES * M_I


def test_a_record_broken_before_the_plan_costs_its_chunk_not_the_site(
    consortium: Consortium,
) -> None:
    # Arrange: one of site 0's images is truncated before the plan arrives.
    data = consortium.settings(0).data_path
    assert data is not None
    image = sorted((data / "images").glob("*.png"))[0]
    original = image.read_bytes()
    image.write_bytes(original[: len(original) // 3])
    try:
        # Act
        planned(consortium)  # every site accepts: the plan stage lists records, never decodes
        result = consortium.secure_sum(extract_request())
    finally:
        image.write_bytes(original)
    # Assert: whether a site takes part, and m, never depend on one record's content.
    assert result is not None
    assert len(result.survivors) == SITES
    assert round(float(result.total[-1])) == SITES * M_I


def test_the_service_start_check_refuses_a_broken_record_in_one_line(
    consortium: Consortium,
) -> None:
    # Arrange
    data = consortium.settings(1).data_path
    assert data is not None
    image = sorted((data / "images").glob("*.png"))[0]
    original = image.read_bytes()
    image.write_bytes(original[: len(original) // 3])
    try:
        # Act / Assert: the admin learns at start, before any plan could depend on it
        with pytest.raises(DataError, match=r"got 1 of \d+ records unusable .*1 unreadable"):
            consortium.services[1].site.check_data()
    finally:
        image.write_bytes(original)
    assert len(consortium.services[1].site.check_data()) > 0


def test_a_release_is_idle_only_when_its_run_sends_nothing(consortium: Consortium) -> None:
    # Arrange: r1's record last changed long ago (e.g. waiting for the slowest site's sum).
    planned(consortium)
    site = consortium.services[0].site
    record = site.records.require("r1")
    site.records.save(record.model_copy(update={"updated": "2000-01-01T00:00:00+00:00"}))
    # Act / Assert: a message of its run a moment ago keeps it open...
    site.touch(record.run_id)
    assert site.sweep() == []
    # ...and without any message since its last change, the site resolves it by itself.
    site.last_seen.clear()
    assert site.sweep() == ["r1"]
    assert consortium.ledger_state(0, "r1") is ReleaseState.ABORTED


def test_a_release_the_site_resolved_by_itself_leaves_no_secure_sum_keys(
    consortium: Consortium,
) -> None:
    # Arrange: an accepted plan holds the release's key agreement in the service's memory
    planned(consortium)
    service = consortium.services[0]
    assert "r1" in service.sums.sessions
    record = service.site.records.require("r1")
    service.site.records.save(record.model_copy(update={"updated": "2000-01-01T00:00:00+00:00"}))
    service.site.last_seen.clear()
    # Act: the service's periodic sweep resolves it (no release or abort message comes)
    service.sweep()
    # Assert
    assert consortium.ledger_state(0, "r1") is ReleaseState.ABORTED
    assert "r1" not in service.sums.sessions


def test_a_release_first_artifact_must_carry_the_noisy_vector_the_site_was_sent(
    consortium: Consortium,
) -> None:
    # Arrange: a private release-first plan; the select sum carried the noisy vector.
    plan = planned(consortium, selection=SelectionMode.PRIVATE, order=ReleaseOrder.RELEASE_FIRST)
    assert consortium.secure_sum(extract_request()) is not None
    all_heads = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    reference = np.random.default_rng(0).normal(size=(NUM_LAYERS, NUM_HEADS, HEAD_DIM))
    select = select_request(plan, reference_heads=all_heads.heads)
    assert consortium.secure_sum(select, reference=reference) is not None
    heads = HeadSet.of([(0, 1), (1, 2)])
    tmp = consortium.tmp / "forged"
    tmp.mkdir()
    # Act: an artifact whose values are not the rows it was sent (zeros), then the right one.
    forged = consortium.ask(
        0, "query.release", signed_request(consortium.world, tmp, plan, heads=heads)
    )
    rows = reference.reshape(-1, HEAD_DIM)[[0 * NUM_HEADS + 1, 1 * NUM_HEADS + 2]]
    honest = signed_request(consortium.world, tmp, plan, heads=heads, values=rows)
    accepted = consortium.ask(0, "query.release", honest)
    # Assert
    assert error_code(forged) is ErrorCode.PLAN_MISMATCH
    assert isinstance(accepted, ReleaseAck)


@pytest.mark.parametrize(
    ("order", "names_heads", "arrays", "code"),
    [
        # a vector the request does not name
        (ReleaseOrder.RELEASE_FIRST, False, "one", ErrorCode.PLAN_MISMATCH),
        (ReleaseOrder.RELEASE_FIRST, True, "none", ErrorCode.PLAN_MISMATCH),  # named, not sent
        (ReleaseOrder.RELEASE_FIRST, True, "two", ErrorCode.BAD_REQUEST),  # named, sent twice
        # not the float64 the site scores
        (ReleaseOrder.RELEASE_FIRST, True, "float32", ErrorCode.BAD_REQUEST),
        (ReleaseOrder.RELEASE_FIRST, True, "wrong-shape", ErrorCode.PLAN_MISMATCH),
        # select-first plans score no vector, nor carry arrays the request does not name
        (ReleaseOrder.SELECT_FIRST, True, "one", ErrorCode.BAD_REQUEST),
        (ReleaseOrder.SELECT_FIRST, False, "one", ErrorCode.BAD_REQUEST),
    ],
)
def test_a_select_sum_carries_exactly_the_noisy_vector_the_plan_calls_for(
    consortium: Consortium, order: ReleaseOrder, names_heads: bool, arrays: str, code: ErrorCode
) -> None:
    # Arrange: a private plan; in release-first order the extract sum already ran.
    plan = planned(consortium, selection=SelectionMode.PRIVATE, order=order)
    if order is ReleaseOrder.RELEASE_FIRST:
        assert consortium.secure_sum(extract_request()) is not None
    all_heads = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    reference = np.random.default_rng(1).normal(size=(NUM_LAYERS, NUM_HEADS, HEAD_DIM))
    choices: dict[str, tuple[np.ndarray, ...]] = {
        "one": (reference,),
        "none": (),
        "two": (reference, reference),
        "float32": (reference.astype(np.float32),),
        "wrong-shape": (reference[:, :1],),
    }
    sent = choices[arrays]
    request = select_request(plan, reference_heads=all_heads.heads if names_heads else None)
    for message_type in ("query.sum_shares", "query.sum_collect"):
        consortium.grid.edits[message_type] = lambda record: attach_arrays(record, sent)
    # Act
    result = consortium.secure_sum(request)
    # Assert: every site refused (no sum), kept no vector and voted nothing.
    assert result is None
    assert [error_code(reply) for reply in sum_replies(consortium)] == [code] * SITES
    for index in range(SITES):
        record = consortium.services[index].site.records.require(plan.release_id)
        assert "select" not in record.sent
        assert record.reference_sha256 is None


def attach_arrays(record: RecordDict, arrays: tuple[np.ndarray, ...]) -> None:
    """Put ``arrays`` (flattened, dtype kept) beside a sum request, as the noisy vector."""
    if len(arrays) == 1 and arrays[0].dtype == np.float64:
        with_array(record, REFERENCE_ARRAY_KEY, arrays[0].ravel())
    elif arrays:  # what with_array itself would refuse to build: another dtype, or two
        names = [REFERENCE_ARRAY_KEY, *(f"{REFERENCE_ARRAY_KEY}-{i}" for i in range(1, 9))]
        record[REFERENCE_ARRAY_KEY] = ArrayRecord(
            {
                name: Array(np.ascontiguousarray(a.ravel()))
                for name, a in zip(names, arrays, strict=False)
            }
        )


def made_up_advert(
    member: str,
    node_id: int,
    *,
    identity: SigningKey | None = None,
    release_id: str = "r1",
    roster_sha256: str = "0" * 64,
) -> KeyAdvert:
    """A key advertisement signed by ``identity`` (a fresh key unless given) for ``member``."""
    identity = identity or SigningKey.generate()
    fields: dict[str, Any] = {
        "member": member,
        "node_id": node_id,
        "release_id": release_id,
        "roster_sha256": roster_sha256,
        "public_key": AgreementKey.generate().public_bytes,
        "nonce_commitment": bytes(32),
    }
    return KeyAdvert(**fields, signature=identity.sign(advert_signed_bytes(**fields)))


def test_a_plan_acceptance_carries_the_site_s_signed_key_and_the_sum_runs_on_it(
    consortium: Consortium,
) -> None:
    # Arrange
    plan = make_plan(consortium.world)
    roster = Roster.load(consortium.settings(0).roster)  # type: ignore[arg-type]
    # Act: the plan (each acceptance carries the site's key), then the sum on those keys.
    accepts = consortium.plan(plan)
    states = [consortium.ledger_state(i, "r1") for i in range(SITES)]
    result = consortium.secure_sum(extract_request())
    # Assert: each acceptance carried the site's key for this release, signed with its roster
    # identity; reserved before any data left; then every site in the sum.
    for index, accept in enumerate(accepts):
        assert isinstance(accept, PlanAccept)
        assert accept.num_chunks == M_I
        keys = accept.keys
        assert keys is not None
        assert (keys.member, keys.node_id, keys.release_id, keys.roster_sha256) == (
            f"site-{index}",
            consortium.node(index),
            "r1",
            roster.fingerprint,
        )
        roster.verify(keys.member, keys.signed_bytes(), keys.signature)
    assert states == [ReleaseState.RESERVED] * SITES
    assert result is not None
    assert len(result.survivors) == SITES
    assert round(float(result.total[-1])) == SITES * M_I
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.EXPOSED


def test_a_plan_refused_reserves_nothing_and_keeps_the_site_out_of_the_sum(
    consortium: Consortium,
) -> None:
    # Arrange: above every site's per-release cap of epsilon 8.
    plan = make_plan(consortium.world, epsilon=50.0)
    # Act: the plan, then a first sum all the same, over keys the coordinator made up.
    accepts = consortium.plan(plan)
    request = SumSharesRequest(
        release_id="r1",
        adverts=[made_up_advert(f"site-{i}", consortium.node(i)) for i in range(SITES)],
        nonces=[],
        instructions=SumInstructions(
            sum_index=0, request=extract_request(), ranges=ranges_for(64.0, SITES)
        ),
    )
    answers = [consortium.ask(i, "query.sum_shares", request) for i in range(SITES)]
    # Assert: no accept, no key, no sum to join, no reservation and no record anywhere.
    assert all(error_code(accept) is ErrorCode.POLICY for accept in accepts)
    assert consortium.adverts == {}
    assert all(error_code(answer) is ErrorCode.STAGE_ORDER for answer in answers)
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is None
        assert consortium.record_state(index, "r1") is None


def test_private_picks_outside_the_plan_s_candidate_heads_get_nothing(
    consortium: Consortium,
) -> None:
    # Arrange: a private select-first plan whose picks must come from three public candidates
    plan = planned(
        consortium,
        selection=SelectionMode.PRIVATE,
        candidate_heads=((0, 0), (0, 1), (1, 0)),
    )
    assert consortium.secure_sum(select_request(plan)) is not None
    # Act: the coordinator asks for the activations of heads it was not allowed to pick
    result = consortium.secure_sum(extract_request(heads=((0, 0), (1, 1))))
    # Assert: no site sends them; each has sent only its votes
    assert result is None
    for index in range(SITES):
        assert consortium.services[index].site.records.require("r1").sent == ("select",)
