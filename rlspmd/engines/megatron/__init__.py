"""The megatron-core training engine: the FSDP engine's surface over a megatron ``GPTModel`` with tensor and pipeline
parallelism.

The trainer's builder makes the role module (``build_megatron_module``: an HF Qwen2/Llama directory loaded into this
rank's stage and TP shard; ``rlspmd.models.megatron_convert`` converts the weights) and hands it to ``MegatronEngine``,
as it hands an HF module to ``FSDPEngine``. Every megatron call is in ``third_party/megatron_adapter.py``, imported
lazily when a module is built, so rlspmd runs without megatron-core. The package, by concern:

* ``packing.py``: front-packing (each row's valid tokens first) and a model-parallel group's rows as one batch;
* ``modules.py``: the policy and value modules (construction, forward, the HF identity of each tensor);
* ``engine.py``: the engine (update through megatron's forward-backward schedule, gradient sums, checkpoints);
* ``weight_stream.py``: full HF tensors for the rollout and for export.

**Layout.** The role's ranks (its mesh, as the trainer builds it) form a (pp, dp, tp) grid, tp fastest (megatron's
``tp-cp-ep-dp-pp`` order): the tensor-parallel groups are consecutive ranks. The groups come from
``rlspmd.distributed.mesh.model_parallel_groups`` (over the role's ranks only), never from
``parallel_state.initialize_model_parallel``, which would carve the whole world into one global layout. Pipeline
stage ``p`` holds layers ``[p L/pp, (p+1) L/pp)``, the embedding on the first stage, the final norm and head on the
last; with tied embeddings the last stage keeps a copy of the embedding (megatron's ``output_layer``), loaded from
the same HF tensor, its gradient summed with the first stage's before each step (``embd_group``).

**Data.** The trainer hands every rank its own samples, exactly as with FSDP (it need not know about TP or PP). A
forward gathers the micro-batches of the model-parallel group (the tp x pp ranks of a replica; same count on every
rank: ``split_micro_batches`` agrees it over the mesh), runs them as one batch through the stages, and each rank
gets its own rows' outputs.

Simplifications (each a ``ValueError`` where a user could ask for it): no interleaved (virtual) pipeline stages, no
sequence/context/expert parallelism, no activation recomputation, no distributed optimiser (AdamW on each rank's
shard, replicated over DP), no packed (THD) sequences: a micro-batch runs padded to its longest row. The LM head is
computed with the full vocabulary on every TP rank (no vocab-parallel cross entropy). The CPU pipeline schedule does
not overlap stages (GPipe with blocking sends): it exists to run and test the engine on CPU.
"""

from rlspmd.engines.megatron.config import MegatronConfig
from rlspmd.utils.imports import lazy_exports

_LAZY = {
    "MegatronEngine": "engine",
    "MegatronModule": "modules",
    "MegatronPolicyModule": "modules",
    "MegatronValueModule": "modules",
    "build_megatron_module": "modules",
    "MegatronWeightStream": "weight_stream",
}
"""Loaded on first use (PEP 562): importing the config (to parse or check one) does not import the engine."""

__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = ["MegatronConfig", *_LAZY]
