"""Writing models out: Hugging Face directories from a sharded FSDP2 engine.

``save_hf_model`` gathers the full state dict (a collective: every rank of the engine's mesh calls it),
and rank 0 writes ``config.json``, safetensors, the tokenizer and the generation config into a temporary
directory that is renamed into place, so an interrupted save never leaves a half-written model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def hf_state_dict(engine, prefix: str = "hf.") -> dict[str, torch.Tensor]:
    """Full state dict of the HF model inside the engine's root module, HF names (wrapper prefix stripped)."""
    sd = engine.full_state_dict()
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def save_hf_model(engine, tokenizer, source_dir: str | Path, out: str | Path, *, is_main: bool, dtype: torch.dtype | None = None) -> Path:
    out = Path(out)
    sd = hf_state_dict(engine)
    if is_main:
        if dtype is not None:
            sd = {k: v.to(dtype) for k, v in sd.items()}
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        engine.hf_model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        gen = Path(source_dir) / "generation_config.json"
        if gen.is_file():
            shutil.copy(gen, tmp / "generation_config.json")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out
