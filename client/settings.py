"""A site's settings: its model, data, ledger, budget, keys and policy (never from the coordinator).

Values come, in this order of precedence, from explicit arguments (command-line flags), then
``DPMTV_CLIENT_*`` environment variables, then the TOML file named by ``config_file``
(``--config`` or ``DPMTV_CLIENT_CONFIG_FILE``), then the defaults below: pydantic-settings'
default order, with the explicit file in the place of its ``.env``. No file is read that the
site admin did not name: a ``.env`` in whatever folder a command runs in could otherwise set
the site's budget, minimum of sites or trusted keys without a word.

Every state file has one default that every command agrees on, whatever the working directory:
the per-user data folder ``$XDG_DATA_HOME/dpmtv/site`` (``~/.local/share/dpmtv/site``), or
``DPMTV_CLIENT_STATE_DIR``. A relative path given explicitly is made absolute at once, so logs
and ledgers always name one file.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.budget import PrivacyBudget

__all__ = ["SiteSettings", "default_state_dir", "service_status_file"]

_LEDGER_FILE = "ledger.sqlite"
_ARTIFACTS_DIR = "artifacts"
_SOCKET_FILE = "site.sock"
_RELEASES_SUFFIX = ".releases"
_STATUS_SUFFIX = ".status.json"
_GRAPH_DRAWS_SUFFIX = ".graph-draws.json"
_CONFIG_FILE_ENV = "DPMTV_CLIENT_CONFIG_FILE"
# Fields whose relative values in a config file are relative to the file's folder.
_PATH_FIELDS = frozenset(
    {
        "model_path",
        "data_path",
        "state_dir",
        "ledger_path",
        "signing_key",
        "trusted_keys",
        "answer_end_from",
        "roster",
        "identity_key",
        "artifacts_dir",
        "socket_path",
        "cache_dir",
    }
)


def default_state_dir() -> Path:
    """The per-user folder of a site's ledger, artifacts, release records and socket."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).absolute() / "dpmtv" / "site"


def service_status_file(socket: Path) -> Path:
    """Where a running service keeps its status for the admin: beside its socket, mode 0600.

    Beside the socket because ``service-status`` always knows the socket; readable by the
    service's user only, so the SuperNode's user, who shares the socket's folder, cannot read
    it (a ``PING`` over the socket answers only that the service is alive).
    """
    return socket.with_name(socket.name + _STATUS_SUFFIX)


class SiteSettings(BaseSettings):
    """Settings of one site (data holder).

    Attributes:
        name: How the site names itself to the coordinator.
        model_path: Local directory of the site's model (``save_pretrained`` layout).
        data_path: The site's private dataset folder (JSONL manifest or image folders).
        state_dir: Folder of every state file below that is not given explicitly.
        ledger_path: SQLite privacy ledger of this site's data (default under ``state_dir``).
        budget_epsilon: Total ε this site allows over every release of its data.
        budget_delta: δ at which the ledger composes releases.
        signing_key: Ed25519 private key (PEM) for single-holder releases.
        trusted_keys: Public keys (PEM) whose artifacts this site accepts.
        answer_end_from: Labelled PUBLIC datasets (other tasks of the domain will do) from
            which a patched answer learns where a one-token answer ends
            (``client.inference.answer_end``); empty: no answer's end is patched. Never the
            private ``data_path``.
        roster: The consortium roster (TOML, ``dpmtv-site roster make``) the site admin
            installed after comparing its fingerprint out of band. Without one the site
            takes part in no secure sum: it could not tell real sites from made-up ones.
        identity_key: This member's Ed25519 identity key (PEM, ``dpmtv-site keygen``); its
            public half is the roster's entry for ``name``. It signs the site's secure-sum
            keys and survivor sets.
        artifacts_dir: Where received or made artifacts are stored (default under ``state_dir``).
        socket_path: The site service's Unix socket (default under ``state_dir``).
        socket_mode: Permission bits of the socket; the SuperNode's user needs write access
            (e.g. through a shared group with mode 0o660), nobody else.
        min_sites: The fewest sites this site accepts in a plan's minimum and in a secure sum:
            below it, the sum of the others reveals too much of this site's contribution.
        max_release_epsilon: Largest ε this site accepts for one release.
        max_release_delta: Largest δ this site accepts for one release.
        noise_mode: The trust mode this site takes part in; a plan of another mode is refused.
        min_honest: In distributed mode, the fewest honest participants this site assumes in
            a sum (t): it accepts only plans whose shares are sized for at most t (t = 1: the
            site's own share alone protects it).
        secagg_min_threshold_fraction: SecAgg+ reconstruction thresholds must exceed this
            fraction of the neighbourhood, so a minority of colluding neighbours cannot rebuild
            this site's mask secrets.
        secagg_max_graph_draws: The most sparse secure-sum graphs this site helps draw in any
            window of ``secagg_graph_draw_window_seconds`` (one a release). Each draw is one
            more chance at the graph's 2^-40 failure probability, and a coordinator that
            aborts to re-draw the graph spends them; past it the site refuses its nonce.
        secagg_graph_draw_window_seconds: The window of ``secagg_max_graph_draws`` (a day).
        idle_release_seconds: A release whose run sent no message for this long is resolved
            by the service on its own record (nothing sent: refund; anything sent: counted).
            Keep it above the coordinator's stage timeout (default 600 s): a site that sent its
            masked vector waits silently while the slowest site extracts.
        device: ``cpu``, ``cuda``...; default CUDA when available.
        dtype: ``float32``, ``bfloat16``...; default bf16 on GPU, float32 on CPU.
        batch_size: Prompts per forward pass.
        cache_dir: Where weight-file digests are remembered, so a command does not re-hash
            the weights at every start; default ``$XDG_CACHE_HOME/dpmtv/fingerprints``.
        device_map: ``from_pretrained``'s device map (e.g. ``auto`` over several GPUs; needs
            accelerate); overrides ``device`` for placement.
        attn_implementation: ``eager``, ``sdpa`` or ``flash_attention_2``; default transformers'.
        config_file: A TOML file of these settings (snake_case or kebab-case keys; relative
            paths are relative to the file), below flags and environment in precedence. Only
            a file named here (``--config``, ``DPMTV_CLIENT_CONFIG_FILE``) is ever read.
    """

    # env_file=None: pydantic-settings would otherwise read a .env from the working directory.
    model_config = SettingsConfigDict(
        env_prefix="DPMTV_CLIENT_", env_file=None, extra="ignore", frozen=True
    )

    name: str = "site"
    model_path: Path | None = None
    data_path: Path | None = None
    state_dir: Path = Field(default_factory=default_state_dir)
    ledger_path: Path | None = None
    budget_epsilon: float = Field(default=10.0, gt=0)
    budget_delta: float = Field(default=1e-5, gt=0, lt=1)
    signing_key: Path | None = None
    trusted_keys: Annotated[tuple[Path, ...], NoDecode] = ()
    answer_end_from: Annotated[tuple[Path, ...], NoDecode] = ()
    roster: Path | None = None
    identity_key: Path | None = None
    artifacts_dir: Path | None = None
    socket_path: Path | None = None
    socket_mode: int = Field(default=0o660, ge=0o600, le=0o777)
    min_sites: int = Field(default=3, ge=2)
    max_release_epsilon: float = Field(default=8.0, gt=0, le=100)
    max_release_delta: float = Field(default=1e-5, gt=0, lt=1)
    noise_mode: Literal["central", "distributed"] = "central"
    min_honest: int = Field(default=2, ge=1)
    secagg_min_threshold_fraction: float = Field(default=0.5, ge=0.5, lt=1)
    secagg_max_graph_draws: int = Field(default=8, ge=1)
    secagg_graph_draw_window_seconds: float = Field(default=86_400.0, gt=0)
    idle_release_seconds: float = Field(default=900.0, gt=0)
    device: str | None = None
    dtype: str | None = None
    batch_size: int = Field(default=4, ge=1)
    cache_dir: Path | None = None
    device_map: str | None = None
    attn_implementation: str | None = None
    config_file: Path | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags > environment > the explicit config file > secrets; never an implicit file."""
        named = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        config = _ConfigFileSource(settings_cls, named.get("config_file"))
        return init_settings, env_settings, config, file_secret_settings

    @model_validator(mode="after")
    def _resolve_state_paths(self) -> Self:
        # Frozen model: fill the derived defaults once, before anyone reads them.
        state = self.state_dir.absolute()
        resolved = {
            "state_dir": state,
            "ledger_path": _absolute(self.ledger_path, state / _LEDGER_FILE),
            "artifacts_dir": _absolute(self.artifacts_dir, state / _ARTIFACTS_DIR),
            "socket_path": _absolute(self.socket_path, state / _SOCKET_FILE),
        }
        self.__dict__.update(resolved)
        return self

    @property
    def ledger_file(self) -> Path:
        """The ledger's absolute path."""
        return _required(self.ledger_path)

    @property
    def default_ledger_file(self) -> Path:
        """The site's one default ledger under its state folder (``ledger_file`` unless named)."""
        return self.state_dir.absolute() / _LEDGER_FILE

    @property
    def artifacts_folder(self) -> Path:
        """The artifacts folder's absolute path."""
        return _required(self.artifacts_dir)

    @property
    def socket_file(self) -> Path:
        """The service socket's absolute path."""
        return _required(self.socket_path)

    @property
    def graph_draws_file(self) -> Path:
        """The log of secure-sum graph draws (``client.release.graph_draws``), by the ledger."""
        ledger = self.ledger_file
        return ledger.with_name(ledger.name + _GRAPH_DRAWS_SUFFIX)

    @property
    def releases_folder(self) -> Path:
        """Where the service keeps one record per release (its state machine), by the ledger."""
        ledger = self.ledger_file
        return ledger.with_name(ledger.name + _RELEASES_SUFFIX)

    @field_validator("trusted_keys", "answer_end_from", mode="before")
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
        fields = (
            "name",
            "model_path",
            "data_path",
            "ledger_path",
            "artifacts_dir",
            "socket_path",
            "state_dir",
            "identity_key",
        )
        for field in fields:
            value = getattr(self, field)
            if value is not None and "{partition-id}" in str(value):
                text = str(value).replace("{partition-id}", str(partition))
                updates[field] = text if field == "name" else Path(text)
        return self.model_copy(update=updates)

    @property
    def budget(self) -> PrivacyBudget:
        """The ledger's budget."""
        return PrivacyBudget(self.budget_epsilon, self.budget_delta)


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The settings in the TOML file the site admin named (flag, else environment), if any."""

    def __init__(self, settings_cls: type[BaseSettings], given: object) -> None:
        super().__init__(settings_cls)
        named = given if given is not None else os.environ.get(_CONFIG_FILE_ENV)
        self._path = None if named in (None, "") else Path(str(named)).absolute()

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """Unused: :meth:`__call__` reads the whole file at once."""
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        """The file's settings, keys in snake_case, relative paths made absolute."""
        if self._path is None:
            return {}
        try:
            with self._path.open("rb") as handle:
                table = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(
                f"config_file must be a readable TOML file, got {str(self._path)!r}: {exc}"
            ) from exc
        values = {str(key).replace("-", "_"): value for key, value in table.items()}
        unknown = sorted(set(values) - (set(self.settings_cls.model_fields) - {"config_file"}))
        if unknown:
            raise ConfigError(
                f"config_file keys must name site settings, got unknown {unknown} in "
                f"{str(self._path)!r}."
            )
        folder = self._path.parent
        for listed in ("trusted_keys", "answer_end_from"):
            if isinstance(values.get(listed), str):  # one string: comma-separated
                values[listed] = [
                    part.strip() for part in values[listed].split(",") if part.strip()
                ]
        for name in _PATH_FIELDS & set(values):
            values[name] = _relative_to(folder, values[name])
        return values


def _relative_to(folder: Path, value: Any) -> Any:
    if isinstance(value, str):
        return folder / value if value else value  # an absolute value stays as it is
    if isinstance(value, list):
        return [_relative_to(folder, item) for item in value]
    return value


def _absolute(given: Path | None, default: Path) -> Path:
    return default if given is None else given.absolute()


def _required(path: Path | None) -> Path:
    if path is None:  # filled by the validator; only a bypassed constructor gets here
        raise ConfigError("site settings must be built through SiteSettings(...), got None.")
    return path
