"""Export the actor of an rlspmd checkpoint as a Hugging Face model directory (one process, CPU, no GPUs needed).

    python scripts/export_hf.py outputs/run/checkpoints/step_00000100 outputs/run/hf-step100
    python scripts/export_hf.py outputs/run/checkpoints hf-latest --dtype bfloat16   # the newest checkpoint

The checkpoint carries everything needed: the DCP shards hold the weights (any number of ranks wrote
them; DCP reads them back unsharded) and ``model/`` holds the config and tokenizer copied at save time.
The model is built on the meta device and materialised once, so memory is about one copy of the weights.
The output loads with ``transformers.AutoModelForCausalLM.from_pretrained``.
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

from rlspmd.trainer.checkpoint import MODEL_FILES, TOKENIZER_FILES, dcp_load, read_dcp_metadata, read_meta, resolve_checkpoint  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFIX = "actor.model.hf."  # DCP key of the HF model inside the actor engine's root module


def export(checkpoint: str | Path, out: str | Path, *, dtype: str | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = resolve_checkpoint(checkpoint, field_name="checkpoint")
    meta = read_meta(ckpt)
    files = ckpt / "model"
    if not (files / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint {ckpt} has no model/config.json (written by save); cannot tell the architecture")
    config = AutoConfig.from_pretrained(str(files))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    state = model.state_dict()
    saved = read_dcp_metadata(ckpt).state_dict_metadata
    missing = [k for k in state if PREFIX + k not in saved]
    if missing:
        raise ValueError(
            f"checkpoint {ckpt} ({meta.get('models', {}).get('actor')}) lacks {len(missing)} weight(s) of the "
            f"architecture in model/config.json, e.g. {PREFIX + missing[0]!r}"
        )
    request = {PREFIX + k: v for k, v in state.items()}
    dcp_load(request, ckpt, no_dist=True)  # one process, unsharded; reads tensors only (any checkpoint format)
    model.load_state_dict({k: request[PREFIX + k] for k in state}, strict=True)
    if dtype is not None:
        model.to(DTYPES[dtype])
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in (*TOKENIZER_FILES, *(f for f in MODEL_FILES if f != "config.json")):
        if (files / name).is_file():
            shutil.copy(files / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint (.../step_XXXXXXXX) or a checkpoint root (uses its newest)")
    p.add_argument("out", help="output Hugging Face model directory (replaced if it exists)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: as trained)")
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, dtype=args.dtype)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"export_hf: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
