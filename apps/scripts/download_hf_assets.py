"""Download a model's Hugging Face assets (tokenizer, config, safetensors) into the folder a config names.

    python apps/scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer config
    # -> ./assets/hf/Llama-3.1-8B, the model.hf_assets_path of apps/configs/llama3_8b.toml

Gated repositories (Llama) need a token: --hf_token, or HF_TOKEN in the environment (or a prior
`huggingface-cli login`). Only files matching the chosen assets are fetched.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("download_hf_assets")

# File patterns per asset kind, as laid out on the hub. Llama 3 keeps its tiktoken file in original/.
ASSET_PATTERNS = {
    "tokenizer": [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "original/tokenizer.model",
    ],
    "config": ["config.json", "generation_config.json"],
    "index": ["model.safetensors.index.json"],
    "safetensors": ["*.safetensors", "model.safetensors.index.json"],
}


def patterns_for(assets: list[str], extra: list[str] | None = None) -> list[str]:
    """The allow-patterns for `assets` (kinds of ASSET_PATTERNS) plus any extra patterns, without repeats."""
    unknown = [a for a in assets if a not in ASSET_PATTERNS]
    if unknown:
        raise ValueError(f"unknown asset kind(s) {unknown}; choose from {', '.join(ASSET_PATTERNS)}")
    patterns: list[str] = []
    for pattern in [p for a in assets for p in ASSET_PATTERNS[a]] + list(extra or []):
        if pattern not in patterns:
            patterns.append(pattern)
    return patterns


def resolve_token(flag: str | None) -> str | None:
    """The token from --hf_token, else HF_TOKEN / HUGGING_FACE_HUB_TOKEN, else None (huggingface_hub's login)."""
    return flag or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def target_folder(local_dir: str, repo_id: str) -> Path:
    """`local_dir/<model name>`: meta-llama/Llama-3.1-8B lands in ./assets/hf/Llama-3.1-8B."""
    return Path(local_dir) / repo_id.split("/")[-1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo_id", required=True, help="hub repository, e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument(
        "--assets", nargs="+", default=["tokenizer"], choices=sorted(ASSET_PATTERNS), help="what to download"
    )
    parser.add_argument("--additional_patterns", nargs="*", default=[], help="more glob patterns to fetch")
    parser.add_argument(
        "--local_dir", default="./assets/hf", help="parent folder; the model name is appended"
    )
    parser.add_argument("--hf_token", default=None, help="access token (default: $HF_TOKEN)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    folder = target_folder(args.local_dir, args.repo_id)
    patterns = patterns_for(args.assets, args.additional_patterns)
    logger.info(
        "downloading %s (%s) from %s into %s",
        ", ".join(args.assets),
        ", ".join(patterns),
        args.repo_id,
        folder,
    )
    try:
        snapshot_download(
            repo_id=args.repo_id,
            revision=args.revision,
            local_dir=folder,
            allow_patterns=patterns,
            token=resolve_token(args.hf_token),
        )
    except GatedRepoError:
        logger.error(
            "%s is gated: accept its licence on huggingface.co, then pass --hf_token or set HF_TOKEN",
            args.repo_id,
        )
        return 1
    except LocalEntryNotFoundError:
        logger.error(
            "cannot reach the Hugging Face hub for %s (HF_HUB_OFFLINE is set, or there is no network); "
            "download on a machine with access and copy %s here",
            args.repo_id,
            folder,
        )
        return 1
    except RepositoryNotFoundError:
        logger.error("%s does not exist or is private (check the name, or pass a token)", args.repo_id)
        return 1
    files = sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts
    )
    logger.info("done: %d files; set model.hf_assets_path = %s", len(files), folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
