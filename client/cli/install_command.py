"""``dpmtv-site install-artifact``: put a released artifact where the site service serves it.

A single-holder release (``dpmtv-site release --out DIR``) writes its artifact where the admin
said; the site service serves (``ask``, ``serve --http``) only artifacts in its own artifacts
folder. This command checks the artifact as the service would before serving it, and as a site
checks a federated one against its plan (here: the plan signed into the manifest), then copies
it in under its release id. A running service lists it at once (``GET /v1/models``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from client.cli._common import add_model_options, check_site_model, settings_from, trusted_keys

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``install-artifact`` sub-command."""
    parser = sub.add_parser(
        "install-artifact",
        help="check a released artifact and install it where the site service serves it",
        description="Checks ARTIFACT as the site service checks what it serves (signature of "
        "a trusted key, tensors' hash, this model's fingerprint, dtype and chat template, "
        "heads that exist) and against the plan signed into it (epsilon and sigma recomputed), "
        "then copies it into the service's artifacts folder under its release id, never "
        "replacing one. Give the settings the service runs with (--config, --state-dir, "
        "--model, --trusted-key: e.g. your own public key for your single-holder releases).",
    )
    parser.add_argument("artifact", type=Path, metavar="ARTIFACT", help="an artifact folder")
    parser.add_argument(
        "--config",
        dest="config_file",
        type=Path,
        help="the service's TOML file of site settings",
    )
    add_model_options(parser)
    parser.add_argument("--state-dir", type=Path, help="the service's state folder")
    parser.add_argument("--artifacts-dir", type=Path, help="the service's artifacts folder")
    parser.add_argument(
        "--trusted-key",
        dest="trusted_keys",
        type=Path,
        action="append",
        help="a public key whose artifacts the service accepts (repeat)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Check and install; print the model id it is served under."""
    settings = settings_from(args)
    trusted_keys(settings)  # none: refused before the model loads
    check_site_model(settings)
    # Imported here: the service side loads torch and the model.
    from client.release.site import Site
    from client.service.install import install_artifact

    installed = install_artifact(Site(settings), args.artifact)
    release_id = installed.name
    print(
        f"installed release {release_id} -> {installed}\n"
        f"served as model {release_id!r} by 'dpmtv-site serve --http' (GET /v1/models lists "
        f"it) and by 'dpmtv-site ask --release-id {release_id}'"
    )
    return 0
