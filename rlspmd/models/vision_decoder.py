"""Incremental decoding of a vision-language model (``models/vision.py``) for the native rollout engine.

``VisionDecoder`` is the Llama-family decoder (``models/decoder.py``) of the language model with a different prefill:
the prompt's embeddings carry the vision tower's features at the image placeholders, and its rotary embedding is
computed from the 3-D M-RoPE positions (the model's own rotary module, as in training); a Qwen3-VL prefill also adds
the DeepStack features at the image tokens after each of the first decoder layers. Decode steps are text: all
three position components are equal, so the 1-D RoPE table serves them, at position ``index + delta`` (the row's
M-RoPE delta, ``mrope_position_ids``). The weights are read from the module tree at every call, as for text models,
so colocated with an FSDP2 actor the gathered parameters (vision blocks included) are used in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rlspmd.models.decoder import HFDecoder, LlamaFamilyDecoder, make_decoder, signed_sin
from rlspmd.models.vision import ImageInputs, VisionSpec, deepstack_hook, image_embeddings, is_vision_language
from rlspmd.models.vision import mrope_position_ids, with_images


def rollout_decoder(hf_model: nn.Module, *, cpu_kernels: bool = True) -> "LlamaFamilyDecoder | HFDecoder":
    """The eager decoder of ``hf_model``: ``VisionDecoder`` for a vision-language model, else ``make_decoder``'s.
    ``cpu_kernels``: ``LlamaFamilyDecoder``'s."""
    if is_vision_language(hf_model.config):
        return VisionDecoder(hf_model, cpu_kernels=cpu_kernels)
    return make_decoder(hf_model, cpu_kernels=cpu_kernels)


def prompt_embeddings(
    hf_model: nn.Module,
    base: nn.Module,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    images: Sequence[ImageInputs | None],
    *,
    spec: VisionSpec,
    prompt_len: int | Sequence[int] | None = None,
):
    """A prefill's inputs: ``(embeddings (B, P, hidden), (cos, signed sin) (B, 1, P, D), next positions (B,),
    after_layer)``, ``after_layer``: the DeepStack hook of ``decoder_layers`` (``deepstack_hook``; None without).
    ``prompt_len``: the columns where image placeholders count (``mrope_position_ids``); None: all of them."""
    B, P = prompt_ids_BP.shape
    dev = prompt_ids_BP.device
    limit = P if prompt_len is None else prompt_len
    pos_3BP, deltas, index = mrope_position_ids(prompt_ids_BP, prompt_mask_BP, images, spec=spec, prompt_len=limit)
    h = F.embedding(prompt_ids_BP, base.embed_tokens.weight).flatten(0, 1)
    features = image_embeddings(hf_model, images, device=dev)
    h = with_images(h, index, features).view(B, P, -1)
    cos, sin = base.rotary_emb(h, pos_3BP.to(dev))
    next_pos = prompt_mask_BP.long().sum(-1) + deltas.to(dev)
    return h, (cos[:, None], signed_sin(sin[:, None])), next_pos, deepstack_hook(features, index)


class VisionDecoder(LlamaFamilyDecoder):
    """``LlamaFamilyDecoder`` whose prefill sees the rows' images (``start(..., images=...)``)."""

    def __init__(self, hf_model: nn.Module, *, cpu_kernels: bool = True):
        super().__init__(hf_model, cpu_kernels=cpu_kernels)
        self.spec = VisionSpec.of(hf_model.config)
        self.images: Sequence[ImageInputs | None] = ()

    def start(self, prompt_ids_BP, prompt_mask_BP, max_new_tokens, *, images: Sequence[ImageInputs | None]):
        self.images = images
        try:
            return super().start(prompt_ids_BP, prompt_mask_BP, max_new_tokens)
        finally:
            self.images = ()  # the prefill used them; decode steps are text

    def prefill(self, prompt_ids_BP, prompt_mask_BP, k_caches, v_caches, rope_table):
        try:
            return super().prefill(prompt_ids_BP, prompt_mask_BP, k_caches, v_caches, rope_table)
        finally:
            self.after_layer = None  # the prefill's DeepStack hook (set by ``prompt_inputs``); decode steps are text

    def rope_table_for(self, L: int, dev) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The text positions' table (all three M-RoPE components equal), asked of the rotary module with 3-D positions:
        transformers 5.17's Qwen2.5-VL rotary indexes them as (3, batch, positions) and fails on 1-D ones."""
        if not self.static_rope:
            return None
        dummy = torch.zeros(1, L, 1, dtype=self._params_dtype(), device=dev)
        cos, sin = self.base.rotary_emb(dummy, torch.arange(L, device=dev)[None, None].expand(3, 1, L))
        return cos[0], signed_sin(sin[0])

    def prompt_inputs(self, prompt_ids_BP, prompt_mask_BP):
        assert len(self.images) == prompt_ids_BP.shape[0], "VisionDecoder.start takes each row's images"
        h, rope, next_pos, self.after_layer = prompt_embeddings(
            self.model, self.base, prompt_ids_BP, prompt_mask_BP, self.images, spec=self.spec
        )
        return h, rope, next_pos
