"""Export the actor of an rlspmd checkpoint as a Hugging Face model directory (one process, CPU, no GPUs needed).

    python scripts/export_hf.py outputs/run/checkpoints/step_00000100 outputs/run/hf-step100
    python scripts/export_hf.py outputs/run/checkpoints hf-latest --dtype bfloat16   # the newest checkpoint

The checkpoint carries everything needed: the DCP shards hold the weights (any number of ranks wrote
them; DCP reads them back unsharded) and ``model/`` holds the config and tokenizer copied at save time.
The model is built on the meta device and materialised once, so memory is about one copy of the weights.
The output loads with ``transformers.AutoModelForCausalLM.from_pretrained`` (a vision-language model: with
``AutoModelForImageTextToText``, its image processor copied).

A LoRA run's checkpoint (``actor.lora.rank`` > 0) holds the adapters only: the base weights are read from the model
directory the run trained (``meta.json``; ``--base-model`` points elsewhere), the adapters are merged into them
(``W + alpha / r * B @ A``) for the HF directory, and ``OUT/adapter`` gets the adapters in peft's format
(``PeftModel.from_pretrained(base, "OUT/adapter")``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing rlspmd
    sys.path.insert(0, str(ROOT))

from rlspmd.config import LoraConfig  # noqa: E402
from rlspmd.models.lora import is_adapter, write_peft_adapter  # noqa: E402
from rlspmd.trainer.checkpoint import (  # noqa: E402
    MODEL_FILES,
    TOKENIZER_FILES,
    dcp_load,
    read_dcp_metadata,
    read_meta,
    resolve_checkpoint,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFIX = "actor.model.hf."  # DCP key of the HF model inside the actor engine's root module


def export(checkpoint: str | Path, out: str | Path, *, dtype: str | None = None, base_model: str | None = None) -> Path:
    from transformers import AutoConfig

    from rlspmd.models.vision import auto_class

    ckpt = resolve_checkpoint(checkpoint, field_name="checkpoint")
    meta = read_meta(ckpt)
    files = ckpt / "model"
    if not (files / "config.json").is_file():
        raise FileNotFoundError(
            f"checkpoint {ckpt} has no model/config.json (written by save); cannot tell the architecture"
        )
    saved = read_dcp_metadata(ckpt).state_dict_metadata
    actor_cfg = meta["config"]["actor"]
    lora = (
        LoraConfig(**actor_cfg["lora"]) if "lora" in actor_cfg else LoraConfig()
    )  # older checkpoints: no LoRA section
    if lora.enabled:
        return _export_lora(ckpt, out, meta=meta, saved=saved, lora=lora, dtype=dtype, base_model=base_model)
    config = AutoConfig.from_pretrained(str(files))
    with torch.device("meta"):
        model = auto_class(config).from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    state = model.state_dict()
    missing = [k for k in state if PREFIX + k not in saved]
    if missing:
        raise ValueError(
            f"checkpoint {ckpt} ({meta.get('models', {}).get('actor')}) lacks {len(missing)} weight(s) of the "
            f"architecture in model/config.json, e.g. {PREFIX + missing[0]!r}"
        )
    request = {PREFIX + k: v for k, v in state.items()}
    dcp_load(request, ckpt, no_dist=True)  # one process, unsharded; reads tensors only (any checkpoint format)
    model.load_state_dict({k: request[PREFIX + k] for k in state}, strict=True)
    return _write(model, files, out, dtype=dtype)


def _write(model, files: Path, out: str | Path, *, dtype: str | None, adapter: dict | None = None) -> Path:
    """``model`` (and ``adapter``: ``write_peft_adapter``'s arguments) into ``out``, atomically."""
    if dtype is not None:
        model.to(DTYPES[dtype])
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in (*TOKENIZER_FILES, *(f for f in MODEL_FILES if f != "config.json")):
        if (files / name).is_file():
            shutil.copy(files / name, tmp / name)
    if adapter is not None:
        write_peft_adapter(out=tmp / "adapter", **adapter)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _export_lora(
    ckpt: Path, out: str | Path, *, meta: dict, saved: dict, lora: LoraConfig, dtype: str | None, base_model: str | None
) -> Path:
    """The base model from its directory, the checkpoint's adapters merged into it,
    and the adapters in peft's format."""
    from rlspmd.models.loader import load_causal_lm
    from rlspmd.models.lora import ADAPTER, merged_weight

    base = base_model or meta["models"]["actor"]
    model = load_causal_lm(
        base,
        dtype="float32",
        attn_implementation="sdpa",
        field_name="--base-model" if base_model else "the run's actor.model.path (meta.json; --base-model overrides)",
    )
    adapters = {
        k[len(PREFIX) :]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in saved.items()
        if k.startswith(PREFIX) and is_adapter(k)
    }
    if not adapters:
        raise ValueError(f"checkpoint {ckpt} was written by a LoRA run but holds no adapters under {PREFIX!r}")
    request = {PREFIX + k: v for k, v in adapters.items()}
    dcp_load(request, ckpt, no_dist=True)
    adapters = {k: request[PREFIX + k] for k in adapters}
    params = dict(model.named_parameters())
    s = lora.alpha / lora.rank
    with torch.no_grad():
        for name in adapters:
            if name.endswith(f".lora_A.{ADAPTER}.weight"):
                layer = name[: -len(f".lora_A.{ADAPTER}.weight")]
                if f"{layer}.weight" not in params:
                    raise ValueError(f"checkpoint {ckpt}: adapter {name!r} has no base weight {layer}.weight in {base}")
                w = params[f"{layer}.weight"]
                w.copy_(merged_weight(w, adapters[name], adapters[f"{layer}.lora_B.{ADAPTER}.weight"], s))
    return _write(
        model, ckpt / "model", out, dtype=dtype, adapter=dict(hf_state=adapters, cfg=lora, base_model=str(base))
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint (.../step_XXXXXXXX) or a checkpoint root (uses its newest)")
    p.add_argument("out", help="output Hugging Face model directory (replaced if it exists)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as trained)")
    p.add_argument(
        "--base-model",
        default=None,
        help="LoRA checkpoints: the base model directory (default: the run's actor.model.path from meta.json)",
    )
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, dtype=args.dtype, base_model=args.base_model)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"export_hf: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
