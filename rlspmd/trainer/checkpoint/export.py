"""Hugging Face export: a checkpoint's model files (config, generation config, tokenizer: with the DCP shards, all
``scripts/export_hf.py`` needs), and the trained model as a Hugging Face directory (safetensors, written by
transformers) at a save (``checkpoint.save_hf``) or at the end of SFT.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.distributed.dispatch import on_main
from rlspmd.engines.base import TrainingEngine


def write_hf_dir(
    hf_model,
    state_dict: dict[str, torch.Tensor],
    tokenizer,
    source_dir: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``config.json``, safetensors, the tokenizer and the generation config into ``out`` (one process).

    Written into ``out.tmp`` and renamed, so an interrupted write never leaves a half-written model.
    """
    out = Path(out)
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name in ("generation_config.json", "preprocessor_config.json"):
        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


MODEL_FILES = ("config.json", "generation_config.json", "preprocessor_config.json")
"""Copied beside the weights; ``preprocessor_config.json`` is a vision-language model's image processor."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
)


def copy_model_files(model_dir: str | Path, tokenizer_dir: str | Path, out: Path) -> None:
    """Copy the model's config, generation config and tokenizer files verbatim: with the weights in the DCP
    shards, that is all it takes to turn a checkpoint back into an HF model (``scripts/export_hf.py``)."""
    out.mkdir(parents=True, exist_ok=True)
    for src, names in ((Path(model_dir), MODEL_FILES), (Path(tokenizer_dir), TOKENIZER_FILES)):
        for name in names:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)


def save_hf_model(
    engine, tokenizer, source_dir: str | Path, out: str | Path, *, is_main: bool, dtype: torch.dtype | None = None
) -> Path:
    """Gather the engine's full weights (collective) and write them as an HF directory on rank 0."""
    sd = engine.hf_state_dict()
    if is_main:
        write_hf_dir(engine.hf_model, sd, tokenizer, source_dir, out, dtype=dtype)
    return Path(out)


def write_model_files(
    ckpt: Path,
    *,
    model_path: str,
    tokenizer_path: str | None,
    save_hf: bool,
    tokenizer,
    engine: TrainingEngine,
    mesh: DeviceMesh,
) -> None:
    """A checkpoint's ``write_files`` (RL and SFT): the model's config and tokenizer files for export, and with
    ``checkpoint.save_hf`` the actor as an HF directory (collective: every rank gathers the full weights)."""
    full = engine.hf_state_dict() if save_hf else None

    def write():
        copy_model_files(model_path, tokenizer_path or model_path, ckpt / "model")
        if full is not None:
            write_hf_dir(engine.hf_model, full, tokenizer, model_path, ckpt / "hf")

    on_main(write, mesh=mesh)
