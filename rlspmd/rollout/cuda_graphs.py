"""Native decoding with static shapes, replayed from CUDA graphs on GPUs.

Why: the eager decode loop launches every kernel of every layer for every token (about 20 per layer), and on a GPU
a small model's decode step is over long before the host has launched the next one. A CUDA graph replays the whole
step with one launch.

One generation (``StaticDecoder.generate``):

1. prefill: the left-padded prompts in one forward (``LlamaFamilyDecoder.prefill``), writing their K/V into a static
   per-layer cache sized for the prompt plus every new token;
2. the first token is sampled from the prefill's logits;
3. every further token is one replay of ``StaticDecoder._step``: ``decode_step`` (the model on the last token, its K/V
   written into the next cache slot, attention over the whole cache under an additive mask), the sampler on a
   precomputed uniform draw (``sample_with_uniform``), and the bookkeeping (tokens, log-probs, lengths, finished rows,
   counters): device tensors updated in place, no host sync;
4. the host reads "have all rows finished?" every ``check_every`` tokens (one small copy) and stops early then.

One graph per batch size: the parts of a generation (``NativeEngine`` splits the batch by ``max_batch_size``: full
parts and a remainder) each get the graph of their size, captured at its first use. Finished rows stay in the batch
(their tokens are pad) and are not compacted away, so a part's shapes never change.

Weights and lifetime (a decision): graphs hold raw device addresses. Colocated with FSDP2, the decoder reads the
actor's parameters gathered in place (``FSDPEngine.unsharded``), and FSDP2 allocates fresh storage at every
``unshard()``, so a graph captured during one generation may read freed memory in the next. A ``StaticDecoder``
therefore lives for ONE generation: its graphs, KV caches and memory pool are created after the weights are
gathered and dropped when the generation ends, which also hands that memory back to training. The cost is one
capture per batch size per generation (``capture_s``, reported by the GPU suite). Keeping graphs across generations
would need the weights at stable addresses (a private copy, or a check of their data pointers before each replay)
and would hold the pool through training.

Randomness: the uniform draws of every step are taken from the rollout's generator before decoding (``T x B``
floats), so the graph holds no RNG state and a generation is reproducible from its generator. The draws are the
eager engine's distribution; on CPU they are even the same numbers, in the same order.

On CPU the same step runs without capture (tested against the eager engine; CPU keeps the eager engine by default);
``compile`` runs ``decode_step`` through ``torch.compile`` (``rollout.engine.compile_decode`` (native engine)), also
inside the graphs.

Simplifications: attention always covers the whole cache (prompt + all new tokens) under the mask, twice the eager
path's average work for long generations; prefill is padded, not packed (one forward either way), each run of identical
prompts (a GRPO group) once, its slots then copied to the group's rows, as in the eager decoder.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from rlspmd.models.decoder import LLAMA_FAMILY, LlamaFamilyDecoder, compiled_decode_step, decode_step
from rlspmd.rollout.sampling import SamplingParams, sample_with_uniform

CHECK_EVERY = 16
"""Tokens between two host reads of "all rows finished" (each is one device-to-host copy of a bool)."""
WARMUP_STEPS = 2
"""Eager runs of the step on a side stream before capture (allocator, cuBLAS workspaces, compilation)."""


class DecodeState:
    """The static tensors of one batch size: per-layer KV caches, mask, counters and outputs. Their addresses are
    what a captured graph reads and writes; every update is in place."""

    def __init__(
        self, B: int, P: int, T: int, *, decoder: LlamaFamilyDecoder, dtype, device, rope_table, sampled: bool
    ):
        L = P + T
        shape = (B, decoder.n_kv, L, decoder.head_dim)
        self.B, self.P, self.T = B, P, T
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(decoder.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(decoder.n_layers)]
        self.cos, self.sin = rope_table
        self.mask = torch.zeros(B, L, dtype=dtype, device=device)
        """Additive (B, L): -inf at prompt padding and at slots not written yet; each step opens its slot."""
        self.tok = torch.zeros(B, dtype=torch.long, device=device)
        """The last sampled token per row (the next step's input)."""
        self.pos = torch.zeros(B, dtype=torch.long, device=device)
        """Position id of ``tok`` per row."""
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        """Cache slot the next step writes (shared by all rows: prompts are left-padded to one width)."""
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        """Output column of the next sampled token."""
        self.tokens = torch.zeros(B, T, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(B, T, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(B, dtype=torch.long, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.u = torch.zeros(T, B, dtype=torch.float32, device=device) if sampled else None
        """Uniform draw per (step, row), filled from the generator before decoding."""

    def rewind(self) -> None:
        """Counters back to the first decode step (before warm-up runs and capture, which advance them)."""
        self.slot.fill_(self.P)
        self.t.fill_(1)
        self.pos.zero_()


class StaticDecoder:
    """Static-shape decoding of a Llama-family model for one generation, CUDA-graph captured when ``capture``."""

    def __init__(self, hf_model: nn.Module, *, capture: bool, compile: bool = False, check_every: int = CHECK_EVERY):
        self.model = LlamaFamilyDecoder(hf_model)
        self.weights = self.model.params()
        self.capture = capture
        self.check_every = check_every
        self.step_fn = compiled_decode_step() if compile else decode_step
        self.states: dict[tuple, tuple[DecodeState, torch.cuda.CUDAGraph | None]] = {}
        self.pool = None
        self.capture_s = 0.0
        """Seconds spent capturing graphs (warm-up included)."""

    @staticmethod
    def supports(hf_model: nn.Module) -> bool:
        """Llama-family models whose RoPE is a fixed table (the step looks cos/sin up by position)."""
        return hf_model.config.model_type in LLAMA_FAMILY and LlamaFamilyDecoder(hf_model).static_rope

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids_BP: torch.Tensor,
        prompt_mask_BP: torch.Tensor,
        params: SamplingParams,
        *,
        eos_ids: torch.Tensor,
        pad_id: int,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Same contract as ``rlspmd.rollout.native.generate_tokens``: (tokens_BR, lengths_B, logprobs_BR)."""
        B, P = prompt_ids_BP.shape
        T = params.max_new_tokens
        suppress = params.ignore_eos and eos_ids.numel() > 0
        stops = eos_ids.numel() > 0 and not suppress
        rules = (params, suppress, stops, pad_id)
        s, graph = self._prepared(B, P, T, prompt_ids_BP.device, rules, eos_ids)
        self._reset(s, prompt_mask_BP, pad_id, generator)
        logits = self._prefill(s, prompt_ids_BP, prompt_mask_BP)
        self._record(s, logits, eos_ids, rules)
        for t in range(1, T):
            if graph is not None:
                graph.replay()
            else:
                self._step(s, eos_ids, rules)
            if stops and t % self.check_every == 0 and bool(s.done.all()):
                break
        return s.tokens.clone(), s.lengths.clone(), s.logprobs.clone()

    def _prefill(self, s: DecodeState, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor) -> torch.Tensor:
        """The prompts' forward into ``s``'s caches: each run of identical prompts (a GRPO group's rows) once, into the
        caches' first rows, then every row gets its prompt's slots (``LlamaFamilyDecoder.distinct_prompts``)."""
        rope = (s.cos, s.sin)
        distinct = self.model.distinct_prompts(prompt_ids_BP, prompt_mask_BP)
        if distinct is None:
            return self.model.prefill(prompt_ids_BP, prompt_mask_BP, s.k, s.v, rope)
        firsts, row_of = distinct
        U = firsts.numel()
        ks, vs = [k[:U] for k in s.k], [v[:U] for v in s.v]
        logits = self.model.prefill(prompt_ids_BP[firsts], prompt_mask_BP[firsts], ks, vs, rope)
        P = prompt_ids_BP.shape[1]
        for cache in (*s.k, *s.v):  # the prompt's slots only (the rest are still zeros), in place: a graph reads them
            slots = cache[:, :, :P]
            slots.copy_(slots.index_select(0, row_of))
        return logits.index_select(0, row_of)

    def _prepared(self, B, P, T, device, rules, eos_ids) -> tuple[DecodeState, torch.cuda.CUDAGraph | None]:
        key = (B, P, T, rules)
        if key not in self.states:
            dtype = self.weights[0].dtype
            rope = self.model.rope_table_for(P + T, device)
            s = DecodeState(
                B, P, T, decoder=self.model, dtype=dtype, device=device, rope_table=rope, sampled=not rules[0].greedy
            )
            graph = self._capture(s, eos_ids, rules) if self.capture and T > 1 else None
            self.states[key] = (s, graph)
        return self.states[key]

    def _capture(self, s: DecodeState, eos_ids, rules) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(WARMUP_STEPS):
                s.rewind()
                self._step(s, eos_ids, rules)
        torch.cuda.current_stream().wait_stream(side)
        s.rewind()
        if self.pool is None:
            self.pool = (
                torch.cuda.graph_pool_handle()
            )  # one pool for every batch size: graphs never replay concurrently
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (NCCL's watchdog polls its events) may keep calling CUDA during
        # the capture; "global" would turn their calls into capture errors
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._step(s, eos_ids, rules)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0
        return graph

    def _reset(self, s: DecodeState, prompt_mask_BP: torch.Tensor, pad_id: int, generator) -> None:
        """The state of a fresh generation, written in place (warm-up and capture left garbage behind)."""
        for k, v in zip(s.k, s.v):  # unwritten slots are masked, but 0 * (inf or nan) would still poison a row
            k.zero_()
            v.zero_()
        s.mask.fill_(float("-inf"))
        s.mask[:, : s.P].masked_fill_(prompt_mask_BP.bool(), 0.0)
        s.tok.zero_()
        s.pos.copy_(prompt_mask_BP.long().sum(-1))  # the first new token's position
        s.slot.fill_(s.P)
        s.t.zero_()
        s.tokens.fill_(pad_id)
        s.logprobs.zero_()
        s.lengths.fill_(s.T)
        s.done.zero_()
        if s.u is not None:
            s.u.copy_(torch.rand(s.T, s.B, generator=generator, device=s.u.device, dtype=s.u.dtype))

    def _step(self, s: DecodeState, eos_ids: torch.Tensor, rules) -> None:
        """One token for every row: what the graph captures. Device ops only, all in place."""
        m = self.model
        s.mask.index_fill_(1, s.slot, 0.0)  # the slot this step writes becomes visible
        logits = self.step_fn(
            self.weights, s.k, s.v, s.tok, s.pos, s.slot, s.mask, s.cos, s.sin, m.n_heads, m.n_kv, m.head_dim, m.eps
        )
        self._record(s, logits, eos_ids, rules)
        s.pos.add_(1)
        s.slot.add_(1)

    @staticmethod
    def _record(s: DecodeState, logits_BV: torch.Tensor, eos_ids: torch.Tensor, rules) -> None:
        """Sample the next token from ``logits_BV`` and write it, its log-prob and the row's stop state."""
        params, suppress, stops, pad_id = rules
        if suppress:
            logits_BV.index_fill_(-1, eos_ids, float("-inf"))
        u = None if s.u is None else s.u.index_select(0, s.t).view(s.B, 1)
        tok, lp = sample_with_uniform(logits_BV, params, u)
        live = ~s.done
        tok = torch.where(live, tok, pad_id)
        lp = torch.where(live, lp, 0.0)
        s.tokens.index_copy_(1, s.t, tok[:, None])
        s.logprobs.index_copy_(1, s.t, lp[:, None])
        if stops:
            newly = live & (tok[:, None] == eos_ids).any(-1)
            s.lengths.copy_(torch.where(newly, s.t + 1, s.lengths))
            s.done.logical_or_(newly)
        s.tok.copy_(tok)
        s.t.add_(1)


def static_decoder(
    hf_model: nn.Module, *, device: torch.device, cuda_graphs: bool, compile: bool
) -> StaticDecoder | None:
    """The static decoder the native engine uses for ``hf_model``, or None for eager decoding: CUDA graphs on CUDA
    (``rollout.engine.cuda_graphs`` (native engine)), or the compiled static step anywhere
    (``rollout.engine.compile_decode`` (native engine)); Llama-family models with a fixed RoPE table only."""
    graphs = cuda_graphs and device.type == "cuda"
    if not (graphs or compile) or not StaticDecoder.supports(hf_model):
        return None
    return StaticDecoder(hf_model, capture=graphs, compile=compile)
