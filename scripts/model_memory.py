"""Print the memory a model needs, from its config alone (no weights read).

Weights, KV cache and captured heads, as ``client.models.memory`` computes them:

    .venv/bin/python scripts/model_memory.py models/my-vlm [more folders...]
    .venv/bin/python scripts/model_memory.py --defaults   # transformers' default config per family

``--tokens`` sets the prompt length of the KV-cache column (default 4096: about a 4-shot chunk
of a VLM that spends ~800 tokens an image; ``dpmtv-site data check DIR --model M`` measures
yours) and ``--batch`` the prompts a forward (``--batch-size``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from client.models.memory import MemoryEstimate, estimate_memory, memory_of_folder

HEADER = (
    "| model | parameters | weights bf16 (GiB) | attention: layers x heads (KV heads) x size "
    "| KV cache (GiB) | captured heads a chunk |\n|---|---:|---:|---|---:|---:|"
)


def row(name: str, estimate: MemoryEstimate, *, tokens: int, batch: int) -> str:
    """One markdown row."""
    kv = estimate.kv_cache_gib(tokens, batch=batch)
    return (
        f"| {name} | {_count(estimate.parameters)} | {estimate.weights_gib():.1f} "
        f"| {estimate.layers} x {estimate.heads} ({estimate.kv_heads}) x {estimate.head_dim} "
        f"| {kv:.2f} | {estimate.capture_bytes() / 1024:.0f} KiB |"
    )


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e8 else f"{parameters / 1e6:.2f} M"


def main() -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="local model folders")
    parser.add_argument("--defaults", action="store_true", help="each family's default config")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="prompts a forward (default 1)")
    args = parser.parse_args()
    print(HEADER.replace("KV cache (GiB)", f"KV cache, {args.batch} x {args.tokens} tokens (GiB)"))
    for folder in args.folders:
        print(row(str(folder), memory_of_folder(folder), tokens=args.tokens, batch=args.batch))
    if args.defaults:
        from transformers import CONFIG_MAPPING

        from client.models import supported_model_types

        warnings.simplefilter("ignore")  # default configs warn about their own defaults
        for model_type in supported_model_types():
            estimate = estimate_memory(CONFIG_MAPPING[model_type]())
            print(row(f"`{model_type}`", estimate, tokens=args.tokens, batch=args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
