"""A site's settings: its model, data, ledger, budget and keys (never from the coordinator).

Values come, in this order of precedence, from explicit arguments (command-line flags or
Flower node config), then ``DPMTV_CLIENT_*`` environment variables, then a ``.env`` file, then
the defaults below (pydantic-settings' default source order).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    trusted_keys: tuple[Path, ...] = ()
    artifacts_dir: Path = Path("artifacts")
    device: str | None = None
    dtype: str | None = None
    batch_size: int = Field(default=4, ge=1)

    @property
    def budget(self) -> PrivacyBudget:
        """The ledger's budget."""
        return PrivacyBudget(self.budget_epsilon, self.budget_delta)
