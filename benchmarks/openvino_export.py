"""Exports the benchmark model to OpenVINO IR once (fp16 weights; or int8, `--weight-format int8`),
for the benchmarks' OpenVINO peer.

    .venv/bin/python benchmarks/openvino_export.py --optimum-cli .venv-openvino/bin/optimum-cli

The export lands in `<cache>/openvino/<model folder name>-<format>` (the cache is the engine's:
`$DAGSTER_LLM_CACHE`, else `~/.cache/dagster-llm`); a later call finds it and does nothing.
The model folder's name carries the embedded model's hash, so a new model gets a new export.
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model_loader.embedded_model import default_cache_dir  # noqa: E402
from engine.model_loader.folder import resolve_model_path  # noqa: E402

MARKER = "openvino_model.xml"


def export_dir(model_path: Path, weight_format: str = "fp16") -> Path:
    """Where the OpenVINO export of the Hugging Face folder `model_path` lives."""
    return default_cache_dir() / "openvino" / f"{model_path.name}-{weight_format}"


def ensure_export(model_path: Path, optimum_cli: Path, weight_format: str = "fp16") -> Path:
    """Exports `model_path` with `optimum-cli export openvino --weight-format <weight_format>`
    (optimum-intel's int8 is per-channel asymmetric weights) unless done already."""
    target = export_dir(model_path, weight_format)
    if (target / MARKER).exists():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(optimum_cli), "export", "openvino", "--model", str(model_path),
                    "--task", "text-generation-with-past", "--weight-format", weight_format, str(staging)], check=True)
    if not (staging / MARKER).exists():
        raise RuntimeError(f"optimum-cli wrote no {MARKER} into {staging}")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--optimum-cli", type=Path, default=Path(".venv-openvino/bin/optimum-cli"))
    parser.add_argument("--weight-format", default="fp16", choices=["fp16", "int8"])
    args = parser.parse_args()
    print(ensure_export(resolve_model_path(args.model), args.optimum_cli, args.weight_format))


if __name__ == "__main__":
    main()
