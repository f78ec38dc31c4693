"""Scalar-head models: per-token values (the PPO critic) and per-sequence scores (a reward model).

``ValueModel`` is an HF backbone (``AutoModel``: the decoder without its LM head) plus a ``value_head``
``Linear(hidden, 1)``; ``forward`` returns the value of every response position. ``SequenceScorer`` wraps an HF
``*ForSequenceClassification`` model and returns the score of each sequence's last real token. Both are the root
module FSDP shards (like ``CausalLMPolicy``): the decoder layers are the sharding units and the head lives in
the root unit, so one root forward gathers it once.

Value convention: ``values_BR[:, t]`` is V(s_t), the value of the state *before* response token ``t`` is chosen,
i.e. the hidden state at the position that predicts token ``t`` (the same positions the policy's log-probs use).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

from rlspmd.models.loader import DTYPES, check_model_dir
from rlspmd.models.packing import TokenCounts, pack, packed_hidden_states, training_attn_implementation
from rlspmd.models.attn_kernels import packed_kernel
from rlspmd.models.policy import response_hidden

HEAD_PREFIXES = ("value_head.", "score.")
"""Weights a model directory may carry for the value head: our own export, or a one-label classifier's head."""


class ValueModel(nn.Module):
    """Backbone + scalar head; ``forward`` returns ``values_BR`` (float32) for the last ``response_len`` tokens."""

    def __init__(self, backbone: nn.Module, value_head: nn.Linear, *, packing: bool = False, attn_kernel: str = "auto"):
        super().__init__()
        self.hf = backbone
        self.value_head = value_head
        self.packing = packing
        self.attn_kernel = attn_kernel
        self.seq = None
        """The engine's sequence-parallel group (``distributed/sequence_parallel.py: SequenceParallel``) or None."""

    @property
    def config(self):
        return self.hf.config

    def forward(
        self, input_ids_BL, attention_mask_BL, position_ids_BL, *, response_len: int, counts: TokenCounts | None = None
    ) -> torch.Tensor:
        """``counts``: the micro-batch's host-side token counts when the caller has them (packed path only)."""
        if self.packing:  # valid tokens only (rlspmd.models.packing); 0 at padded response positions
            kernel = packed_kernel(self.attn_kernel, input_ids_BL.device, self.value_head.weight.dtype)
            if self.seq is not None:  # the group's rows packed together, each rank a slice
                (values_BR,) = self.seq.run(
                    self.hf,
                    lambda hidden_NH, targets_N, scalars: (_scalar_head(self.value_head, hidden_NH),),
                    input_ids_BL,
                    attention_mask_BL,
                    position_ids_BL,
                    response_len=response_len,
                    kernel=kernel,
                )
                return values_BR
            packed = pack(
                input_ids_BL,
                attention_mask_BL,
                position_ids_BL,
                kernel=kernel,
                response_len=response_len,
                counts=counts,
            )
            hidden_TH = packed_hidden_states(self.hf, packed)
            values_N = _scalar_head(self.value_head, hidden_TH.index_select(0, packed.predictor_pos_N))
            return packed.scatter_responses(values_N)
        hidden = self.hf(
            input_ids=input_ids_BL, attention_mask=attention_mask_BL, position_ids=position_ids_BL, use_cache=False
        ).last_hidden_state
        return _scalar_head(self.value_head, response_hidden(hidden, response_len))


def _scalar_head(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` without the trailing unit dim, as a fresh float32 tensor (FSDP2 warns about returning views)."""
    out = torch.matmul(hidden, head.weight[0])  # (..., H) @ (H,) for a batch of rows or a (B, R, H) block
    return (out + head.bias[0] if head.bias is not None else out).float()


def _head_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """``value_head.*`` or one-label ``score.*`` weights stored in the directory's safetensors, if any."""
    for prefix in HEAD_PREFIXES:
        found = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if key.startswith(prefix) and key[len(prefix) :] in ("weight", "bias"):
                        found[key[len(prefix) :]] = st.get_tensor(key)
        if "weight" in found and found["weight"].shape[0] == 1:
            return found
    return {}


def load_value_model(
    path: str | Path,
    *,
    dtype: str,
    attn_implementation: str,
    seed: int,
    field_name: str,
    packing: bool = False,
    attn_kernel: str = "auto",
) -> ValueModel:
    """A value model initialised from ``path`` (causal LM, base model, or reward model directory).

    The head comes from the directory when it has one (``value_head.*`` or a one-label ``score.*``); otherwise it
    is drawn from N(0, (0.1 / sqrt(hidden))^2) with a generator seeded by ``seed``, bias 0, so the initial values are
    small (std ~0.1 for unit-scale hidden states) and identical on every rank and every run.
    """
    p = check_model_dir(path, field_name=field_name)
    attn_implementation = training_attn_implementation(
        attn_implementation, packing=packing, field_name="model.attn_implementation"
    )
    config = AutoConfig.from_pretrained(str(p))
    backbone = AutoModel.from_pretrained(
        str(p), config=config, dtype=DTYPES[dtype], attn_implementation=attn_implementation
    )
    backbone.config.use_cache = False
    head = value_head(p, hidden=backbone.config.hidden_size, dtype=DTYPES[dtype], seed=seed)
    return ValueModel(backbone, head, packing=packing, attn_kernel=attn_kernel)


@torch.no_grad()
def value_head(model_dir: Path, *, hidden: int, dtype: torch.dtype, seed: int) -> nn.Linear:
    """The value head of ``load_value_model``: the directory's head if it has one, else ``initial_value_head``."""
    head = nn.Linear(hidden, 1, dtype=dtype)
    stored = _head_tensors(model_dir)
    if stored:
        head.weight.copy_(stored["weight"].reshape(1, hidden))
        head.bias.copy_(stored["bias"].reshape(1) if "bias" in stored else torch.zeros(1))
    else:
        head.weight.copy_(initial_value_head(hidden, seed=seed))
        head.bias.zero_()
    return head


def initial_value_head(hidden: int, *, seed: int) -> torch.Tensor:
    """A new value head's ``(1, hidden)`` float32 weight: N(0, (0.1 / sqrt(hidden))^2) from a generator seeded by
    ``seed``, so the initial values are small and identical on every rank and every run."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, hidden, generator=g) * (0.1 / math.sqrt(hidden))


class SequenceScorer(nn.Module):
    """An HF ``*ForSequenceClassification`` model scoring each row at its last real token (attention mask).

    Pooling by the attention mask rather than by ``pad_token_id`` (what HF's forward does) stays right when the
    pad token equals EOS, which ends every scored response.
    """

    def __init__(self, hf_model: nn.Module, *, packing: bool = False, attn_kernel: str = "auto"):
        super().__init__()
        self.hf = hf_model
        self.packing = packing
        self.attn_kernel = attn_kernel
        self.backbone = getattr(hf_model, hf_model.base_model_prefix)
        head = getattr(hf_model, "score", None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ValueError(
                f"reward.model.path: {type(hf_model).__name__} must have a one-label `score` head "
                f"(a *ForSequenceClassification model with num_labels=1)"
            )

    def forward(
        self, input_ids_BL, attention_mask_BL, position_ids_BL, *, counts: TokenCounts | None = None
    ) -> torch.Tensor:
        if self.packing:  # the last valid token of each sample ends its segment of the pack
            kernel = packed_kernel(self.attn_kernel, input_ids_BL.device, self.hf.score.weight.dtype)
            packed = pack(input_ids_BL, attention_mask_BL, position_ids_BL, kernel=kernel, counts=counts)
            hidden_TH = packed_hidden_states(self.backbone, packed)
            return _scalar_head(self.hf.score, hidden_TH[packed.cu_seqlens[1:].long() - 1])
        hidden = self.backbone(
            input_ids=input_ids_BL, attention_mask=attention_mask_BL, position_ids=position_ids_BL, use_cache=False
        ).last_hidden_state
        L = attention_mask_BL.shape[1]
        last_B = (attention_mask_BL.long() * torch.arange(L, device=attention_mask_BL.device)).argmax(-1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_B]
        return _scalar_head(self.hf.score, pooled)


def load_sequence_scorer(
    path: str | Path,
    *,
    dtype: str,
    attn_implementation: str,
    field_name: str,
    packing: bool = False,
    attn_kernel: str = "auto",
) -> SequenceScorer:
    p = check_model_dir(path, field_name=field_name)
    attn_implementation = training_attn_implementation(
        attn_implementation, packing=packing, field_name="model.attn_implementation"
    )
    check_sequence_classifier(p, field_name=field_name)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(p), dtype=DTYPES[dtype], attn_implementation=attn_implementation
    )
    model.config.use_cache = False
    return SequenceScorer(model, packing=packing, attn_kernel=attn_kernel)


def check_sequence_classifier(model_dir: Path, *, field_name: str) -> None:
    """``model_dir``'s config names a ``*ForSequenceClassification`` architecture."""
    archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{field_name}: {model_dir} is a {archs or 'model without architectures'}, "
            "not a *ForSequenceClassification model"
        )
