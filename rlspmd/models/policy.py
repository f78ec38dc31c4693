"""Training-side model wrappers: the module FSDP shards as one root.

``CausalLMPolicy`` runs a Hugging Face causal LM's backbone and turns the hidden states of the response
positions into per-token log-probs and entropy with the chunked kernel (no full logits). Wrapping the HF
model (instead of calling its ``forward``) keeps the embedding, final norm and LM head inside the root
FSDP unit, so one root forward gathers them exactly once.
"""

from __future__ import annotations

import torch
from torch import nn

from rlspmd.models.logprobs import DEFAULT_CHUNK, chunked_logprobs


def response_hidden(hidden_BLH: torch.Tensor, response_len: int) -> torch.Tensor:
    """Hidden states that predict the last ``response_len`` tokens (positions P-1 .. L-2)."""
    L = hidden_BLH.shape[1]
    return hidden_BLH[:, L - response_len - 1 : L - 1]


class CausalLMPolicy(nn.Module):
    """Wraps an HF ``*ForCausalLM``; ``forward`` returns ``(logprobs_BR, entropy_BR)`` of the response tokens."""

    def __init__(self, hf_model: nn.Module, *, logprob_chunk: int = DEFAULT_CHUNK):
        super().__init__()
        self.hf = hf_model
        self.logprob_chunk = logprob_chunk

    @property
    def config(self):
        return self.hf.config

    def backbone_hidden(self, input_ids_BL, attention_mask_BL, position_ids_BL) -> torch.Tensor:
        out = self.hf.get_decoder()(
            input_ids=input_ids_BL, attention_mask=attention_mask_BL, position_ids=position_ids_BL, use_cache=False
        )
        return out.last_hidden_state

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        position_ids_BL: torch.Tensor,
        *,
        response_len: int,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.backbone_hidden(input_ids_BL, attention_mask_BL, position_ids_BL)
        head = self.hf.get_output_embeddings()
        targets = input_ids_BL[:, -response_len:]
        return chunked_logprobs(
            response_hidden(hidden, response_len),
            head.weight,
            targets,
            bias=head.bias,
            temperature=temperature,
            chunk_size=self.logprob_chunk,
            with_entropy=with_entropy,
        )
