"""A site's settings: its model, data, ledger, budget and keys (never from the coordinator).

Values come, in this order of precedence, from explicit arguments (command-line flags or
Flower node config), then ``DPMTV_CLIENT_*`` environment variables, then a ``.env`` file, then
the defaults below (pydantic-settings' default source order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.budget import PrivacyBudget

__all__ = ["SiteSettings"]


class SiteSettings(BaseSettings):
    """Settings of one site (data holder).

    Attributes:
        name: How the site names itself to the coordinator.
        model_path: Local directory of the site's model (``save_pretrained`` layout).
        data_path: The site's private dataset folder (JSONL manifest or image folders).
        ledger_path: SQLite privacy ledger of this site's data.
        budget_epsilon: Total ε this site allows over every release of its data.
        budget_delta: δ at which the ledger composes releases.
        signing_key: Ed25519 private key (PEM) for single-holder releases.
        trusted_keys: Public keys (PEM) whose artifacts this site accepts.
        artifacts_dir: Where received or made artifacts are stored.
        device: ``cpu``, ``cuda``...; default CUDA when available.
        dtype: ``float32``, ``bfloat16``...; default bf16 on GPU, float32 on CPU.
        batch_size: Prompts per forward pass.
        cache_dir: Where weight-file digests are remembered, so a deployed site (one process
            per message) does not re-hash its weights every time; None disables it.
    """

    model_config = SettingsConfigDict(
        env_prefix="DPMTV_CLIENT_", env_file=".env", extra="ignore", frozen=True
    )

    name: str = "site"
    model_path: Path | None = None
    data_path: Path | None = None
    ledger_path: Path = Path("dpmtv-site-ledger.sqlite")
    budget_epsilon: float = Field(default=10.0, gt=0)
    budget_delta: float = Field(default=1e-5, gt=0, lt=1)
    signing_key: Path | None = None
    trusted_keys: Annotated[tuple[Path, ...], NoDecode] = ()
    artifacts_dir: Path = Path("artifacts")
    device: str | None = None
    dtype: str | None = None
    batch_size: int = Field(default=4, ge=1)
    cache_dir: Path | None = None

    @field_validator("trusted_keys", mode="before")
    @classmethod
    def _split_key_list(cls, value: Any) -> Any:
        # Flower node config and env vars carry lists as comma-separated strings.
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> SiteSettings:
        """Settings from a SuperNode's ``--node-config`` (kebab-case keys), over env values.

        ``{partition-id}`` in a string value (or in a ``DPMTV_CLIENT_*`` path) is replaced by
        the node's partition id, so one simulation command can give each site its own folder.
        """
        partition = node_config.get("partition-id")
        given = {
            key.replace("-", "_"): value
            for key, value in node_config.items()
            if key.replace("-", "_") in cls.model_fields
        }
        try:
            settings = cls(**given)
        except (ValidationError, SettingsError) as exc:
            raise ConfigError(f"site settings must be valid, got: {exc}") from exc
        if partition is None:
            return settings
        return settings.with_partition(int(partition))

    def with_partition(self, partition: int) -> SiteSettings:
        """Replace ``{partition-id}`` in every path and the name by ``partition``."""
        updates: dict[str, Any] = {}
        for field in ("name", "model_path", "data_path", "ledger_path", "artifacts_dir"):
            value = getattr(self, field)
            if value is not None and "{partition-id}" in str(value):
                text = str(value).replace("{partition-id}", str(partition))
                updates[field] = text if field == "name" else Path(text)
        return self.model_copy(update=updates)

    @property
    def budget(self) -> PrivacyBudget:
        """The ledger's budget."""
        return PrivacyBudget(self.budget_epsilon, self.budget_delta)
