"""Training-side model wrappers: the module FSDP shards as one root.

``CausalLMPolicy`` runs a Hugging Face causal LM's backbone and turns the hidden states of the response
positions into per-token log-probs and entropy with the chunked kernel (no full logits). Wrapping the HF
model (instead of calling its ``forward``) keeps the embedding, final norm and LM head inside the root
FSDP unit, so one root forward gathers them exactly once.

With ``packing`` (the default, ``model.packing``) the micro-batch's valid tokens run as one packed sequence
(``rlspmd.models.packing``) through the attention kernel ``attn_kernel`` (``model.attn_kernel``, resolved per device
and compute dtype), and the LM head sees only the valid response positions; the outputs are scattered back to the
padded ``(B, R)`` layout with zeros at padding. Without it the padded batch runs as is.

A mixture-of-experts model (``models/moe.py``) gets rlspmd's sparse blocks (``adapt_moe``); ``moe`` is then the
``RoutingState`` they share: a forward replays ``replay_BL`` when given, and leaves what it routed and its
load-balancing loss there for the role to read. ``moe`` is None for a dense model.

On CUDA the packed forward and backward read nothing back to the host except the micro-batch's token counts (one
copy, skipped when the caller passes ``counts``): positions are gathered with ``nonzero_static`` and ``index_put``,
never with boolean indexing or ``masked_scatter``.

What needs the whole vocabulary at each response position is computed here too, inside the forward (where FSDP2 has
gathered the LM head), and only when a caller asks: per-token ``extras`` of the log-prob kernel (``sum_p2``,
``argmax``, ``vocab_logprobs``: ``rlspmd.models.logprobs``), and GKD's JSD against a teacher's distribution
(``jsd``). The forward then returns a third output, ``{name: tensor}``: per-token outputs as ``(B, R)`` (0 at
padding); ``vocab_logprobs`` as ``(N, V)`` over the positions this module scored, in its own order (the valid response
tokens row by row when packed, every ``(B, R)`` position row-major when not), which is the order a second module with
the same packing setting scores the same micro-batch in: a teacher's ``vocab_logprobs`` is a student's ``jsd`` target.
"""

from __future__ import annotations

import torch
from torch import nn

from rlspmd.models.logprobs import DEFAULT_CHUNK, VOCAB_LOGPROBS, JSDTarget, chunked_jsd, chunked_logprobs
from rlspmd.models.moe import adapt_moe
from rlspmd.models.packing import SHARES_PROMPTS, TokenCounts, pack, packed_hidden_states
from rlspmd.models.attn_kernels import packed_kernel


def response_hidden(hidden_BLH: torch.Tensor, response_len: int) -> torch.Tensor:
    """Hidden states that predict the last ``response_len`` tokens (positions P-1 .. L-2)."""
    L = hidden_BLH.shape[1]
    return hidden_BLH[:, L - response_len - 1 : L - 1]


class CausalLMPolicy(nn.Module):
    """Wraps an HF ``*ForCausalLM``; ``forward`` returns ``(logprobs_BR, entropy_BR)`` of the response tokens."""

    def __init__(
        self,
        hf_model: nn.Module,
        *,
        logprob_chunk: int | None = DEFAULT_CHUNK,
        packing: bool = False,
        attn_kernel: str = "auto",
    ):
        super().__init__()
        self.hf = hf_model
        self.logprob_chunk = logprob_chunk
        self.packing = packing
        self.attn_kernel = attn_kernel
        self.moe = adapt_moe(hf_model)
        self.share_prompts = False
        """Pack the prompt of consecutive rows that share it once (``model.share_prompts``; ``packing.pack``): with
        the ``sdpa_loop`` or ``cpu_fused`` kernel, for a dense model, outside sequence parallelism."""
        self.seq = None
        """The engine's sequence-parallel group (``distributed/sequence_parallel.py: SequenceParallel``) or None."""

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
        counts: TokenCounts | None = None,
        replay_BL: torch.Tensor | None = None,
        extras: tuple[str, ...] = (),
        jsd: JSDTarget | None = None,
    ):
        """``(logprobs_BR, entropy_BR)``, and a dict of ``extras`` (and ``jsd``, with gradient) when asked for (module
        docstring). ``counts``: the micro-batch's host-side token counts when the caller has them (packed path only).
        ``replay_BL``: MoE routing to replay, ``(B, L, N, K)`` (``models/moe.py: RoutingState.begin``)."""
        head = self.hf.get_output_embeddings()
        kw = dict(bias=head.bias, temperature=temperature, chunk_size=self.logprob_chunk, with_entropy=with_entropy)
        if not self.packing:
            if self.moe is not None:
                self.moe.begin(input_ids_BL.shape, mask_BL=attention_mask_BL, replay_BL=replay_BL)
            hidden = response_hidden(
                self.backbone_hidden(input_ids_BL, attention_mask_BL, position_ids_BL), response_len
            )
            outs = chunked_logprobs(hidden, head.weight, input_ids_BL[:, -response_len:], extras=extras, **kw)

            def per_token(x):  # already (B, R)
                return x

        else:
            kernel = packed_kernel(self.attn_kernel, input_ids_BL.device, head.weight.dtype)
            if self.seq is not None:  # the group's rows packed together, each rank a slice (rlspmd.validate: no MoE)
                if extras or jsd is not None:
                    raise ValueError(
                        "sequence parallel (mesh.actor_sp > 1) computes log-probs and entropy only: no vocabulary "
                        f"extras {extras} or GKD's JSD (the teacher role and algorithm.kl_estimator 'full' / OTB)"
                    )

                def logprobs(hidden_NH, targets_N, scalars):
                    return chunked_logprobs(hidden_NH, head.weight, targets_N, **{**kw, "temperature": scalars[0],
                                            "with_entropy": bool(scalars[1])})  # fmt: skip

                return self.seq.run(
                    self.hf.get_decoder(),
                    logprobs,
                    input_ids_BL,
                    attention_mask_BL,
                    position_ids_BL,
                    response_len=response_len,
                    scalars=(float(temperature), float(with_entropy)),
                    kernel=kernel,
                )
            packed = pack(
                input_ids_BL,
                attention_mask_BL,
                position_ids_BL,
                kernel=kernel,
                response_len=response_len,
                counts=counts,
                share_prompts=self.share_prompts and kernel in SHARES_PROMPTS and self.moe is None,
            )
            if self.moe is not None:
                self.moe.begin(packed.shape, token_index_T=packed.token_index_T, replay_BL=replay_BL)
            hidden_TH = packed_hidden_states(self.hf.get_decoder(), packed)
            hidden = hidden_TH.index_select(0, packed.predictor_pos_N)
            outs = chunked_logprobs(
                hidden, head.weight, packed.input_ids_1T[0].index_select(0, packed.target_pos_N), extras=extras, **kw
            )
            per_token = packed.scatter_responses
        lp, ent = per_token(outs[0]), per_token(outs[1])
        if not extras and jsd is None:
            return lp, ent
        out = {
            k: v.reshape(-1, v.shape[-1]) if k == VOCAB_LOGPROBS else per_token(v)
            for k, v in (outs[2] if extras else {}).items()
        }
        if jsd is not None:
            H = hidden.shape[-1]
            target = jsd.teacher_logprobs
            assert target.shape[0] == hidden.numel() // H, (
                "the teacher scored other positions: its packing setting must be the student's",
                target.shape,
                hidden.shape,
            )
            div = chunked_jsd(
                hidden.reshape(-1, H),
                head.weight,
                target,
                beta=jsd.beta,
                temperature=jsd.temperature,
                bias=head.bias,
                chunk_size=self.logprob_chunk,
            )
            out["jsd"] = per_token(div.view(hidden.shape[:-1]))
        return lp, ent, out
