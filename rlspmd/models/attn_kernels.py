"""Which packed-attention kernel runs where: the kernels' availability on a device and dtype, ``auto``'s choice, and
the start-up check of ``model.attn_kernel``.

Kernels (``ModelConfig.attn_kernel``; ``auto`` picks the first that runs on the device and dtype), each called on a
pack by ``models/packing.KERNELS``:

* ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` (CUDA, half precision, when installed).
* ``varlen``: ``torch.nn.attention.varlen.varlen_attn``, the FlashAttention-2 kernel inside libtorch (torch >= 2.10;
  CUDA sm80+, half precision). Its keywords changed between torch versions; they are detected, not assumed.
* ``flex``: FlexAttention (compiled on CUDA, in half precision there) with a document-causal ``BlockMask`` built
  from the sample boundaries directly at block granularity: no ``T × T`` mask is materialised and no host sync is
  needed. CPU runs its forward only (torch has no CPU backward), eagerly.
* ``sdpa_loop``: one causal SDPA call per sample on its slice of the pack (exact ``Σ len²`` work). On CPU this
  measured faster than the alternatives (a block-diagonal ``T × T`` mask is quadratic in the whole pack; a padded
  ``(samples, max_len)`` layout pays ``max_len²`` per sample plus scatter/gather backwards), so CPU keeps it. On CUDA
  it launches one small attention per sample and layer (launch-bound), the last resort there.
* ``cpu_fused``: rlspmd's own C++ kernel (``models/cpu_kernels.py``, built at first use), one call per pack each way,
  float32 inside, bfloat16 or float32 in and out; shared prompts as ``sdpa_loop``. On CPU with gradients in bfloat16
  it skips ``sdpa_loop``'s float32 casts, gathers and padded calls: SmolLM2-135M's GRPO update on a 2-core Xeon, 1.74
  against 1.91 s (``scripts/bench/stage_ablation.py --variants baseline,sdpa_loop``, medians of 10). A call it does
  not take (attention dropout, ``head_dim`` not a multiple of 16, float16, the kernels not built) runs ``sdpa_loop``'s.

``auto`` on CPU picks cpu_fused for bfloat16 compute with gradients when the kernels build, else sdpa_loop (without
gradients torch's bfloat16 flash kernel is faster); on CUDA it prefers flash_attn, then varlen, then flex (half
precision; float32 falls back to sdpa_loop, since the compiled float32 FlexAttention failed to lower on an H100); the
GPU suite (``scripts/bench/gpu_suite.py``) times varlen against flex: on an H100, 1.80 ms against 3.13 ms for one q05
layer's forward and backward (docs/performance.md).
``check_attn_kernel`` validates a choice at start-up (before models load) and returns the name the run log reports.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

ATTN_KERNELS = ("auto", "flash_attn", "varlen", "flex", "sdpa_loop", "cpu_fused")
"""Values of ``ModelConfig.attn_kernel``."""

HALF = (torch.float16, torch.bfloat16)


@functools.cache
def varlen_api() -> tuple[object, frozenset[str]] | None:
    """``varlen_attn`` and its keyword names, or None where this torch has none (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def flex_api():
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    return flex_attention, BlockMask


@functools.cache
def compiled_flex():
    """One compiled FlexAttention for the process (eager flex materialises the scores; per-layer compiles would
    multiply compile time). New block masks are new inputs, not recompiles."""
    return torch.compile(flex_api()[0])


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def kernel_problem(kernel: str, *, device: torch.device, dtype: torch.dtype, backward: bool = True) -> str | None:
    """Why ``kernel`` cannot run packed attention on ``device`` in ``dtype`` (None: it can).

    ``backward``: the role also differentiates through it (training); a no-grad forward is enough for a reference.
    """
    if kernel == "sdpa_loop":
        return None
    if kernel == "cpu_fused":
        if device.type != "cpu":
            return f"cpu_fused runs on CPU only, this run's device is {device.type}"
        if dtype not in (torch.bfloat16, torch.float32):
            return f"cpu_fused computes from bfloat16 or float32, this role computes in {dtype} (see fsdp.param_dtype)"
        from rlspmd.models.cpu_kernels import cpu_ops

        if cpu_ops() is None:
            return "rlspmd's CPU kernels could not be built here (models/cpu_kernels.py needs g++ and ninja)"
        return None
    if kernel == "flash_attn":
        if not _flash_attn_installed():
            return "flash-attn is not installed (pip install flash-attn)"
        if device.type != "cuda":
            return f"flash-attn runs on CUDA only, this run's device is {device.type}"
        if dtype not in HALF:
            return f"flash-attn needs bfloat16 or float16 compute, this role computes in {dtype} (see fsdp.param_dtype)"
        return None
    if kernel == "varlen":
        if varlen_api() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (added in torch 2.10)"
        if device.type != "cuda":
            return f"varlen_attn runs on CUDA only, this run's device is {device.type}"
        if dtype not in HALF:
            return (
                f"varlen_attn needs bfloat16 or float16 compute, this role computes in {dtype} (see fsdp.param_dtype)"
            )
        if torch.cuda.get_device_capability(device) < (8, 0):
            return f"varlen_attn (FlashAttention-2) needs an sm80+ GPU, {torch.cuda.get_device_name(device)} is older"
        return None
    if kernel == "flex":
        if flex_api() is None:
            return f"torch {torch.__version__} has no FlexAttention"
        if device.type == "cpu" and backward:
            return "FlexAttention has no backward on CPU (torch raises NotImplementedError); use sdpa_loop"
        if device.type not in ("cpu", "cuda"):
            return f"FlexAttention is not supported on {device.type}"
        if device.type == "cuda" and dtype == torch.float32:
            # measured on an H100 (torch 2.11, 2026-11-27): the compiled float32 kernel fails to lower (inductor's
            # NoValidChoicesError); bfloat16 and float16 compile and run
            return "compiled FlexAttention fails to lower in float32 on CUDA; use bfloat16 compute or sdpa_loop"
        return None
    return f"unknown kernel {kernel!r}; one of {list(ATTN_KERNELS)}"


@functools.cache
def resolve_attn_kernel(kernel: str, *, device: torch.device, dtype: torch.dtype, backward: bool = True) -> str:
    """The concrete kernel for ``kernel`` (``auto`` picks one; a named one is validated): the name the log reports."""
    if kernel == "auto":
        if device.type == "cuda":
            for name in ("flash_attn", "varlen", "flex"):
                if kernel_problem(name, device=device, dtype=dtype, backward=backward) is None:
                    return name
        if device.type == "cpu" and dtype == torch.bfloat16 and backward:
            if kernel_problem("cpu_fused", device=device, dtype=dtype, backward=backward) is None:
                return "cpu_fused"
        return "sdpa_loop"
    problem = kernel_problem(kernel, device=device, dtype=dtype, backward=backward)
    if problem is not None:
        raise ValueError(f"attn_kernel={kernel!r}: {problem}")
    return kernel


def packed_kernel(attn_kernel: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """The concrete kernel of a packed forward, from inside a model wrapper's forward. ``compute_dtype``: what the
    layers compute in; under FSDP2 mixed precision, the dtype of the gathered root parameters in the root's forward."""
    return resolve_attn_kernel(attn_kernel, device=device, dtype=compute_dtype, backward=torch.is_grad_enabled())


def check_attn_kernel(
    kernel: str,
    *,
    attn_implementation: str,
    packing: bool,
    device: torch.device,
    dtype: torch.dtype,
    field_name: str,
    backward: bool = True,
) -> str:
    """Start-up check of a role's ``model.attn_kernel`` (call it before models load); returns what the run log
    reports: the kernel name, or what runs instead when packing is off or transformers' own flash path packs.

    ``dtype`` is the role's compute dtype (``engines.base.compute_dtype``); ``backward`` False for a frozen role.
    """
    if kernel not in ATTN_KERNELS:
        raise ValueError(f"{field_name}={kernel!r} is not one of {list(ATTN_KERNELS)}")
    if not packing or attn_implementation != "sdpa":
        if kernel != "auto":
            why = "model.packing=False" if not packing else f"model.attn_implementation={attn_implementation!r}"
            raise ValueError(f"{field_name}={kernel!r} needs packed sequences with attn_implementation='sdpa' ({why})")
        return "padded" if not packing else f"{attn_implementation} (transformers)"
    try:
        return resolve_attn_kernel(kernel, device=device, dtype=dtype, backward=backward)
    except ValueError as e:
        raise ValueError(f"{field_name}: {e}") from None
