"""Reading checkpoints without running code.

Loading runs no code from the checkpoint (format 2). What is stored is data only: tensors, a JSON string, and the
scalars of the optimiser's and LR schedule's state. DCP itself pickles two things, and both are read here with
restricted unpicklers instead of its defaults (torch 2.13 has no safe mode for either): ``.metadata``
(``SafeFileSystemReader``: only DCP's metadata dataclasses, ``torch.Size``, dtypes and layouts may be built) and
the non-tensor leaves (``SafeLoadPlanner``: ``torch.load(weights_only=True)``; DCP uses ``weights_only=False``).
Tensor shards are read by DCP with ``weights_only=True`` already. Format 1 (trainer and RNG state as pickles) is
refused with a message that says what to do (``layout.check_format``); its weights can still be exported
(``scripts/export_hf.py``), which reads nothing but tensors.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from rlspmd.trainer.checkpoint.base import CheckpointError
from rlspmd.trainer.checkpoint.integrity import verify_checkpoint


def _metadata_globals() -> dict[tuple[str, str], object]:
    """Every global a DCP ``.metadata`` pickle may name (torch 2.13): DCP's metadata dataclasses, its storage
    record, ``torch.Size``, dtypes, layouts and paths. Building these from pickled fields runs no code of the file's
    choosing (the classes are plain records)."""
    classes = [
        Metadata,
        StorageMeta,
        TensorStorageMetadata,
        BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.MetadataIndex,
        dcp_metadata._MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
        OrderedDict,
        PosixPath,
        PurePosixPath,  # StorageMeta.checkpoint_id may be a path
    ]
    allowed: dict[tuple[str, str], object] = {(c.__module__, c.__qualname__): c for c in classes}
    layouts = {}
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout)):
            allowed[("torch", name)] = value
        if isinstance(value, torch.layout):
            layouts[str(value)] = value
    # A layout pickles as a call of torch.serialization._get_layout("torch.strided"): answer it from our own table.
    allowed[("torch.serialization", "_get_layout")] = lambda name: layouts[name]
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    ALLOWED = _metadata_globals()

    def find_class(self, module: str, name: str):
        found = self.ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a DCP metadata type")
        return found


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of checkpoint ``path``, unpickled with only DCP's metadata types allowed."""
    try:
        with open(Path(path) / ".metadata", "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - name the file for any failure (truncated, refused global, ...)
        raise CheckpointError(
            f"checkpoint {path}: cannot read the DCP metadata (.metadata): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"checkpoint {path}: .metadata holds a {type(md).__name__}, not DCP metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a restricted ``.metadata`` unpickler (``read_dcp_metadata``), not ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = read_dcp_metadata(Path(self.path))
        if md.storage_meta is None:  # as FileSystemReader.read_metadata does
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor leaves (optimiser hyper-parameters, LR schedule counters, the
    trainer's JSON) are read with ``torch.load(weights_only=True)``: plain containers and scalars only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        # Hand the parent a re-serialisation of what the safe load produced: its own (unrestricted) torch.load then
        # only sees plain data, and where to put it stays the parent's business (it changes across torch versions).
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def dcp_load(state: dict, path: Path, *, process_group=None, no_dist: bool = False) -> None:
    """``dcp.load`` with the safe reader and planner (``no_dist``: in this one process, e.g. a tool)."""
    with warnings.catch_warnings():
        # A single-process read is what no_dist asks for; DCP warns about it anyway.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )


def saved_tensors(path: Path, *, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every tensor of checkpoint ``path`` whose key starts with ``prefix`` (removed from the keys),
    from its DCP metadata, read safely."""
    md = read_dcp_metadata(path).state_dict_metadata
    return {
        k[len(prefix) :]: (item.size, item.properties.dtype)
        for k, item in md.items()
        if k.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def read_checkpoint(path: str | Path, *, prefix: str = "") -> dict[str, object]:
    """Every entry of a checkpoint whose key starts with ``prefix``, unsharded, in this one process (no process
    group): flat DCP keys -> tensors or plain values, after ``verify_checkpoint``. For tools and tests; memory is one
    full copy."""
    path = Path(path)
    if (path / "meta.json").is_file():  # an rlspmd checkpoint: check its files (a bare DCP directory has no record)
        verify_checkpoint(path)
    md = read_dcp_metadata(path).state_dict_metadata
    state: dict[str, object] = {}
    for key, item in md.items():
        if not key.startswith(prefix):
            continue
        if isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            state[key] = None  # a non-tensor leaf: DCP replaces the placeholder
    dcp_load(state, path, no_dist=True)  # flat keys: the planner's flattening maps each to itself
    return state
