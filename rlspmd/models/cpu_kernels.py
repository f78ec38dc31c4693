"""rlspmd's C++ kernels for CPU (``cpu_kernels.cpp``), built at first use: the native engine's fused decode step in
bfloat16 (``rollout.engine.cpu_kernels``) and the packed attention of training forwards
(``model.attn_kernel=cpu_fused``).

**Decode.** A decode step multiplies a few rows by every weight; between those matmuls, each layer's elementwise work
(two RMSNorms with their residual adds, RoPE on q and k, the KV-cache writes, SwiGLU) ran as about 35 torch ops on
tensors of a few kilobytes, each paying the dispatcher and a pass over memory the weights just flushed from the caches.
In SmolLM2-135M's decode step at 16 rows that work was about a third of the step. The kernels do it in four calls per
layer (``add_rms_norm`` twice, ``rope_write``, ``silu_mul``), with the same roundings as the ops they replace (tested
bit for bit against them in ``tests/test_cpu_kernels.py``).

**Training attention.** ``segment_attention`` and its backward run a whole pack's attention in one call each way
(``packing.segment_attention``): every segment of queries (a sample, a shared prompt, or a response that also sees its
group's prompt) against its keys, computed in float32 from bfloat16 or float32 inputs, the result rounded once. Torch's
CPU flash attention is slower in bfloat16 with gradients than in float32, so the ``sdpa_loop`` kernel casts to float32
and back around per-segment or padded calls; this kernel reads the inputs where they are and writes the gradients in
their dtype, with its own register-tiled products and a vectorised exp.

The source is compiled once per machine with ``torch.utils.cpp_extension`` (g++ and ninja; about 11 s on 2 cores)
into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), under a name that
hashes the source, the flags, torch's version and the CPU's feature flags (the code is built for this CPU:
``-march=native``; OpenMP, so that ``at::parallel_for`` uses torch's threads), and loaded as ``torch.ops.rlspmd_cpu``.
Ranks that build at once wait on torch's lock file. Where it cannot be built (no compiler, no ninja), a warning says
so once and the callers run torch ops, as with the kernels turned off.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The extension's name: a digest of what its binary depends on."""
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        " ".join(CFLAGS + LDFLAGS).encode(),
        torch.__version__.encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
    return f"rlspmd_cpu_{h.hexdigest()[:16]}"


@functools.cache
def cpu_ops():
    """``torch.ops.rlspmd_cpu``, built and loaded once per process; None (after one warning) where it cannot be."""
    try:
        from torch.utils.cpp_extension import load

        load(
            build_name(),
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: decode with torch ops
        warnings.warn(
            f"rlspmd: the CPU kernels (rollout.engine.cpu_kernels, model.attn_kernel=cpu_fused) could not be built, "
            f"so decoding and training attention run torch ops (slower on CPU): {type(e).__name__}: "
            f"{str(e).strip()[:300]}",
            stacklevel=2,
        )
        return None
    return torch.ops.rlspmd_cpu
