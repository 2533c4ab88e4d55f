"""Model folders on an object store: a pod that starts with nothing on its disk fetches the
model once into the machine's cache and loads it from there, as the engine loads only local
folders.

A copy is named by a digest of the folder's URL and its files' names, sizes and versions
(ETag, generation or modification time), so it is reused while the store's files stay the
same, and a changed model is fetched again rather than mixed with the old one. A copy is
downloaded beside its final name and renamed into place when complete: two processes
fetching at once never load half a folder.
"""

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from upath import UPath

from dagster_llm.core.engine_surface import default_cache_dir
from dagster_llm.core.generation import digest

# Keys of fsspec file info that change when an object's content does.
_VERSION_KEYS = ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "last_modified")


def is_remote(model_id: str) -> bool:
    """Whether `model_id` is an object-store URL (s3://, gs://, az://, ...), not a local folder
    or the name of the embedded model."""
    protocol, sep, _ = model_id.partition("://")
    return bool(sep) and protocol not in ("file", "local")


def local_model_folder(model_id: str, storage_options: Mapping[str, Any] | None = None,
                       cache_dir: Path | None = None) -> str:
    """`model_id` itself, or for an object-store URL a local copy of that folder in the cache
    (`cache_dir`, default `$DAGSTER_LLM_CACHE/remote-models`), fetched unless it is there.

    Raises:
        FileNotFoundError: the URL holds no files.
    """
    if not is_remote(model_id):
        return model_id
    folder = UPath(model_id, **(storage_options or {}))
    fs = folder.fs
    fs.invalidate_cache(folder.path)
    files = {path: info for path, info in fs.find(folder.path, detail=True).items() if info.get("type") != "directory"}
    if not files:
        raise FileNotFoundError(f"{model_id}: no files there; point model_id at a model folder (config.json, "
                                "*.safetensors, tokenizer files)")
    root = folder.path.rstrip("/") + "/"
    listing = sorted((path.removeprefix(root), info.get("size"), _version(info)) for path, info in files.items())
    target = (cache_dir or default_cache_dir() / "remote-models") / f"{folder.name}-{digest([model_id, listing])[:16]}"
    if not target.exists():
        _download(fs, {path: path.removeprefix(root) for path in files}, target)
    return str(target)


def _version(info: Mapping[str, Any]) -> str | None:
    return next((str(info[key]) for key in _VERSION_KEYS if info.get(key) is not None), None)


def _download(fs: Any, names: Mapping[str, str], target: Path) -> None:
    """Fetches every file (remote path -> relative name) into `target`, whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        for remote, name in names.items():
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(partial / name))
        try:
            os.rename(partial, target)
        except OSError:
            if not target.exists():
                raise  # else another process finished first: keep its copy
    finally:
        shutil.rmtree(partial, ignore_errors=True)
