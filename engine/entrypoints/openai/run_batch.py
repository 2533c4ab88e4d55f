"""`python -m engine.run_batch -i requests.jsonl -o results.jsonl [--model M] [engine settings]`
(the long form: `python -m engine.entrypoints.openai.run_batch`): an OpenAI Batch API input
file run offline, as vLLM's `vllm run-batch` runs one.

Every `LLM` setting is a flag of its own, derived from `EngineConfig` (`--max-num-seqs 64`,
`--enforce-eager` or `--enforce-eager false`, `--limit-mm-per-prompt '{"image": 2}'`, `none` for
None); the run itself is `engine.entrypoints.openai.batch.run_batch_file`. Exit status 0 once the file is
processed (lines with errors included), 2 for arguments or files that cannot be used.
"""

import argparse
import json
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import Field
from typing import Any, Union, get_args, get_origin

from engine.config import engine_settings
from engine.entrypoints.openai.batch import BatchRun, BatchRunError, run_batch_file


def build_parser() -> argparse.ArgumentParser:
    """The command line: the files, the embedding model, and one flag per engine setting."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.run_batch",
        description="Run an OpenAI Batch API file (/v1/chat/completions, /v1/completions and /v1/embeddings "
                    "lines) offline, resuming into an existing output file. See docs/openai-batch.md.")
    parser.add_argument("-i", "--input-file", required=True,
                        help="The batch input file (JSONL): a local path or an fsspec URL such as s3://bucket/in.jsonl.")
    parser.add_argument("-o", "--output-file", required=True,
                        help="The output file (JSONL), a local path: lines already in it are skipped and new ones "
                             "appended. '-' writes to standard output (no resume).")
    parser.add_argument("--embedding-model", default=None,
                        help="The model for /v1/embeddings lines (default: --model, loaded with runner='pooling').")
    settings = parser.add_argument_group("engine settings", "Any LLM(...) setting; 'none' gives None.")
    for setting in engine_settings():
        settings.add_argument(f"--{setting.name.replace('_', '-')}", dest=setting.name, default=argparse.SUPPRESS,
                              help=f"{setting.metadata['help']} (default: {setting.default!r})".replace("%", "%%"),
                              **_value_options(setting))
    return parser


def _value_options(setting: Field) -> dict[str, Any]:
    """How argparse reads a setting: by its type (bool flags alone mean true; dicts are JSON)."""
    union = get_origin(setting.type) in (Union, types.UnionType)
    kinds = [get_origin(kind) or kind for kind in (get_args(setting.type) if union else (setting.type,))]
    optional = type(None) in kinds
    kind = next(kind for kind in kinds if kind is not type(None))
    parse: Callable[[str], Any] = {bool: _boolean, dict: _json_object}.get(kind, kind)

    def convert(text: str) -> Any:
        return None if optional and text.lower() in ("none", "null") else parse(text)

    convert.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    if kind is bool:
        return {"type": convert, "nargs": "?", "const": True, "metavar": "true|false"}
    return {"type": convert, "metavar": kind.__name__.upper()}


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    settings = vars(build_parser().parse_args(argv))
    input_file, output_file = settings.pop("input_file"), settings.pop("output_file")
    run = BatchRun(settings.pop("model", None), settings.pop("embedding_model"), settings)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = run_batch_file(input_file, output_file, run)
    except BatchRunError as exc:
        print(f"run_batch: {exc}", file=sys.stderr)
        return 2
    print(f"run_batch: {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
