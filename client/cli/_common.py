"""Options and helpers shared by the ``dpmtv-site`` commands.

Nothing here imports torch or transformers at module level: commands that need no model
(``keygen``, ``ledger``, ``--help``) must start in well under a second, so the model side is
imported inside :func:`load_site_model`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from client.cli._choices import ATTENTION_CHOICES, DTYPES, PATCH_POLICIES
from client.cli._errors import validation_line
from client.cli._types import positive_float, positive_int
from client.settings import SiteSettings
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError, ModelError
from dpmtv_common.heads import HeadSet

if TYPE_CHECKING:
    from client.models import LoadedModel

__all__ = [
    "add_image_crops_option",
    "add_model_options",
    "add_patch_options",
    "answer_end_folders",
    "check_artifact",
    "check_site_model",
    "load_heads_file",
    "load_site_model",
    "public_data_folder",
    "settings_from",
    "trusted_keys",
    "write_heads_file",
]

# Settings fields and the flag that sets each, for error lines that name what to change.
_OPTIONS = {
    "model_path": "--model",
    "data_path": "--data",
    "ledger_path": "--ledger",
    "budget_epsilon": "--budget-epsilon",
    "budget_delta": "--budget-delta",
    "signing_key": "--signing-key",
    "trusted_keys": "--trusted-key",
    "answer_end_from": "--answer-end-from",
    "roster": "--roster",
    "identity_key": "--identity-key",
    "batch_size": "--batch-size",
    "device": "--device",
    "dtype": "--dtype",
    "name": "--name",
    "state_dir": "--state-dir",
    "artifacts_dir": "--artifacts-dir",
    "socket_path": "--socket",
    "socket_mode": "--socket-mode",
    "min_sites": "--min-sites",
    "max_release_epsilon": "--max-release-epsilon",
}


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --batch-size."""
    parser.add_argument("--model", type=Path, help="local model directory (save_pretrained)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CUDA if available)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on GPU, else float32")
    parser.add_argument("--batch-size", type=positive_int, help="prompts per forward (default 4)")
    parser.add_argument(
        "--attn-implementation",
        choices=ATTENTION_CHOICES,
        help="attention kernel (default: transformers' choice, sdpa where supported)",
    )
    parser.add_argument(
        "--device-map", help="from_pretrained device map, e.g. auto (needs accelerate)"
    )


def add_image_crops_option(parser: argparse.ArgumentParser, *, purpose: str) -> None:
    """--max-image-crops N: the plan's cap on crops an image (default: the processor as shipped)."""
    parser.add_argument(
        "--max-image-crops",
        type=positive_int,
        help=f"split no image into more than N crops, {purpose} (1 = no splitting; default: "
        "the processor as shipped). Image splitting multiplies image tokens; a model whose "
        "processor cannot meet the cap is refused",
    )


def add_patch_options(parser: argparse.ArgumentParser) -> None:
    """--policy, --max-new-tokens, --rescale-norm, --answer-end-from: how an artifact answers."""
    parser.add_argument("--policy", choices=PATCH_POLICIES, default="prompt-last-token")
    parser.add_argument("--max-new-tokens", type=positive_int, default=10)
    parser.add_argument(
        "--rescale-norm",
        type=positive_float,
        help="set each released head to this L2 norm (a typical norm on PUBLIC data; "
        "post-processing, no privacy cost)",
    )
    parser.add_argument(
        "--answer-end-from",
        type=Path,
        action="append",
        metavar="DIR",
        help="a labelled PUBLIC dataset (repeat for more; other tasks of the domain will do): "
        "learn from it where a one-token answer ends and patch that at the first decoding "
        "step, so the model answers with the word and stops (no privacy cost; for tasks "
        "whose answers are one token; prompt-last-token policy only)",
    )


def answer_end_folders(args: argparse.Namespace) -> tuple[Path, ...]:
    """The public sets an answer's end is learnt from, each checked (never the private data).

    ``--answer-end-from`` on the command line, else the site's ``answer_end_from`` setting
    (``DPMTV_CLIENT_ANSWER_END_FROM``, config file ``answer-end-from``), as the service reads it.

    Raises:
        ConfigError: One is the site's private data folder (see :func:`public_data_folder`).
    """
    given = getattr(args, "answer_end_from", None)
    if getattr(args, "policy", "prompt-last-token") != "prompt-last-token":
        if given:
            raise ConfigError(
                "--answer-end-from needs --policy prompt-last-token (the answer's end takes "
                f"the first decoding step, which {args.policy} patches), got --policy "
                f"{args.policy}."
            )
        return ()  # the site's setting applies where the policy leaves that step alone
    settings = settings_from(args, ignore=("data_path",))
    for folder in settings.answer_end_from:
        _refuse_private(folder, settings.data_path, "--answer-end-from")
    return settings.answer_end_from


def settings_from(
    args: argparse.Namespace, *, ignore: tuple[str, ...] = (), **mapping: str
) -> SiteSettings:
    """Site settings: flags given on the command line override environment and defaults.

    ``mapping`` maps settings fields to argument names where they differ; fields in
    ``ignore`` are not taken from the arguments (so the environment or config file's value,
    if any, is what the settings hold).

    Raises:
        ConfigError: A value (from a flag or a ``DPMTV_CLIENT_*`` variable) is invalid; the
            message names the flag and the variable.
    """
    names = {"model_path": "model", "data_path": "data", **mapping}
    given: dict[str, Any] = {}
    for field in SiteSettings.model_fields:
        if field in ignore:
            continue
        value = getattr(args, names.get(field, field), None)
        if value is not None and value != []:
            given[field] = tuple(value) if isinstance(value, list) else value
    try:
        return SiteSettings(**given)
    except ValidationError as exc:
        options = {
            field: f"{flag} (or DPMTV_CLIENT_{field.upper()})" for field, flag in _OPTIONS.items()
        }
        raise ConfigError(validation_line(exc, options=options)) from exc


def public_data_folder(args: argparse.Namespace, *, option: str = "--data") -> Path:
    """The PUBLIC dataset folder ``option`` names; never the site's private data setting.

    Public data steers a release with no privacy cost (heads, C), so it must never be the
    private data: it comes only from the explicit option, and is refused when absent (the
    site's ``DPMTV_CLIENT_DATA_PATH`` or config file ``data-path`` names its PRIVATE data and
    is never a fallback) or when it is that very private folder.

    Raises:
        ConfigError: The option is absent, or names the site's private data folder.
    """
    dest = option.lstrip("-").replace("-", "_")
    given: Path | None = getattr(args, dest, None)
    if given is None:
        raise ConfigError(
            f"{option} must name a PUBLIC dataset folder, got none; public data is never "
            "taken from DPMTV_CLIENT_DATA_PATH or a config file's data-path (the site's "
            "private data)."
        )
    _refuse_private(given, settings_from(args, ignore=("data_path",)).data_path, option)
    return given


def _refuse_private(given: Path, private: Path | None, option: str) -> None:
    if private is not None and given.resolve() == private.resolve():
        raise ConfigError(
            f"{option} must be PUBLIC data, got the site's private data folder "
            f"{str(given)!r} (its DPMTV_CLIENT_DATA_PATH or config file data-path): choosing "
            "on it would spend privacy without accounting for it."
        )


def _damaged_weights(directory: Path) -> str:
    """Name the first safetensors file in ``directory`` that cannot be opened."""
    import safetensors

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safetensors.safe_open(str(file), framework="numpy"):
                pass
        except (safetensors.SafetensorError, OSError) as exc:
            return f"{str(file)!r} ({exc})"
    return f"a weights file in {str(directory)!r}"


def check_site_model(settings: SiteSettings) -> str:
    """Refuse the settings' model from its config alone (no weights, no data); its type.

    Commands that read data call this (or :func:`load_site_model`) before the data, so an
    unsupported model is refused in a second, not after a full decode of the dataset.
    """
    from client.models.preflight import preflight_model

    return preflight_model(_model_path(settings))


def _model_path(settings: SiteSettings) -> Path:
    if settings.model_path is None:
        raise ConfigError("a model is needed: pass --model DIR or set DPMTV_CLIENT_MODEL_PATH.")
    return settings.model_path


def load_site_model(settings: SiteSettings) -> LoadedModel:
    """Load the settings' model (checked first by :func:`check_site_model`), or say why not."""
    model_type = check_site_model(settings)
    path = _model_path(settings)
    # Imported here, not at the top: torch and transformers take seconds to import.
    import safetensors

    from client.models import default_fingerprint_cache_dir, load_model
    from client.models.preflight import per_layer_heads_refused

    try:
        with per_layer_heads_refused(model_type):
            return load_model(
                path,
                device=settings.device,
                dtype=settings.dtype,
                device_map=settings.device_map,
                attn_implementation=settings.attn_implementation,
                fingerprint_cache=settings.cache_dir or default_fingerprint_cache_dir(),
            )
    except safetensors.SafetensorError as exc:
        raise ModelError(
            f"--model weights must be complete safetensors files, got a damaged or truncated "
            f"{_damaged_weights(path)}."
        ) from exc


def trusted_keys(settings: SiteSettings) -> TrustedKeys:
    """The public keys whose artifacts the site accepts (at least one)."""
    if not settings.trusted_keys:
        raise ConfigError(
            "trusted keys are needed to verify an artifact: pass --trusted-key FILE.pub "
            "(the coordinator's or your own public key), or set DPMTV_CLIENT_TRUSTED_KEYS."
        )
    return TrustedKeys.from_files(settings.trusted_keys)


def check_artifact(path: Path, keys: TrustedKeys) -> None:
    """Check ``--artifact``'s format and signature before seconds of model loading.

    The model fingerprint is checked later, once the model is loaded (``artifact_patch``).
    """
    if not path.is_dir():
        raise ConfigError(f"--artifact must be an artifact directory, got {str(path)!r}.")
    load_artifact(path, trusted_keys=keys, expected_model_fingerprint=None)


CLIP_SCOPE_LISTED = "listed heads"
"""A heads file's C' was chosen for the layers of the heads it lists (released, or picked among)."""
CLIP_SCOPE_EVERY_HEAD = "every carried head"
"""A heads file's C' was chosen for every carried head's layers (a Gaussian over them all)."""


def heads_file_clip_scope(extras: dict[str, Any]) -> str:
    """The scope a heads file's C' was chosen for: recorded, or read from an older file.

    Older files recorded no ``clip_scope``: a public head list (``select-heads --data``, or
    public heads chosen task-agnostically) for a release-first plan had C' chosen for every
    carried head; every other file for the heads it lists.
    """
    recorded = extras.get("clip_scope")
    if recorded in (CLIP_SCOPE_LISTED, CLIP_SCOPE_EVERY_HEAD):
        return str(recorded)
    public = extras.get("heads_mode") in (None, "public")
    if public and extras.get("release_order") == "release-first":
        return CLIP_SCOPE_EVERY_HEAD
    return CLIP_SCOPE_LISTED


def write_heads_file(path: Path, heads: HeadSet, **extra: Any) -> None:
    """A head list a plan can name: JSON with ``heads`` and descriptive extras."""
    path.write_text(json.dumps({"heads": [list(h) for h in heads.heads], **extra}, indent=2))


def load_heads_file(path: Path) -> tuple[HeadSet, dict[str, Any]]:
    """Read a head list written by ``select-heads``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        heads = HeadSet.of((int(layer), int(head)) for layer, head in data["heads"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--public-heads must be a JSON file with a 'heads' list of [layer, head] pairs, "
            f"got {str(path)!r} ({exc})."
        ) from exc
    if not heads.heads:
        raise ConfigError(f"--public-heads must list at least one head, got none in {str(path)!r}.")
    return heads, data
