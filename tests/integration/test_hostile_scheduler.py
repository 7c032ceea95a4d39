"""A hostile scheduler: random interleavings of everything a coordinator or relay can send.

A hypothesis ``RuleBasedStateMachine`` drives real site services (``tests.hostile_world``:
handlers, policy, record, ledger and secure-sum session; only the model's forward pass is
replaced) through random schedules of every message a coordinator or relay can send — plans,
key adverts (re-keyed colluders, made-up members, other releases'), nonces (missing,
wrong, withheld), first-sum shares, survivor sets (random, cut around a victim, every honest
neighbour of a victim dropped, two disjoint halves), boxes (honest, forged), unmask requests
(with the signatures it holds, one short, one forged), later sums, abort notices, idle
sweeps, and replays of any earlier message to any site — with up to a tenth of the roster
colluding (the coordinator runs their sessions and knows their secrets), at 3, 11, 30 and
100 sites, both noise modes. After every step it checks (``HostileWorld.check``):

* no group of fewer honest sites than its members' minimum can be unmasked from what the
  coordinator and its colluders hold (``tests.unmask_oracle``, which proves every group it
  finds by computing its sum);
* one survivor set a sum among the honest sites that revealed;
* no refund after exposure, and every record beside its ledger entry as the table says.

The default run explores about 200 schedules (most reach an unmask; about two minutes of CPU);
``-m reproduction`` (run by ``scripts/check-reproductions``) explores twenty times as many:
``DPMTV_SCHEDULES=<n>`` scales either by n instead.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from protocol import COMPLETE_UP_TO, SelectionMode
from protocol.secure_sum import AddressedBox, NodeBytes
from tests.hostile_world import HostileWorld, Release, Scenario, scratch_folder
from tests.integration.test_hostile_coordinator import World, made_up_advert, make_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

MINIMA = {3: (2, 3), 11: (3, 4), 30: (3, 12), 100: (3, 12)}
HOSTILE = ("plan", "keys", "shares", "survivors", "unmask", "collect", "replay", "abort", "sweep")
ACTIONS = ("advance",) * len(HOSTILE) + HOSTILE  # half the steps go on as an honest one would
# sites: (schedules in the default run, steps a schedule); the reproduction run: x20
BUDGET = {3: (160, 6), 11: (30, 6), 30: (6, 6), 100: (2, 6)}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("scheduler"))


class HostileScheduler(RuleBasedStateMachine):
    """One schedule: a fresh consortium, then any message to any site, in any order."""

    sites = 3
    make: Callable[[Scenario], HostileWorld]
    reached: Counter[str]  # schedules that got this far, by milestone (the run's statistics)

    def __init__(self) -> None:
        super().__init__()
        self.hostile: HostileWorld | None = None
        self.milestones: set[str] = set()
        self.keyed: dict[str, list[Any]] = {}  # release -> the adverts its nonce round showed

    # ------------------------------------------------------------------ set up

    @initialize(data=st.data())
    def open(self, data: st.DataObject) -> None:
        colluders = data.draw(st.integers(0, self.sites // 10), label="colluders")
        minimum = data.draw(st.sampled_from(MINIMA[self.sites]), label="minimum")
        mode = data.draw(st.sampled_from(["central", "distributed"]), label="mode")
        self.hostile = self.make(Scenario(self.sites, colluders, minimum, mode))
        selection = data.draw(st.sampled_from([SelectionMode.ALL, SelectionMode.PRIVATE]))
        self.world.plan("r0", self.world.honest, selection=selection)

    def teardown(self) -> None:
        if self.hostile is not None:
            self.hostile.close()  # every service resolves what is open: checked once more
        self.reached.update({"schedules", *self.milestones})

    @property
    def world(self) -> HostileWorld:
        assert self.hostile is not None
        return self.hostile

    # ------------------------------------------------------------------ choices

    def subset(self, data: st.DataObject, nodes: Sequence[int], label: str) -> list[int]:
        """All of ``nodes``, all but a few, or a random part (dropouts anywhere)."""
        if not nodes:
            return []
        pick = data.draw(st.sampled_from(["all", "all", "all-but-one", "part"]), label=label)
        shuffler = data.draw(st.randoms(use_true_random=False), label=f"{label} order")
        if pick == "all":
            return list(nodes)
        if pick == "all-but-one":
            out = shuffler.choice(list(nodes))
            return [node for node in nodes if node != out]
        return sorted(shuffler.sample(list(nodes), shuffler.randint(1, len(nodes))))

    def release(self, data: st.DataObject) -> Release:
        return self.world.releases[data.draw(st.sampled_from(sorted(self.world.releases)))]

    def survivor_sets(
        self, data: st.DataObject, release: Release, sum_index: int
    ) -> dict[int, list[int]]:
        """What each honest site is told survived: one set for all, or two halves."""
        world = self.world
        senders = release.senders(sum_index) or world.honest
        everyone = sorted(set(senders) | set(world.colluders))
        shuffler = data.draw(st.randoms(use_true_random=False), label="survivors order")
        kind = data.draw(
            st.sampled_from(["all", "random", "cut", "victim-alone", "halves"]), label="survivors"
        )
        graph = release.graph
        if kind == "random" or (graph is None and kind in ("cut", "victim-alone")):
            chosen = sorted(shuffler.sample(everyone, shuffler.randint(1, len(everyone))))
        elif kind == "cut":  # a small group around a victim, all its other neighbours dropped
            assert graph is not None
            group = [shuffler.choice(senders)]
            for node in group:
                near = [o for o in graph.neighbours.get(node, ()) if o not in group]
                group += near[: max(0, shuffler.randint(1, 4) - len(group))]
            cut = {o for node in group for o in graph.neighbours.get(node, ())} - set(group)
            chosen = [node for node in everyone if node not in cut]
        elif kind == "victim-alone":  # every honest neighbour of the victim dropped
            assert graph is not None
            victim = shuffler.choice(senders)
            honest_near = set(graph.neighbours.get(victim, ())) - set(world.colluders)
            chosen = [node for node in everyone if node not in honest_near]
        elif kind == "halves":
            shuffler.shuffle(everyone)
            first, second = (
                sorted(everyone[: len(everyone) // 2]),
                sorted(everyone[len(everyone) // 2 :]),
            )
            return {node: (first if node in first else second) for node in everyone}
        else:
            chosen = everyone
        return {node: chosen for node in everyone}

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        """One step of the schedule: an honest coordinator's next steps, or anything else."""
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        if action == "plan" and len(self.world.releases) >= 2:
            action = "advance"
        if action == "replay" and not self.world.sent:
            action = "advance"
        getattr(self, action)(data)

    @invariant()
    def nothing_below_the_minimum_one_survivor_set_no_refund_after_exposure(self) -> None:
        if self.hostile is None:
            return
        self.world.check()
        for release in self.world.releases.values():  # how deep schedules go (statistics)
            self.milestones |= {f"sum {j}: masked inputs held" for j in release.inputs}
            self.milestones |= {f"sum {j}: an honest site revealed" for j in release.revealed}
            if any(len(s) > 1 for s in release.signed.values()):
                self.milestones.add("two sites signed one sum")
            if release.graph is not None and not release.graph.shape.complete:
                self.milestones.add("a sparse graph drawn")

    def plan(self, data: st.DataObject) -> None:
        selection = data.draw(st.sampled_from([SelectionMode.ALL, SelectionMode.PRIVATE]))
        recipients = self.subset(data, self.world.honest, "plan to")
        self.world.plan(f"r{len(self.world.releases)}", recipients, selection=selection)

    def advance(self, data: st.DataObject) -> None:
        """The next one to four steps an honest coordinator would take, to every site."""
        release = self.release(data)
        for _ in range(data.draw(st.integers(1, 4), label="honest steps")):
            self.honest_step(release)

    def honest_step(self, release: Release) -> None:
        """The next step an honest coordinator would take, to every site still in the sum."""
        world = self.world
        adverts = self.keyed.get(release.release_id) or world.adverts(release)
        sparse = len(adverts) > COMPLETE_UP_TO
        if sparse and not release.reveals:
            world.keys(release, world.honest, adverts)
            self.keyed[release.release_id] = adverts
            return
        done = [j for j in range(release.num_sums) if release.revealed.get(j)]
        current = max(done) + 1 if done else 0
        if current >= release.num_sums:
            return
        senders = release.senders(current)
        if not senders:
            if current == 0:
                world.shares(release, world.honest, adverts, world.nonces(release, adverts))
            else:
                world.collect(release, sorted(release.revealed[current - 1]), current)
            return
        survivors = sorted(set(senders) | set(world.colluders))
        if not release.signed.get(current):
            for node in senders:
                world.survivors(release, node, current, survivors)
            return
        shown = world.signatures(release, current, survivors)
        for node in senders:
            world.unmask(release, node, current, survivors, shown)

    def keys(self, data: st.DataObject) -> None:
        release = self.release(data)
        adverts = self.adverts(data, release)
        self.world.keys(release, self.subset(data, self.world.honest, "keys to"), adverts)
        self.keyed[release.release_id] = adverts

    def shares(self, data: st.DataObject) -> None:
        release = self.release(data)
        keyed = self.keyed.get(release.release_id)
        adverts = (
            keyed if keyed is not None and data.draw(st.booleans()) else self.adverts(data, release)
        )
        nonces = self.world.nonces(release, adverts)
        change = data.draw(
            st.sampled_from(["as held", "as held", "one missing", "one wrong", "none"])
        )
        if change == "one missing" and nonces:
            nonces = nonces[1:]
        elif change == "one wrong" and nonces:
            nonces = [*nonces[1:], NodeBytes(node_id=nonces[0].node_id, value=bytes(32))]
        elif change == "none":
            nonces = []
        self.world.shares(
            release, self.subset(data, self.world.honest, "shares to"), adverts, nonces
        )

    def survivors(self, data: st.DataObject) -> None:
        release = self.release(data)
        sum_index = data.draw(st.integers(0, release.num_sums - 1), label="sum")
        told = self.survivor_sets(data, release, sum_index)
        forged = data.draw(st.sampled_from([False, False, False, True]), label="forged boxes")
        for node in self.subset(data, [n for n in self.world.honest if n in told], "survivors to"):
            boxes = None
            if forged and sum_index == 0:
                honest = self.world.boxes_for(release, node, told[node])
                boxes = [
                    AddressedBox(node_id=b.node_id, box=b.box[:-1] + bytes([b.box[-1] ^ 1]))
                    for b in honest
                ]
            self.world.survivors(release, node, sum_index, told[node], boxes)

    def unmask(self, data: st.DataObject) -> None:
        release = self.release(data)
        sum_index = data.draw(st.integers(0, release.num_sums - 1), label="sum")
        signed = sorted({s for s, _ in release.signed.get(sum_index, {}).values()})
        told = self.survivor_sets(data, release, sum_index)
        reuse: bool = data.draw(st.booleans(), label="a set someone signed")
        if signed and reuse:
            chosen = list(data.draw(st.sampled_from(signed), label="signed set"))
            told = {node: chosen for node in self.world.honest}
        change = data.draw(st.sampled_from(["all held", "all held", "one short", "one forged"]))
        for node in self.subset(data, [n for n in self.world.honest if n in told], "unmask to"):
            shown = self.world.signatures(release, sum_index, told[node])
            if change == "one short" and shown:
                shown = shown[1:]
            elif change == "one forged" and shown:
                shown = [*shown[1:], NodeBytes(node_id=shown[0].node_id, value=bytes(64))]
            self.world.unmask(release, node, sum_index, told[node], shown)

    def collect(self, data: st.DataObject) -> None:
        release = self.release(data)
        sum_index = data.draw(st.integers(1, 2), label="sum")
        self.world.collect(release, self.subset(data, self.world.honest, "collect to"), sum_index)

    def replay(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.world.sent) - 1), label="replayed")
        message_type, record = self.world.sent[index]
        target = data.draw(st.sampled_from(self.world.honest), label="to")
        self.world.send_record(target, message_type, record)

    def abort(self, data: st.DataObject) -> None:
        release = self.release(data)
        noisy = data.draw(st.booleans(), label="claims noisy output")
        self.world.abort(release, self.subset(data, self.world.honest, "abort to"), noisy)

    def sweep(self, data: st.DataObject) -> None:
        self.world.sweep(self.subset(data, self.world.honest, "idle at"), later_s=10**7)

    # ------------------------------------------------------------------ helpers

    def adverts(self, data: st.DataObject, release: Release) -> list[Any]:
        """The adverts the coordinator shows: as held, re-keyed colluders, or forged."""
        world = self.world
        kind = data.draw(
            st.sampled_from(["held", "held", "regrind", "one missing", "made up", "other release"]),
            label="adverts",
        )
        if kind == "regrind":
            for node in world.colluders:
                world.regrind(release, node)
        adverts = world.adverts(release)
        if kind == "one missing" and adverts:
            return adverts[1:]
        if kind == "made up":
            return [*adverts, made_up_advert("site-0", 9999, release_id=release.release_id)]
        if kind == "other release":
            others = [r for r in world.releases.values() if r is not release and r.accepted]
            if others:
                foreign = next(iter(others[0].accepted.values()))
                return [a for a in adverts if a.node_id != foreign.node_id] + [foreign]
        return adverts


def run_schedules(world: World, sites: int, budget: tuple[int, int], scale: float) -> Counter[str]:
    """Run ``budget`` (schedules, steps) times ``scale`` of the machine at ``sites``; how far
    the schedules got."""

    def make(scenario: Scenario) -> HostileWorld:
        data = world.root / "data" / "site-0"
        return HostileWorld(world.model, data, world.verify_key, scratch_folder(), scenario)

    reached: Counter[str] = Counter()
    machine = type(
        f"HostileScheduler{sites}",
        (HostileScheduler,),
        {"sites": sites, "make": staticmethod(make), "reached": reached},
    )
    schedules = max(1, round(budget[0] * scale))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=schedules,
            stateful_step_count=budget[1],
            deadline=None,
            derandomize=scale <= 1.0,  # the default run is the same schedules every time
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )
    return reached


def scale_of(default: float) -> float:
    given = os.environ.get("DPMTV_SCHEDULES")
    return float(given) if given else default


@pytest.mark.parametrize("sites", sorted(BUDGET))
def test_random_schedules_never_expose_a_sum_below_the_minimum(world: World, sites: int) -> None:
    # Act: the invariants are asserted after every step of every schedule.
    reached = run_schedules(world, sites, BUDGET[sites], scale_of(1.0))

    # Assert: the schedules explored deep states, not only refusals at the first message.
    print(f"{sites} sites: {dict(reached)}")
    assert reached["schedules"] >= BUDGET[sites][0] * scale_of(1.0) - 1
    assert reached["sum 0: an honest site revealed"] >= reached["schedules"] / 10


@pytest.mark.reproduction
@pytest.mark.parametrize("sites", sorted(BUDGET))
def test_thousands_of_random_schedules_never_expose_a_sum_below_the_minimum(
    world: World, sites: int
) -> None:
    reached = run_schedules(world, sites, BUDGET[sites], scale_of(20.0))
    print(f"{sites} sites: {dict(reached)}")
