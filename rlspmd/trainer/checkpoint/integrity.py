"""SHA-256 integrity: what a save wrote, checked before a load.

Integrity: every DCP file (each rank's shards, rank 0's ``.metadata``) is hashed as it is written
(``DigestingFileSystemWriter``: the bytes pass through Python on their way to the file, so nothing is read twice),
and ``meta.json`` records each file's size and digest. Before a load the ranks re-hash the files, a share each
(``Checkpointer._verify``); a mismatch names the file, the recorded and the found digest. ``--resume auto`` then falls
back to the newest intact checkpoint and moves the damaged one aside. ``model/`` and ``hf/`` (config, tokenizer, the
optional HF export: written by shutil and transformers, read only by an export, never by a resume) are not recorded.
A checkpoint written before digests were recorded loads unchecked (rank 0 says so).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from rlspmd.trainer.checkpoint.base import CheckpointError
from rlspmd.trainer.checkpoint.layout import read_meta

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
