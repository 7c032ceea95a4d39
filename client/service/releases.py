"""The releases the service can serve: each stored artifact, verified before it is named.

A model name on the HTTP endpoint is a release id (a plain token, so never a path) or
:data:`PLAIN_MODEL_ID` (the unpatched model; it holds a ``/``, which no release id may).
A release is listed and served only once its artifact passes the checks of every other use:
the signature of a trusted key, the tensors' hash, the model's fingerprint, dtype and chat
template, and heads that exist in the loaded model. A request is served a release only with
the instruction the release's prompts carried (its system messages, or none), checked per
request since each request brings its own. A verified artifact is kept in memory until one of its
files changes (size or modification time), when it is verified again; its files are looked at
again at most once every ``recheck_s`` (default :data:`RECHECK_S`), not at every request: a
listing and a ``stat`` of each file cost a small model's request a few percent of its
throughput, and what a request meanwhile gets is the copy verified before (a release removed
or rewritten on disk is seen within that second). A site that names public
sets in ``answer_end_from`` has each release's ``prompt-last-token`` rows take the answer's end
learnt from them (:mod:`client.service.answer_ends`). Why an artifact fails
goes to the log only: the reason may name a path of the site.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import TypeAdapter, ValidationError

from client.activations.hooks import PatchPolicy
from client.inference.answers import check_instruction
from client.models import LoadedModel
from client.release.site import Site
from client.service.answer_ends import AnswerEnds
from client.service.inference import verified_artifact
from client.service.rows import RowPatch
from dpmtv_common.artifact import ArtifactManifest, TaskVectorArtifact
from dpmtv_common.errors import ConfigError, DpmtvError
from protocol.plan import ReleaseId

__all__ = [
    "PLAIN_MODEL_ID",
    "RECHECK_S",
    "ReleaseCatalogue",
    "UnknownModelError",
    "servable_artifact",
]

_log = logging.getLogger(__name__)

PLAIN_MODEL_ID = "dpmtv/plain"
"""The model name that serves the model without any patch."""

RECHECK_S = 1.0
"""Seconds a verified artifact is served before its files are looked at again."""

_Stamp = tuple[tuple[str, int, int], ...]
_Served = tuple[RowPatch, int | None, ArtifactManifest]
"""A verified release: its row patch, its image-crop cap, and its manifest."""
_RELEASE_ID: TypeAdapter[str] = TypeAdapter(ReleaseId)


@dataclasses.dataclass(frozen=True)
class _Verified:
    """A verified release, the files it was verified from, and when they were looked at."""

    stamp: _Stamp
    served: _Served
    looked: float


class UnknownModelError(ConfigError):
    """A request names no release whose verified artifact this site stores."""


class ReleaseCatalogue:
    """Verified patches of the site's stored artifacts, by release id (thread-safe).

    Args:
        site: The site whose artifacts folder and model are served.
        model_lock: The lock every use of the model takes (learning an answer's end runs it).
        answer_ends: Where each release's public answer's end is learnt and kept; None: none.
        capped: The site's model capped at an image-crop cap (the server's copies).
        recheck_s: Seconds between looks at a verified artifact's files (0: every request).
        clock: Seconds, monotonic (tests pass their own).

    Raises:
        ConfigError: ``recheck_s`` is negative.
    """

    def __init__(
        self,
        site: Site,
        *,
        model_lock: threading.Lock | None = None,
        answer_ends: AnswerEnds | None = None,
        capped: Callable[[int | None], LoadedModel] | None = None,
        recheck_s: float = RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not recheck_s >= 0:  # also refuses NaN
            raise ConfigError(f"recheck_s must be at least 0 seconds, got {recheck_s!r}.")
        self._site = site
        self._lock = threading.Lock()
        self._verified: dict[str, _Verified] = {}
        self._recheck_s = recheck_s
        self._clock = clock
        self._model_lock = model_lock or threading.Lock()
        self._answer_ends = answer_ends
        self._capped = capped or (lambda crops: site.model().with_image_crops(crops))

    def model_ids(self) -> list[str]:
        """The plain model's name, then every release whose artifact verifies, sorted."""
        folder = self._site.settings.artifacts_folder
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        verified = [name for name in names if self._lookup(name) is not None]
        return [PLAIN_MODEL_ID, *verified]

    def patch(
        self, model: str, policy: PatchPolicy, *, instruction: str | None
    ) -> tuple[RowPatch | None, int | None]:
        """The row patch and image-crop cap that serving ``model`` takes.

        ``instruction`` is the one the request's prompt carries; the plain model takes any.

        Raises:
            UnknownModelError: ``model`` is neither the plain model nor a release whose
                artifact this site stores and verifies.
            ConfigError: ``instruction`` is not the one the release's prompts carried.
        """
        if model == PLAIN_MODEL_ID:
            return None, None
        found = self._lookup(model)
        if found is None:
            raise UnknownModelError(
                f"model must be {PLAIN_MODEL_ID!r} or a release id this site holds a verified "
                f"artifact for (GET /v1/models lists them), got {model[:80]!r}."
            )
        patch, crops, manifest = found
        remedy = "send the release's instruction as the system message (or none if it had none)"
        check_instruction(manifest, instruction, remedy=remedy)
        if policy is not patch.policy:
            return RowPatch(patch.release_id, patch.heads, patch.values, policy), crops
        answer_end = self._answer_end(patch, crops, manifest, instruction)
        if answer_end is not None:
            patch = dataclasses.replace(patch, answer_end=answer_end)
        return patch, crops

    def _answer_end(
        self,
        patch: RowPatch,
        crops: int | None,
        manifest: ArtifactManifest,
        instruction: str | None,
    ) -> torch.Tensor | None:
        """The release's public answer's end (learnt at its first request), or None."""
        if self._answer_ends is None or not self._answer_ends.enabled:
            return None
        loaded = self._capped(crops)
        return self._answer_ends.for_release(
            manifest, patch.heads, loaded, instruction, model_lock=self._model_lock
        )

    def _lookup(self, name: str) -> _Served | None:
        try:
            release_id = _check_release_id(name)
        except ValueError:
            return None
        now = self._clock()
        with self._lock:
            cached = self._verified.get(release_id)
        if cached is not None and now - cached.looked < self._recheck_s:
            return cached.served
        folder = self._site.settings.artifacts_folder / release_id  # a checked token
        stamp = _stamp(folder)
        if not stamp:
            with self._lock:
                self._verified.pop(release_id, None)
            return None
        with self._lock:
            cached = self._verified.get(release_id)
            if cached is not None and cached.stamp == stamp:
                self._verified[release_id] = dataclasses.replace(cached, looked=now)
                return cached.served
            try:
                served = _load_patch(self._site, folder, release_id)
            except (DpmtvError, OSError) as exc:  # the reason may name a path: log only
                _log.warning("release %s is not served: %s", release_id, exc)
                self._verified.pop(release_id, None)
                return None
            self._verified[release_id] = _Verified(stamp, served, now)
            return served


def _check_release_id(name: str) -> str:
    try:
        return str(_RELEASE_ID.validate_python(name))
    except ValidationError as exc:
        raise ValueError(str(exc)) from exc


def _stamp(folder: Path) -> _Stamp:
    if not folder.is_dir() or folder.is_symlink():
        return ()
    try:
        return tuple(sorted(_file_stamp(p) for p in folder.iterdir()))
    except OSError:
        return ()


def _file_stamp(path: Path) -> tuple[str, int, int]:
    info = path.stat()  # one call a file: every request checks its release's files
    return path.name, info.st_mtime_ns, info.st_size


def servable_artifact(site: Site, folder: Path) -> TaskVectorArtifact:
    """The artifact in ``folder`` if this service would serve it (every check of serving).

    Raises:
        DpmtvError: What refused it (signature, hash, model, dtype, template, heads, values).
    """
    artifact, _ = verified_artifact(site, folder)
    return artifact


def _load_patch(site: Site, folder: Path, release_id: str) -> _Served:
    artifact, values = verified_artifact(site, folder)
    patch = RowPatch(release_id, artifact.heads, values, PatchPolicy.PROMPT_LAST_TOKEN)
    return patch, artifact.manifest.max_image_crops, artifact.manifest
