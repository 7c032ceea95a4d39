"""A hostile coordinator against real site services at any size, and what it gets from them.

:class:`HostileWorld` runs the honest roster members as real site services
(``client.service.SiteService``: handlers, plan policy, release record, ledger, secure-sum
session), each behind its real relay on an ``InProcessGrid``, and plays the coordinator: it
sends any message it likes, in any order, to any of them. The colluding roster members are
the coordinator's own: it holds their identity keys and runs their ``SiteSumSession`` itself
(any key, any nonce, any signature). Only the site's model forward pass is replaced
(``Site._compute`` returns a fixed vector per site with its true chunk count): what these
tests ask is who can unmask what, not what activations are.

Everything a site answers is recorded as the coordinator holds it, and, for the oracle
(``tests.unmask_oracle``), what the answering site really masked with (read from its session
at that moment). :meth:`HostileWorld.check` asserts the invariants after any step:

* no group of fewer honest sites than one of its members' minimum can be unmasked;
* every honest site that revealed for a sum revealed for one and the same survivor set;
* no refund after exposure: a site whose masked input left counts the release, and every
  record stands beside its ledger entry as ``client.release.states`` says.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from flwr.app import RecordDict

from client.release.states import in_step
from client.secure_sum import SiteSumSession
from client.service.inprocess import open_in_process_sites
from client.service.server import SiteService
from client.settings import SiteSettings
from dpmtv_common.crypto import SigningKey
from dpmtv_common.crypto import key_agreement as ka
from dpmtv_common.errors import DpmtvError, IntegrityError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.roster import Roster
from protocol import (
    AbortNotice,
    DistributedRelease,
    NoiseMode,
    PlanAccept,
    PlanRequest,
    ReleasePlan,
    SecureSumRequest,
    SelectionMode,
    message_from_record,
    message_to_record,
)
from protocol.codec import array_from_record
from protocol.secure_sum import (
    MASKED_ARRAY_KEY,
    AddressedBox,
    MaskedInput,
    NodeBytes,
    NonceReveal,
    SumCollectRequest,
    SumInstructions,
    SumKeysRequest,
    SumRanges,
    SumSharesRequest,
    SurvivorsRequest,
    SurvivorsSigned,
    UnmaskReply,
    UnmaskRequest,
    key_transcript,
    ranges_for,
    survivors_signed_bytes,
)
from protocol.sum_graph import SumGraph
from protocol.sum_keys import KeyAdvert
from server.simulation import FIRST_NODE_ID, InProcessGrid, set_task_identity
from tests.flower_harness import flower_process_state
from tests.plans import make_plan
from tests.unmask_oracle import HonestInput, KeyView, SumView, violations

__all__ = ["COLLUDER_BASE", "HostileWorld", "Release", "Scenario", "scratch_folder"]

SHOTS, M_I = 2, 5  # 15 records at K = 2: five chunks a site
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 4, 16
COLLUDER_BASE = 5000  # colluders' node ids: the coordinator picks them
_DRAWS = 1_000_000  # hundreds of schedules draw graphs; the limit has its own tests


def scratch_folder() -> Path:
    """A fresh folder for a world's site states: on tmpfs when there is one.

    A schedule writes hundreds of records and ledger entries, each fsynced; on tmpfs an fsync
    is free. Durability itself is what other tests check (the ledger crash tests).
    """
    shm = Path("/dev/shm")  # noqa: S108 (a private mkdtemp inside it, removed at close)
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="dpmtv-hostile-", dir=base))


@dataclass(frozen=True)
class Scenario:
    """A consortium: roster members (colluders among them), the plan's minimum, the mode."""

    sites: int
    colluders: int
    minimum: int
    mode: str = "central"

    @property
    def honest(self) -> int:
        """Honest members (each a real site service)."""
        return self.sites - self.colluders


@dataclass
class Release:
    """One release as the coordinator runs it: what it sent, what it got, what it knows."""

    plan: ReleasePlan
    accepted: dict[int, KeyAdvert] = field(default_factory=dict)
    colluding: dict[int, SiteSumSession] = field(default_factory=dict)
    agreement_keys: dict[bytes, ka.AgreementKey] = field(default_factory=dict)
    reveals: dict[int, bytes] = field(default_factory=dict)
    boxes: dict[int, list[AddressedBox]] = field(default_factory=dict)  # by sender
    key_views: dict[int, KeyView] = field(default_factory=dict)
    inputs: dict[int, dict[int, HonestInput]] = field(default_factory=dict)  # sum -> node
    revealed: dict[int, dict[int, tuple[tuple[int, ...], UnmaskReply]]] = field(
        default_factory=dict
    )
    signed: dict[int, dict[int, tuple[tuple[int, ...], bytes]]] = field(default_factory=dict)
    graph: SumGraph | None = None
    exposed: set[int] = field(default_factory=set)

    @property
    def release_id(self) -> str:
        """The release."""
        return self.plan.release_id

    @property
    def num_sums(self) -> int:
        """Secure sums the plan runs."""
        return 2 if self.plan.selection is SelectionMode.PRIVATE else 1

    def senders(self, sum_index: int) -> list[int]:
        """Honest sites whose masked input to ``sum_index`` the coordinator holds."""
        return sorted(self.inputs.get(sum_index, {}))


class HostileWorld:
    """Honest site services behind relays, colluders the coordinator runs, and a record."""

    def __init__(
        self,
        model: Path,
        data: Path,
        verify_key: Path,
        root: Path,
        scenario: Scenario,
        **site_settings: Any,
    ) -> None:
        self.scenario = scenario
        self.root = root
        names = [f"site-{index}" for index in range(scenario.sites)]
        keys = {name: SigningKey.generate() for name in names}
        roster_file = root / "roster.toml"
        root.mkdir(parents=True, exist_ok=True)
        self.roster = Roster("hostile", {n: k.verify_key for n, k in keys.items()})
        roster_file.write_text(self.roster.to_toml())
        honest = names[: scenario.honest]
        settings = [
            SiteSettings(
                name=name,
                model_path=model,
                data_path=data,
                state_dir=root / name,
                trusted_keys=(verify_key,),
                roster=roster_file,
                identity_key=keys[name].save(root / f"{name}.identity.key"),
                device="cpu",
                min_sites=2,
                budget_epsilon=1000.0,
                noise_mode=scenario.mode,
                **{"secagg_max_graph_draws": _DRAWS, **site_settings},
            )
            for name in honest
        ]
        self.colluder_keys = {
            COLLUDER_BASE + index: keys[name] for index, name in enumerate(names[scenario.honest :])
        }
        self.colluder_names = {
            COLLUDER_BASE + index: name for index, name in enumerate(names[scenario.honest :])
        }
        self._process_state = flower_process_state()
        self._process_state.__enter__()
        sites = open_in_process_sites(settings)
        self.services: list[SiteService] = sites.services
        for index, service in enumerate(self.services):
            service.site._compute = _fixed_contribution(index)  # type: ignore[method-assign]
        self.grid = InProcessGrid(sites.relays, num_nodes=len(self.services))
        self.honest = [FIRST_NODE_ID + index for index in range(len(self.services))]
        self.colluders = sorted(self.colluder_keys)
        self.fingerprint = ""
        self.releases: dict[str, Release] = {}
        self.sent: list[tuple[str, RecordDict]] = []
        self.touched: set[int] = set()

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        """Stop every service (each resolves its open releases), then check once more."""
        for service in self.services:
            service.close()
        self.touched = set(self.honest)
        try:
            self.check()
        finally:
            self._process_state.__exit__(None, None, None)
            shutil.rmtree(self.root, ignore_errors=True)

    def service(self, node: int) -> SiteService:
        """The service of honest ``node``."""
        return self.services[node - FIRST_NODE_ID]

    # ------------------------------------------------------------------ messages

    def ask(
        self, node: int, message_type: str, body: Any, arrays: dict[str, np.ndarray] | None = None
    ) -> Any:
        """Send ``body`` to honest ``node``; record what comes back; the decoded reply."""
        record = message_to_record(body)
        for key, value in (arrays or {}).items():
            from protocol.codec import with_array

            with_array(record, key, value)
        return self.send_record(node, message_type, record)

    def send_record(self, node: int, message_type: str, record: RecordDict) -> Any:
        """Send a record as it is (a replay, a forgery); record the reply."""
        self.sent.append((message_type, record))
        set_task_identity()  # Flower's process identity, which Message(...) reads
        message = self.grid.create_message(record, message_type, node, "hostile")
        (reply,) = self.grid.send_and_receive([message])
        self.touched.add(node)
        answer = message_from_record(reply.content)
        self._note(node, answer, reply.content)
        return answer

    # ------------------------------------------------------------------ the release

    def plan(self, release_id: str, recipients: Iterable[int], **overrides: Any) -> Release:
        """Send a plan; keep the keys of those that accept; make the colluders' sessions."""
        plan = self.make_plan(release_id, **overrides)
        release = Release(plan)
        self.releases[release_id] = release
        for node in recipients:
            answer = self.ask(node, "query.plan", PlanRequest(plan=plan))
            if isinstance(answer, PlanAccept) and answer.keys is not None:
                release.accepted[node] = answer.keys
        for node in self.colluders:
            self.regrind(release, node)
        return release

    def make_plan(self, release_id: str, **overrides: Any) -> ReleasePlan:
        """A plan of this world's model, minimum and mode."""
        fields: dict[str, Any] = {
            "release_id": release_id,
            "model_fingerprint": self.model_fingerprint(),
            "shots": SHOTS,
            "min_sites": self.scenario.minimum,
            "max_chunks_per_site": M_I,
        }
        if self.scenario.mode == "distributed":
            fields |= {
                "noise_mode": NoiseMode.DISTRIBUTED,
                "max_sites": self.scenario.sites,
                "min_honest": 2,
            }
        return make_plan(**(fields | overrides))

    def model_fingerprint(self) -> str:
        """The fingerprint every honest site checks plans against."""
        if not self.fingerprint:
            self.fingerprint = self.services[0].site.model().fingerprint
        return self.fingerprint

    def regrind(self, release: Release, node: int) -> KeyAdvert:
        """A fresh session (new key, new nonce) for colluder ``node``: a re-ground advert."""
        session = SiteSumSession(
            release_id=release.release_id,
            node_id=node,
            member=self.colluder_names[node],
            roster=self.roster,
            identity=self.colluder_keys[node],
            num_sums=release.num_sums,
            required_sites=release.plan.min_sites,
            min_threshold_fraction=0.5,
            graph_minimum=release.plan.min_sites,
        )
        release.colluding[node] = session
        release.agreement_keys[session.key.public_bytes] = session.key
        return session.advertise()

    def adverts(self, release: Release) -> list[KeyAdvert]:
        """Every accepting honest site's advert and every colluder's current one."""
        colluding = [session.advertise() for session in release.colluding.values()]
        return [*release.accepted.values(), *colluding]

    def keys(self, release: Release, recipients: Iterable[int], adverts: list[KeyAdvert]) -> None:
        """Send every advert (sparse graphs' nonce round); keep the nonces revealed."""
        if len(adverts) < 2:
            return  # no such message decodes at a site: the wire model refuses it first
        request = SumKeysRequest(release_id=release.release_id, adverts=adverts)
        for node in recipients:
            self.ask(node, "query.sum_keys", request)

    def nonces(self, release: Release, adverts: list[KeyAdvert]) -> list[NodeBytes]:
        """The nonces of ``adverts`` the coordinator has (honest reveals, colluders' own)."""
        found = []
        for advert in adverts:
            session = release.colluding.get(advert.node_id)
            if session is not None and advert == session.advertise():
                found.append(NodeBytes(node_id=advert.node_id, value=session.nonce))
            elif advert.node_id in release.reveals:
                found.append(
                    NodeBytes(node_id=advert.node_id, value=release.reveals[advert.node_id])
                )
        return found

    def instructions(self, release: Release, sum_index: int) -> SumInstructions:
        """Sum ``sum_index`` as the plan runs it (votes first in a private plan)."""
        plan = release.plan
        private = plan.selection is SelectionMode.PRIVATE
        stage: Literal["select", "extract"] = "select" if private and sum_index == 0 else "extract"
        heads = ((0, 0), (0, 1)) if private and stage == "extract" else None
        request = SecureSumRequest(
            release_id=plan.release_id,
            stage=stage,
            heads=heads,
            clip_norm=plan.clip_norm,
            score_top_r=plan.score_top_r if stage == "select" else None,
        )
        return SumInstructions(
            sum_index=sum_index, request=request, ranges=self._ranges(plan, stage, heads)
        )

    def _ranges(
        self, plan: ReleasePlan, stage: str, heads: tuple[tuple[int, int], ...] | None
    ) -> SumRanges:
        if plan.noise_mode is not NoiseMode.DISTRIBUTED:
            return ranges_for(float(M_I) * max(plan.clip_norm, 1.0), self.scenario.sites)
        release = DistributedRelease(plan, NUM_LAYERS * NUM_HEADS, HEAD_DIM)
        scope = (
            HeadSet(heads)
            if heads
            else HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
        )
        grid = release.votes() if stage == "select" else release.activations(scope)
        assert grid is not None
        return SumRanges(
            clipping_range=float(grid.clipping_range),
            quantization_range=grid.quantization_range,
            modulus_range=grid.modulus_range,
        )

    def shares(
        self,
        release: Release,
        recipients: Iterable[int],
        adverts: list[KeyAdvert],
        nonces: list[NodeBytes],
    ) -> None:
        """The first sum: adverts and nonces out, masked inputs and boxes back."""
        if len(adverts) < 2:
            return  # no such message decodes at a site: the wire model refuses it first
        self._colluders_draw(release, adverts, nonces)
        request = SumSharesRequest(
            release_id=release.release_id,
            adverts=adverts,
            nonces=nonces,
            instructions=self.instructions(release, 0),
        )
        for node in recipients:
            self.ask(node, "query.sum_shares", request)

    def _colluders_draw(
        self, release: Release, adverts: list[KeyAdvert], nonces: list[NodeBytes]
    ) -> None:
        """Colluders in ``adverts`` draw the graph and seal shares, so their boxes exist."""
        for session in release.colluding.values():
            if session.drawn is not None or session.advertise() not in adverts:
                continue
            try:
                release.boxes[session.node_id] = _colluder_boxes(session, adverts, nonces)
            except DpmtvError:
                continue  # a colluder the honest sites would refuse too: it sits out

    def boxes_for(
        self, release: Release, receiver: int, survivors: Sequence[int]
    ) -> list[AddressedBox]:
        """What an honest coordinator forwards to ``receiver``: the survivors' boxes to it."""
        return [
            AddressedBox(node_id=sender, box=box.box)
            for sender, sent in release.boxes.items()
            if sender in survivors
            for box in sent
            if box.node_id == receiver
        ]

    def survivors(
        self,
        release: Release,
        node: int,
        sum_index: int,
        survivors: Sequence[int],
        boxes: list[AddressedBox] | None = None,
    ) -> Any:
        """Ask ``node`` to sign ``survivors`` (the honest boxes unless ``boxes``)."""
        if boxes is None:
            boxes = self.boxes_for(release, node, survivors) if sum_index == 0 else []
        request = SurvivorsRequest(
            release_id=release.release_id,
            sum_index=sum_index,
            survivors=list(survivors),
            boxes=boxes,
        )
        return self.ask(node, "query.sum_survivors", request)

    def signatures(
        self, release: Release, sum_index: int, survivors: Sequence[int]
    ) -> list[NodeBytes]:
        """Every signature over ``survivors`` the coordinator can show: honest ones it got for
        that very set, and any colluder's (it holds their keys)."""
        wanted = tuple(sorted(set(survivors)))
        found = []
        for node in wanted:
            if node in self.colluder_keys:
                signature = self.colluder_sign(release, node, sum_index, wanted)
                found.append(NodeBytes(node_id=node, value=signature))
                continue
            signed = release.signed.get(sum_index, {}).get(node)
            if signed is not None and signed[0] == wanted:
                found.append(NodeBytes(node_id=node, value=signed[1]))
        return found

    def colluder_sign(
        self, release: Release, colluder: int, sum_index: int, survivors: Sequence[int]
    ) -> bytes:
        """Colluder ``colluder``'s signature over ``survivors`` (the honest sites' transcript)."""
        transcript = self._transcript(release)
        statement = survivors_signed_bytes(
            release_id=release.release_id,
            sum_index=sum_index,
            transcript=transcript,
            survivors=survivors,
        )
        return self.colluder_keys[colluder].sign(statement)

    def _transcript(self, release: Release) -> bytes:
        for node in self.honest:
            session = self.service(node).sums.sessions.get(release.release_id)
            if session is not None and session.agreement is not None:
                return session.agreement.transcript
        return key_transcript(self.adverts(release))

    def unmask(
        self,
        release: Release,
        node: int,
        sum_index: int,
        survivors: Sequence[int],
        signatures: list[NodeBytes],
    ) -> Any:
        """Ask ``node`` to reveal for ``survivors``, showing ``signatures``."""
        request = UnmaskRequest(
            release_id=release.release_id,
            sum_index=sum_index,
            survivors=list(survivors),
            signatures=signatures,
        )
        return self.ask(node, "query.sum_unmask", request)

    def collect(self, release: Release, recipients: Iterable[int], sum_index: int) -> None:
        """A later sum's instructions to ``recipients``."""
        request = SumCollectRequest(
            release_id=release.release_id, instructions=self.instructions(release, sum_index)
        )
        for node in recipients:
            self.ask(node, "query.sum_collect", request)

    def abort(self, release: Release, recipients: Iterable[int], noisy: bool = False) -> None:
        """An abort notice (its claim is never believed)."""
        notice = AbortNotice(release_id=release.release_id, reason="hostile", noisy_output=noisy)
        for node in recipients:
            self.ask(node, "query.abort", notice)

    def sweep(self, nodes: Iterable[int], *, later_s: float) -> None:
        """Let ``later_s`` seconds pass at ``nodes``: each resolves what went idle."""
        import time

        for node in nodes:
            service = self.service(node)
            try:
                service.site.sweep(now=time.time() + later_s)
            finally:
                service.sums.forget_resolved()
            self.touched.add(node)

    # ------------------------------------------------------------------ recording

    def _note(self, node: int, answer: Any, content: RecordDict) -> None:
        release = self.releases.get(getattr(answer, "release_id", ""))
        if release is None:
            return
        if isinstance(answer, NonceReveal):
            release.reveals[node] = answer.nonce
        elif isinstance(answer, MaskedInput):
            self._note_input(release, node, answer, content)
        elif isinstance(answer, SurvivorsSigned):
            session = self.service(node).sums.sessions[release.release_id]
            assert session.signed is not None
            release.signed.setdefault(answer.sum_index, {})[node] = (
                session.signed,
                answer.signature,
            )
        elif isinstance(answer, UnmaskReply):
            session = self.service(node).sums.sessions[release.release_id]
            # the session moved on: its participants are the survivors it revealed for
            release.revealed.setdefault(answer.sum_index, {})[node] = (
                tuple(session.participants),
                answer,
            )

    def _note_input(
        self, release: Release, node: int, answer: MaskedInput, content: RecordDict
    ) -> None:
        vector = np.asarray(
            array_from_record(content, MASKED_ARRAY_KEY, dtype="int64"), dtype=np.int64
        )
        session = self.service(node).sums.sessions[release.release_id]
        assert session.drawn is not None
        assert session.agreement is not None
        record = self.service(node).site.records.require(release.release_id)
        release.exposed.add(node)
        release.key_views[node] = KeyView(
            own_public=session.key.public_bytes,
            publics={n: a.public_key for n, a in session.agreement.adverts.items()},
        )
        release.inputs.setdefault(answer.sum_index, {})[node] = HonestInput(
            node=node,
            vector=vector,
            participants=frozenset(session.participants),
            neighbours=session.drawn.neighbours,
            count=record.num_chunks,
            minimum=session.required_sites,
            threshold=session.drawn.threshold,
        )
        release.graph = release.graph or session.drawn.graph
        if answer.boxes:
            release.boxes[node] = list(answer.boxes)

    # ------------------------------------------------------------------ the invariants

    def views(self, release: Release) -> list[SumView]:
        """Every sum of ``release`` as the coordinator and its colluders hold it."""
        views = []
        for sum_index, inputs in release.inputs.items():
            view = SumView(
                release_id=release.release_id,
                sum_index=sum_index,
                ranges=self.instructions(release, sum_index).ranges,
                colluders=frozenset(self.colluders),
                keys=dict(release.key_views),
                inputs=dict(inputs),
            )
            self._add_revealed(release, view)
            self._add_colluders_knowledge(release, view)
            views.append(view)
        return views

    def _add_revealed(self, release: Release, view: SumView) -> None:
        for node, (_, reply) in release.revealed.get(view.sum_index, {}).items():
            for entry in reply.seed_shares:
                view.add_share(entry.node_id, entry.value)
            for entry in reply.pair_seeds:
                view.pair_seeds[(node, entry.node_id)] = entry.value

    def _add_colluders_knowledge(self, release: Release, view: SumView) -> None:
        """Shares sealed to colluders, and every pair seed between a colluder and a site."""
        for node, item in view.inputs.items():
            keys = release.key_views[node]
            for partner in item.neighbours:
                if partner not in self.colluder_keys:
                    continue
                secret = self._colluder_secret(release, keys, partner)
                if secret is None:
                    continue
                view.pair_seeds[(node, partner)] = ka.pair_mask_seed(
                    secret,
                    release_id=release.release_id,
                    sum_index=view.sum_index,
                    nodes=(node, partner),
                )
                share = self._opened_share(release, node, partner, secret, view.sum_index)
                if share is not None:
                    view.add_share(node, share)

    def _colluder_secret(self, release: Release, keys: KeyView, partner: int) -> bytes | None:
        key = release.agreement_keys.get(keys.publics.get(partner, b""))
        return None if key is None else key.shared_secret(keys.own_public)

    def _opened_share(
        self, release: Release, owner: int, colluder: int, secret: bytes, sum_index: int
    ) -> bytes | None:
        found = [b.box for b in release.boxes.get(owner, []) if b.node_id == colluder]
        if not found:
            return None
        box = found[0]
        context = b"|".join(
            (release.release_id.encode(), owner.to_bytes(8, "big"), colluder.to_bytes(8, "big"))
        )
        key = ka.share_box_key(secret, release_id=release.release_id)
        try:
            plaintext = ka.open_box(key, box, associated=context)
        except IntegrityError:
            return None
        return _unpack(plaintext)[sum_index]

    def check(self) -> None:
        """Assert the invariants of the module docstring after any step."""
        for release in self.releases.values():
            for view in self.views(release):
                found = violations(view)
                assert not found, f"sums below the minimum can be unmasked: {found}"
            for sum_index, revealed in release.revealed.items():
                sets = {survivors for survivors, _ in revealed.values()}
                assert len(sets) <= 1, f"sum {sum_index}: honest sites revealed for {sets}"
        for node in sorted(self.touched):
            self._check_ledger(node)
        self.touched.clear()

    def _check_ledger(self, node: int) -> None:
        service = self.service(node)
        settings = service.settings
        if not settings.ledger_file.exists():
            return
        with PrivacyLedger.open(settings.ledger_file, settings.budget) as ledger:
            states = {entry.release_id: entry.state for entry in ledger.releases()}
        for release in self.releases.values():
            state = states.get(release.release_id)
            if node in release.exposed:
                counted = (ReleaseState.EXPOSED, ReleaseState.COMMITTED)
                assert state in counted, f"{node}'s input to {release.release_id} left: {state}"
            record = service.site.records.get(release.release_id)
            if record is not None:
                assert in_step(record, state), f"site {node}: {record.state} beside {state}"


def _colluder_boxes(
    session: SiteSumSession, adverts: list[KeyAdvert], nonces: list[NodeBytes]
) -> list[AddressedBox]:
    """A colluder's session joins, reveals, draws the graph and seals its shares."""
    if session.agreement is None:
        session.join(adverts)
    agreement = session.agreement
    if agreement is not None and not agreement.shape.complete and not session.revealed:
        session.reveal_nonce()
    session.draw_graph(adverts, nonces)
    session.begin_sum(0)
    return session.seal_shares()


def _fixed_contribution(index: int) -> Any:
    """``Site._compute`` without the model: a fixed vector per site, its true chunk count."""

    def compute(record: Any, request: SecureSumRequest, seed: int) -> list[np.ndarray]:
        if request.stage == "select":
            votes = np.zeros(record.num_layers * record.num_heads)
            votes[index % votes.size] = record.num_chunks
            return [votes, np.array([float(record.num_chunks)])]
        heads = len(request.heads) if request.heads else record.num_layers * record.num_heads
        values = np.full(heads * record.head_dim, 0.01 * (1 + index % 7))
        return [values, np.array([float(record.num_chunks)])]

    return compute


def _unpack(plaintext: bytes) -> list[bytes]:
    """The shares in a share box, one per sum (length-prefixed, as the site packs them)."""
    shares, offset = [], 0
    while offset < len(plaintext):
        size = int.from_bytes(plaintext[offset : offset + 2], "big")
        shares.append(plaintext[offset + 2 : offset + 2 + size])
        offset += 2 + size
    return shares
