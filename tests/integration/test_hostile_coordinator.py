"""A hostile coordinator against real site services: what it asks for, and what it gets.

Each test plays the coordinator by hand — crafted plans, secure sums, notices and artifacts
sent through ``InProcessGrid`` to real relays and real site services (tiny random LLaVA,
L = 2, H = 4, D = 16; three sites of 15 records, K = 2, so m_i = 5) — and checks that the
site refuses with a typed, fixed-text error and loses nothing: no budget refunded after its
data left, nothing stored or deleted outside its own folder, no second contribution.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from client.models import load_model, prompt_template_digest, save_tiny_model
from client.release_record import SiteReleaseState
from client.service.inprocess import open_in_process_sites
from client.service.server import SiteService
from client.settings import SiteSettings
from client.synthetic import write_task_datasets
from dpmtv_common.artifact import MANIFEST_FILE, SIGNATURE_FILE, TENSORS_FILE, write_artifact
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import DataError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from protocol import (
    MESSAGE_RECORD_KEY,
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
    secure_sum_request_to_config,
)
from server.secagg import SecureSumRound, SecureSumSettings, install_secure_mask_prg, secure_sum
from server.simulation import (
    FIRST_NODE_ID,
    InProcessGrid,
    make_server_context,
    set_task_identity,
)
from tests.flower_harness import flower_process_state

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


@dataclass
class Consortium:
    """Three site services behind relays, and a grid the hostile coordinator drives."""

    world: World
    tmp: Path
    services: list[SiteService]
    grid: InProcessGrid
    rounds: int = 0
    modulus_bits: int = 0

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
        return [self.ask(i, "query.plan", PlanRequest(plan=plan)) for i in sites]

    def secure_sum(
        self,
        request: SecureSumRequest,
        *,
        sites: int = SITES,
        threshold: float = 0.67,
        broadcast: tuple[np.ndarray, ...] = (),
    ):
        self.rounds += 1
        settings = SecureSumSettings.for_plan(
            max_abs_coordinate=64.0,
            max_sites=sites,
            timeout=30.0,
            reconstruction_threshold=threshold,
        )
        self.modulus_bits = int(settings.modulus_range).bit_length() - 1
        return secure_sum(
            self.grid,
            make_server_context(),
            [self.node(i) for i in range(sites)],
            secure_sum_request_to_config(request),
            round_id=self.rounds,
            settings=settings,
            min_sites=2,
            broadcast=broadcast,
        )

    def ledger_state(self, index: int, release_id: str) -> ReleaseState | None:
        settings = self.settings(index)
        with PrivacyLedger.open(settings.ledger_file, settings.budget) as ledger:
            states = {entry.release_id: entry.state for entry in ledger.releases()}
        return states.get(release_id)

    def record_state(self, index: int, release_id: str) -> SiteReleaseState | None:
        record = self.services[index].site.records.get(release_id)
        return None if record is None else record.state


@pytest.fixture
def consortium(world: World, tmp_path: Path) -> Iterator[Consortium]:
    settings = [
        SiteSettings(
            name=f"site-{i}",
            model_path=world.model,
            data_path=world.root / "data" / f"site-{i}",
            state_dir=tmp_path / f"site-{i}",
            trusted_keys=(world.verify_key,),
            device="cpu",
            min_sites=3,
        )
        for i in range(SITES)
    ]
    with flower_process_state():
        install_secure_mask_prg()
        sites = open_in_process_sites(settings)
        grid = InProcessGrid(sites.relays, num_nodes=SITES)
        yield Consortium(world, tmp_path, sites.services, grid)


def make_plan(world: World, release_id: str = "r1", **overrides: Any) -> ReleasePlan:
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "release_id": release_id,
        "task": "colour",
        "model_fingerprint": world.fingerprint,
        "epsilon": 1.0,
        "delta": 1e-5,
        "shots": SHOTS,
        "clip_norm": 1.0,
        "selection": SelectionMode.ALL,
        "order": ReleaseOrder.SELECT_FIRST,
        "num_selected_heads": 2,
        "public_heads": None,
        "selection_share": 0.3,
        "score_top_r": 2,
        "min_sites": 3,
        "max_chunks_per_site": None,
        "created": datetime.now(UTC).isoformat(),
    }
    fields.update(overrides)
    return ReleasePlan(**fields)


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
    values: np.ndarray | None = None,
) -> ReleaseRequest:
    """An artifact as a coordinator would sign it; fields may be forged.

    ``prompt_template_sha256`` left empty is the sites' own digest; None leaves it out.
    """
    from dpmtv_common.artifact import ReleaseDescription

    calibration = plan_calibration(plan)
    scope = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    sigma = calibration.gaussian(clip_norm=plan.clip_norm, heads=scope).noise_std
    released = heads or scope
    description = ReleaseDescription(
        protocol_version=PROTOCOL_VERSION,
        release_id=release_id or plan.release_id,
        model_fingerprint=plan.model_fingerprint,
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
    # Act: the same secure sum again (same plan, same stage).
    second = consortium.secure_sum(extract_request())
    # Assert
    assert first is not None
    assert first.num_sites == SITES
    assert second is None  # every site refused: nothing to unmask
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.EXPOSED
        assert consortium.services[index].site.records.require("r1").sent == ("extract",)


@pytest.mark.parametrize(
    "forged",
    [
        {"clip_norm": 100.0},  # a larger clip norm breaks the sensitivity the plan priced
        {"heads": ((0, 0),)},  # another head scope
        {"stage": "select", "score_top_r": 2},  # a stage the plan (selection all) never runs
    ],
)
def test_a_secure_sum_unlike_the_plan_gets_nothing(
    consortium: Consortium, forged: dict[str, Any]
) -> None:
    planned(consortium)
    result = consortium.secure_sum(extract_request(**forged))
    assert result is None
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
    # Act / Assert
    assert consortium.secure_sum(extract_request()) is None
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
    }[forgery]()
    # Act
    reply = consortium.ask(0, "query.release", forged)
    # Assert
    assert isinstance(reply, ErrorReply)
    assert not (consortium.settings(0).artifacts_folder / "r1").exists()
    assert consortium.ledger_state(0, "r1") is ReleaseState.EXPOSED
    assert consortium.record_state(0, "r1") is SiteReleaseState.CONTRIBUTED


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
    assert consortium.secure_sum(extract_request()) is None


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
    # Assert: the sum is right, yet each site's collect reply looks uniform mod M.
    assert result is not None
    collect = [r for _, stage, r in consortium.grid.replies if stage == "collect_masked_vectors"]
    assert len(collect) == SITES
    for reply in collect:
        masked = _masked_vector(reply)
        # Masks uniform on [0, M) make the top byte uniform over 256 values; an unmasked
        # quantised value lies in [0, Q], Q = M/4, around Q/2, so its top byte sits in a few
        # bins. 129 uniform values put 13 or more in one bin with probability < 1e-12.
        top_byte = (masked >> (consortium.modulus_bits - 8)) & 0xFF
        counts = np.bincount(top_byte, minlength=256)
        assert counts.max() < 13


def _masked_vector(reply: Message) -> np.ndarray:
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    masked = reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
    assert isinstance(masked, list)
    first = masked[0]
    assert isinstance(first, bytes)
    return bytes_to_ndarray(first).astype(np.int64)


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


# ---------------------------------------------------------------- SecAgg+ policy


def _setup_message(sample: int, shares: int, threshold: int) -> Message:
    from flwr.app import ConfigRecord
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    configs = ConfigRecord(
        {
            Key.STAGE: "setup",
            Key.SAMPLE_NUMBER: sample,
            Key.SHARE_NUMBER: shares,
            Key.THRESHOLD: threshold,
        }
    )
    return Message(RecordDict({RECORD_KEY_CONFIGS: configs}), dst_node_id=1, message_type="train")


@pytest.mark.parametrize(
    ("sample", "shares", "threshold", "allowed"),
    [
        (3, 3, 2, True),  # Flower's 0.67 of 3
        (5, 5, 3, True),  # round(0.67 * 5)
        (5, 5, 2, False),  # 1/3 of 5, raised to Flower's floor of 2: a minority rebuilds
        (10, 10, 7, True),
        (10, 10, 3, False),
        (10, 10, 11, False),  # more shares than exist: nobody could ever unmask
        (2, 2, 2, False),  # fewer sites than the site's minimum of 3
    ],
)
def test_secagg_setup_weaker_than_the_site_policy_is_refused(
    sample: int, shares: int, threshold: int, allowed: bool
) -> None:
    from client.service.handlers import secagg_policy_mod
    from dpmtv_common.errors import PolicyError

    mod = secagg_policy_mod(SiteSettings(state_dir=Path("/nonexistent"), min_sites=3))
    with flower_process_state():
        set_task_identity()
        message = _setup_message(sample, shares, threshold)
    if allowed:
        assert mod(message, None, lambda m, c: m) is message  # type: ignore[arg-type]
    else:
        with pytest.raises(PolicyError):
            mod(message, None, lambda m, c: m)  # type: ignore[arg-type]


def test_a_secure_sum_over_fewer_sites_than_the_site_s_minimum_is_refused(
    consortium: Consortium,
) -> None:
    planned(consortium)
    result = consortium.secure_sum(extract_request(), sites=2)
    assert result is None
    assert consortium.ledger_state(0, "r1") is ReleaseState.RESERVED


def test_unmask_lists_naming_a_node_both_active_and_dropped_are_refused() -> None:
    from flwr.app import ConfigRecord
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    from client.service.handlers import secagg_policy_mod
    from dpmtv_common.errors import PolicyError

    configs = ConfigRecord(
        {Key.STAGE: "unmask", Key.ACTIVE_NODE_ID_LIST: [1, 2], Key.DEAD_NODE_ID_LIST: [2]}
    )
    mod = secagg_policy_mod(SiteSettings(state_dir=Path("/nonexistent")))
    with flower_process_state():
        set_task_identity()
        message = Message(
            RecordDict({RECORD_KEY_CONFIGS: configs}), dst_node_id=1, message_type="train"
        )
        with pytest.raises(PolicyError, match="disjoint"):
            mod(message, None, lambda m, c: m)  # type: ignore[arg-type]


def test_a_site_sends_its_exact_clipped_sum_and_no_noise_of_its_own(
    consortium: Consortium,
) -> None:
    # Arrange: in central mode the coordinator adds the one noise draw; a site that added its
    # own would change the sum (and the accounting). Recompute each site's contribution from
    # its secret chunk seed with the production extraction.
    from client.chunking import make_chunks
    from client.data import load_dataset
    from client.release import LocalSums

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
    # Assert: equal up to SecAgg+'s quantisation (3 sites x 2c/Q = 3 x 128 / 2^30 < 1e-6).
    assert result is not None
    np.testing.assert_allclose(result.arrays[0], expected, rtol=0, atol=1e-6)


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
    assert result.num_sites == SITES
    assert round(float(result.arrays[1][0])) == SITES * M_I


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
    assert result.num_sites == SITES
    assert round(float(result.arrays[1][0])) == SITES * M_I


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


def test_a_release_first_artifact_must_carry_the_noisy_vector_the_site_was_sent(
    consortium: Consortium,
) -> None:
    # Arrange: a private release-first plan; the select sum carried the noisy vector.
    plan = planned(consortium, selection=SelectionMode.PRIVATE, order=ReleaseOrder.RELEASE_FIRST)
    assert consortium.secure_sum(extract_request()) is not None
    all_heads = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    reference = np.random.default_rng(0).normal(size=(NUM_LAYERS, NUM_HEADS, HEAD_DIM))
    select = select_request(plan, reference_heads=all_heads.heads)
    assert consortium.secure_sum(select, broadcast=(reference,)) is not None
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
    ("order", "names_heads", "arrays"),
    [
        (ReleaseOrder.RELEASE_FIRST, False, "one"),  # a vector the request does not name
        (ReleaseOrder.RELEASE_FIRST, True, "none"),  # named, but not sent
        (ReleaseOrder.RELEASE_FIRST, True, "two"),  # named, sent twice
        (ReleaseOrder.RELEASE_FIRST, True, "float32"),  # not the float64 the site scores
        (ReleaseOrder.RELEASE_FIRST, True, "wrong-shape"),
        (ReleaseOrder.SELECT_FIRST, True, "one"),  # select-first plans score no vector
        (ReleaseOrder.SELECT_FIRST, False, "one"),  # nor carry arrays the request does not name
    ],
)
def test_a_select_sum_carries_exactly_the_noisy_vector_the_plan_calls_for(
    consortium: Consortium, order: ReleaseOrder, names_heads: bool, arrays: str
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
    # Act
    result = consortium.secure_sum(request, broadcast=sent)
    # Assert: every site refused (no sum), kept no vector and voted nothing.
    assert result is None
    for index in range(SITES):
        record = consortium.services[index].site.records.require(plan.release_id)
        assert "select" not in record.sent
        assert record.reference_sha256 is None


def setup_round(
    consortium: Consortium, plan: ReleasePlan, *, sites: int = SITES
) -> tuple[SecureSumRound, dict[int, Any]]:
    """A secure sum whose SecAgg+ setup message carries ``plan`` (what the coordinator sends)."""
    consortium.rounds += 1
    settings = SecureSumSettings.for_plan(max_abs_coordinate=64.0, max_sites=sites, timeout=30.0)
    sum_round = SecureSumRound.open(
        consortium.grid,
        make_server_context(),
        [consortium.node(i) for i in range(sites)],
        round_id=consortium.rounds,
        settings=settings,
        min_sites=2,
    )
    record = message_to_record(PlanRequest(plan=plan)).config_records[MESSAGE_RECORD_KEY]
    replies = sum_round.setup((MESSAGE_RECORD_KEY, record))
    decoded = {
        node: message_from_record(RecordDict({MESSAGE_RECORD_KEY: reply}))
        for node, reply in replies.items()
        if reply is not None
    }
    return sum_round, decoded


def test_a_plan_riding_on_the_secagg_setup_is_accepted_then_summed_in_that_round(
    consortium: Consortium,
) -> None:
    # Arrange
    plan = make_plan(consortium.world)
    # Act: setup (with the plan), then the rest of the same secure sum.
    sum_round, accepts = setup_round(consortium, plan)
    states = [consortium.ledger_state(i, "r1") for i in range(SITES)]
    result = sum_round.finish(secure_sum_request_to_config(extract_request()))
    # Assert: each reply carried the site's PlanAccept; reserved before any data left.
    assert sorted(accepts) == [consortium.node(i) for i in range(SITES)]
    assert all(isinstance(a, PlanAccept) and a.num_chunks == M_I for a in accepts.values())
    assert states == [ReleaseState.RESERVED] * SITES
    assert result is not None
    assert result.num_sites == SITES
    assert round(float(result.arrays[1][0])) == SITES * M_I
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is ReleaseState.EXPOSED


def test_a_plan_refused_at_setup_reserves_nothing_and_keeps_the_site_out_of_the_sum(
    consortium: Consortium,
) -> None:
    # Arrange: above every site's per-release cap of epsilon 8.
    plan = make_plan(consortium.world, epsilon=50.0)
    # Act
    sum_round, accepts = setup_round(consortium, plan)
    # Assert: no accept, no site left in the sum, no reservation and no record anywhere.
    assert accepts == {}
    assert sum_round.active_sites == set()
    assert sum_round.finish(secure_sum_request_to_config(extract_request())) is None
    for index in range(SITES):
        assert consortium.ledger_state(index, "r1") is None
        assert consortium.record_state(index, "r1") is None


def test_secagg_parameters_below_the_site_policy_refuse_the_setup_before_the_plan(
    consortium: Consortium,
) -> None:
    # Arrange: a plan every site accepts (min-sites 3), riding on a two-site SecAgg+ setup,
    # below every site's minimum of three.
    plan = make_plan(consortium.world)
    # Act
    _, accepts = setup_round(consortium, plan, sites=2)
    # Assert: the SecAgg+ policy refused first, so the plan reserved nothing.
    assert accepts == {}
    for index in range(2):
        assert consortium.ledger_state(index, "r1") is None


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
