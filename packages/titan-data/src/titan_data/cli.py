"""`titan-data`: preprocessing from the command line.

titan-data tokenize --input corpus/ --output tokens/ --tokenizer assets/ --workers 8
titan-data prepare c4 --output /lustre/c4 --shards 64 --tokenize-to /lustre/c4_tokens --tokenizer assets/
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from titan_data.datasets.file_formats import FileSource
from titan_data.datasets.registry import DATASETS, get_source
from titan_data.datasets.sources import TextSource
from titan_data.errors import DataError, SourceUnavailable
from titan_data.prepare import SPLITS, prepare_c4
from titan_data.tokenize_job import tokenize_to_shards

logger = logging.getLogger("titan_data.cli")


def _source(args: argparse.Namespace) -> TextSource:
    if args.input in DATASETS:
        return get_source(args.input, args.dataset_path)
    path = Path(args.input)
    if not path.exists():
        raise DataError(
            f"tokenize: --input '{args.input}' is neither a registered dataset ({', '.join(sorted(DATASETS))}) "
            "nor an existing file or folder"
        )
    return FileSource.from_path(path.name, path, text_field=args.text_field)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titan-data", description="Titan data preprocessing")
    commands = parser.add_subparsers(dest="command", required=True)
    tok = commands.add_parser(
        "tokenize",
        help="tokenise text into token shards a memory-mapped dataset trains from",
        description="Tokenise documents into uint16/uint32 token shards with an index. Interrupted runs "
        "continue where they stopped when the same command is run again.",
    )
    tok.add_argument(
        "--input",
        required=True,
        help="a file or folder (.jsonl, .json, .gz, .parquet, .txt), or a dataset name",
    )
    tok.add_argument("--output", required=True, type=Path, help="folder for the shards and index.json")
    tok.add_argument(
        "--tokenizer", required=True, help="tokenizer file, or a folder holding one (hf_assets_path)"
    )
    tok.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1)")
    tok.add_argument(
        "--dataset-path", default=None, help="where a named dataset's files are (e.g. a local C4 copy)"
    )
    tok.add_argument("--text-field", default="text", help="JSON field or parquet column holding the text")
    tok.add_argument("--documents-per-shard", type=int, default=100_000, help="documents in each shard file")
    tok.add_argument("--quiet", action="store_true", help="no progress bar")
    prep = commands.add_parser(
        "prepare",
        help="copy C4 from the hub into a folder dataset_path reads (on a node with hub access)",
        description="Download C4 files laid out as on the hub, resumably (run the same command again after "
        "an interruption) and verified against the sizes and sha256 the hub lists; optionally tokenise them "
        "into token shards too. HF_ENDPOINT names a mirror or proxy.",
    )
    prep.add_argument("dataset", choices=sorted(SPLITS), help="c4 (train split) or c4_validation")
    prep.add_argument("--output", required=True, type=Path, help="folder to hold en/c4-*.json.gz")
    prep.add_argument("--shards", type=int, default=None, help="only the first N files (default: all)")
    prep.add_argument("--verify", action="store_true", help="hash the files already there again")
    prep.add_argument("--tokenize-to", type=Path, default=None, help="also write token shards here")
    prep.add_argument("--tokenizer", default=None, help="tokenizer for --tokenize-to (hf_assets_path)")
    prep.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _tokenize(args: argparse.Namespace) -> int:
    source = _source(args)
    source.check()  # a hub that does not answer: one line now, not a stop at the first document
    index = tokenize_to_shards(
        source,
        args.tokenizer,
        args.output,
        workers=args.workers,
        documents_per_shard=args.documents_per_shard,
        progress=not args.quiet,
    )
    print(f"{args.output}: {index.num_documents:,} documents, {index.num_tokens:,} tokens ({index.dtype})")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    if (args.tokenize_to is None) != (args.tokenizer is None):
        raise DataError("prepare: --tokenize-to and --tokenizer go together")
    files = prepare_c4(
        args.dataset, args.output, shards=args.shards, verify=args.verify, progress=not args.quiet
    )
    print(f"{args.output}: {len(files)} files of {args.dataset}; train with dataset_path = {args.output}")
    if args.tokenize_to is not None:
        index = tokenize_to_shards(
            get_source(args.dataset, args.output),
            args.tokenizer,
            args.tokenize_to,
            workers=args.workers,
            progress=not args.quiet,
        )
        print(
            f"{args.tokenize_to}: {index.num_documents:,} documents, {index.num_tokens:,} tokens; train with "
            f"dataset = token_shards, dataset_path = {args.tokenize_to}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        return _prepare(args) if args.command == "prepare" else _tokenize(args)
    except SourceUnavailable as err:
        print(
            f"titan-data: {err}; what arrived is kept: run the same command again to continue",
            file=sys.stderr,
        )
        return 3
    except DataError as err:
        print(f"titan-data: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = "finished files and shards" if args.command == "prepare" else "finished shards"
        print(
            f"titan-data: interrupted; {kept} are kept in {args.output}. Run the same command again to continue",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
