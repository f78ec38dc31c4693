"""Checkpoints: torch.distributed.checkpoint (DCP) over a dict of ``Stateful`` objects, and Hugging Face export.

What a checkpoint holds (``Checkpointer.save``), one key per object:

    actor, critic, ...   every trainable role engine: sharded model and optimiser state, LR schedule
                         (``FSDPEngine.state_dict``; DCP reshards on load, so the world size may change)
    trainer              the step, counters, and the ``state_dict()`` of every trainer component that has one
                         (data sampler position, KL controller, ...), as one JSON string
    rng                  every rank's python/numpy/torch/CUDA RNG state as integer/float tensors (``rank_<r>.*``);
                         the rollout sampler derives its generator from (seed, step, rank), so the step covers it
    pipeline             asynchronous RL only: each actor rank's batches generated for the coming steps, as tensors
                         (``rank_<r>.batch_<i>.*``; per-sample objects as JSON text in a uint8 tensor)

Layout of ``checkpoint.dir``:

    step_00000010/        a complete checkpoint; the rename from ``.tmp`` is the commit point
        .metadata, *.distcp   DCP shards
        meta.json             step, world size, roles, model sources, trainer state (readable), run config, and
                              the size and SHA-256 of every DCP file (``digests``)
        model/                config.json, generation_config.json, tokenizer: all ``scripts/export_hf.py`` needs
        hf/                   the actor as a Hugging Face directory (``checkpoint.save_hf``)
    step_00000020.tmp/    a save in progress, or an interrupted one: never resumed from, removed by the next save
    latest                the newest complete checkpoint's name, replaced atomically after the rename

Resume picks the newest complete ``step_*`` directory (``latest`` names the same one except in the instant
between a rename and the pointer update). A failed save (disk full, permissions) removes its ``.tmp``
directory and raises on every rank; the previous checkpoint and ``latest`` are untouched.

Integrity: every DCP file (each rank's shards, rank 0's ``.metadata``) is hashed as it is written
(``DigestingFileSystemWriter``: the bytes pass through Python on their way to the file, so nothing is read twice),
and ``meta.json`` records each file's size and digest. Before a load the ranks re-hash the files, a share each
(``Checkpointer._verify``); a mismatch names the file, the recorded and the found digest. ``--resume auto`` then falls
back to the newest intact checkpoint and moves the damaged one aside. ``model/`` and ``hf/`` (config, tokenizer, the
optional HF export: written by shutil and transformers, read only by an export, never by a resume) are not recorded.
A checkpoint written before digests were recorded loads unchecked (rank 0 says so).

Loading runs no code from the checkpoint (format 2). What is stored is data only: tensors, a JSON string, and the
scalars of the optimiser's and LR schedule's state. DCP itself pickles two things, and both are read here with
restricted unpicklers instead of its defaults (torch 2.13 has no safe mode for either): ``.metadata``
(``SafeFileSystemReader``: only DCP's metadata dataclasses, ``torch.Size``, dtypes and layouts may be built) and
the non-tensor leaves (``SafeLoadPlanner``: ``torch.load(weights_only=True)``; DCP uses ``weights_only=False``).
Tensor shards are read by DCP with ``weights_only=True`` already. Format 1 (trainer and RNG state as pickles) is
refused with a message that says what to do; its weights can still be exported (``scripts/export_hf.py``), which
reads nothing but tensors.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PosixPath, PurePosixPath

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from rlspmd.config import CheckpointConfig
from rlspmd.distributed.dispatch import broadcast_object, on_main
from rlspmd.distributed.progress import progress
from rlspmd.distributed.runtime import rng_state, set_rng_state

STEP_RE = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 2
PIPELINE = "pipeline"
"""The key of asynchronous RL's in-flight batches (``trainer/state.py: InFlightBatches``): not a trained role."""


class CheckpointError(RuntimeError):
    pass


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return STEP_RE.match(path.name) is not None and (path / "meta.json").is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and is_complete(p)), key=lambda p: p.name)


def resolve_checkpoint(path: str | Path, *, field_name: str) -> Path:
    """A checkpoint directory, or a checkpoint root (-> its newest complete checkpoint); errors name the path."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{field_name}: checkpoint {p} does not exist")
    if is_complete(p):
        return p
    if p.name.endswith(".tmp"):
        raise ValueError(f"{field_name}: {p} is an interrupted save (a .tmp directory), not a checkpoint")
    found = complete_checkpoints(p)
    if found:
        return found[-1]
    if STEP_RE.match(p.name):
        raise ValueError(f"{field_name}: {p} is incomplete (no meta.json or DCP .metadata)")
    raise ValueError(f"{field_name}: {p} holds no complete checkpoint (step_XXXXXXXX directories)")


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read meta.json: {e}") from None


def check_format(path: Path, meta: dict) -> None:
    """Only this format is resumed: format 1 stored trainer and RNG state as pickles, which run code when loaded."""
    found = meta.get("format")
    if found == FORMAT_VERSION:
        return
    if found == 1:
        raise CheckpointError(
            f"checkpoint {path} is format 1, which stores the trainer and RNG state as Python pickles: loading it could "
            f"run code, so this version (format {FORMAT_VERSION}) does not resume it. To keep its weights, export them "
            f"(python scripts/export_hf.py {path} OUT, which reads tensors only) and start a new run from OUT; to "
            "continue the run exactly, resume it with the rlspmd version that wrote it, if you trust where it came from"
        )
    raise CheckpointError(
        f"checkpoint {path}: meta.json has format {found!r}; this version reads format {FORMAT_VERSION}"
    )


def to_json_text(value, *, what: str) -> str:
    """``value`` as JSON text, refusing anything JSON would not give back unchanged (tuples, non-str keys, numpy
    scalars, tensors, ...): a resume must see exactly what was saved. The error names the offending entry."""

    def check(v, where: str) -> None:
        if v is None or isinstance(v, (bool, int, float, str)):
            return
        if isinstance(v, list):
            for i, x in enumerate(v):
                check(x, f"{where}[{i}]")
            return
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"{what}: key {k!r} of {where or 'the top level'} is a {type(k).__name__}; only str keys survive JSON"
                    )
                check(x, f"{where}.{k}" if where else k)
            return
        raise TypeError(
            f"{what}: {where or 'the value'} is a {type(v).__module__}.{type(v).__name__}; a checkpoint stores only JSON types "
            "(None, bool, int, float, str, list, dict with str keys) here, so that loading it cannot run code"
        )

    check(value, "")
    return json.dumps(value)


class TrainerState(Stateful):
    """The trainer's progress: a snapshot dict (the same on every rank) to save, or ``restore`` to call on load.

    Stored as one JSON string (``to_json_text``: only JSON types, checked at save time), so the structure DCP sees
    does not depend on the trainer's components and loading it cannot run code; ``meta.json`` keeps a copy.
    """

    def __init__(self, snapshot: dict | None = None, restore: Callable[[dict], None] | None = None):
        self.snapshot, self.restore = snapshot, restore

    def state_dict(self) -> dict:
        if self.restore is not None:  # loading: DCP replaces this placeholder with the saved string
            return {"json": ""}
        return {"json": to_json_text(self.snapshot, what="trainer state")}

    def load_state_dict(self, state: dict) -> None:
        assert self.restore is not None, "TrainerState built for saving cannot load"
        self.restore(json.loads(state["json"]))


def encode_rng_state(state: dict) -> dict[str, torch.Tensor]:
    """``runtime.rng_state()`` as tensors only (``decode_rng_state`` inverts it exactly).

    python ``random``: (version, 625 words, gauss_next); numpy's legacy MT19937: ('MT19937', 624 words, pos,
    has_gauss, cached_gaussian); torch CPU and CUDA states are byte tensors already. Words are uint32 values, kept
    in int64; floats in float64 (exact for Python floats).
    """
    version, words, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    assert name == "MT19937", f"numpy's global generator is {name}, not MT19937"
    out = {
        "python.version": torch.tensor(version, dtype=torch.int64),
        "python.words": torch.tensor(words, dtype=torch.int64),
        "python.gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "numpy.pos_has_gauss": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy.cached_gaussian": torch.tensor(cached, dtype=torch.float64),
        "torch": state["torch"].clone(),
    }
    for i, s in enumerate(state.get("cuda", [])):
        out[f"cuda.{i}"] = s.clone()
    return out


def decode_rng_state(tensors: dict[str, torch.Tensor]) -> dict:
    has_gauss, gauss = tensors["python.gauss"].tolist()
    pos, numpy_has_gauss = tensors["numpy.pos_has_gauss"].tolist()
    state = {
        "python": (
            int(tensors["python.version"]),
            tuple(tensors["python.words"].tolist()),
            gauss if has_gauss else None,
        ),
        "numpy": (
            "MT19937",
            tensors["numpy.keys"].numpy().astype(np.uint32),
            pos,
            numpy_has_gauss,
            float(tensors["numpy.cached_gaussian"]),
        ),
        "torch": tensors["torch"],
    }
    cuda = sorted((int(k.split(".")[1]), v) for k, v in tensors.items() if k.startswith("cuda."))
    if cuda:
        state["cuda"] = [v for _, v in cuda]
    return state


class RNGState(Stateful):
    """This rank's global RNG states under ``rank_<r>.*`` (ranks write distinct keys; DCP keeps them all), as
    tensors (``encode_rng_state``)."""

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"
        self.only: set[str] | None = None  # on load: the parts this checkpoint holds (Checkpointer.load sets it)

    def state_dict(self) -> dict:
        parts = encode_rng_state(rng_state())
        if self.only is not None:
            parts = {k: v for k, v in parts.items() if k in self.only}
        return {self.key: parts}

    def load_state_dict(self, state: dict) -> None:
        saved = decode_rng_state(state[self.key])
        if self.only is not None and "cuda" not in saved:  # written without CUDA: keep this process's CUDA state
            saved.pop("cuda", None)
        set_rng_state(saved)


# -- reading checkpoints without running code ---------------------------------------------------------------


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
    """DCP's file reader with a restricted ``.metadata`` unpickler (``read_dcp_metadata``) instead of ``pickle.load``."""

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


def _first_failure(e: BaseException) -> str:
    """The most telling failure behind a save error: an OSError (disk full, permissions) on any rank if there
    is one (DCP wraps per-rank failures; a torch.save error often hides the OSError in its context). torch.save's zip
    writer can also fail on a short write with no OSError at all; that case is said in words."""
    failures = sorted(e.failures.items()) if isinstance(e, CheckpointException) and e.failures else [(None, (e, None))]
    candidates = []
    for rank, (exc, _trace) in failures:
        chain = exc
        while chain is not None:
            candidates.append((rank, chain))
            chain = chain.__cause__ or chain.__context__
    rank, exc = next(((r, x) for r, x in candidates if isinstance(x, OSError)), candidates[0])
    text = f"{type(exc).__name__}: {exc}"
    if "inline_container" in text and "unexpected pos" in text:
        text += " (a write came up short: is the disk or quota full, or a file-size limit reached?)"
    return f"rank {rank}: {text}" if rank is not None else text


# -- file digests: what a save wrote, checked before a load ----------------------------------------------------

DIGEST = "sha256"
"""The digest of every file a save writes. SHA-256 because it is both strong and, through OpenSSL, the fastest of
hashlib's algorithms on CPUs with SHA instructions (x86 SHA-NI, Armv8 SHA2): 1.7 GB/s on the AMD EPYC this was
measured on, against 0.9 GB/s for BLAKE2b. zlib's CRC-32 (3.9 GB/s) catches a flipped bit as well, but 32 bits
do not tell apart two versions of a file that differ in more than a burst (a partial copy, a file from another
save); a cryptographic digest does."""
CHUNK = 8 << 20
"""Bytes per read while verifying: large enough that hashing, not Python, sets the pace."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint's files differ from what its save recorded (``problems``: one line per file, naming it)."""

    def __init__(self, path: Path, problems: list[str]):
        self.path, self.problems = path, problems
        super().__init__(f"checkpoint {path} is damaged: " + "; ".join(problems))

    def __reduce__(self):  # raised on every rank through a broadcast (``on_main``): pickle the fields, not the message
        return type(self), (self.path, self.problems)


class FileDigests:
    """The files one rank wrote into a checkpoint directory: name (relative, POSIX) -> size and digest, filled by
    ``DigestingFileSystem`` as the bytes are written. Thread-safe (DCP may write with several threads)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.files: dict[str, dict] = {}
        self._lock = threading.Lock()

    def name(self, path: str | os.PathLike) -> str:
        return Path(path).relative_to(self.root).as_posix()

    def add(self, path: str | os.PathLike, *, size: int, digest: str) -> None:
        with self._lock:
            self.files[self.name(path)] = {"size": size, "digest": digest}

    def rename(self, old: str | os.PathLike, new: str | os.PathLike) -> None:
        with self._lock:
            found = self.files.pop(self.name(old), None)
            if found is not None:
                self.files[self.name(new)] = found

    def remove(self, path: str | os.PathLike) -> None:
        with self._lock:
            self.files.pop(self.name(path), None)


class _DigestingStream(io.RawIOBase):
    """A file opened for writing that hashes every byte on its way to the file: the digest is of exactly what was
    written, with no second read. Written front to back only (DCP's shards and torch.save's zip writer are): a seek
    would make the hashed bytes differ from the file's, so it is refused."""

    def __init__(self, raw):
        super().__init__()
        self.raw, self.hash, self.size = raw, hashlib.new(DIGEST), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self.raw.write(b)
        view = memoryview(b).cast("B")
        self.hash.update(view[:n] if n is not None and n < len(view) else view)
        self.size += len(view) if n is None else n
        return len(view) if n is None else n

    def tell(self) -> int:
        return self.raw.tell()

    def seekable(self) -> bool:
        return False

    def seek(self, *args):
        raise io.UnsupportedOperation(
            "a checkpoint file is written front to back (its digest is taken as it is written)"
        )

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


class DigestingFileSystem(FileSystem):
    """DCP's local file system, recording the size and digest of every file it writes (``create_stream`` in a write
    mode) into ``digests``, and following DCP's ``.metadata.tmp`` -> ``.metadata`` rename."""

    def __init__(self, digests: FileDigests):
        super().__init__()
        self.digests = digests

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        assert "a" not in mode and "+" not in mode, f"DCP opened {path} with mode {mode!r}: a digest needs a fresh file"
        with super().create_stream(path, mode) as raw:
            stream = _DigestingStream(raw)
            yield stream
            stream.flush()
            assert stream.size == raw.tell(), f"{path}: hashed {stream.size} bytes, the file has {raw.tell()}"
        self.digests.add(path, size=stream.size, digest=stream.hash.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.digests.rename(path, new_path)

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.digests.remove(path)


class DigestingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (same files, same bytes) whose files are hashed as they are written."""

    def __init__(self, path: str | os.PathLike, digests: FileDigests):
        super().__init__(path)
        self.fs = DigestingFileSystem(digests)


def file_digest(path: Path) -> tuple[int, str]:
    """Size and ``DIGEST`` of a file, read in ``CHUNK``s (hashlib releases the GIL on large updates)."""
    h, size = hashlib.new(DIGEST), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def recorded_digests(path: Path, meta: dict) -> dict[str, dict] | None:
    """The file digests ``meta.json`` of checkpoint ``path`` records (name -> size, digest), or None for a checkpoint
    written before they were recorded. A record this version cannot check raises ``CheckpointDamagedError``."""
    found = meta.get("digests")
    if found is None:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("files"), dict) or not found["files"]:
        raise CheckpointDamagedError(
            path, ["meta.json: its 'digests' entry is not {'algorithm': ..., 'files': {name: {size, digest}}}"]
        )
    if found.get("algorithm") != DIGEST:
        raise CheckpointDamagedError(
            path, [f"meta.json records {found.get('algorithm')!r} digests; this version checks {DIGEST}"]
        )
    for name, entry in found["files"].items():
        if not (
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("digest"), str)
        ):
            raise CheckpointDamagedError(
                path, [f"meta.json: the record of {name!r} is not {{size, digest}}: {entry!r}"]
            )
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointDamagedError(path, [f"meta.json: {name!r} is not a file inside the checkpoint"])
    return found["files"]


def check_files(path: Path, files: dict[str, dict], *, threads: int = 4) -> list[str]:
    """Compare the files of checkpoint ``path`` with their recorded sizes and digests; one problem per file, naming
    it with what was recorded and what was found. Never raises for a file that is missing or unreadable. Up to
    ``threads`` files at once (reads and hashlib release the GIL): a rank checking many files (a checkpoint resumed on
    fewer ranks than wrote it) uses the cores its host has."""

    def check(name: str) -> str | None:
        want = files[name]
        try:
            size, digest = file_digest(path / name)
        except OSError as e:
            return f"{path / name} cannot be read ({type(e).__name__}: {e.strerror or e})"
        if size != want["size"]:
            return f"{path / name} has {size} bytes, its save wrote {want['size']} (truncated or appended to)"
        if digest != want["digest"]:
            return f"{path / name} does not match its recorded {DIGEST}: expected {want['digest']}, found {digest}"
        return None

    names = sorted(files)
    if len(names) <= 1 or threads <= 1:
        found = [check(name) for name in names]
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(names)), thread_name_prefix="checkpoint-digest") as pool:
            found = list(pool.map(check, names))
    return [p for p in found if p is not None]


def verify_checkpoint(path: str | Path) -> bool:
    """Check every file of checkpoint ``path`` against ``meta.json``'s digests, in this one process; raises
    ``CheckpointDamagedError`` naming each file that differs. Returns False for a checkpoint that records no digests
    (written before they were), which is not checked. (The trainer spreads this over its ranks: ``Checkpointer``.)"""
    path = Path(path)
    files = recorded_digests(path, read_meta(path))
    if files is None:
        return False
    problems = check_files(path, files)
    if problems:
        raise CheckpointDamagedError(path, problems)
    return True


def share_files(files: dict[str, dict], n: int) -> list[list[str]]:
    """``files`` split over ``n`` ranks by size (largest first, each to the least loaded rank): the same split on
    every rank, since every rank holds the same record."""
    shares: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for name in sorted(files, key=lambda k: (-files[k]["size"], k)):
        i = load.index(min(load))
        shares[i].append(name)
        load[i] += files[name]["size"]
    return shares


class Checkpointer:
    """Saves and restores DCP checkpoints under ``cfg.dir``; every method is collective over ``mesh`` (the ranks
    that hold trainable state: the actor's; None = the whole world).

    Rank 0 makes the filesystem decisions (which checkpoint, create, rename, prune) and broadcasts them, so
    an error there is raised on every rank instead of leaving the others in a collective.
    """

    def __init__(self, cfg: CheckpointConfig, *, output_dir: str, rank: int, world_size: int, mesh=None):
        self.cfg = cfg
        self.mesh = mesh  # in split placement the rollout-only ranks hold no state and take no part
        self.root = Path(cfg.dir or Path(output_dir) / "checkpoints").expanduser()
        self.field = "checkpoint.dir" if cfg.dir else "checkpoint.dir (default <trainer.output_dir>/checkpoints)"
        self.rank, self.world_size = rank, world_size
        self._verified: Path | None = None  # the checkpoint ``prepare`` picked and checked
        if cfg.save_every < 0 or cfg.keep_last < 0:
            raise ValueError(
                f"checkpoint.save_every={cfg.save_every} and checkpoint.keep_last={cfg.keep_last} must be >= 0"
            )

    # -- deciding ---------------------------------------------------------------------------------------

    def prepare(self) -> Path | None:
        """Check that the checkpoint root is writable and pick the checkpoint to resume from (None: fresh); collective.

        Runs before anything expensive, so a bad ``checkpoint.dir`` or ``checkpoint.resume`` fails in seconds. The pick
        is checked against the file digests its save recorded (``_verify``: every rank reads a share of the files and
        learns every rank's findings, so all take the same decision and none waits on another). A damaged checkpoint
        named by ``checkpoint.resume`` is an error naming the file; with ``auto`` the newest intact one is resumed
        instead, every rank says so, and the damaged ones are moved aside (``step_N.damaged-<time>``, kept) so that
        ``latest``, ``keep_last`` and the next save see this run's line of checkpoints only.
        """
        path = on_main(self._choose, mesh=self.mesh)
        damaged: list[CheckpointDamagedError] = []
        while path is not None:
            try:
                self._verify(path)
                break
            except CheckpointDamagedError as e:
                if self.cfg.resume.strip() != "auto":
                    raise
                damaged.append(e)
                path = on_main(lambda: self._newest_before(e.path), mesh=self.mesh)
        if damaged and path is None:
            raise CheckpointError(
                f"checkpoint.resume=auto: every checkpoint in {self.field}={self.root} is damaged ("
                + "; ".join(str(e) for e in damaged)
                + "). Nothing was moved or removed: restore them, resume one with "
                "--resume PATH (which still checks it), or move them aside to start afresh"
            )
        aside = on_main(lambda: self._settle(path, [e.path for e in damaged]), mesh=self.mesh)
        for e in damaged:
            print(
                f"[rlspmd] rank {self.rank}: checkpoint.resume=auto: {e}; resuming from the newest intact checkpoint "
                f"{path.name} instead (moved {e.path.name} aside to {aside[e.path.name]})",
                flush=True,
            )
        self._verified = path
        return path

    def _prepare(self) -> Path | None:
        """``prepare`` in this one process, without the digest check: the bookkeeping its unit tests exercise."""
        path = self._choose()
        self._settle(path, [])
        return path

    def _choose(self) -> Path | None:
        """Which checkpoint ``checkpoint.resume`` asks for (rank 0; nothing on disk changes yet)."""
        self._check_writable()
        spec = self.cfg.resume.strip()
        if spec == "none":
            existing = complete_checkpoints(self.root)
            if existing:
                raise ValueError(
                    f"checkpoint.resume=none, but {self.field}={self.root} already holds checkpoints (newest "
                    f"{existing[-1].name}) from an earlier run: continue it with --resume auto, or give this run "
                    "a new trainer.output_dir or checkpoint.dir"
                )
            return None
        if spec == "auto":
            found = complete_checkpoints(self.root)
            return found[-1] if found else None
        return resolve_checkpoint(spec, field_name="checkpoint.resume")

    def _newest_before(self, path: Path) -> Path | None:
        older = [p for p in complete_checkpoints(self.root) if p.name < path.name]
        return older[-1] if older else None

    def _settle(self, path: Path | None, damaged: list[Path]) -> dict[str, str]:
        """Rank 0, once the checkpoint to resume is known to be intact: move the damaged ones aside (returns their new
        names), and, when resuming an explicit older checkpoint, the newer ones (``_supersede_after``)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = {}
        for p in damaged:
            aside[p.name] = f"{p.name}.damaged-{stamp}"
            p.rename(p.with_name(aside[p.name]))
        if damaged:
            self._write_latest()
        if path is not None and self.cfg.resume.strip() not in ("auto", "none"):
            self._supersede_after(int(STEP_RE.match(path.name).group(1)))
        return aside

    def _verify(self, path: Path) -> None:
        """Check checkpoint ``path``'s files against the digests ``meta.json`` records (collective over the mesh):
        the files are shared out by size, each rank hashes its share, and every rank gets every finding, so every
        rank raises the same ``CheckpointDamagedError`` (naming each file) or none does. A checkpoint written before
        digests were recorded is loaded unchecked, and rank 0 says so."""

        def record() -> dict[str, dict] | None:
            try:
                meta = read_meta(path)
            except CheckpointError as e:
                raise CheckpointDamagedError(path, [str(e)]) from None
            files = recorded_digests(path, meta)
            if files is None:
                print(
                    f"checkpoint {path} records no file digests (written before rlspmd recorded them): loading it "
                    "without checking its files",
                    flush=True,
                )
            return files

        files = on_main(record, mesh=self.mesh)
        if files is None:
            return
        group = self._group()
        n, me = dist.get_world_size(group), dist.get_rank(group)
        mine = share_files(files, n)[me]
        try:
            problems = check_files(path, {name: files[name] for name in mine})
        except Exception as e:  # noqa: BLE001 - reported like a damaged file: this rank must still join the gather
            problems = [f"rank {self.rank} could not check {mine}: {type(e).__name__}: {e}"]
        every: list[list[str] | None] = [None] * n
        dist.all_gather_object(every, problems, group=group)
        found = sorted(p for rank_problems in every for p in rank_problems)
        if found:
            raise CheckpointDamagedError(path, found)

    def _supersede_after(self, step: int) -> None:
        """Resuming from an older checkpoint (rewinding a run): newer checkpoints in ``dir`` belong to the abandoned
        future. Rename them out of the way (kept, but never resumed from or pruned) so ``auto`` and ``keep_last``
        only see this run's line of checkpoints."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        newer = [p for p in complete_checkpoints(self.root) if int(STEP_RE.match(p.name).group(1)) > step]
        for p in newer:
            p.rename(p.with_name(f"{p.name}.superseded-{stamp}"))
            print(
                f"checkpoint.resume: resuming from step {step}; moved the newer {p.name} aside to {p.name}.superseded-{stamp}",
                flush=True,
            )
        if newer:
            self._write_latest()

    def _write_latest(self) -> None:
        """Point ``latest`` at the newest complete checkpoint (atomically), or remove it when there is none."""
        found = complete_checkpoints(self.root)
        if not found:
            (self.root / "latest").unlink(missing_ok=True)
            return
        pointer = self.root / "latest.tmp"
        pointer.write_text(found[-1].name + "\n")
        os.replace(pointer, self.root / "latest")
        _fsync_dir(self.root)

    def _check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write_probe_{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise PermissionError(
                f"{self.field}={self.root} is not a writable directory: {type(e).__name__}: {e}"
            ) from None

    def due(self, step: int, *, last: bool) -> bool:
        every = self.cfg.save_every
        return bool(every and step % every == 0) or (last and self.cfg.save_final)

    # -- saving -----------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Stateful], *, meta: dict, write_files: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step``: DCP shards into ``step_N.tmp``, then ``write_files(tmp)`` (called on every
        rank; model config and tokenizer, the optional HF export), then ``meta.json``, rename, ``latest``, prune.

        Any failure removes the ``.tmp`` directory and raises ``CheckpointError`` on every rank. The save is a
        ``checkpoint`` stage of this rank's progress (the hang monitor names a rank stuck in it).
        """
        with progress.stage("checkpoint", step=step):
            return self._save(step, state, meta=meta, write_files=write_files)

    def _save(self, step: int, state: dict[str, Stateful], *, meta: dict, write_files: Callable[[Path], None]) -> Path:
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        previous = on_main(lambda: self._start(tmp), mesh=self.mesh)
        try:
            written = FileDigests(tmp)
            dcp.save(state, storage_writer=DigestingFileSystemWriter(tmp, written), process_group=self._group())
            digests = self._gather_digests(written)
            write_files(tmp)
            meta = {
                **meta,
                "step": step,
                "world_size": self.world_size,
                "digests": {"algorithm": DIGEST, "files": digests},
            }
            on_main(lambda: self._commit(tmp, final, meta), mesh=self.mesh)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank gets here (DCP and on_main raise
            # everywhere); DCP's CheckpointException is a BaseException
            reason = _first_failure(e)
            on_main(lambda: shutil.rmtree(tmp, ignore_errors=True), mesh=self.mesh)
            kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
            raise CheckpointError(
                f"{self.field}={self.root}: saving step {step} failed ({reason}); {kept} and `latest` is unchanged"
            ) from e
        on_main(lambda: self._prune(keep=final), mesh=self.mesh)
        return final

    def _gather_digests(self, written: FileDigests) -> dict[str, dict]:
        """Every rank's written files, by name, on every rank (each rank writes its own shards; rank 0 ``.metadata``)."""
        group = self._group()
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, written.files, group=group)
        merged: dict[str, dict] = {}
        for files in every:
            assert not set(files) & set(merged), f"two ranks wrote {sorted(set(files) & set(merged))}"
            merged.update(files)
        return dict(sorted(merged.items()))

    def _start(self, tmp: Path) -> str | None:
        self._check_writable()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        found = complete_checkpoints(self.root)
        return found[-1].name if found else None

    def _commit(self, tmp: Path, final: Path, meta: dict) -> None:
        meta = {"format": FORMAT_VERSION, "time": time.time(), **meta}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        _fsync_dir(tmp)
        if final.exists():  # an older run's checkpoint of the same step: replace it without a gap
            old = final.with_name(final.name + f".replaced-{int(time.time())}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        self._write_latest()

    def _prune(self, keep: Path) -> None:
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.cfg.keep_last:
            for old in complete_checkpoints(self.root)[: -self.cfg.keep_last]:
                if old != keep:
                    shutil.rmtree(old, ignore_errors=True)

    # -- restoring --------------------------------------------------------------------------------------

    def load(self, path: Path, state: dict[str, Stateful], *, engines: dict, components: list[str]) -> dict:
        """Restore ``state`` from checkpoint ``path``; returns its ``meta.json``.

        Before reading any shard it checks that the checkpoint fits this run: its format, the same roles, trainer
        components, and every engine's parameter names and shapes (a clear error names the first mismatch).
        Nothing read runs code (see the module docstring). A ``resume`` stage of this rank's progress.
        """
        with progress.stage("resume"):
            return self._load(path, state, engines=engines, components=components)

    def _load(self, path: Path, state: dict[str, Stateful], *, engines: dict, components: list[str]) -> dict:
        if path != self._verified:  # ``prepare`` checked the checkpoint it picked; any other is checked here
            self._verify(path)
        meta = on_main(lambda: self._check_fits(path, engines=engines, components=components), mesh=self.mesh)
        have_rng = broadcast_object(None if self.rank else self._rng_keys(path), mesh=self.mesh)
        state = dict(state)
        mine = f"rng.rank_{self.rank}."
        parts = {k[len(mine) :] for k in have_rng if k.startswith(mine)}
        if not parts:
            state.pop("rng", None)  # resuming on more ranks than wrote the checkpoint: these keep their seeds
        elif isinstance(state.get("rng"), RNGState):
            state["rng"].only = parts  # e.g. written without CUDA: restore the parts it has
        dcp_load(state, path, process_group=self._group())
        return meta

    def _group(self):
        return None if self.mesh is None else self.mesh.get_group()

    @staticmethod
    def _rng_keys(path: Path) -> set[str]:
        return {k for k in read_dcp_metadata(path).state_dict_metadata if k.startswith("rng.")}

    def _check_fits(self, path: Path, *, engines: dict, components: list[str]) -> dict:
        meta = read_meta(path)
        check_format(path, meta)
        saved = read_dcp_metadata(path).state_dict_metadata
        roles = sorted({k.split(".", 1)[0] for k in saved} - {"trainer", "rng", PIPELINE})
        for role, engine_shapes in engines.items():
            if role not in roles:
                raise CheckpointError(
                    f"checkpoint {path} has no {role!r} state (it holds {roles}); it was written by a different kind of run"
                )
            self._check_shapes(path, role, engine_shapes, saved, meta)
        unused = sorted(set(roles) - set(engines))
        if unused:
            print(f"checkpoint {path} also holds {unused}, which this run does not train; not loaded", flush=True)
        missing = sorted(set(components) - set(meta.get("trainer_components", [])))
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no state for trainer component(s) {missing} "
                f"(it has {meta.get('trainer_components')}); it was written with a different algorithm config"
            )
        return meta

    @staticmethod
    def _check_shapes(path: Path, role: str, shapes: dict[str, torch.Size], saved: dict, meta: dict) -> None:
        source = meta.get("models", {}).get(role, "?")
        prefix = f"{role}.model."
        saved_model = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
        for name, shape in shapes.items():
            md = saved_model.get(name)
            if md is None:
                raise CheckpointError(
                    f"checkpoint {path} was written for a different model ({source}): it has no parameter {name!r} for {role}"
                )
            if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(shape):
                raise CheckpointError(
                    f"checkpoint {path} was written for a different model ({source}): {role} parameter {name!r} "
                    f"has shape {list(md.size)} in the checkpoint but {list(shape)} in this run's model"
                )
        extra = sorted(set(saved_model) - set(shapes))
        if extra:
            raise CheckpointError(
                f"checkpoint {path} was written for a different model ({source}): {role} parameter {extra[0]!r} "
                f"(and {len(extra) - 1} more) does not exist in this run's model"
            )


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- Hugging Face directories -------------------------------------------------------------------------------


def write_hf_dir(
    hf_model,
    state_dict: dict[str, torch.Tensor],
    tokenizer,
    source_dir: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``config.json``, safetensors, the tokenizer and the generation config into ``out`` (one process).

    Written into ``out.tmp`` and renamed, so an interrupted write never leaves a half-written model.
    """
    out = Path(out)
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name in ("generation_config.json", "preprocessor_config.json"):
        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


MODEL_FILES = ("config.json", "generation_config.json", "preprocessor_config.json")
"""Copied beside the weights; ``preprocessor_config.json`` is a vision-language model's image processor."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
)


def copy_model_files(model_dir: str | Path, tokenizer_dir: str | Path, out: Path) -> None:
    """Copy the model's config, generation config and tokenizer files verbatim: with the weights in the DCP
    shards, that is all it takes to turn a checkpoint back into an HF model (``scripts/export_hf.py``)."""
    out.mkdir(parents=True, exist_ok=True)
    for src, names in ((Path(model_dir), MODEL_FILES), (Path(tokenizer_dir), TOKENIZER_FILES)):
        for name in names:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)


def save_hf_model(
    engine, tokenizer, source_dir: str | Path, out: str | Path, *, is_main: bool, dtype: torch.dtype | None = None
) -> Path:
    """Gather the engine's full weights (collective) and write them as an HF directory on rank 0."""
    sd = engine.hf_state_dict()
    if is_main:
        write_hf_dir(engine.hf_model, sd, tokenizer, source_dir, out, dtype=dtype)
    return Path(out)
