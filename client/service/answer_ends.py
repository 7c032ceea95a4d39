"""Each served release's answer's end, learnt once from the site's PUBLIC sets.

A site that sets ``answer_end_from`` (labelled public datasets; never its private data) has
every release it serves under the ``prompt-last-token`` policy answer with a one-token
answer and stop (:mod:`client.inference.answer_end`). The end depends on the release's heads
and chunk size, on the prompts' instruction and image-crop cap, and on the public data: it is
learnt at the first request that needs it and kept for the service's life (a public set
changed on disk is read again only after a restart). Learning runs the model, under the
model lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from client.data.records import load_dataset
from client.inference.answer_end import learn_answer_end
from client.models import LoadedModel, instruction_digest
from client.settings import SiteSettings
from dpmtv_common.artifact import ArtifactManifest
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

__all__ = ["AnswerEnds", "check_public_answer_end"]

_log = logging.getLogger(__name__)

_Key = tuple[str, tuple[tuple[int, int], ...], int, str, int | None]


def check_public_answer_end(settings: SiteSettings) -> None:
    """Refuse an ``answer_end_from`` that names the site's private data folder.

    Raises:
        ConfigError: One of the folders is ``data_path``.
    """
    private = settings.data_path
    for folder in settings.answer_end_from:
        if private is not None and folder.resolve() == private.resolve():
            raise ConfigError(
                "answer_end_from (--answer-end-from, DPMTV_CLIENT_ANSWER_END_FROM) must be "
                f"PUBLIC data, got the site's private data folder {str(folder)!r}: learning on "
                "it would spend privacy without accounting for it."
            )


class AnswerEnds:
    """The answer's end of each (release, heads, instruction, crop cap), learnt once.

    Raises:
        ConfigError: At construction, when ``answer_end_from`` names the private data.
    """

    def __init__(self, settings: SiteSettings) -> None:
        check_public_answer_end(settings)
        self._folders = settings.answer_end_from
        self._lock = threading.Lock()
        self._learnt: dict[_Key, torch.Tensor] = {}

    @property
    def enabled(self) -> bool:
        """Whether the site named public sets to learn answer ends from."""
        return bool(self._folders)

    def for_release(
        self,
        manifest: ArtifactManifest,
        heads: HeadSet,
        loaded: LoadedModel,
        instruction: str | None,
        *,
        model_lock: threading.Lock | None = None,
    ) -> torch.Tensor | None:
        """The release's answer's end in its heads, or None when the site names no public set.

        ``loaded`` is the model capped as the release's queries are. Learning runs the model
        once per public chunk: under ``model_lock``, taken only then (a learnt end is read
        without it, so serving never waits on the model to find it); None: the caller holds
        the model lock already.

        Raises:
            DataError: A public set cannot be read, or has no one-token answer.
        """
        if not self._folders:
            return None
        key = (
            manifest.release_id,
            heads.heads,
            manifest.shots,
            instruction_digest(instruction),
            loaded.max_image_crops,
        )
        with self._lock:
            if key in self._learnt:
                return self._learnt[key]
        with model_lock or contextlib.nullcontext(), self._lock:  # the model lock first, always
            if key not in self._learnt:
                datasets = [load_dataset(folder) for folder in self._folders]
                end = learn_answer_end(
                    loaded, datasets, heads, shots=manifest.shots, instruction=instruction
                )
                self._learnt[key] = end.values
                _log.info(
                    "release %s: answer's end learnt from %d public chunks (%d skipped: "
                    "answers of more than one token)",
                    manifest.release_id, end.chunks, end.skipped,
                )  # fmt: skip
            return self._learnt[key]
