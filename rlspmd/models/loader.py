"""Loading local Hugging Face model directories and tokenizers, with errors that name the path.

``check_model_dir`` and ``check_tokenizer_dir`` only look at files (no transformers import, no weights read), so the
start-up config check (``rlspmd/validate/``) runs them before anything heavy loads; they also read every
safetensors header, so a truncated or corrupt weights file is named before a model is built.

Simplification: every rank reads the safetensors (memory-mapped) and FSDP2 then keeps only its shard.
That is fine up to a few billion parameters per node; larger models want meta-device init with
rank-0 broadcast (noted in the README's roadmap).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch


@dataclass
class ModelConfig:
    path: str = "models/tiny"
    """Local Hugging Face model directory (config.json, *.safetensors, tokenizer files)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; defaults to ``path``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Storage dtype of the (master) parameters. Keep float32 for training;
    compute dtype is set by FSDP mixed precision."""
    attn_implementation: str = "sdpa"
    """Transformers attention implementation for training forwards (``sdpa``, ``eager``, ``flash_attention_2``)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (activation checkpointing): less activation
    memory for about one more forward of compute. Gradients are unchanged."""
    packing: bool = True
    """Remove padding: run each micro-batch's valid tokens as one packed sequence with per-sample boundaries (the
    attention kernel is ``attn_kernel``). Same results as the padded forward, less compute. Needs
    ``attn_implementation`` ``sdpa`` or ``flash_attention_2``."""
    attn_kernel: Literal["auto", "flash_attn", "varlen", "flex", "sdpa_loop", "cpu_fused"] = "auto"
    """Packed attention kernel (``packing`` with ``attn_implementation=sdpa``): ``flash_attn`` (flash-attn's varlen
    kernel; CUDA, bf16/fp16, needs the package), ``varlen`` (torch's ``varlen_attn``, FlashAttention-2 in libtorch;
    CUDA sm80+, bf16/fp16), ``flex`` (compiled FlexAttention with a document-causal block mask; CUDA), ``sdpa_loop``
    (one SDPA call per sample; any device), ``cpu_fused`` (rlspmd's C++ kernel, one call per pack; CPU, bf16/fp32).
    ``auto``: on CUDA the first of flash_attn, varlen, flex that runs on the device and compute dtype; on CPU cpu_fused
    for bf16 with gradients (training) where the kernels build; else sdpa_loop. One that cannot run here stops the run
    at start-up."""
    share_prompts: bool = True
    """With ``packing`` and the ``sdpa_loop`` or ``cpu_fused`` kernel (what CPU runs), a policy's forward packs the
    prompt of consecutive rows that share it (a GRPO group's samples) once, and each response attends to that one copy:
    the token-wise layers run on fewer tokens, the log-probs and gradients are the unshared ones up to float summation
    order. Other kernels, mixture-of-experts and vision-language models, sequence parallelism and value models pack
    every row whole."""
    sharded_load: bool = True
    """Build the model on the meta device, apply the parallelism, then read only this rank's slices of the safetensors
    files (peak host memory per rank: its shards plus one slice, not the whole model). Keys are matched by name; False
    loads the whole model on every rank with ``from_pretrained`` and shards it (for ``*.bin`` checkpoints, or
    architectures whose checkpoints need transformers' key conversions)."""


if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the config's spelling)."""
    return next(k for k, v in DTYPES.items() if v == dtype)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit


def check_safetensors(path: Path, *, field_name: str) -> None:
    """The file's header parses and the file is exactly as long as the header says (a cut-off download or copy is
    shorter). Reads the header only."""
    size = path.stat().st_size

    def bad(why: str) -> ValueError:
        return ValueError(f"{field_name}: {path} is truncated or corrupt ({why}); re-download or re-copy it")

    if size < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise bad(f"header of {n} bytes in a file of {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise bad(f"header is not JSON: {e}") from None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        raise bad(f"{size} bytes, but its header describes {expected}")


def check_model_dir(path: str | Path, *, field_name: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{field_name}: model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{field_name}: {p} has no config.json (not a Hugging Face model directory)")
    weights = sorted(p.glob("*.safetensors"))
    if not weights and not any(p.glob("*.bin")):
        raise FileNotFoundError(f"{field_name}: {p} has no *.safetensors weights")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        missing = sorted(
            {f for f in json.loads(index.read_text()).get("weight_map", {}).values() if not (p / f).is_file()}
        )
        if missing:
            raise FileNotFoundError(f"{field_name}: {index} lists shard(s) {missing} that are not in {p}")
    for f in weights:
        check_safetensors(f, field_name=field_name)
    return p


def check_tokenizer_dir(path: str | Path, *, field_name: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{field_name}: tokenizer directory {p} does not exist")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{field_name}: {p} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return p


VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")
"""The files that define a tokenizer's token ids (not its chat template or padding side)."""


def tokenizer_vocab(path: str | Path) -> dict[str, int]:
    """Token -> id of the tokenizer in ``path``, read from ``tokenizer.json`` (its model's vocabulary and added tokens)
    without loading transformers; a tokenizer without one (sentencepiece files only) is loaded to ask it."""
    p = Path(path).expanduser()
    fast = p / "tokenizer.json"
    if fast.is_file():
        spec = json.loads(fast.read_text())
        vocab = spec.get("model", {}).get("vocab", {})
        if isinstance(vocab, list):  # Unigram: [piece, score] in id order
            vocab = {piece: i for i, (piece, _score) in enumerate(vocab)}
        return {**vocab, **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(p)).get_vocab())


def check_same_tokenizer(path: str | Path, *, field_name: str, student: str | Path, student_field: str) -> None:
    """The tokenizer in ``path`` gives every token the id the student's tokenizer (``student``) gives it: a model that
    scores another model's token ids (a teacher) must read them as the same tokens. Files compared first (byte-equal
    vocabulary files pass), then the vocabularies; an error names both directories and the first difference."""
    t, s = check_tokenizer_dir(path, field_name=field_name), Path(student).expanduser()
    if t.resolve() == s.resolve():
        return
    files = [f for f in VOCAB_FILES if (t / f).is_file() or (s / f).is_file()]
    if files and all((t / f).is_file() and (s / f).is_file() and (t / f).read_bytes() == (s / f).read_bytes()
                     for f in files):  # fmt: skip
        return
    tv, sv = tokenizer_vocab(t), tokenizer_vocab(s)
    if tv == sv:
        return
    by_id_t, by_id_s = {i: k for k, i in tv.items()}, {i: k for k, i in sv.items()}
    first = next(
        (i for i in sorted(set(by_id_t) | set(by_id_s)) if by_id_t.get(i) != by_id_s.get(i)),
        None,
    )
    raise ValueError(
        f"{field_name}: the tokenizer in {t} ({len(tv)} tokens) is not the student's, {student_field}={s} "
        f"({len(sv)} tokens): token id {first} is {by_id_t.get(first)!r} in one and {by_id_s.get(first)!r} in the "
        "other. The teacher scores the student's token ids, so it needs the student's tokenizer"
    )


def load_tokenizer(path: str | Path, *, field_name: str, require_chat_template: bool = True) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    p = check_tokenizer_dir(path, field_name=field_name)
    tok = AutoTokenizer.from_pretrained(str(p))
    if require_chat_template and not tok.chat_template:
        raise ValueError(
            f"{field_name}: the tokenizer in {p} has no chat template (chat_template.jinja or tokenizer_config.json)"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def eos_token_ids(path: str | Path, tok: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the tokenizer and generation_config.json (chat models often stop on several)."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = Path(path).expanduser() / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return sorted(ids)


def load_causal_lm(path: str | Path, *, dtype: str, attn_implementation: str, field_name: str) -> torch.nn.Module:
    """A causal LM, or a vision-language model (``models/vision.py``) with its vision tower."""
    from transformers import AutoConfig

    from rlspmd.models.vision import attn_implementation as vision_attn
    from rlspmd.models.vision import auto_class

    p = check_model_dir(path, field_name=field_name)
    config = AutoConfig.from_pretrained(str(p))
    model = auto_class(config).from_pretrained(
        str(p), config=config, dtype=DTYPES[dtype], attn_implementation=vision_attn(config, attn_implementation)
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
