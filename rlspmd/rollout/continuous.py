"""Request-level generation for the native engine: continuous batching over a slotted KV cache.

An agent conversation generates a turn, waits for its tools, then generates again. Generating turns in lock-step
batches would make every conversation wait for the slowest tool of the batch; here requests join and leave a running
batch instead. The KV cache has ``slots`` rows; a request (a conversation's whole context so far: prompt, earlier
turns, tool results) is prefilled into a free slot, decodes one token per step together with every other active slot,
and frees its slot when it ends (EOS or its token budget). Between two decode steps the engine asks its
``RequestSource`` for new requests (a conversation whose tool calls returned), so they join at the next step.

Choices and simplifications:

* The eager Llama-family arithmetic of ``models/decoder.py`` (same helpers), with per-slot lengths and positions (a
  vision-language model: the prompt's images and M-RoPE positions at prefill, ``models/vision_decoder.py``). Not
  the CUDA-graph path (``cuda_graphs.py``), whose static batch serves single-turn generation. Other architectures
  are refused by the builder.
* A new turn re-prefills the conversation's whole context into a free slot rather than keeping the slot (and its KV)
  while the tools run: finished rows free their slots at once. Prefix reuse across turns would save that prefill;
  it is left for later.
* Sampling randomness is a pure function of (request seed, token index) (``sampling.counter_uniform``), so a
  conversation's tokens do not depend on the requests it shared the batch with, or on when its tools returned: with
  the same weights, one-at-a-time and continuous generation give the same tokens (tested greedy, and sampled, in
  float32). In bfloat16 on CPU the steps attend with SDPA, whose blocking follows the step's longest row, so a
  near-tie between two tokens can resolve differently in another batch (as in any engine that batches).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rlspmd.models.decoder import (
    LlamaFamilyDecoder,
    decode_attention,
    decoder_layers,
    project,
    rms_norm,
    sdpa_decodes,
    signed_sin,
)
from rlspmd.models.vision import ImageInputs, VisionSpec, is_vision_language
from rlspmd.models.vision_decoder import prompt_embeddings
from rlspmd.rollout.sampling import SamplingParams, counter_uniform, sample_with_uniform


@dataclass(frozen=True)
class Request:
    key: int
    """The caller's id for the request (returned with its tokens)."""
    ids: list[int]
    """The whole context, unpadded."""
    max_new_tokens: int
    seed: int
    """Sampling stream of the conversation."""
    counter: int = 0
    """Index of this request's first token in the seed's stream (tokens the conversation generated before)."""
    images: ImageInputs | None = None
    """The images of the conversation's prompt (a vision-language model), whose placeholders are in its first
    ``prompt_len`` tokens."""
    prompt_len: int = 0


class RequestSource(Protocol):
    def take(self, *, block: bool) -> list[Request]:
        """Requests ready to run. ``block``: the engine is idle, wait until some are ready; ``[]`` then means none
        will come (every conversation is over)."""

    def finish(self, key: int, tokens: list[int], logprobs: list[float]) -> None:
        """A request ended: its generated tokens (with the EOS that ended it) and their log-probs."""


@dataclass
class _Row:
    request: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class SlotDecoder:
    """The Llama-family forward over a KV cache of ``slots`` rows of ``max_len`` positions each."""

    def __init__(self, hf_model: nn.Module, *, slots: int, max_len: int, device: torch.device):
        # config values, RoPE table and the weights' modules (its decode steps write each slot at its own position,
        # which the fused CPU kernels of the static-batch decoder do not cover: torch ops here)
        base = LlamaFamilyDecoder(hf_model, cpu_kernels=False)
        self.m, self.base = base, base.base
        dtype = base._params_dtype()
        shape = (base.n_layers, slots, base.n_kv, max_len, base.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        # a slot's next RoPE position is its length plus its delta (M-RoPE positions advance less over an image;
        # 0 for text models)
        self.deltas = torch.zeros(slots, dtype=torch.long, device=device)
        self.rope_table = base.rope_table_for(max_len, device)
        self.max_len, self.device = max_len, device
        self.vision = VisionSpec.of(hf_model.config) if is_vision_language(hf_model.config) else None
        # The weights of this decoder's lifetime (one ``serve``, during which they do not change), read once as the
        # static-batch decoder reads them per generation: concatenated projections, on CPU in bfloat16 also packed.
        self.sdpa_decode = sdpa_decodes(device, dtype)
        base.read_weights(slots, device)
        self.fused, self.head = base.fused, base.head

    def _rope(self, h: torch.Tensor, pos_BS: torch.Tensor):
        if self.rope_table is not None:
            return self.rope_table[0][pos_BS][:, None], self.rope_table[1][pos_BS][:, None]
        cos, sin = self.base.rotary_emb(h, pos_BS)
        return cos[:, None], signed_sin(sin[:, None])

    def prefill(self, slots: list[int], requests: list[Request]) -> torch.Tensor:
        """Write the requests' contexts' K/V into positions ``[0, n)`` of their slots (one right-padded forward);
        returns the next-token logits ``(len(slots), V)``."""
        contexts = [r.ids for r in requests]
        n = torch.tensor([len(c) for c in contexts], device=self.device)
        S = int(n.max())
        if S > self.max_len:
            raise ValueError(f"a request of {S} tokens does not fit the engine's {self.max_len}-token cache")
        ids = torch.zeros(len(contexts), S, dtype=torch.long, device=self.device)
        for r, c in enumerate(contexts):
            ids[r, : len(c)] = torch.tensor(c, device=self.device)
        pos = torch.arange(S, device=self.device)
        # Causal within each context; padding keys are hidden, and a padding query still sees position 0 (no NaN).
        mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < n[:, None, None])
        slot_t = torch.tensor(slots, device=self.device)
        h = rope = after_layer = None
        deltas = torch.zeros(len(slots), dtype=torch.long, device=self.device)
        if self.vision is not None:  # image features in the embeddings, M-RoPE positions
            valid = (pos[None] < n[:, None]).long()
            images, bounds = [r.images for r in requests], [r.prompt_len for r in requests]
            h, rope, next_pos, after_layer = prompt_embeddings(
                self.m.model, self.base, ids, valid, images, spec=self.vision, prompt_len=bounds
            )
            deltas = next_pos - n
        h = self._layers(
            ids,
            pos[None].expand(len(slots), S),
            lambda i, k, v: self._write_prefill(i, slot_t, k, v),
            lambda i, q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[:, None], enable_gqa=self.m.n_kv != self.m.n_heads
            ),
            h=h,
            rope=rope,
            after_layer=after_layer,
        )
        self.lengths[slot_t] = n
        self.deltas[slot_t] = deltas
        last = h[torch.arange(len(slots), device=self.device), n - 1]
        return self._logits(last)

    def _write_prefill(self, i: int, slot_t: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        S = k.shape[2]
        self.k[i][slot_t, :, :S] = k
        self.v[i][slot_t, :, :S] = v

    def step(self, slots: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One token for each of ``slots`` at the slot's next position; returns the next-token logits."""
        pos = self.lengths[slots]
        end = int(pos.max()) + 1
        B, KV, H = len(slots), self.m.n_kv, self.m.n_heads
        keep = torch.arange(end, device=self.device)[None] <= pos[:, None]
        mask = torch.zeros(B, end, dtype=self.k.dtype, device=self.device).masked_fill_(~keep, float("-inf"))
        if self.sdpa_decode:
            mask = mask[:, None, None]  # (B, 1, 1, end)
        else:
            mask = mask[:, None, None].expand(B, KV, H // KV, end).reshape(B * KV, H // KV, end)
        # Consecutive slots (the usual case: free slots are handed out lowest first) are a view of the cache; others
        # are gathered (a copy) for the attention.
        first = int(slots[0])
        consecutive = bool((slots == torch.arange(first, first + B, device=slots.device)).all())
        rows = slice(first, first + B) if consecutive else slots

        def write(i, k, v):
            self.k[i][slots, :, pos] = k[:, :, 0]
            self.v[i][slots, :, pos] = v[:, :, 0]

        def attend(i, q, k, v):
            k, v = self.k[i][rows, :, :end], self.v[i][rows, :, :end]
            if self.sdpa_decode:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=KV != H)
            return decode_attention(q, k, v, mask)

        h = self._layers(tokens[:, None], (pos + self.deltas[slots])[:, None], write, attend)
        self.lengths[slots] = pos + 1
        return self._logits(h[:, -1])

    def _layers(self, ids_BS, pos_BS, write, attend, *, h=None, rope=None, after_layer=None) -> torch.Tensor:
        """``h``, ``rope``: a vision-language prefill's embeddings and (cos, signed sin), instead of the tokens';
        ``after_layer``: its DeepStack hook (``decoder_layers``)."""
        m = self.m
        h = F.embedding(ids_BS, self.base.embed_tokens.weight) if h is None else h
        cos, sin = self._rope(h, pos_BS) if rope is None else rope
        return decoder_layers(
            self.base,
            h,
            cos,
            sin,
            n_heads=m.n_heads,
            n_kv=m.n_kv,
            head_dim=m.head_dim,
            eps=m.eps,
            write=write,
            attend=attend,
            after_layer=after_layer,
            fused=self.fused,
        )

    def _logits(self, h_BH: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h_BH, self.base.norm.weight, self.m.eps)
        return project(h, *self.head)  # in the head's dtype (``sample_with_uniform`` upcasts)


@torch.inference_mode()
def serve(
    decoder: SlotDecoder, source: RequestSource, params: SamplingParams, *, slots: int, eos_ids: list[int]
) -> dict:
    """Run requests from ``source`` until it has none left, at most ``slots`` at a time. Returns counts: decode steps,
    prefills, generated tokens, and ``idle_waits``
    (times the engine had nothing to decode and waited for the source)."""
    free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest slot first
    active: dict[int, _Row] = {}
    last: dict[int, int] = {}  # slot -> its last sampled token, fed at the next step
    pending: deque[Request] = deque()
    eos = set(eos_ids)
    stats = {"decode_steps": 0, "prefills": 0, "tokens": 0, "idle_waits": 0}
    while True:
        idle = not active and not pending
        pending.extend(source.take(block=idle))
        stats["idle_waits"] += idle
        if not active and not pending:
            return stats
        order: list[int] = []
        logits = []
        if last:
            stepping = sorted(last)
            logits.append(
                decoder.step(
                    torch.tensor(stepping, device=decoder.device),
                    torch.tensor([last[s] for s in stepping], device=decoder.device),
                )
            )
            order += stepping
            stats["decode_steps"] += 1
        admitted = []
        while pending and free:
            r = pending.popleft()
            if not 0 < r.max_new_tokens or len(r.ids) + r.max_new_tokens > decoder.max_len:
                raise ValueError(
                    f"request {r.key}: {len(r.ids)} context + {r.max_new_tokens} new tokens do not fit the "
                    f"engine's {decoder.max_len}-token cache (or ask for no token)"
                )
            admitted.append((free.pop(), r))
        if admitted:
            logits.append(decoder.prefill([s for s, _ in admitted], [r for _, r in admitted]))
            for s, r in admitted:
                active[s] = _Row(r)
            order += [s for s, _ in admitted]
            stats["prefills"] += 1
        rows = [active[s] for s in order]
        u = None
        if not params.greedy:
            seeds = torch.tensor([r.request.seed for r in rows], device=decoder.device)
            counters = torch.tensor([r.request.counter + len(r.tokens) for r in rows], device=decoder.device)
            u = counter_uniform(seeds, counters)
        tok, lp = sample_with_uniform(torch.cat(logits), params, u)
        last = {}
        for s, row, t, logprob in zip(order, rows, tok.tolist(), lp.tolist()):
            row.tokens.append(t)
            row.logprobs.append(logprob)
            stats["tokens"] += 1
            if t in eos or len(row.tokens) >= row.request.max_new_tokens:
                del active[s]
                free.append(s)
                source.finish(row.request.key, row.tokens, row.logprobs)
            else:
                last[s] = t
