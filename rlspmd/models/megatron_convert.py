"""Hugging Face Qwen2/Llama ↔ megatron-core GPT: the architecture and the weight layout, as pure functions.

No megatron import here: everything is plain dicts and tensors, so it is testable (and the round trip exact) on any
machine. ``third_party/megatron_adapter.py`` turns a ``MegatronArch`` into megatron's ``TransformerConfig``.

Layout differences (megatron-core 0.16 ``GPTModel`` with the local layer spec, ``rotary_interleaved=False``):

* **Fused QKV.** ``linear_qkv`` holds q, k and v of all heads in one matrix, *interleaved per query group* (a group
  is one KV head and the ``heads / kv_heads`` query heads that share it)::

      rows  [ q(g0 h0) .. q(g0 h{n-1}) k(g0) v(g0) | q(g1 h0) .. k(g1) v(g1) | ... ]     each block head_dim rows

  HF keeps ``q_proj``/``k_proj``/``v_proj`` apart, query head ``h`` belonging to KV head ``h // (heads / kv_heads)``
  (``repeat_kv``), which is the grouping above. The qkv bias (Qwen2) is fused the same way.
* **Fused gate/up.** ``linear_fc1`` = ``cat(gate_proj, up_proj)`` (megatron's SwiGLU splits its output in halves:
  ``silu(first) * second``).
* **Tied embeddings.** With ``tie_word_embeddings`` megatron has no ``output_layer`` weight (the head reads the
  embedding); HF state dicts still list ``lm_head.weight`` (the same tensor), which ``megatron_to_hf`` restores.
* **Tensor parallelism.** Every HF tensor is either replicated (norms) or split into ``tp`` equal contiguous chunks
  along one dim (``hf_shard_dim``): columns of the output (q/k/v, gate/up, embedding and head rows: dim 0) or of the
  input (o_proj, down_proj: dim 1). A megatron TP shard is then exactly ``join`` of the HF chunks with the local head
  counts: QKV is interleaved per group and groups are split contiguously; fc1's shard is ``[gate chunk; up chunk]``.
  So a local megatron tensor converts to *local HF pieces* (``split_megatron``) with no communication, which is what
  the checkpoint (DTensor pieces) and the weight stream (gather each piece) use.
* **Pipeline parallelism.** Stage ``p`` of ``pp`` holds layers ``[p L/pp, (p+1) L/pp)`` numbered locally from 0 in its
  module; the names here always use global layer indices (``local_name``/``global_name`` translate).

Simplifications: dense models only (no MoE, no MLA), default RoPE only (no ``rope_scaling``), no sliding window, no
attention output bias (Llama ``attention_bias``) and no MLP bias; each raises a ``ValueError`` naming the config key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class MegatronArch:
    """The architecture facts megatron needs, read from an HF ``config.json``."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_embeddings: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def megatron_arch(hf_config: dict, *, field_name: str) -> MegatronArch:
    """``MegatronArch`` of an HF ``config.json`` dict (Qwen2 or Llama); unsupported features raise naming the key.

    Accepts both the transformers 5 layout (``rope_parameters``) and the 4.x one (``rope_theta``, ``rope_scaling``).
    """
    where = f"{field_name} (config.json)"
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type={model_type!r}; the megatron engine supports {SUPPORTED_MODEL_TYPES}")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={hf_config['hidden_act']!r}; only SwiGLU (silu) MLPs are supported")
    rope = hf_config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf_config.get("rope_scaling"):
        raise ValueError(
            f"{where}: rope_scaling / rope_parameters.rope_type={rope_type!r} is not supported (default RoPE only)"
        )
    rope_theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    if rope_theta is None:
        raise ValueError(f"{where}: no rope_theta (in rope_parameters or at the top level)")
    if hf_config.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported")
    if model_type == "llama" and (hf_config.get("attention_bias") or hf_config.get("mlp_bias")):
        raise ValueError(f"{where}: attention_bias / mlp_bias are not supported (megatron would bias every linear)")
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads  # absent in MHA configs
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    hidden = hf_config["hidden_size"]
    return MegatronArch(
        model_type=model_type,
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf_config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hf_config.get("head_dim") or hidden // heads,  # Qwen2 configs leave it implicit
        vocab_size=hf_config["vocab_size"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        rms_norm_eps=float(hf_config["rms_norm_eps"]),
        rope_theta=float(rope_theta),
        qkv_bias=model_type == "qwen2",  # Qwen2 always biases q/k/v; Llama never (attention_bias refused above)
        # Both config classes default to untied embeddings when the key is absent.
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
    )


def check_parallel(arch: MegatronArch, *, tp: int, pp: int, field_prefix: str) -> None:
    """``ValueError`` (naming ``<field_prefix>.tp`` / ``.pp``) when the degrees do not divide the model."""
    for what, n in (
        ("num_key_value_heads", arch.num_kv_heads),
        ("num_attention_heads", arch.num_heads),
        ("vocab_size", arch.vocab_size),
        ("intermediate_size", arch.ffn_hidden_size),
    ):
        if n % tp:
            raise ValueError(f"{field_prefix}.tp={tp} does not divide the model's {what}={n}")
    if arch.num_layers % pp:
        raise ValueError(f"{field_prefix}.pp={pp} does not divide the model's num_hidden_layers={arch.num_layers}")


# -- names ------------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per-layer megatron suffix -> the HF tensors it fuses (suffixes under ``model.layers.<i>.``).
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
_TOP_MAP = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
    "decoder.final_layernorm.weight": ("model.norm.weight",),
    "output_layer.weight": ("lm_head.weight",),
}
# HF tensor suffix -> the dim it is split along under tensor parallelism (None: replicated).
_SHARD_DIM = {
    "q_proj.weight": 0,
    "k_proj.weight": 0,
    "v_proj.weight": 0,
    "q_proj.bias": 0,
    "k_proj.bias": 0,
    "v_proj.bias": 0,
    "o_proj.weight": 1,
    "gate_proj.weight": 0,
    "up_proj.weight": 0,
    "down_proj.weight": 1,
    "embed_tokens.weight": 0,
    "lm_head.weight": 0,
    "input_layernorm.weight": None,
    "post_attention_layernorm.weight": None,
    "norm.weight": None,
}


def megatron_names(arch: MegatronArch, layers: range | None = None, *, with_head: bool = True) -> list[str]:
    """Megatron parameter names (global layer indices) in model order: embedding, ``layers``, final norm, head."""
    layers = range(arch.num_layers) if layers is None else layers
    names = ["embedding.word_embeddings.weight"]
    for i in layers:
        for suffix in _LAYER_MAP:
            if suffix.endswith(".bias") and not arch.qkv_bias:
                continue
            names.append(f"decoder.layers.{i}.{suffix}")
    names.append("decoder.final_layernorm.weight")
    if with_head and not arch.tie_embeddings:
        names.append("output_layer.weight")
    return names


def stage_names(arch: MegatronArch, layers: range, *, first: bool, last: bool, with_head: bool) -> list[str]:
    """The megatron names (global layer indices) a pipeline stage holds, in model order: the embedding on the first
    stage, ``layers``, the final norm and (``with_head``, untied) the head on the last."""
    names = megatron_names(arch, layers, with_head=with_head)
    return [
        n
        for n in names
        if (first or not n.startswith("embedding."))
        and (last or n not in ("decoder.final_layernorm.weight", "output_layer.weight"))
    ]


def hf_shapes(arch: MegatronArch) -> dict[str, tuple[int, ...]]:
    """Full shape of every HF causal-LM tensor (``lm_head.weight`` only when untied), by name, in model order."""
    H, hd, V, F = arch.hidden_size, arch.head_dim, arch.vocab_size, arch.ffn_hidden_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    per_layer = {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (H, q),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (F, H),
        "mlp.up_proj.weight": (F, H),
        "mlp.down_proj.weight": (H, F),
    }
    shapes = {"model.embed_tokens.weight": (V, H)}
    for m in megatron_names(arch):
        for h in hf_names_of(m):
            layer = re.match(r"^model\.layers\.\d+\.(.+)$", h)
            if layer:
                shapes[h] = per_layer[layer.group(1)]
    shapes["model.norm.weight"] = (H,)
    if not arch.tie_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def hf_names_of(megatron_name: str) -> tuple[str, ...]:
    """The HF tensors a megatron parameter holds (global layer indices), in fusion order."""
    m = _LAYER.match(megatron_name)
    if m:
        return tuple(f"model.layers.{m.group(1)}.{s}" for s in _LAYER_MAP[m.group(2)])
    return _TOP_MAP[megatron_name]


def hf_shard_dim(hf_name: str) -> int | None:
    """The dim tensor parallelism splits ``hf_name`` along (None: replicated on every TP rank)."""
    for suffix, dim in _SHARD_DIM.items():
        if hf_name.endswith(suffix):
            return dim
    raise KeyError(f"no tensor-parallel layout for {hf_name!r}")


def local_name(megatron_name: str, first_layer: int) -> str:
    """The name inside a pipeline stage's module, whose layers are numbered from ``first_layer``."""
    m = _LAYER.match(megatron_name)
    return f"decoder.layers.{int(m.group(1)) - first_layer}.{m.group(2)}" if m else megatron_name


def global_name(stage_name: str, first_layer: int) -> str:
    m = _LAYER.match(stage_name)
    return f"decoder.layers.{int(m.group(1)) + first_layer}.{m.group(2)}" if m else stage_name


def stage_layers(num_layers: int, *, pp: int, pp_rank: int) -> range:
    """Global indices of the layers pipeline stage ``pp_rank`` holds (even split, as megatron's default)."""
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


# -- tensors ----------------------------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``linear_qkv`` rows from HF q/k/v (weights ``(rows, H)`` or biases ``(rows,)``), interleaved per query group.

    ``q`` has ``num_kv_heads * heads_per_group * head_dim`` rows, ``k`` and ``v`` ``num_kv_heads * head_dim``.
    """
    tail = q.shape[1:]
    q_g = q.reshape(num_kv_heads, -1, *tail)  # (groups, heads_per_group * head_dim, ...)
    k_g = k.reshape(num_kv_heads, head_dim, *tail)
    v_g = v.reshape(num_kv_heads, head_dim, *tail)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *tail)


def split_qkv(
    qkv: torch.Tensor, *, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``: ``(q, k, v)`` from interleaved ``linear_qkv`` rows."""
    tail = qkv.shape[1:]
    groups = qkv.reshape(num_kv_heads, -1, *tail)
    q_rows = groups.shape[1] - 2 * head_dim
    q, k, v = torch.split(groups, [q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def join_megatron(megatron_name: str, pieces: list[torch.Tensor], *, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """One megatron tensor from its HF pieces (``hf_names_of`` order). ``num_kv_heads`` is the count the pieces hold:
    the model's for full tensors, ``num_kv_heads / tp`` for a TP shard."""
    if len(pieces) == 1:
        return pieces[0]
    if ".linear_qkv." in megatron_name:
        return fuse_qkv(*pieces, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return torch.cat(pieces, dim=0)  # linear_fc1 = [gate; up]


def split_megatron(megatron_name: str, tensor: torch.Tensor, *, num_kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """Inverse of ``join_megatron`` (views where the layout allows)."""
    if ".linear_qkv." in megatron_name:
        return list(split_qkv(tensor, num_kv_heads=num_kv_heads, head_dim=head_dim))
    if ".linear_fc1." in megatron_name:
        return list(tensor.chunk(2, dim=0))
    return [tensor]


def hf_to_megatron(hf_sd: dict[str, torch.Tensor], arch: MegatronArch) -> dict[str, torch.Tensor]:
    """Full (unsharded) megatron state dict, global layer indices, from an HF causal-LM state dict."""
    kw = dict(num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)
    return {m: join_megatron(m, [hf_sd[h] for h in hf_names_of(m)], **kw) for m in megatron_names(arch)}


def megatron_to_hf(m_sd: dict[str, torch.Tensor], arch: MegatronArch) -> dict[str, torch.Tensor]:
    """HF causal-LM state dict from a full megatron one; a tied model also gets ``lm_head.weight`` (the embedding),
    as ``state_dict()`` of an HF model lists it."""
    kw = dict(num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)
    out: dict[str, torch.Tensor] = {}
    for m in megatron_names(arch):
        out.update(zip(hf_names_of(m), split_megatron(m, m_sd[m], **kw)))
    if arch.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def tp_chunk(hf_name: str, full: torch.Tensor, *, tp: int, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s chunk of an HF tensor (the whole tensor when it is replicated)."""
    dim = hf_shard_dim(hf_name)
    return full if dim is None or tp == 1 else full.chunk(tp, dim=dim)[tp_rank]


def tp_shard(
    megatron_name: str, hf_full: list[torch.Tensor], arch: MegatronArch, *, tp: int, tp_rank: int
) -> torch.Tensor:
    """A megatron parameter's TP shard from the full HF tensors it fuses (``hf_names_of`` order)."""
    pieces = [tp_chunk(h, t, tp=tp, tp_rank=tp_rank) for h, t in zip(hf_names_of(megatron_name), hf_full)]
    return join_megatron(megatron_name, pieces, num_kv_heads=arch.num_kv_heads // tp, head_dim=arch.head_dim)
