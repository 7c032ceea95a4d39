"""The coordinator's settings: a typed run config (``flwr run --run-config``) and its own secrets.

``RunConfig`` is parsed once at the app edge from ``context.run_config`` (kebab-case keys,
Flower's convention) — the release the consortium asked for. ``CoordinatorSettings`` come
from ``DPMTV_SERVER_*`` environment variables on the coordinator's machine — its signing key,
ledger and budget, which must never travel in a run config.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.budget import PrivacyBudget

__all__ = ["CoordinatorSettings", "RunConfig"]


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class RunConfig(BaseModel):
    """The release a run makes (``[tool.flwr.app.config]`` overridden by ``--run-config``).

    Attributes mirror ``protocol.ReleasePlan``; the extra ones steer the run: how many sites
    to wait for and how long, and the per-stage timeout of the secure sums.
    """

    model_config = ConfigDict(alias_generator=_kebab, populate_by_name=True, extra="forbid")

    task: str = "default"
    model_fingerprint: str
    epsilon: float = 1.0
    delta: float = 1e-5
    shots: int = 4
    clip_norm: float
    selection: str = "private"
    # "" = the default for the selection (protocol.ReleaseOrder.default_for): release-first for
    # private selection, select-first for public or all heads.
    order: str = ""
    num_selected_heads: int = 8
    public_heads: str = ""
    candidate_heads: str = ""  # private selection's public candidate set, "layer:head,..."
    # A centred release: the public centre file (select-heads --centre-out) on this machine.
    centre_path: str = ""
    selection_share: float = 0.3
    score_top_r: int = 0
    # A secure sum of one site is that site's vector; 3, as every site's own default minimum
    # (client.settings.SiteSettings.min_sites), so a default plan is one default sites accept.
    min_sites: int = Field(default=3, ge=2)
    expected_sites: int = 3
    # Most chunks a site contributes (its count is public, so the cap bounds what one site
    # weighs in the sum). 0 = no cap.
    max_chunks_per_site: int = Field(default=10_000, ge=0)
    max_image_crops: int = Field(default=0, ge=0)  # 0 = each processor as shipped
    # What one neighbouring change replaces at every site: one record, or one owner's records
    # (each site's data must say the same in its dataset.json; a site refuses another unit).
    privacy_unit: Literal["example", "group"] = "example"
    noise_mode: str = "central"
    min_honest: int = Field(default=2, ge=1)  # distributed mode: shares sized for t honest
    max_sites: int = Field(default=0, ge=0)  # distributed mode: 0 = expected-sites
    release_id: str = ""
    node_wait_timeout: float = Field(default=120.0, gt=0)
    stage_timeout: float = Field(default=600.0, gt=0)

    @classmethod
    def from_context(cls, run_config: dict[str, Any]) -> RunConfig:
        """Parse Flower's run config; unknown keys are refused with the known ones listed."""
        known = {_kebab(name) for name in cls.model_fields}
        unknown = sorted(set(run_config) - known)
        if unknown:
            raise ConfigError(f"run config keys must be among {sorted(known)}, got {unknown}.")
        try:
            return cls.model_validate(run_config)
        except ValidationError as exc:
            raise ConfigError(f"run config must be valid: {exc}") from exc

    @field_validator("model_fingerprint")
    @classmethod
    def _fingerprint_given(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "model-fingerprint must name the consortium's model, got ''. Compute it with "
                "dpmtv_common.fingerprint_model_dir(<model dir>) and pass --run-config "
                "'model-fingerprint=\"sha256:...\"'."
            )
        return value

    def heads(self) -> HeadSet | None:
        """``public-heads`` ("layer:head,layer:head") as a head set, or None."""
        return _head_list("public-heads", self.public_heads)

    def candidates(self) -> HeadSet | None:
        """``candidate-heads`` ("layer:head,layer:head") as a head set, or None."""
        return _head_list("candidate-heads", self.candidate_heads)

    def centre(self) -> ActivationCentre | None:
        """The public centre of a centred release (``centre-path``), or None.

        Raises:
            ConfigError: The file cannot be read as a centre.
        """
        if not self.centre_path.strip():
            return None
        return ActivationCentre.load(Path(self.centre_path).expanduser())

    def resolved_release_id(self) -> str:
        """The given release id, or a fresh random one."""
        return self.release_id or f"release-{uuid.uuid4().hex[:12]}"


def _head_list(key: str, text: str) -> HeadSet | None:
    if not text.strip():
        return None
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return HeadSet.of((int(layer), int(head)) for layer, head in pairs)
    except ValueError as exc:
        raise ConfigError(f"{key} must look like '0:1,3:2', got {text!r}.") from exc


class CoordinatorSettings(BaseSettings):
    """Secrets and state of the coordinator (``DPMTV_SERVER_*`` environment variables).

    Attributes:
        signing_key: Ed25519 private key (PEM) that signs every artifact.
        ledger_path: The consortium's privacy ledger (SQLite).
        budget_epsilon: ε the consortium allows over all its releases.
        budget_delta: δ at which the consortium ledger composes.
        artifacts_dir: Where the coordinator keeps the artifacts it signed.
    """

    model_config = SettingsConfigDict(env_prefix="DPMTV_SERVER_", extra="ignore", frozen=True)

    signing_key: Path | None = None
    ledger_path: Path = Path("dpmtv-consortium-ledger.sqlite")
    budget_epsilon: float = Field(default=10.0, gt=0)
    budget_delta: float = Field(default=1e-5, gt=0, lt=1)
    artifacts_dir: Path = Path("coordinator-artifacts")

    @field_validator("signing_key")
    @classmethod
    def _exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"signing_key must be an existing file, got {str(value)!r}")
        return value

    @property
    def budget(self) -> PrivacyBudget:
        """The consortium ledger's budget."""
        return PrivacyBudget(self.budget_epsilon, self.budget_delta)
