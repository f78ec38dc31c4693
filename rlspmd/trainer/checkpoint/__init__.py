"""Checkpoints: torch.distributed.checkpoint (DCP) over a dict of ``Stateful`` objects, and Hugging Face export.

What a checkpoint holds (``Checkpointing.state``), one key per object:

    actor, critic, ...   every trainable role engine: sharded model and optimiser state, LR schedule
                         (``FSDPEngine.state_dict``; DCP reshards on load, so the world size may change)
    trainer              the step, counters, and the ``state_dict()`` of every trainer component that has one
                         (data sampler position, KL controller, ...), as one JSON string
    rng                  every rank's python/numpy/torch/CUDA RNG state as integer/float tensors (``rank_<r>.*``);
                         the rollout sampler derives its generator from (seed, step, rank), so the step covers it
    pipeline             asynchronous RL only: each actor rank's batches generated for the coming steps, as tensors
                         (``rank_<r>.batch_<i>.*``; per-sample objects as JSON text in a uint8 tensor)

One module per concern; the trainer side meets the store only through the contract in ``base.py``:

    base.py           ``CheckpointStore``: what a store offers (prepare, due, save, load, saved_tensors)
    checkpointing.py  the trainer side: the explicit dict above (``Checkpointing``), the run's counters, and the end of
                      a step for RL and SFT (``StopAndSave``: save when due, save and stop on a signal or stop step)
    checkpointer.py   ``Checkpointer``, the DCP store: collective save and load, the resume pick, the fit checks
    layout.py         the directory: ``step_N`` names, completeness, ``latest``, commit by rename, pruning, rewinds,
                      the resume choice; the ``checkpoint`` section's checks (``config_problems``)
    state.py          the trainer's state as data only: JSON trainer state, RNG states and in-flight batches as tensors
    safe_load.py      reading DCP files without running code (restricted unpicklers); tools' one-process reads
    integrity.py      SHA-256 of every file as it is written, checked (a share per rank) before a load
    export.py         model config and tokenizer files for export, HF directories (``checkpoint.save_hf``, SFT's end)

Everything public is importable from ``rlspmd.trainer.checkpoint``; modules of this package import each other
directly, never through this file.
"""

from rlspmd.utils.imports import lazy_exports

_LAZY = {
    "CheckpointError": "base",
    "CheckpointStore": "base",
    "Checkpointer": "checkpointer",
    "Checkpointing": "checkpointing",
    "Counters": "checkpointing",
    "NoCheckpointing": "checkpointing",
    "StopAndSave": "checkpointing",
    "MODEL_FILES": "export",
    "TOKENIZER_FILES": "export",
    "copy_model_files": "export",
    "save_hf_model": "export",
    "write_hf_dir": "export",
    "write_model_files": "export",
    "DIGEST": "integrity",
    "CheckpointDamagedError": "integrity",
    "DigestingFileSystem": "integrity",
    "DigestingFileSystemWriter": "integrity",
    "FileDigests": "integrity",
    "check_files": "integrity",
    "file_digest": "integrity",
    "recorded_digests": "integrity",
    "share_files": "integrity",
    "verify_checkpoint": "integrity",
    "FORMAT_VERSION": "layout",
    "STEP_RE": "layout",
    "CheckpointDir": "layout",
    "check_format": "layout",
    "complete_checkpoints": "layout",
    "config_problems": "layout",
    "is_complete": "layout",
    "read_meta": "layout",
    "resolve_checkpoint": "layout",
    "step_dir_name": "layout",
    "SafeFileSystemReader": "safe_load",
    "SafeLoadPlanner": "safe_load",
    "dcp_load": "safe_load",
    "read_checkpoint": "safe_load",
    "read_dcp_metadata": "safe_load",
    "saved_tensors": "safe_load",
    "PIPELINE": "state",
    "InFlightBatches": "state",
    "RNGState": "state",
    "TrainerState": "state",
    "decode_batch": "state",
    "decode_rng_state": "state",
    "encode_batch": "state",
    "encode_rng_state": "state",
    "to_json_text": "state",
}
"""Where each public name lives; loaded on first use (PEP 562), so that checking a config (``layout.config_problems``,
called by ``rlspmd.validate``) does not import torch.distributed.checkpoint."""

__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = list(_LAZY)
