"""Mixture-of-experts layers for training and rollout: routing, experts, expert parallelism, routing replay.

transformers (5.x) builds Qwen3-MoE and Qwen2-MoE with a sparse block per decoder layer: a router ``mlp.gate``
(``weight`` ``(E, H)``), the experts fused into two 3-D parameters ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and
``mlp.experts.down_proj`` ``(E, H, I)`` (and, for Qwen2-MoE, a dense ``mlp.shared_expert`` scaled by
``sigmoid(mlp.shared_expert_gate(x))``). Checkpoints store the experts one by one
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``); transformers fuses them on load and splits them on
save. rlspmd's sharded loader reads the per-expert tensors straight into the slices of the fused parameters
(``fused_expert_keys``); exports go through ``save_pretrained``, which writes the per-expert layout again.

**Training** (``adapt_moe``): each sparse block of the policy's HF model is replaced by ``MoEBlock``, which keeps the
block's own router and experts modules (same parameter names and shapes: checkpoints, weight sync and FSDP2 see no
difference) and computes the same function as transformers, plus what RL needs:

* routing replay: a forward may be given the experts to use per token (``RoutingState.begin(replay_TNK=...)``); the
  gate weights are then the router's probabilities *at those experts* (renormalised when ``norm_topk_prob``), so
  the router still gets a gradient (verl's / Megatron's routing replay);
* what the forward routed (per MoE layer: the experts used, the router's own top-k, the logits for the
  load-balancing loss), kept in the shared ``RoutingState`` until the next forward begins, so that activation
  checkpointing's recomputation (during the backward) replays the same routing and records nothing twice;
* expert parallelism (``apply_ep``): the experts' parameters become ``DTensor``s sharded over the ``ep`` mesh dim
  (each rank holds ``E / ep`` experts) and tokens travel to their experts' rank and back with two differentiable
  ``all_to_all``s per layer (Gloo supports them on CPU). The dense parameters stay with FSDP2 over all ranks.

**Experts' matmuls**: the routed tokens are sorted by expert; on CUDA one grouped GEMM per projection
(``torch.nn.functional.grouped_mm``, bfloat16 / float16), elsewhere a loop over the experts that received tokens
(CPU; ``torch._grouped_mm``'s CPU kernel has no backward in torch 2.13). Summation over the top-k follows
transformers' order (weighted outputs reshaped ``(T, K, H)`` and summed), so outputs agree to rounding.

**Rollout** (``moe_mlp``): the native engine's fused decoder calls the same routing and experts functionally on the
block it finds (transformers' or ours), and returns the experts used per token, which the engine records with the
sample (router replay R3).

Simplifications: top-k softmax routing only (Qwen2/Qwen3-MoE; no grouped top-k or sigmoid routers as in
DeepSeek-V3); no capacity factor or token dropping; expert parallel sends every routed token (no deduplication of a
token going to two experts on the same rank).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from rlspmd.algorithms.moe import load_balancing_loss
from rlspmd.components import Problem

MOE_MODEL_TYPES = frozenset({"qwen3_moe", "qwen2_moe"})
"""``model_type``s whose sparse blocks rlspmd runs itself (top-k softmax router, fused SwiGLU experts)."""
FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.)(?P<param>gate_up_proj|down_proj)$")
"""A fused experts parameter's name, and the part its per-expert checkpoint keys share."""


def is_moe(config) -> bool:
    """Whether a model config (an HF ``PretrainedConfig``) is a MoE architecture rlspmd supports."""
    return config.model_type in MOE_MODEL_TYPES


def moe_layer_indices(config) -> list[int]:
    """Decoder layers with a sparse block (transformers' rule: not in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th layer)."""
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    ]


def _sparse_block_types() -> tuple[type, ...]:
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, MoEBlock)


def has_shared_expert(block: nn.Module) -> bool:
    """A sparse block with a gated shared expert (Qwen2-MoE's, or a ``MoEBlock`` made from one)."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    return block.has_shared if isinstance(block, MoEBlock) else isinstance(block, Qwen2MoeSparseMoeBlock)


def is_sparse_block(module: nn.Module) -> bool:
    """A layer's ``mlp`` is a sparse block (transformers' or ``MoEBlock``), not a dense MLP."""
    return isinstance(module, _sparse_block_types())


# -- routing ----------------------------------------------------------------------------------------------------------


def route(
    logits_TE: torch.Tensor, *, top_k: int, norm_topk_prob: bool, replay_TK: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k softmax routing -> ``(weights_TK, used_TK, own_TK)``.

    ``own_TK``: the router's top-k (probabilities computed in float32, as transformers does). ``used_TK``: ``own_TK``,
    or the rows of ``replay_TK`` that are known (``>= 0``; a row of ``-1`` routes freely). ``weights_TK``: the
    probabilities at the used experts, renormalised to sum 1 when ``norm_topk_prob``, in the logits' dtype."""
    probs = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
    top, own = torch.topk(probs, top_k, dim=-1)
    if replay_TK is None:
        used, weights = own, top
    else:
        free = (replay_TK[:, 0] < 0)[:, None]
        used = torch.where(free, own, replay_TK.long())
        weights = probs.gather(-1, used)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits_TE.dtype), used, own


# -- experts ----------------------------------------------------------------------------------------------------------


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a parameter (an expert-parallel ``DTensor``), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def can_group(x: torch.Tensor) -> bool:
    """Whether ``grouped_swiglu`` runs one grouped GEMM per projection for ``x``: CUDA, half precision, a torch with
    ``torch.nn.functional.grouped_mm``."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and hasattr(F, "grouped_mm")


def grouped_swiglu(
    x_SH: torch.Tensor, counts_E: torch.Tensor, gate_up_EIH, down_EHI, act, *, grouped: bool | None = None
) -> torch.Tensor:
    """SwiGLU experts over rows sorted by expert: rows ``[sum(counts[:e]), sum(counts[:e+1]))`` go to expert ``e``.
    ``gate_up_EIH`` is ``(E, 2I, H)`` (gate rows, then up rows), ``down_EHI`` ``(E, H, I)``. ``grouped``: the grouped
    GEMM or the loop (None: the grouped GEMM where ``can_group``)."""
    if can_group(x_SH) if grouped is None else grouped:
        offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
        gate, up = F.grouped_mm(x_SH, gate_up_EIH.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(act(gate) * up, down_EHI.transpose(-2, -1), offs=offs)
    out, start = [], 0
    for e, n in enumerate(counts_E.tolist()):  # one host read of the counts per call (free on CPU)
        if n:
            gate, up = F.linear(x_SH[start : start + n], gate_up_EIH[e]).chunk(2, dim=-1)
            out.append(F.linear(act(gate) * up, down_EHI[e]))
            start += n
    return torch.cat(out) if out else x_SH.new_zeros(0, down_EHI.shape[1])


def _combine(y_SH: torch.Tensor, order_S: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Expert outputs in expert-sorted order -> the token outputs: back to (token, k) order, weighted, summed over k."""
    T, K = weights_TK.shape
    inverse = torch.empty_like(order_S)
    inverse[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    weighted = y_SH[inverse] * weights_TK.reshape(-1, 1)
    return weighted.view(T, K, -1).sum(dim=1)


def experts_forward(
    experts: nn.Module,
    x_TH: torch.Tensor,
    used_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    ep_group=None,
    grouped: bool | None = None,
) -> torch.Tensor:
    """The routed experts' output per token: ``sum_k w_tk * expert_{used_tk}(x_t)``. ``ep_group``: the experts are
    sharded over this group (``apply_ep``) and tokens travel to them with ``all_to_all``. ``grouped``: see
    ``grouped_swiglu`` (benchmarks force the loop)."""
    T, K = used_TK.shape
    E = experts.num_experts
    flat = used_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    x_sorted = x_TH[order // K]
    gate_up, down = _local(experts.gate_up_proj), _local(experts.down_proj)
    if ep_group is None:
        y = grouped_swiglu(x_sorted, counts, gate_up, down, experts.act_fn, grouped=grouped)
    else:
        y = _ep_experts(x_sorted, counts, gate_up, down, experts.act_fn, group=ep_group, grouped=grouped)
    return _combine(y, order, weights_TK).to(x_TH.dtype)


def _ep_experts(x_SH, counts_E, gate_up, down, act, *, group, grouped: bool | None) -> torch.Tensor:
    """Expert parallel: rows sorted by (global) expert go to the rank holding their expert, are computed there and come
    back in the same order. Rank ``r`` of ``group`` holds experts ``[r * El, (r + 1) * El)``."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    P = dist.get_world_size(group)
    El = gate_up.shape[0]
    # how many rows each rank sends to each of my experts: one all-to-all of the counts (and one host read)
    recv_counts = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts, counts_E, group=group)
    send = counts_E.view(P, El).sum(1)
    recv = recv_counts.view(P, El)
    send_splits, recv_splits = send.tolist(), recv.sum(1).tolist()
    x_recv = wait_tensor(all_to_all_single_autograd(x_SH, recv_splits, send_splits, group))
    # received rows come by source rank, then expert: regroup them by local expert
    local_expert = torch.repeat_interleave(torch.arange(El, device=x_SH.device).repeat(P), recv.reshape(-1))
    regroup = torch.argsort(local_expert, stable=True)
    y = grouped_swiglu(x_recv[regroup], recv.sum(0), gate_up, down, act, grouped=grouped)
    back = torch.empty_like(regroup)
    back[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    return wait_tensor(all_to_all_single_autograd(y[back], send_splits, recv_splits, group))


def moe_mlp(block: nn.Module, x: torch.Tensor, *, replay_TK: torch.Tensor | None = None, ep_group=None):
    """A sparse block's output for hidden states ``x`` ``(..., H)``, functionally (transformers' block or
    ``MoEBlock``) -> ``(y (..., H), used_TK, own_TK, logits_TE)`` with ``T`` the flattened leading dims."""
    shape = x.shape
    x_TH = x.reshape(-1, shape[-1])
    gate = block.gate
    logits = F.linear(x_TH, gate.weight)
    weights, used, own = route(logits, top_k=gate.top_k, norm_topk_prob=gate.norm_topk_prob, replay_TK=replay_TK)
    y = experts_forward(block.experts, x_TH, used, weights, ep_group=ep_group)
    if has_shared_expert(block):
        y = y + torch.sigmoid(F.linear(x_TH, block.shared_expert_gate.weight)) * block.shared_expert(x_TH)
    return y.view(shape), used, own, logits


# -- training: the blocks, their shared routing state, expert parallel ------------------------------------------------


@dataclass
class RoutingState:
    """What one forward of a MoE model routed, shared by its ``MoEBlock``s (indexed by MoE layer ``0..N-1``).

    ``begin`` starts a forward over a ``(B, L)`` batch, packed (only the tokens ``token_index_T`` run) or padded, and
    says what to replay. The blocks record on their first call after it only, so the recomputation of checkpointed
    layers in the backward replays the same routing and records nothing twice. Routing tensors are int16 ``(..., N,
    K)``: the ``N`` MoE layers' ``K`` experts of a token, ``-1`` where unknown."""

    num_layers: int
    top_k: int
    num_experts: int
    shape: tuple[int, int] = (0, 0)
    token_index_T: torch.Tensor | None = None
    mask_T: torch.Tensor | None = None
    replay_TNK: torch.Tensor | None = None
    used: list[torch.Tensor | None] = field(default_factory=list)
    own: list[torch.Tensor | None] = field(default_factory=list)
    logits: list[torch.Tensor | None] = field(default_factory=list)

    def begin(
        self,
        shape: tuple[int, int],
        *,
        token_index_T: torch.Tensor | None = None,
        mask_BL: torch.Tensor | None = None,
        replay_BL: torch.Tensor | None = None,
    ) -> None:
        """A forward over a ``(B, L)`` batch: packed (``token_index_T``, the flat ``B * L`` index of each token that
        runs) or padded (every position runs; ``mask_BL`` says which count in the load-balancing loss).
        ``replay_BL`` ``(B, L, N, K)``: the experts to use per token (rows of ``-1`` route freely), or None."""
        self.shape, self.token_index_T = shape, token_index_T
        self.mask_T = None if mask_BL is None else mask_BL.reshape(-1)
        self.replay_TNK = None if replay_BL is None else self._tokens(replay_BL)
        self.used, self.own, self.logits = ([None] * self.num_layers for _ in range(3))

    def _tokens(self, x_BL: torch.Tensor) -> torch.Tensor:
        flat = x_BL.reshape(self.shape[0] * self.shape[1], *x_BL.shape[2:])
        return flat if self.token_index_T is None else flat.index_select(0, self.token_index_T)

    def replay(self, layer: int) -> torch.Tensor | None:
        return None if self.replay_TNK is None else self.replay_TNK[:, layer]

    def record(self, layer: int, used_TK, own_TK, logits_TE) -> None:
        if self.used and self.used[layer] is None:
            self.used[layer], self.own[layer], self.logits[layer] = used_TK, own_TK, logits_TE

    def routed_BL(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(used, own)`` of the last forward, each ``(B, L, N, K)`` int16 (``-1`` at positions that did not run):
        the experts the forward used, and the router's own top-k."""
        assert self.used and all(u is not None for u in self.used), "no complete forward recorded"
        B, L = self.shape
        out = []
        for per_layer in (self.used, self.own):
            routed = torch.stack(per_layer, 1).to(torch.int16)
            if self.token_index_T is not None:
                routed = routed.new_full((B * L, *routed.shape[1:]), -1).index_copy_(0, self.token_index_T, routed)
            out.append(routed.view(B, L, *routed.shape[1:]))
        return out[0], out[1]

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward over the tokens that count (differentiable through the router
        logits)."""
        return load_balancing_loss(self.logits, top_k=self.top_k, mask_T=self.mask_T)


class MoEBlock(nn.Module):
    """A transformers sparse block's replacement for training: the block's own ``gate`` and ``experts`` (and shared
    expert) modules, ``moe_mlp``'s computation, routing replay and recording through ``state``, expert parallel when
    ``apply_ep`` has set ``ep_group``."""

    def __init__(self, block: nn.Module, *, layer: int, state: RoutingState):
        super().__init__()
        self.gate = block.gate
        self.experts = block.experts
        self.has_shared = has_shared_expert(block)
        if self.has_shared:
            self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        self.layer = layer
        self.state = state
        self.ep_group = None

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        y, used, own, logits = moe_mlp(
            self, hidden_BSH, replay_TK=self.state.replay(self.layer), ep_group=self.ep_group
        )
        self.state.record(self.layer, used, own, logits)
        return y


def adapt_moe(hf_model: nn.Module) -> RoutingState | None:
    """Replace the sparse blocks of a MoE ``hf_model`` (a causal LM or its base model) with ``MoEBlock``s sharing one
    ``RoutingState``, which is returned; None for a dense model (left untouched). Parameters keep their names."""
    cfg = hf_model.config
    if not is_moe(cfg):
        return None
    base = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model
    sparse = moe_layer_indices(cfg)
    state = RoutingState(num_layers=len(sparse), top_k=cfg.num_experts_per_tok, num_experts=cfg.num_experts)
    for n, i in enumerate(sparse):
        layer = base.layers[i]
        assert is_sparse_block(layer.mlp), f"layer {i} of {cfg.model_type} should be sparse"
        layer.mlp = MoEBlock(layer.mlp, layer=n, state=state)
    return state


def moe_blocks(module: nn.Module) -> list[MoEBlock]:
    return [m for m in module.modules() if isinstance(m, MoEBlock)]


def apply_ep(module: nn.Module, *, ep_mesh) -> None:
    """Expert parallel over the 1-D ``ep_mesh``: every ``MoEBlock``'s experts become ``DTensor``s ``Shard(0)`` on it
    (rank ``r`` keeps experts ``[r * E / ep, (r + 1) * E / ep)``; works on meta-built modules) and the block sends
    its tokens over the mesh's group. Call before FSDP2 (``engines/fsdp.py`` shards the experts over the mesh's
    sibling dim)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    blocks = moe_blocks(module)
    if not blocks:
        raise ValueError(f"mesh.actor_ep={ep}: the model has no mixture-of-experts layers to shard")
    for block in blocks:
        E = block.experts.num_experts
        if E % ep:
            raise ValueError(f"mesh.actor_ep={ep} must divide the model's {E} experts (num_experts in config.json)")
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(block.experts, name)
            sharded = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
            block.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        block.ep_group = ep_mesh.get_group()


# -- checkpoint layout ------------------------------------------------------------------------------------------------


def fused_expert_keys(name: str, num_experts: int) -> list[list[str]] | None:
    """The per-expert checkpoint keys of a fused experts parameter, ``[[keys of expert e, in the order they are
    concatenated along the parameter's dim 1] for e in experts]``; None for any other parameter.

    ``...mlp.experts.gate_up_proj`` (E, 2I, H) <- ``...mlp.experts.{e}.gate_proj.weight`` (I, H) then ``up_proj``;
    ``...mlp.experts.down_proj`` (E, H, I) <- ``...mlp.experts.{e}.down_proj.weight`` (H, I)."""
    m = FUSED.match(name)
    if m is None:
        return None
    parts = ("gate_proj", "up_proj") if m["param"] == "gate_up_proj" else ("down_proj",)
    return [[f"{m['prefix']}{e}.{part}.weight" for part in parts] for e in range(num_experts)]


def per_expert_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused experts parameter as its per-expert checkpoint tensors (views, no copy); any other as itself."""
    keys = fused_expert_keys(name, tensor.shape[0])
    if keys is None:
        return [(name, tensor)]
    out = []
    for e, expert_keys in enumerate(keys):
        out += zip(expert_keys, tensor[e].chunk(len(expert_keys), dim=0))
    return out


@dataclass
class MoEConfig:
    """The actor's mixture-of-experts options (Qwen3-MoE / Qwen2-MoE models; ``models/moe.py``, docs/moe.md). Expert
    parallelism is a mesh dim: ``mesh.actor_ep``."""

    aux_loss_coef: float | None = None
    """Coefficient of the router's load-balancing loss in the actor's loss (``actor/moe_aux_loss`` is logged either
    way); None: the model's own ``router_aux_loss_coef`` (config.json), 0: off."""
    router_replay: Literal["off", "R2", "R3"] = "off"
    """Routing replay in the actor's passes. ``R2``: the update reuses the experts the old-log-prob pass routed each
    token to (so the ratio's numerator and denominator route alike). ``R3``: the old-log-prob pass and the update
    both use the experts the rollout engine routed each token to, recorded with the sample (native engine; vLLM
    where it can return them), so training routes as generation did. The gate weights always come from the current
    router (it keeps its gradient)."""

    def problems(self) -> list[Problem]:
        if self.aux_loss_coef is not None and not self.aux_loss_coef >= 0:
            return [("aux_loss_coef", self.aux_loss_coef, "must be >= 0, or None (the model's router_aux_loss_coef)")]
        return []
