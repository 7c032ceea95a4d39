"""Options and helpers shared by the ``dpmtv-site`` commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from client.hooks import PatchPolicy
from client.models import LoadedModel, load_model
from client.settings import SiteSettings
from dpmtv_common.crypto import TrustedKeys
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

__all__ = [
    "add_model_options",
    "add_patch_options",
    "load_heads_file",
    "load_site_model",
    "settings_from",
    "trusted_keys",
    "write_heads_file",
]


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --batch-size."""
    parser.add_argument("--model", type=Path, help="local model directory (save_pretrained)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CUDA if available)")
    parser.add_argument("--dtype", help="float32, bfloat16, float16 (default: bf16 on GPU)")
    parser.add_argument("--batch-size", type=int, help="prompts per forward pass (default 4)")


def add_patch_options(parser: argparse.ArgumentParser) -> None:
    """--policy, --max-new-tokens, --rescale-norm: how an artifact answers queries."""
    parser.add_argument(
        "--policy", choices=[p.value for p in PatchPolicy], default="prompt-last-token"
    )
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument(
        "--rescale-norm",
        type=float,
        help="set each released head to this L2 norm (a typical norm on PUBLIC data; "
        "post-processing, no privacy cost)",
    )


def settings_from(args: argparse.Namespace, **mapping: str) -> SiteSettings:
    """Site settings: flags given on the command line override environment and defaults.

    ``mapping`` maps settings fields to argument names where they differ.
    """
    names = {"model_path": "model", "data_path": "data", **mapping}
    given: dict[str, Any] = {}
    for field in SiteSettings.model_fields:
        value = getattr(args, names.get(field, field), None)
        if value is not None and value != []:
            given[field] = tuple(value) if isinstance(value, list) else value
    return SiteSettings(**given)


def load_site_model(settings: SiteSettings) -> LoadedModel:
    """Load the settings' model, or say how to name one."""
    if settings.model_path is None:
        raise ConfigError("a model is needed: pass --model DIR or set DPMTV_CLIENT_MODEL_PATH.")
    return load_model(settings.model_path, device=settings.device, dtype=settings.dtype)


def trusted_keys(settings: SiteSettings) -> TrustedKeys:
    """The public keys whose artifacts the site accepts (at least one)."""
    if not settings.trusted_keys:
        raise ConfigError(
            "trusted keys are needed to verify an artifact: pass --trusted-key FILE.pub "
            "(the coordinator's or your own public key), or set DPMTV_CLIENT_TRUSTED_KEYS."
        )
    return TrustedKeys.from_files(settings.trusted_keys)


def write_heads_file(path: Path, heads: HeadSet, **extra: Any) -> None:
    """A head list a plan can name: JSON with ``heads`` and descriptive extras."""
    path.write_text(json.dumps({"heads": [list(h) for h in heads.heads], **extra}, indent=2))


def load_heads_file(path: Path) -> tuple[HeadSet, dict[str, Any]]:
    """Read a head list written by ``select-heads``."""
    try:
        data = json.loads(path.read_text())
        heads = HeadSet.of((int(layer), int(head)) for layer, head in data["heads"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"heads file must be JSON with a 'heads' list of [layer, head] pairs, got {str(path)!r}"
            f" ({exc})."
        ) from exc
    if not heads.heads:
        raise ConfigError(f"heads file must list at least one head, got none in {str(path)!r}.")
    return heads, data
