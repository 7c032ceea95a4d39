"""docker/compose.yaml keeps each site's secrets in its service container (no engine needed).

Parsed with PyYAML (anchors and ``<<`` merges resolved); mounts in the short syntax
``SOURCE:TARGET[:MODE]``. A site is the pair ``site-N-service`` / ``site-N-supernode``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no stubs

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.yaml"
_SITE = re.compile(r"^(site-\d+)-(service|supernode)$")


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def mounts(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(source, target, mode) of every volume of a service."""
    found = []
    for entry in service.get("volumes", []):
        assert isinstance(entry, str), f"use the short mount syntax, got {entry!r}"
        # ${VAR:?message}/x:/target:ro -- the interpolation may hold a colon of its own.
        source, _, rest = re.sub(r"\$\{[^}]*\}", "$VAR", entry).partition(":")
        target, _, mode = rest.partition(":")
        found.append((source, target, mode))
    return found


def named_volumes(service: dict[str, Any]) -> set[str]:
    return {src for src, _, _ in mounts(service) if not src.startswith(("$", ".", "/"))}


def sites(services: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    grouped: dict[str, dict[str, dict[str, Any]]] = {}
    for name, service in services.items():
        match = _SITE.match(name)
        if match:
            grouped.setdefault(match.group(1), {})[match.group(2)] = service
    return grouped


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return dict(compose()["services"])


def test_every_site_has_a_service_and_a_supernode(services: dict[str, Any]) -> None:
    grouped = sites(services)
    assert len(grouped) >= 3
    for site, pair in grouped.items():
        assert set(pair) == {"service", "supernode"}, site
        assert pair["supernode"]["build"]["dockerfile"] == "docker/supernode.Dockerfile"
        assert pair["service"]["build"]["dockerfile"] == "docker/site-service.Dockerfile"


def test_no_supernode_mounts_data_model_state_or_keys_but_its_node_key(
    services: dict[str, Any],
) -> None:
    for site, pair in sites(services).items():
        node = pair["supernode"]
        for source, target, mode in mounts(node):
            if target == "/run/dpmtv":
                assert source == f"{site}-socket", (site, source)
                continue
            # Only the CA certificate and the node's own SSH key, read-only.
            assert mode == "ro", (site, source, target)
            allowed = {
                "/app/certs/ca.crt": "/credentials/certs/ca.crt",
                "/app/secrets/node.key": f"/credentials/keys/{site}",
            }
            assert target in allowed, (site, target)
            assert source.endswith(allowed[target]), (site, source)
        text = " ".join(str(item) for item in node.get("command", []))
        assert "site-socket=" in text
        for word in ("model", "data", "ledger", "trusted", "signing"):
            assert word not in text, (site, word)
        assert "10100" in [str(group) for group in node.get("group_add", [])], site


def test_every_site_service_reads_its_data_read_only_and_owns_its_state(
    services: dict[str, Any],
) -> None:
    state_volumes = []
    for site, pair in sites(services).items():
        service = pair["service"]
        by_target = {target: (source, mode) for source, target, mode in mounts(service)}
        assert by_target["/srv/data"][0].endswith(f"/data/{site}"), site
        assert by_target["/srv/data"][1] == "ro", site
        assert by_target["/srv/model"][1] == "ro", site
        assert by_target["/var/lib/dpmtv"][0] == f"{site}-state", site
        assert by_target["/var/cache/dpmtv"][0] == f"{site}-cache", site
        assert str(service["user"]).split(":") == ["10001", "10100"], site
        state_volumes.append(f"{site}-state")
    for volume in state_volumes:  # nobody else mounts a site's state
        holders = [name for name, svc in services.items() if volume in named_volumes(svc)]
        assert len(holders) == 1, (volume, holders)


def test_a_socket_volume_is_shared_by_one_sites_two_containers_only(
    services: dict[str, Any],
) -> None:
    for site in sites(services):
        holders = {n for n, svc in services.items() if f"{site}-socket" in named_volumes(svc)}
        assert holders == {f"{site}-service", f"{site}-supernode"}, (site, holders)
    # And no named volume at all is shared across sites or with the coordinator.
    seen: dict[str, str] = {}
    for name, service in services.items():
        owner = _SITE.match(name).group(1) if _SITE.match(name) else name  # type: ignore[union-attr]
        for volume in named_volumes(service):
            assert seen.setdefault(volume, owner) == owner, (volume, name)


def test_the_coordinator_mounts_nothing_of_a_site(services: dict[str, Any]) -> None:
    sources = [source for source, _, _ in mounts(services["superlink"])]
    assert not [s for s in sources if "/data" in s or "/model" in s or "/keys/" in s]


def _base_images(dockerfile: Path) -> list[str]:
    args: dict[str, str] = {}
    bases = []
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        if match := re.match(r"^ARG (\w+)=(\S+)", line):
            args[match.group(1)] = match.group(2).strip('"')
        elif match := re.match(r"^FROM (\S+)", line):
            bases.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], match.group(1)))
    return bases


def test_every_image_is_built_on_debian_or_ubuntu(services: dict[str, Any]) -> None:
    dockerfiles = {svc["build"]["dockerfile"] for svc in services.values() if "build" in svc}
    assert len(dockerfiles) == 3
    for dockerfile in sorted(dockerfiles):
        bases = _base_images(DOCKER.parent / dockerfile)
        assert bases, dockerfile
        for base in bases:
            assert "alpine" not in base, (dockerfile, base)
            assert re.search(r"(bookworm|bullseye|trixie|ubuntu\d|debian)", base), (
                dockerfile,
                base,
            )


def test_the_dockerfiles_no_service_uses_are_gone() -> None:
    used = {Path(svc["build"]["dockerfile"]).name for svc in compose()["services"].values()}
    present = {path.name for path in DOCKER.glob("*.Dockerfile")}
    assert present == used
