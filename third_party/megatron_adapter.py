"""The only module that calls megatron-core. Written against megatron-core 0.16.1 (see README.md here).

``rlspmd.engines.megatron`` imports this module lazily (when a module is built), so rlspmd imports and runs without
megatron-core; importing this module without it raises an ``ImportError`` that says how to install it.

What it wraps, and why each piece is here rather than in the engine:

* ``transformer_config``: a ``TransformerConfig`` for a Qwen2/Llama ``MegatronArch``: RMSNorm, SwiGLU, GQA, qkv bias,
  no dropout, every fusion off (the unfused paths are the ones that also run on CPU), and
  ``calculate_per_token_loss`` so megatron's schedules never rescale our loss (see ``forward_backward``).
* ``gpt_model``: a ``GPTModel`` (local layer spec, no Transformer Engine) that returns the final hidden states
  instead of logits, with rlspmd's SDPA core attention, optionally on CPU:

  - ``SDPACoreAttention`` implements megatron's ``CoreAttention`` protocol with
    ``torch.nn.functional.scaled_dot_product_attention`` and an explicit boolean mask (causal + key padding).
    Megatron's own local ``DotProductAttention`` allocates its score buffer with ``torch.cuda.current_device()``
    (``megatron/core/utils.py: GlobalMemoryBuffer.get_tensor``), so it cannot run on CPU, and it materialises the
    scores in any case.
  - ``_HiddenStatesGPTModel`` overrides the private ``GPTModel._postprocess`` to return the decoder output (after
    the final norm): the LM head runs in rlspmd's chunked log-prob kernel, never as ``B x T x V`` logits.
  - On CPU only, the model's ``RotaryEmbedding`` is given a ``get_emb`` that keeps ``inv_freq`` on its device
    (upstream moves it to ``torch.cuda.current_device()``: ``rotary_pos_embedding.py: RotaryEmbedding.get_emb``).
* ``process_groups``: a ``ProcessGroupCollection`` from groups rlspmd built over the role mesh's ranks, so megatron
  never calls ``parallel_state.initialize_model_parallel`` (which carves the *whole* world and keeps its groups in
  module globals: one layout per process).
* ``forward_backward``: megatron's ``get_forward_backward_func`` schedule on CUDA (1F1B with a ``P2PCommunicator``
  over rlspmd's pipeline group when ``pp`` > 1). On CPU the same loop written out (forward step, loss function,
  backward, per micro-batch): megatron's ``forward_backward_no_pipelining`` allocates its token counter with
  ``device="cuda"`` (``schedules.py``), so it cannot run on CPU; with pipeline stages, rlspmd's GPipe schedule
  (``rlspmd.engines.pipeline``), because megatron's p2p code allocates its buffers on
  ``torch.cuda.current_device()`` (``p2p_communication.py``), on Gloo as on NCCL.
* ``no_dropout_rng_tracker``: megatron forks a CUDA RNG state around dropout regions; with dropout off the
  "inference" tracker (a no-op fork) is exact and needs no CUDA RNG.

What megatron-core 0.16.1 does on a CPU-only torch (2.13.0+cpu, Gloo), found while writing this (details in
README.md here): ``parallel_state.initialize_model_parallel`` works over Gloo; ``GPTModel`` builds with
``use_cpu_initialization``; the forward fails in RoPE and in ``DotProductAttention`` (above);
``DistributedDataParallel`` fails allocating its gradient buffer on CUDA (``param_and_grad_buffer.py``); the schedules
and the pipeline p2p code allocate on CUDA. With the two forward pieces replaced as above, forward and backward run on
CPU, and tensor parallelism runs over Gloo.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlspmd.models.megatron_convert import MegatronArch

try:
    with warnings.catch_warnings():
        # "(Transformer Engine and) Apex are/is not installed. Falling back to ...": expected, this path uses neither.
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine and )?Apex (are|is) not installed")
        import megatron.core
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel.random import initialize_rng_tracker
        from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f'the megatron engine needs megatron-core ({e}); install it with `pip install -e ".[megatron]"`'
    ) from e

MEGATRON_VERSION = "0.16.1"
"""The release this adapter was written and tested against (``setup.py``'s ``megatron`` extra pins it)."""


def version() -> str:
    return megatron.core.__version__


def no_dropout_rng_tracker() -> None:
    """Install megatron's no-op RNG tracker (process-wide).
    Exact because every dropout is 0 (``transformer_config``)."""
    initialize_rng_tracker(inference_rng_tracker=True)


def transformer_config(
    arch: MegatronArch, *, tp: int, pp: int, params_dtype: torch.dtype, cpu: bool
) -> TransformerConfig:
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Unfused paths: the fused kernels need CUDA (and some Apex / Transformer Engine).
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        use_cpu_initialization=cpu,
        perform_initialization=False,  # every weight is loaded from the HF directory right after
        calculate_per_token_loss=True,  # schedules then leave the loss alone (no division by #micro-batches)
        variable_seq_lengths=pp > 1,  # micro-batches are padded to their own longest row: p2p sends shapes first
        # No MoE here; megatron 0.16.1 still refuses variable_seq_lengths with the default "allgather" dispatcher.
        moe_token_dispatcher_type="alltoall",
        cuda_graph_scope=[],  # no CUDA graphs; the default ("full") only triggers a deprecation warning
    )


class SDPACoreAttention(nn.Module):
    """Megatron's ``CoreAttention`` protocol on ``scaled_dot_product_attention`` with an explicit mask.

    ``attention_mask`` is megatron's convention: boolean ``(b, 1, sq, sk)``, True where attention is *not* allowed.
    GQA: key/value heads are repeated per query group (``enable_gqa``), the grouping of ``repeat_kv``.
    """

    def __init__(
        self,
        *,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=None,
    ):
        super().__init__()
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), as HF

    def forward(
        self, query, key, value, attention_mask, /, *, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        assert packed_seq_params is None and attention_bias is None, "SDPACoreAttention takes padded batches only"
        # megatron: (s, b, heads, d) -> SDPA: (b, heads, s, d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale, enable_gqa=True
        )
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


class _HiddenStatesGPTModel(GPTModel):
    """``forward`` returns the decoder's output ``(s, b, h)`` (after the final norm on the last stage): no logits."""

    def _postprocess(self, hidden_states, *args, **kwargs):
        return hidden_states


class _DeviceLocalRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose table stays on ``inv_freq``'s device (upstream moves it to CUDA). Non-interleaved
    RoPE only (``rotary_interleaved=False``, HF's ``rotate_half`` convention)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        assert not self.rotary_interleaved
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def gpt_model(
    config: TransformerConfig,
    arch: MegatronArch,
    *,
    pg_collection: ProcessGroupCollection,
    pre_process: bool,
    post_process: bool,
    tie_embeddings: bool,
    device: torch.device,
) -> nn.Module:
    """This pipeline stage of a GPT model on ``device``, uninitialised (load weights next). Its ``forward(input_ids,
    position_ids, attention_mask)`` returns hidden states ``(s, b, h)``."""
    assert hasattr(GPTModel, "_postprocess"), (
        f"megatron-core {version()}: GPTModel._postprocess is gone; "
        f"third_party/megatron_adapter.py targets {MEGATRON_VERSION}"
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = _HiddenStatesGPTModel(
        config,
        spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tie_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        pg_collection=pg_collection,
    )
    if device.type == "cpu":
        model.rotary_pos_emb.__class__ = _DeviceLocalRotaryEmbedding
    return model.to(device)


def process_groups(*, tp, pp, cp, dp, embd) -> ProcessGroupCollection:
    """The groups megatron's modules and schedules read, all built by the caller over its own ranks (``cp``: a group
    of this rank alone, context parallelism being 1; ``embd``: None unless tied embeddings span pipeline stages)."""
    assert cp.size() == 1, "context parallelism is not supported"
    return ProcessGroupCollection(tp=tp, pp=pp, cp=cp, dp=dp, dp_cp=dp, embd=embd, pos_embd=None)


def forward_backward(
    forward_step: Callable,
    data: Iterator,
    *,
    model: nn.Module,
    num_micro_batches: int,
    pg_collection: ProcessGroupCollection,
    device: torch.device,
    forward_only: bool = False,
    pipeline_dtype: torch.dtype = torch.float32,
) -> None:
    """Run ``forward_step(data_iterator, model) -> (output, loss_func)`` over ``num_micro_batches`` micro-batches and
    backpropagate each ``loss_func(output)[0]`` (megatron's contract, ``calculate_per_token_loss``: the loss is used
    as returned; with pipeline stages, on the last stage). CUDA: megatron's schedule (1F1B with pipeline stages).
    CPU: the same loop without pipelining, or with pipeline stages rlspmd's GPipe schedule over Gloo
    (``rlspmd.engines.pipeline``: megatron's p2p code and schedules allocate on CUDA)."""
    pp = pg_collection.pp.size()
    if device.type == "cuda":
        extra = {} if pp == 1 else {"p2p_communicator": P2PCommunicator(pp_group=pg_collection.pp, config=model.config)}
        get_forward_backward_func(pp_size=pp)(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model,
            num_microbatches=num_micro_batches,
            seq_length=0,
            micro_batch_size=0,  # unused: shapes are exchanged per micro-batch (variable_seq_lengths)
            forward_only=forward_only,
            pg_collection=pg_collection,
            **extra,
        )
        return
    if pp > 1:
        from rlspmd.engines.pipeline import StageP2P, gpipe_forward_backward

        gpipe_forward_backward(
            forward_step,
            data,
            model=model,
            num_micro_batches=num_micro_batches,
            forward_only=forward_only,
            p2p=StageP2P(pg_collection.pp, dtype=pipeline_dtype, device=device),
        )
        return
    for _ in range(num_micro_batches):
        output, loss_func = forward_step(data, model)
        loss = loss_func(output)[0]
        if not forward_only:
            loss.backward()
