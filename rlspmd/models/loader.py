"""Loading local Hugging Face model directories and tokenizers, with errors that name the path.

Simplification: every rank reads the safetensors (memory-mapped) and FSDP2 then keeps only its shard.
That is fine up to a few billion parameters per node; larger models want meta-device init with
rank-0 broadcast (noted in the README's roadmap).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_dir(path: str | Path, *, field_name: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{field_name}: model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{field_name}: {p} has no config.json (not a Hugging Face model directory)")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise FileNotFoundError(f"{field_name}: {p} has no *.safetensors weights")
    return p


def load_tokenizer(path: str | Path, *, field_name: str, require_chat_template: bool = True) -> PreTrainedTokenizerBase:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{field_name}: tokenizer directory {p} does not exist")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"{field_name}: {p} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(str(p))
    if require_chat_template and not tok.chat_template:
        raise ValueError(f"{field_name}: the tokenizer in {p} has no chat template (chat_template.jinja or tokenizer_config.json)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def eos_token_ids(path: str | Path, tok: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the tokenizer and generation_config.json (chat models often stop on several)."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = Path(path).expanduser() / "generation_config.json"
    if gen.is_file():
        import json

        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return sorted(ids)


def load_causal_lm(path: str | Path, *, dtype: str, attn_implementation: str, field_name: str) -> torch.nn.Module:
    p = check_model_dir(path, field_name=field_name)
    config = AutoConfig.from_pretrained(str(p))
    model = AutoModelForCausalLM.from_pretrained(
        str(p), config=config, dtype=DTYPES[dtype], attn_implementation=attn_implementation
    )
    model.config.use_cache = False
    return model


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ModuleList of transformer blocks of a causal LM (the FSDP/checkpointing unit)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
