"""Incremental decoding for the native rollout engine.

``LlamaFamilyDecoder`` runs a Llama/Qwen2/Qwen3/Mistral-style model functionally: it reads the weights
from the Hugging Face module tree at every call (so, colocated with an FSDP2 actor whose parameters are
gathered in place, it uses the actor's current weights with no copy) and keeps its own preallocated KV
cache. It reuses the model's rotary module, so every RoPE variant transformers implements is supported.
Numerics follow transformers' own implementation (RMSNorm in float32, SDPA attention), which is what
makes greedy outputs equal ``generate``'s.

Mixture-of-experts models of that family (Qwen3-MoE, Qwen2-MoE) run the same path with their sparse blocks computed
by ``models/moe.py: moe_mlp``; the decoder then keeps the experts each token of its last forward used
(``routing``, ``(B, S, N, K)``), which the engine records with the sample (router replay).

``HFDecoder`` is the fallback for other architectures: the model's own forward with a ``DynamicCache``.

Both expose ``start(prompt_ids_BP, prompt_mask_BP, max_new_tokens) -> logits_BV``, ``step(tokens_B) ->
logits_BV`` and ``keep(rows)`` (drop finished rows from the batch, compacting the cache): the eager engine.

``decode_step`` is the same Llama-family step with static shapes, a function of tensors only: the token's K/V go
into a cache slot given as a device tensor and attention runs over the whole preallocated cache under an additive
mask. ``rlspmd.rollout.cuda_graphs`` captures it in CUDA graphs (and ``compiled_decode_step`` compiles it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlspmd.models.moe import MOE_MODEL_TYPES, is_sparse_block, moe_mlp

LLAMA_FAMILY = {"llama", "qwen2", "qwen3", "mistral"}
FUSED_FAMILY = LLAMA_FAMILY | MOE_MODEL_TYPES
"""What ``LlamaFamilyDecoder`` runs: the dense family, and its mixture-of-experts members."""


def make_decoder(hf_model: nn.Module, *, cpu_kernels: bool = True) -> "LlamaFamilyDecoder | HFDecoder":
    """The eager decoder for ``hf_model``: the fused Llama-family path, or the model's own forward. ``cpu_kernels``:
    ``LlamaFamilyDecoder``'s."""
    if hf_model.config.model_type in FUSED_FAMILY:
        return LlamaFamilyDecoder(hf_model, cpu_kernels=cpu_kernels)
    return HFDecoder(hf_model)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel; same arithmetic in float32
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin == roll(x, D/2) * sin_signed``: same products
    and sum as transformers' formula, two fewer kernels."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def linear(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
    return F.linear(x, proj.weight, proj.bias)


def prompt_positions(prompt_mask_BP: torch.Tensor) -> torch.Tensor:
    """Left-padded prompts: position of each real token counts from 0; pads get position 0."""
    return (prompt_mask_BP.long().cumsum(-1) - 1).clamp(min=0)


class LlamaFamilyDecoder:
    def __init__(self, hf_model: nn.Module, *, cpu_kernels: bool = True):
        """``cpu_kernels`` (``rollout.engine.cpu_kernels``): decode steps on CPU in bfloat16 run each layer's
        elementwise work in the fused kernels of ``models/cpu_kernels.py`` (``fused_decode_layers``)."""
        cfg = hf_model.config.get_text_config()  # a vision-language model's language model
        self.model = hf_model
        base = hf_model.get_decoder()
        self.base = base
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.n_layers = len(base.layers)
        self.routing: torch.Tensor | None = None
        """MoE models: the experts each token of the last forward used, ``(B, S, N, K)``; None for dense models."""
        self.fused: list[FusedProjections] | None = None
        """The layers' concatenated (on CPU in bfloat16 also packed) projections for the current generation
        (``fused_projections``; set by ``start``), or None."""
        self.head: tuple[torch.Tensor, torch.Tensor | None, bool] | None = None
        """The output head's ``(weight, bias, packed)`` for the current generation (``project``; set by ``start``)."""
        self.cpu_kernels = cpu_kernels
        self.kernels = None
        """``torch.ops.rlspmd_cpu`` for the current generation's decode steps (``fused_decode_layers``), or None."""
        self.kernel_attention = True
        """With the kernels, a decode step attends with their ``decode_attention`` (float32 inside, rounded once;
        SDPA rounds its probabilities to bfloat16); False: SDPA, whose roundings the torch ops share."""
        self.after_layer = None
        """``(i, h) -> h`` run after decoder layer ``i`` of the next forward, or None: a vision-language decoder's
        prefill adds its DeepStack features with it (``decoder_layers``)."""

    def _params_dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    def start(self, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        B, P = prompt_ids_BP.shape
        dev = prompt_ids_BP.device
        L = P + max_new_tokens
        distinct = self.distinct_prompts(prompt_ids_BP, prompt_mask_BP)
        shape = (B if distinct is None else distinct[0].numel(), self.n_kv, L, self.head_dim)
        # How a decode step attends (``sdpa_decodes``): with SDPA over the filled slots, or (float32 on CPU) with
        # ``decode_attention`` over the whole cache, whose slots must then be finite before they are written (0 under
        # a -inf mask adds nothing).
        self.sdpa_decode = sdpa_decodes(dev, self._params_dtype())
        self.whole_cache = dev.type == "cpu" and not self.sdpa_decode
        alloc = torch.zeros if self.whole_cache else torch.empty
        self.k = alloc(self.n_layers, *shape, dtype=self._params_dtype(), device=dev)
        self.v = alloc(self.n_layers, *shape, dtype=self._params_dtype(), device=dev)
        self.rope_table = self.rope_table_for(L, dev)
        # Decode-step attention mask, additive and shared by every layer: -inf at prompt padding, 0 elsewhere. A step
        # attends over the slots filled so far only: by slicing the cache (SDPA reads the strided slice in place; so
        # does ``decode_attention`` on GPUs), or, float32 on CPU, over the whole cache with the slots not written yet
        # at -inf, opened one per step: there a slice is a strided batch of matrices, which CPU matmuls copy first,
        # and the whole contiguous cache was 3.5x faster for that attention (SmolLM2-135M, batch 64, prompt 43 + 64
        # tokens: 0.16 ms against 0.56 ms per layer and step), the masked slots' extra products included.
        self.decode_mask = torch.zeros(B, L, dtype=self._params_dtype(), device=dev)
        self.decode_mask[:, :P].masked_fill_(~prompt_mask_BP.bool(), float("-inf"))
        if self.whole_cache:
            self.decode_mask[:, P:] = float("-inf")
        self.read_weights(B, dev)
        if distinct is None:
            return self.prefill(prompt_ids_BP, prompt_mask_BP, self.k, self.v, self.rope_table)
        firsts, row_of = distinct  # prefill each distinct prompt once, then give every row its prompt's cache
        logits = self.prefill(prompt_ids_BP[firsts], prompt_mask_BP[firsts], self.k, self.v, self.rope_table)
        self.k, self.v = self.k.index_select(1, row_of), self.v.index_select(1, row_of)
        self.next_pos = self.next_pos.index_select(0, row_of)
        return logits.index_select(0, row_of)

    def distinct_prompts(self, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor):
        """Consecutive rows with the same prompt (a GRPO group's samples) are prefilled once: ``(first row of each
        run (U,), each row's run (B,))``, or None when no two neighbours share a prompt, or when the prefill is not
        the plain text one (a vision-language decoder's image inputs, a MoE model's per-row routing log). One host
        read of B flags per generation."""
        if type(self).prompt_inputs is not LlamaFamilyDecoder.prompt_inputs:
            return None
        if any(is_sparse_block(layer.mlp) for layer in self.base.layers):
            return None
        from rlspmd.models.packing import same_prompt_as_previous

        same = same_prompt_as_previous(prompt_ids_BP, prompt_mask_BP, 0).tolist()
        if not any(same):
            return None
        firsts: list[int] = []
        row_of: list[int] = []  # each row's index among ``firsts``
        for b, s in enumerate(same):
            if not s:
                firsts.append(b)
            row_of.append(len(firsts) - 1)
        dev = prompt_ids_BP.device
        return torch.tensor(firsts, device=dev), torch.tensor(row_of, device=dev)

    def read_weights(self, rows: int, dev: torch.device) -> None:
        """Read the weights once for a generation (or a ``serve``) of about ``rows`` rows: ``fused`` and ``head``,
        on CPU in bfloat16 packed (``packs_weights``)."""
        with torch.no_grad():
            head = self.model.get_output_embeddings()
            packed = dev.type == "cpu" and packs_weights(head.weight.dtype)
            self.fused = fused_projections(self.base, pack_rows=rows if packed else None)
            self.head = (pack(head.weight, rows) if packed else head.weight, head.bias, packed)
        self.kernels = None
        if self.cpu_kernels and self.fused is not None and head.weight.dtype == torch.bfloat16:
            if not any(hasattr(layer.self_attn, "q_norm") for layer in self.base.layers):
                from rlspmd.models.cpu_kernels import cpu_ops

                self.kernels = cpu_ops()

    def prefill(self, prompt_ids_BP, prompt_mask_BP, k_caches, v_caches, rope_table) -> torch.Tensor:
        """The prompts' forward (one call, left-padded batch): writes their K/V into slots ``[0, P)`` of the given
        per-layer caches (``(B, KV, L, D)`` each, indexable by layer) and returns the next-token logits."""
        P = prompt_ids_BP.shape[1]
        dev = prompt_ids_BP.device
        self.k, self.v, self.rope_table = k_caches, v_caches, rope_table
        h, rope, self.next_pos = self.prompt_inputs(prompt_ids_BP, prompt_mask_BP)  # next_pos: of the next token
        self.length = 0  # cache slots filled (the prefill fills P)
        # Causal mask; a pad query also sees itself so no row is fully masked (SDPA would give NaN).
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        mask = (causal & prompt_mask_BP.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)
        return self._forward(prompt_ids_BP, prompt_positions(prompt_mask_BP), mask[:, None], h=h, rope=rope)

    def prompt_inputs(self, prompt_ids_BP, prompt_mask_BP):
        """``(embeddings, (cos, signed sin), next positions)`` of a prefill: None for the first two computes them from
        the tokens and their 1-D positions (a vision-language decoder gives its own: image features, M-RoPE)."""
        return None, None, prompt_mask_BP.long().sum(-1)

    @property
    def static_rope(self) -> bool:
        """RoPE frequencies that do not depend on the sequence length (all but dynamic scaling): a table serves."""
        return "dynamic" not in str(getattr(self.base.rotary_emb, "rope_type", "default"))

    def rope_table_for(self, L: int, dev) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and signed sin for positions 0..L-1, computed once by the model's own rotary module, so a decode step
        looks them up instead of recomputing them. Not for RoPE variants whose frequencies depend on the current
        sequence length (dynamic scaling): those run the rotary module at every step, as transformers does."""
        if not self.static_rope:
            return None
        rotary = self.base.rotary_emb
        dummy = torch.zeros(1, L, 1, dtype=self._params_dtype(), device=dev)
        cos, sin = rotary(dummy, torch.arange(L, device=dev)[None])
        return cos[0], signed_sin(sin[0])

    def params(self, fuse: bool = True):
        """The weights ``decode_step`` reads, as plain tensors (the step's inputs, not module state). Read once per
        generation: colocated with FSDP2, they are the parameters gathered in place for its duration. With ``fuse``,
        where ``fused_projections`` pays (CPU), a layer's q/k/v and gate/up come concatenated (k, v and up then None),
        and the prefill uses the same copies."""

        def w(mod):
            return None if mod is None else mod.weight

        with torch.no_grad():
            self.fused = fused_projections(self.base) if fuse else None
        layers = []
        for i, layer in enumerate(self.base.layers):
            a, m = layer.self_attn, layer.mlp
            if self.fused is not None:
                f = self.fused[i]
                qkv = (f.qkv_w, f.qkv_b, None, None, None, None)
                gate_up = (f.gate_up_w, None)
            else:
                qkv = (a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias)
                gate_up = (m.gate_proj.weight, m.up_proj.weight)
            layers.append(
                (
                    layer.input_layernorm.weight,
                    *qkv,
                    w(getattr(a, "q_norm", None)),
                    w(getattr(a, "k_norm", None)),
                    a.o_proj.weight,
                    a.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    *gate_up,
                    m.down_proj.weight,
                )
            )
        head = self.model.get_output_embeddings()
        self.head = (head.weight, head.bias, False)  # the prefill's (``_forward``)
        return self.base.embed_tokens.weight, tuple(layers), self.base.norm.weight, head.weight, head.bias

    def step(self, tokens_B: torch.Tensor) -> torch.Tensor:
        pos = self.next_pos[:, None]
        if self.whole_cache:
            self.decode_mask[:, self.length] = 0.0  # this step's slot opens
            mask = self.decode_mask[:, None, None, :]  # (B, 1, 1, L)
        else:
            mask = self.decode_mask[:, None, None, : self.length + 1]  # (B, 1, 1, cached), a view
        self.next_pos = self.next_pos + 1
        return self._forward(tokens_B[:, None], pos, mask)

    def keep(self, rows: torch.Tensor) -> None:
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]
        self.decode_mask = self.decode_mask[rows]
        self.next_pos = self.next_pos[rows]

    def _forward(self, ids_BS: torch.Tensor, pos_BS: torch.Tensor, mask: torch.Tensor, *, h=None, rope=None):
        """``h``: input embeddings instead of the tokens'; ``rope``: (cos, signed sin) instead of ``pos_BS``'s."""
        base, B, S = self.base, ids_BS.shape[0], ids_BS.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        start, end = self.length, self.length + S
        h = F.embedding(ids_BS, base.embed_tokens.weight) if h is None else h
        if rope is not None:
            cos, sin = rope
        elif self.rope_table is not None:
            cos, sin = self.rope_table[0][pos_BS][:, None], self.rope_table[1][pos_BS][:, None]
        else:
            cos, sin = base.rotary_emb(h, pos_BS)
            cos, sin = cos[:, None], signed_sin(sin[:, None])
        M = mask.shape[-1]  # the cache slots attended: ``end``, or the whole cache in a CPU float32 decode step
        if S == 1 and self.kernels is not None and self.after_layer is None and cos.shape == (B, 1, 1, D):
            # decode_attention's limits: head_dim a multiple of 16 up to 256, at most 8 query heads per KV head
            use_kernel = self.kernel_attention and D % 16 == 0 and D <= 256 and H // KV <= 8
            mask_BM = mask.reshape(B, M).contiguous() if use_kernel and mask.shape == (B, 1, 1, M) else None

            def attend(q, i):
                if mask_BM is not None:
                    return self.kernels.decode_attention(q, self.k[i], self.v[i], mask_BM)
                o = F.scaled_dot_product_attention(
                    q, self.k[i][:, :, :M], self.v[i][:, :, :M], attn_mask=mask, enable_gqa=KV != H
                )
                return o.transpose(1, 2).reshape(B, 1, -1)

            h = fused_decode_layers(
                self.kernels,
                base,
                h,
                cos,
                sin,
                self.k,
                self.v,
                start,
                attend,
                fused=self.fused,
                n_heads=H,
                n_kv=KV,
                eps=self.eps,
            )
            self.routing = None
            self.length = end
            return project(h[:, -1], *self.head)
        sdpa = S > 1 or self.sdpa_decode
        if not sdpa:  # the (B*KV, G, M) additive mask all layers share, expanded once per step
            mask = mask.reshape(B, 1, 1, M).expand(B, KV, H // KV, M).reshape(B * KV, H // KV, M)

        def write(i, k, v):
            self.k[i][:, :, start:end] = k
            self.v[i][:, :, start:end] = v

        def attend(i, q, k, v):
            if not sdpa:
                return decode_attention(q, self.k[i][:, :, :M], self.v[i][:, :, :M], mask)
            return F.scaled_dot_product_attention(
                q, self.k[i][:, :, :M], self.v[i][:, :, :M], attn_mask=mask, enable_gqa=KV != H
            )

        routes: list[torch.Tensor] = []
        h = decoder_layers(
            base,
            h,
            cos,
            sin,
            n_heads=H,
            n_kv=KV,
            head_dim=D,
            eps=self.eps,
            write=write,
            attend=attend,
            routes=routes,
            after_layer=self.after_layer,
            fused=self.fused,
        )
        self.routing = torch.stack(routes, 2) if routes else None
        self.length = end
        h = rms_norm(h[:, -1], base.norm.weight, self.eps)
        return project(h, *self.head)  # in the head's dtype: sampling upcasts a block of rows at a time


class FusedProjections(NamedTuple):
    """One dense layer's matmul weights for a generation: q, k, v as one matrix (and bias), gate and up as another, then
    the output and down projections; with ``packed``, each in oneDNN's blocked layout (``project``)."""

    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    gate_up_w: torch.Tensor
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    down_w: torch.Tensor
    packed: bool = False


def packs_weights(dtype: torch.dtype) -> bool:
    """Whether CPU matmuls in ``dtype`` run on pre-packed weights (``project``): bfloat16 where oneDNN computes it
    natively (AVX512-BF16 / AMX). A decode step multiplies a few rows by every weight, and F.linear then re-lays the
    weight out for oneDNN at every call: packed once per generation, the same products are 1.3-2x faster (SmolLM2-135M
    shapes, bfloat16, a 2-core Xeon with AMX: 0.16 against 0.21 ms for the 3072x576 gate/up at 16 rows, 3.0 against
    6.5 ms for the 49152x576 head at 64), equal in those measurements; oneDNN's packed path may round some products
    differently from F.linear's (a whole quickstart run's trajectory was not bit-identical)."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` (out, in) in oneDNN's blocked layout for ``rows``-row inputs (any row count works); only ``project`` with
    ``packed=True`` reads it."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)


def project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
    """``F.linear(x, w, b)``, with ``w`` from ``pack`` when ``packed``."""
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def fused_projections(base: nn.Module, *, pack_rows: int | None = None) -> "list[FusedProjections] | None":
    """Each decoder layer's ``FusedProjections``, copied from its current weights, where that pays: on CPU, for dense
    layers (no MoE block, no MLP bias). A decode step there streams every weight from memory for a few rows, and 2
    matmuls instead of 5 run the same products 28 % faster (SmolLM2-135M, 16 rows, bfloat16, a 2-core Xeon: 14.2 ms
    against 19.8 ms a step for those projections). The copies cost one pass over those weights per generation and
    their memory for its duration; on CUDA the decode step's graph hides the extra launches instead. None: use the
    modules' own weights. ``pack_rows``: also pack every matrix for inputs of about that many rows (the eager decoder,
    where ``packs_weights`` says it pays; ``decode_step``, compiled or not, reads plain weights)."""
    layers = base.layers
    if not len(layers) or base.embed_tokens.weight.device.type != "cpu":
        return None
    packed = pack_rows is not None

    def prep(w):
        return pack(w, pack_rows) if packed else w

    out = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if is_sparse_block(mlp) or not hasattr(mlp, "gate_proj") or mlp.gate_proj.bias is not None:
            return None
        biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return None
        out.append(
            FusedProjections(
                prep(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                None if biases[0] is None else torch.cat(biases),
                prep(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                prep(attn.o_proj.weight),
                attn.o_proj.bias,
                prep(mlp.down_proj.weight),
                packed,
            )
        )
    return out


def decoder_layers(
    base: nn.Module,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    *,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    eps: float,
    write,
    attend,
    routes: list | None = None,
    after_layer=None,
    fused: "list[FusedProjections] | None" = None,
) -> torch.Tensor:
    """The decoder layers of a Llama-family ``base`` model over hidden states ``h`` (B, S, hidden), with the caller's
    KV cache: ``write(i, k, v)`` stores layer ``i``'s new keys and values (B, KV, S, D) and ``attend(i, q, k, v)``
    returns its attention output (B, H, S, D). The static-batch decoder (``LlamaFamilyDecoder``) and the continuous
    batching one (``rollout/continuous.py``) differ only in those two. ``routes``: each sparse layer appends the
    experts its tokens used, ``(B, S, K)``. ``after_layer(i, h) -> h``: run on each layer's output (Qwen3-VL's
    DeepStack features at a prefill's image tokens). ``fused``: each layer's concatenated projections
    (``fused_projections``), used instead of its modules' separate ones: the same products, fewer matmuls."""
    B, S, H, KV, D = h.shape[0], h.shape[1], n_heads, n_kv, head_dim
    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        x = rms_norm(h, layer.input_layernorm.weight, eps)
        f = None if fused is None else fused[i]
        if f is not None:
            q, k, v = project(x, f.qkv_w, f.qkv_b, f.packed).split((H * D, KV * D, KV * D), -1)
            q, k, v = q.view(B, S, H, D), k.view(B, S, KV, D), v.view(B, S, KV, D)
        else:
            q = linear(x, attn.q_proj).view(B, S, H, D)
            k = linear(x, attn.k_proj).view(B, S, KV, D)
            v = linear(x, attn.v_proj).view(B, S, KV, D)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = rms_norm(q, attn.q_norm.weight, eps), rms_norm(k, attn.k_norm.weight, eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed)
        write(i, k, v)
        a = attend(i, q, k, v)
        a = a.transpose(1, 2).reshape(B, S, H * D)
        h = h + (linear(a, attn.o_proj) if f is None else project(a, f.o_w, f.o_b, f.packed))
        x = rms_norm(h, layer.post_attention_layernorm.weight, eps)
        if f is not None:
            gate, up = project(x, f.gate_up_w, None, f.packed).chunk(2, -1)
            h = h + project(F.silu(gate) * up, f.down_w, None, f.packed)
        else:
            h = h + feed_forward(layer.mlp, x, routes)
        if after_layer is not None:
            h = after_layer(i, h)
    return h


def fused_decode_layers(
    ops,
    base: nn.Module,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    attend,
    *,
    fused: "list[FusedProjections]",
    n_heads: int,
    n_kv: int,
    eps: float,
) -> torch.Tensor:
    """``decoder_layers`` for one token per row (``h`` (B, 1, hidden), bfloat16, CPU), then the final RMSNorm, with the
    fused kernels of ``models/cpu_kernels.py`` (``ops``) around the same matmuls and attention: per layer, the residual
    add and RMSNorm in one call (``add_rms_norm``), RoPE on q and k with k and v written to slot ``start`` of layer
    ``i``'s cache ``k_cache[i]`` / ``v_cache[i]`` in one (``rope_write``), SwiGLU in one (``silu_mul``), instead of
    about 35 torch ops. ``attend(q, i)`` returns layer ``i``'s attention output as ``(B, 1, H * D)``, for the output
    projection. With SDPA as ``attend``, the same roundings as ``decoder_layers``: the same tokens
    (``tests/test_cpu_kernels.py``). SmolLM2-135M at 16 rows, bfloat16, a 2-core Xeon with AMX: 42 against 51 ms a
    step."""
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    h = h.contiguous().clone()  # the residual stream, updated in place by add_rms_norm
    y = None  # the last layer's MLP output, not yet added
    for i, layer in enumerate(base.layers):
        f = fused[i]
        x = ops.add_rms_norm(h, y, layer.input_layernorm.weight, eps)
        qkv = project(x, f.qkv_w, f.qkv_b, f.packed)
        q = ops.rope_write(qkv, cos, sin_signed, k_cache[i], v_cache[i], start, n_heads, n_kv)
        a = attend(q, i)
        x = ops.add_rms_norm(h, project(a, f.o_w, f.o_b, f.packed), layer.post_attention_layernorm.weight, eps)
        y = project(ops.silu_mul(project(x, f.gate_up_w, None, f.packed)), f.down_w, None, f.packed)
    return ops.add_rms_norm(h, y, base.norm.weight, eps)


def feed_forward(mlp: nn.Module, x: torch.Tensor, routes: list | None) -> torch.Tensor:
    """A layer's MLP: SwiGLU, or a sparse block (whose experts per token go to ``routes``)."""
    if is_sparse_block(mlp):
        y, used, _, _ = moe_mlp(mlp, x)
        if routes is not None:
            routes.append(used.view(*x.shape[:-1], used.shape[-1]))
        return y
    return linear(F.silu(linear(x, mlp.gate_proj)) * linear(x, mlp.up_proj), mlp.down_proj)


def decode_step(
    params, k_caches, v_caches, tok_B, pos_B, slot_1, mask_BL, cos_table, sin_table, H: int, KV: int, D: int, eps: float
):
    """One decode step with static shapes: writes this token's K/V at ``slot_1`` of each layer's preallocated cache
    (``(B, KV, L, D)``) and attends over all ``L`` slots under ``mask_BL`` (additive: -inf at prompt padding and at
    slots not written yet). Same arithmetic as ``LlamaFamilyDecoder._forward`` for one token; a function of its tensor
    inputs only, which is what ``torch.compile`` wants."""
    emb, layers, norm_w, head_w, head_b = params
    B, L, G = tok_B.shape[0], k_caches[0].shape[2], H // KV
    h = F.embedding(tok_B[:, None], emb)
    cos, sin = cos_table[pos_B][:, None, None], sin_table[pos_B][:, None, None]
    mask = mask_BL[:, None, None, :].expand(B, KV, G, L).reshape(B * KV, G, L)
    for i, (in_w, qw, qb, kw, kb, vw, vb, qn, kn, ow, ob, post_w, gw, uw, dw) in enumerate(layers):
        x = rms_norm(h, in_w, eps)
        if kw is None:  # q/k/v concatenated (``params``)
            q, k, v = F.linear(x, qw, qb).split((H * D, KV * D, KV * D), -1)
            q, k, v = q.view(B, 1, H, D), k.view(B, 1, KV, D), v.view(B, 1, KV, D)
        else:
            q, k, v = (
                F.linear(x, qw, qb).view(B, 1, H, D),
                F.linear(x, kw, kb).view(B, 1, KV, D),
                F.linear(x, vw, vb).view(B, 1, KV, D),
            )
        if qn is not None:
            q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_caches[i].index_copy_(2, slot_1, k)  # index_copy_: a tensor slot, no host read (CUDA-graph safe)
        v_caches[i].index_copy_(2, slot_1, v)
        a = decode_attention(q, k_caches[i], v_caches[i], mask)
        h = h + F.linear(a.transpose(1, 2).reshape(B, 1, H * D), ow, ob)
        x = rms_norm(h, post_w, eps)
        if uw is None:  # gate/up concatenated
            gate, up = F.linear(x, gw).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, dw)
        else:
            h = h + F.linear(F.silu(F.linear(x, gw)) * F.linear(x, uw), dw)
    h = rms_norm(h[:, -1], norm_w, eps)
    return F.linear(h, head_w, head_b).float()


_COMPILED_STEP = None


def compiled_decode_step():
    """``torch.compile(decode_step)``, built once per process; a shape that changes between calls (batch, cache
    length) becomes dynamic after its first recompile (torch.compile's automatic-dynamic rule)."""
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        _COMPILED_STEP = torch.compile(decode_step)
    return _COMPILED_STEP


def sdpa_decodes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the eager decoder's steps attend with ``F.scaled_dot_product_attention`` (over the filled slots of the
    cache, grouped-query heads unrepeated) rather than ``decode_attention``: on CPU in 16-bit floats, where SDPA's
    kernel is 1.3-2.7x faster (SmolLM2-135M's 9/3 heads and a 2/2-head shape, batch 16-256, 112 slots, bfloat16, a
    2-core Xeon: 2.44 against 3.10 ms per layer at batch 256, 0.17 against 0.29 at 16) and more accurate (its scores
    stay in float32; the batched matmuls round them to bfloat16). In float32 both ran within 12 % of each other, and
    ``decode_attention`` on the whole contiguous cache stays; GPUs keep ``decode_attention`` too (unmeasured there)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def decode_attention(q_BH1D, k_BKLD, v_BKLD, mask_NGL) -> torch.Tensor:
    """One query token per row against the cache, grouped-query heads batched per KV head (no K/V repeat).

    Two batched matmuls and a softmax: the CUDA-graph / compiled step's attention, and the eager decoder's in float32
    on CPU (level with SDPA there; in 16-bit floats SDPA is faster, ``sdpa_decodes``). ``mask_NGL`` is additive (0 or
    -inf), already expanded to ``(B * KV, H / KV, L)``.
    """
    B, H, _, D = q_BH1D.shape
    KV, L = k_BKLD.shape[1], k_BKLD.shape[2]
    G = H // KV
    q = q_BH1D.reshape(B * KV, G, D)
    # scores = mask + scale * q @ k^T in one kernel (the scale and the mask add ride on the batched matmul)
    scores = torch.baddbmm(mask_NGL, q, k_BKLD.reshape(B * KV, L, D).transpose(-1, -2), alpha=D**-0.5)
    return torch.bmm(scores.softmax(-1), v_BKLD.reshape(B * KV, L, D)).reshape(B, H, 1, D)


class HFDecoder:
    """Any causal LM, through its own forward and a DynamicCache (slower; no fused fast path)."""

    def __init__(self, hf_model: nn.Module):
        self.model = hf_model

    def start(self, prompt_ids_BP, prompt_mask_BP, max_new_tokens):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.mask = prompt_mask_BP.long()
        self.next_pos = self.mask.sum(-1)
        out = self.model(
            input_ids=prompt_ids_BP,
            attention_mask=self.mask,
            position_ids=prompt_positions(prompt_mask_BP),
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits[:, -1].float()

    def step(self, tokens_B):
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        out = self.model(
            input_ids=tokens_B[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1].float()

    def keep(self, rows):
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.next_pos = self.next_pos[rows]
