"""The only module that calls vLLM. Targets vLLM 0.32.0 (see README.md here); vLLM is imported lazily.

``VllmBackend`` is a thin shim: build the engine, wake/sleep/reset, load weights in place, generate. It holds no
policy about *when* to do these things; ``rlspmd.rollout.vllm.VllmEngine`` and its lifecycle decide that.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
import warnings
from collections.abc import Iterable

import numpy as np
import torch

VLLM_VERSION = "0.32.0"


def prepare_environment() -> None:
    """Environment vLLM's in-process (``external_launcher``) mode needs; call before any NCCL communicator exists.

    * ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core must run in this process (asserted by the executor).
    * ``NCCL_CUMEM_ENABLE=0`` and symmetric-memory all-reduce off: hangs and segfaults seen with sleep mode under
      torchrun (vLLM #16993; verl's defaults).
    * ``expandable_segments:True`` is incompatible with vLLM's sleep-mode memory pool (pytorch #147851): refused.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    os.environ.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:True" in os.environ.get(var, ""):
            raise ValueError(f"{var} has expandable_segments:True, which vLLM's sleep mode cannot use; unset it for rollout.engine=vllm")


def _rng_state():
    return (random.getstate(), np.random.get_state(), torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class VllmBackend:
    """One ``vllm.LLM`` in this process, part of a TP group of consecutive torchrun ranks.

    Construction is collective over the whole torch world (vLLM creates its process groups with ``new_group`` and
    min-reduces the KV-cache size over every rank): every rank must build its backend at the same point.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int,
        seed: int,
        dtype: torch.dtype,
        max_model_len: int,
        gpu_memory_utilization: float,
        kv_cache_memory_bytes: int | None,
        max_num_seqs: int,
        enforce_eager: bool,
        enable_prefix_caching: bool,
        sleeps: bool,
    ):
        prepare_environment()
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                f"rollout.engine=vllm needs vLLM: pip install 'rlspmd[vllm]' (vllm=={VLLM_VERSION}) on a CUDA machine"
            ) from e
        if not torch.cuda.is_available():
            raise ValueError("rollout.engine=vllm needs CUDA; use rollout.engine=native on CPU")
        if vllm.__version__ != VLLM_VERSION:
            warnings.warn(f"vLLM {vllm.__version__} is installed; rlspmd's adapter targets {VLLM_VERSION}", stacklevel=2)
        kwargs = dict(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            seed=seed,  # equal within a TP group, different across groups (the caller's seed = base + group index)
            dtype=str(dtype).removeprefix("torch."),
            load_format="dummy",  # the first weight sync fills it
            enable_sleep_mode=sleeps,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            disable_custom_all_reduce=True,  # custom all-reduce misbehaves in SPMD mode (verl)
            skip_tokenizer_init=True,  # rlspmd passes token ids and reads token ids
        )
        optional = {
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "async_scheduling": False,  # has gone out of sync across externally launched engines (vLLM #28774)
            # log-probs after temperature, like the native engine and the trainer (before top-k/top-p filtering
            # only when those are off)
            "logprobs_mode": "processed_logprobs",
        }
        fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        kwargs.update({k: v for k, v in optional.items() if k in fields and v is not None})
        state = _rng_state()  # vLLM reseeds the global RNGs while building (P8)
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            _set_rng_state(state)
        self._vllm = vllm
        self._wake_tags = "tags" in inspect.signature(self.llm.wake_up).parameters
        self._top_k_off = vllm.SamplingParams().top_k  # 0 in new releases, -1 in old ones
        if sleeps:
            self.llm.sleep(level=2)  # the dummy weights are worthless; free everything until the first sync

    def wake_up(self, tags: list[str]) -> None:
        if self._wake_tags:
            self.llm.wake_up(tags=tags)
        elif tags == ["weights"]:  # releases without tags wake everything at once
            self.llm.wake_up()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, check_coverage: bool) -> int:
        """Copy HF-named full tensors into the engine's existing storage (CUDA graphs stay valid); returns bytes.

        The model's ``load_weights`` narrows each tensor to this rank's TP shard and fuses qkv/gate_up itself.
        ``check_coverage``: fail unless every engine parameter was loaded (a level-2 wake with a partial load runs
        on garbage, silently: vLLM #29341).
        """
        counted = {"bytes": 0}

        def stream():
            for name, tensor in weights:
                counted["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        def load(worker):
            worker = getattr(worker, "worker", worker)  # the WorkerWrapperBase's worker
            runner = worker.model_runner
            model = runner.get_model() if hasattr(runner, "get_model") else runner.model  # unwraps CUDA-graph wrappers
            loaded = model.load_weights(stream())
            expected = {n for n, _ in model.named_parameters()}
            return None if loaded is None else sorted(expected - set(loaded))

        missing = self.llm.collective_rpc(load)[0]
        if check_coverage and missing:
            raise RuntimeError(f"vLLM weight load left {len(missing)} parameters unloaded, e.g. {missing[:5]}")
        return counted["bytes"]

    def generate(self, token_ids: list[list[int]], *, params, seeds: list[int] | None, stop_token_ids: list[int]):
        """-> [(response token ids, log-prob of each sampled token)] in prompt order."""
        vllm = self._vllm
        top_k = params.top_k if params.top_k > 0 else self._top_k_off
        sampling = [
            vllm.SamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=top_k,
                max_tokens=params.max_new_tokens,
                # rollout.ignore_eos (benchmarks): EOS is never sampled, so every response has max_tokens tokens
                min_tokens=params.max_new_tokens if params.ignore_eos else 0,
                ignore_eos=params.ignore_eos,
                seed=None if seeds is None else seeds[i],
                logprobs=0,  # the sampled token's log-prob only
                stop_token_ids=[] if params.ignore_eos else stop_token_ids,
                detokenize=False,
            )
            for i in range(len(token_ids))
        ]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], sampling, use_tqdm=False)
        result = []
        for out in outs:
            c = out.outputs[0]
            toks = list(c.token_ids)
            lps = [float(getattr(step[tok], "logprob", step[tok])) for step, tok in zip(c.logprobs or [], toks)]
            result.append((toks, lps))
        return result

    def serve(self, source, *, params, stop_token_ids: list[int]) -> dict:
        """Request-level generation (the agent loop): each request of ``source`` (``rlspmd.rollout.continuous``) is
        added to vLLM's running engine as it arrives (``LLMEngine.add_request``) and the engine is stepped; every
        finished request goes back to ``source.finish`` at once, so a conversation waiting on a tool holds up no other.
        A request's seed is a function of (conversation seed, token counter): independent of the scheduling."""
        vllm, engine = self._vllm, self.llm.llm_engine
        top_k = params.top_k if params.top_k > 0 else self._top_k_off
        keys: dict[str, int] = {}
        stats = {"requests": 0, "engine_steps": 0, "tokens": 0}
        while True:
            for r in source.take(block=not keys):
                request_id = f"agent-{stats['requests']}"
                stats["requests"] += 1
                keys[request_id] = r.key
                seed = None if params.greedy else (r.seed * 1_000_003 + r.counter) % (2**31 - 1)
                sampling = vllm.SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=top_k,
                                               max_tokens=r.max_new_tokens, seed=seed, logprobs=0,
                                               stop_token_ids=stop_token_ids, detokenize=False)
                engine.add_request(request_id, {"prompt_token_ids": r.ids}, sampling)
            if not keys:
                return stats
            stats["engine_steps"] += 1
            for out in engine.step():
                if not out.finished:
                    continue
                c = out.outputs[0]
                toks = list(c.token_ids)
                lps = [float(getattr(step[tok], "logprob", step[tok])) for step, tok in zip(c.logprobs or [], toks)]
                stats["tokens"] += len(toks)
                source.finish(keys.pop(out.request_id), toks, lps)

    @staticmethod
    def memory_in_use() -> int:
        """Bytes in use on this GPU as the driver sees them (sleep unmaps pages that the allocator counters miss)."""
        free, total = torch.cuda.mem_get_info()
        return total - free
