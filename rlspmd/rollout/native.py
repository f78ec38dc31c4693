"""The native rollout engine: torch-only batched sampling with a preallocated KV cache.

The engine reads its model from ``weights``: the actor's own parameters gathered in place for the duration of
``generate`` (``rollout/weights.py: InPlaceWeights``; no copy of the model, and always the current weights, so the
weight sync is free), or ``OwnWeights``, a private copy (split placement, or a rollout dtype different from
training) that ``update_weights`` loads from the weight stream, the same stream the vLLM engine loads.

Decoding: on CUDA (``rollout.engine.cuda_graphs`` (native engine), Llama-family models) a static KV cache and a decode
step replayed from CUDA graphs, sampling on the device and no host sync per token (``rlspmd/rollout/cuda_graphs.py``).
Elsewhere (CPU, other architectures) the eager decoder, where finished rows stop costing compute: once a quarter of the
active rows have produced EOS they are dropped from the batch and the KV cache is compacted (compacting at every EOS
would copy the cache too often).

Mixture-of-experts models (eager decoding only; their routing is data-dependent, no static graph) also return the
experts every token was routed to, ``rollout_routing_BL`` ``(B, L, N, K)`` int16 in the sample layout (``-1`` where
no forward ran the token: the last sampled token, padding), which router replay R3 replays in the trainer.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from rlspmd.components import Problem
from rlspmd.models.decoder import FUSED_FAMILY
from rlspmd.models.loader import dtype_name, load_causal_lm
from rlspmd.models.vision import VISION_MODEL_TYPES, vision_inputs
from rlspmd.models.vision_decoder import rollout_decoder
from rlspmd.models.moe import is_moe
from rlspmd.protocol import Batch
from rlspmd.rollout.base import RolloutEngineConfig, assemble_rollout
from rlspmd.rollout.continuous import RequestSource, SlotDecoder, serve
from rlspmd.rollout.cuda_graphs import StaticDecoder, static_decoder
from rlspmd.rollout.sampling import SamplingParams, sample_next


@dataclass
class NativeConfig(RolloutEngineConfig):
    """The native engine (the default): torch-only batched sampling with a KV cache, on CPU and GPU; colocated with an
    FSDP2 actor it reads the gathered weights in place (no copy, no sync)."""

    name: ClassVar[str] = "native"
    reads_in_place: ClassVar[bool] = True
    serves_images: ClassVar[bool] = True
    records_routing: ClassVar[bool] = True
    max_batch_size: int = 256
    """Most sequences the native engine decodes at once on one rank."""
    compile_decode: bool = False
    """Run the static-shape decode step (``cuda_graphs``' step: it attends over the whole preallocated KV cache under a
    mask, finished rows stay in the batch) through ``torch.compile`` (Llama-family models); with ``cuda_graphs`` on
    CUDA the compiled step is what the graphs capture. The first generations pay the compile time. Same tokens as the
    eager step (tested on CPU). On a 2-core CPU it is no faster than eager (measured 1.11 s vs 1.02 s per 64 x 128
    generation)."""
    cuda_graphs: bool = True
    """On CUDA (Llama-family models with a static RoPE table): a static KV cache, the decode step (model, sampling and
    bookkeeping, no host sync) captured in one CUDA graph per batch size and replayed for every token, finished rows
    checked every 16 tokens, prefill as one forward. Graphs are captured at the start of each generation, while the
    weights are gathered in place, and released at its end. Same greedy tokens as eager decoding (tested on CPU for
    the uncaptured step; the captured graphs by a ``gpu``-marked test, not yet run on a GPU). No effect on CPU or for
    other architectures (they decode eagerly). False: eager decoding."""
    cpu_kernels: bool = True
    """On CPU in bfloat16 (Llama-family models without q/k norms): the eager decode step runs each layer's elementwise
    work (RMSNorm with its residual add, RoPE with the KV-cache write, SwiGLU) in fused C++ kernels, built once per
    machine at first use (``models/cpu_kernels.py``: g++ and ninja, about 11 s; where they cannot be built, a warning
    says so and decoding runs torch ops), with the torch ops' roundings (tested bit for bit), and its attention in one
    more (``decode_attention``: float32 inside, rounded once, where SDPA rounds its probabilities to bfloat16; the
    logits agree to bfloat16's precision). SmolLM2-135M at 16 rows on a 2-core Xeon: 42 against 51 ms a decode step
    with the elementwise kernels; the GRPO benchmark's generation then 2.04 against 2.25 s with the attention kernel.
    False: torch ops and SDPA."""

    def problems(self) -> list[Problem]:
        return [] if self.max_batch_size >= 1 else [("max_batch_size", self.max_batch_size, "must be >= 1")]

    def build(self, *, weights, model_path, dtype, sleeps, tp, seed, eos_ids, pad_id, device, max_model_len):
        """Reads ``weights`` in place when they are ``InPlaceWeights``, else keeps a private copy loaded from disk and
        replaced at the first sync."""
        if not weights.in_place:
            model = load_causal_lm(
                model_path, dtype=dtype_name(dtype), attn_implementation="sdpa", field_name="actor.model.path"
            )
            weights = OwnWeights(model.to(device))
        return NativeEngine(
            weights,
            eos_ids=eos_ids,
            pad_id=pad_id,
            max_batch_size=self.max_batch_size,
            device=device,
            compile_decode=self.compile_decode,
            cuda_graphs=self.cuda_graphs,
            cpu_kernels=self.cpu_kernels,
        )


class OwnWeights:
    """The engine's private copy of the model, refreshed by ``load``."""

    def __init__(self, hf_model: nn.Module):
        self.hf_model = hf_model.eval().requires_grad_(False)

    def model(self):
        return nullcontext(self.hf_model)

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = dict(self.hf_model.named_parameters())
        n_bytes = 0
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"weight {name!r} does not exist in the rollout model")
            params[name].copy_(tensor)
            n_bytes += tensor.numel() * tensor.element_size()
        return n_bytes


class RoutingLog:
    """The experts a MoE generation routed each token to, in the sample layout ``(B, P + T, N, K)`` (``-1`` until a
    forward runs the token), filled from the decoder's ``routing`` after the prefill and after every decode step."""

    def __init__(self, B: int, P: int, T: int):
        self.shape, self.P = (B, P + T), P
        self.routing_BL: torch.Tensor | None = None

    def prompts(self, routing_BPNK: torch.Tensor) -> None:
        self.routing_BL = routing_BPNK.new_full((*self.shape, *routing_BPNK.shape[2:]), -1, dtype=torch.int16)
        self.routing_BL[:, : self.P] = routing_BPNK

    def token(self, t: int, rows: torch.Tensor, routing_B1NK: torch.Tensor) -> None:
        """Response token ``t`` of the original rows ``rows`` ran through the decoder."""
        self.routing_BL[rows, self.P + t] = routing_B1NK[:, 0].to(torch.int16)


@torch.inference_mode()
def generate_tokens(
    decoder,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    params: SamplingParams,
    *,
    eos_ids: torch.Tensor,
    pad_id: int,
    generator: torch.Generator | None,
    compact_fraction: float = 0.25,
    images: list | None = None,
    routing: RoutingLog | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode up to ``params.max_new_tokens`` per row -> (tokens_BR, lengths_B, logprobs_BR).

    ``lengths_B`` counts generated tokens including the EOS token; tokens past it are ``pad_id``. A
    ``StaticDecoder`` runs its own loop (static shapes, CUDA graphs); the eager decoders run the loop below.
    ``images``: the rows' images, for a vision-language decoder's prefill (``models/vision_decoder.py``).
    ``routing``: filled with a MoE model's routing (an eager ``LlamaFamilyDecoder``).
    """
    if isinstance(decoder, StaticDecoder):
        return decoder.generate(
            prompt_ids_BP, prompt_mask_BP, params, eos_ids=eos_ids, pad_id=pad_id, generator=generator
        )
    B, T = prompt_ids_BP.shape[0], params.max_new_tokens
    dev = prompt_ids_BP.device
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)
    logprobs = torch.zeros(B, T, dtype=torch.float32, device=dev)
    lengths = torch.full((B,), T, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)  # original row of each decoder row
    done = torch.zeros(B, dtype=torch.bool, device=dev)  # per decoder row
    if images is None:
        logits = decoder.start(prompt_ids_BP, prompt_mask_BP, T)
    else:
        logits = decoder.start(prompt_ids_BP, prompt_mask_BP, T, images=images)
    if routing is not None:
        routing.prompts(decoder.routing)

    def step(t: int, tok: torch.Tensor) -> torch.Tensor:
        out = decoder.step(tok)
        if routing is not None:  # the rows still generating (finished ones run until the batch is compacted)
            live = ~done
            routing.token(t, rows[live], decoder.routing[live])
        return out

    suppress = params.ignore_eos and eos_ids.numel() > 0
    stops = eos_ids.numel() > 0 and not suppress
    any_done = False  # while no row has finished (and none was dropped), rows == arange(B): plain column writes
    for t in range(T):
        if suppress:
            logits.index_fill_(-1, eos_ids, float("-inf"))
        tok, lp = sample_next(logits, params, generator)
        if any_done:
            live = ~done
            tokens[rows[live], t] = tok[live]
            logprobs[rows[live], t] = lp[live]
        else:
            live = None
            tokens[:, t] = tok
            logprobs[:, t] = lp
        if not stops:
            if t + 1 < T:
                logits = step(t, tok)
            continue
        newly = torch.isin(tok, eos_ids) if live is None else live & torch.isin(tok, eos_ids)
        if newly.any():
            any_done = True
            lengths[rows[newly]] = t + 1
            done |= newly
            if bool(done.all()):
                break
            if done.float().mean() >= compact_fraction:
                keep = (~done).nonzero().squeeze(-1)
                decoder.keep(keep)
                rows, tok, done = rows[keep], tok[keep], done[keep]
        if t + 1 < T:
            logits = step(t, tok)
    return tokens, lengths, logprobs


class NativeEngine:
    def __init__(
        self,
        weights,
        *,
        eos_ids: list[int],
        pad_id: int,
        max_batch_size: int,
        device: torch.device,
        compile_decode: bool = False,
        cuda_graphs: bool = True,
        cpu_kernels: bool = True,
    ):
        """``cuda_graphs`` (``rollout.engine.cuda_graphs`` (native engine)): static decoding from CUDA graphs on CUDA;
        ``compile_decode`` (``rollout.engine.compile_decode`` (native engine)): the static step through
        ``torch.compile`` (see ``rollout/cuda_graphs.py``); ``cpu_kernels`` (``rollout.engine.cpu_kernels`` (native
        engine)): fused CPU kernels in the eager decode step (``models/cpu_kernels.py``)."""
        self.weights = weights
        self.compile_decode = compile_decode
        self.cuda_graphs = cuda_graphs
        self.cpu_kernels = cpu_kernels
        self.capture_s = 0.0
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.device = device

    def generate(self, prompts: Batch, params: SamplingParams, *, generator: torch.Generator | None) -> Batch:
        prompts = prompts.to(self.device)  # the engine's device, as FSDP2 moves a module's inputs
        batch = prompts.repeat(params.n) if params.n > 1 else prompts
        outs, routed = [], []
        with self.weights.model() as hf_model:
            # The static decoder lives for this generation only: its graphs read the weights gathered for it.
            static = static_decoder(
                hf_model, device=self.device, cuda_graphs=self.cuda_graphs, compile=self.compile_decode
            )
            decoder = static or rollout_decoder(hf_model, cpu_kernels=self.cpu_kernels)
            moe = is_moe(hf_model.config)
            for part in batch.split(self.max_batch_size):
                P = part["prompts_BP"].shape[1]
                log = RoutingLog(len(part), P, params.max_new_tokens) if moe else None
                outs.append(
                    generate_tokens(
                        decoder,
                        part["prompts_BP"],
                        part["prompt_mask_BP"],
                        params,
                        eos_ids=self.eos_ids,
                        pad_id=self.pad_id,
                        generator=generator,
                        **vision_inputs(part),
                        routing=log,
                    )
                )
                if log is not None:
                    routed.append(log.routing_BL)
            if static is not None:
                self.capture_s += static.capture_s
        tokens, lengths, logprobs = (torch.cat(x) for x in zip(*outs))
        out = assemble_rollout(batch, tokens, lengths, logprobs, pad_id=self.pad_id)
        if routed:
            out.set(rollout_routing_BL=torch.cat(routed)[:, : out["input_ids_BL"].shape[1]])
        return out

    def serve(self, source: RequestSource, params: SamplingParams, *, max_len: int, max_requests: int) -> dict:
        """Request-level generation (``rollout/continuous.py``): continuous batching of ``source``'s requests over a
        slotted KV cache of ``max_len`` positions, at most ``rollout.engine.max_batch_size`` at a time (fewer when
        ``max_requests``, the most that can be in flight, is smaller). Eager Llama-family decoding."""
        slots = max(1, min(self.max_batch_size, max_requests))
        with self.weights.model() as hf_model:
            if hf_model.config.model_type not in (*FUSED_FAMILY, *VISION_MODEL_TYPES):
                raise ValueError(
                    f"rollout.agent: the native engine's request-level generation supports Llama-family "
                    f"models ({sorted(FUSED_FAMILY)}) and {list(VISION_MODEL_TYPES)}, not "
                    f"model_type={hf_model.config.model_type!r}"
                )
            decoder = SlotDecoder(hf_model, slots=slots, max_len=max_len, device=self.device)
            return serve(decoder, source, params, slots=slots, eos_ids=self.eos_ids.tolist())

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if not isinstance(self.weights, OwnWeights):
            raise RuntimeError("the colocated native engine reads the actor's weights in place; nothing to update")
        return self.weights.load(weights)

    @property
    def holds_weights(self) -> bool:
        """Always: in place, or a private copy that survives between generations."""
        return True

    def sleep(self) -> None:
        """Nothing to release: the KV cache lives only inside ``generate``."""

    def wake(self) -> None:
        pass

    def take_times(self) -> dict[str, float]:
        """Seconds since the last call: CUDA-graph capture (``timing/rollout/capture`` in the role's metrics)."""
        capture_s, self.capture_s = self.capture_s, 0.0
        return {"wake_s": 0.0, "sleep_s": 0.0, "capture_s": capture_s}
