"""Where an ERM release schedule keeps the blocks it may still train on: memory or files.

A cumulative schedule of paper 004 (multi-resolution, continual) trains on ranges that reach back
to block 0, so it must keep every raw row it may still use: about ``8(d + 2)`` bytes per event
(``0.5 kB`` at ``d = 64``). Held in RAM and in every snapshot, that grows with the stream. A
:class:`BlockStore` holds those blocks for :class:`~dpstream.core.erm.schedules.schedule.
ReleaseSchedule`, which reads a computation's range from it when it trains and tells it which
blocks no later computation can use (:meth:`BlockStore.drop_before`):

* :class:`MemoryBlockStore` (the core default): the blocks in RAM; its :meth:`~BlockStore.state`
  is the list of the blocks' arrays, exactly the bytes of the schedule snapshots made before
  block stores existed.
* :class:`FileBlockStore`: append-only *segment* files of one stream of one shard in a
  directory; its state is a cursor only (``segment``, ``offset``, ``end``), O(1) whatever the
  history holds.

**Files rather than re-reading the input topic.** The alternative, re-reading a range's events
from the input topic by offset, would tie training to the topic's retention (a base model over
a year needs a year of retention), to the broker's availability at every base step, and to the
exact decoding, bounding and ordering of a replay of every partition that fed a block. The rows
of a block are the output of that whole pipeline (decoded, feature-mapped, sorted by partition
and offset); storing them once, next to the recovery store, makes a training read local, fast
and independent of the broker, at a disk cost of ``8·columns + 8`` bytes per event plus
``RECORD_OVERHEAD`` bytes per block (``columns = d + 1`` with an intercept: ``528`` bytes per
event at ``d = 64``), bounded by ``release.max_history`` blocks.

**The segment format.** Segment ``i`` holds the blocks of steps ``[i·P, (i+1)·P)``
(``P = blocks_per_segment``, 64 by default), one *record* per block, appended in step order::

    header  : magic b"DPHB", version u16, 0 u16, columns u32, step u64, rows u64  (28 bytes)
    payload : z, rows x columns float64 little-endian; y, rows int64 little-endian
    checksum: BLAKE2b-128 of header + payload                                     (16 bytes)

A record's length follows from its header (``28 + 8·rows·(columns + 1) + 16``). Every record is
checked when it is read (magic, version, columns, step, length and checksum): a corrupt record
raises :class:`HistoryError` naming the segment, the step and what failed, never a value.

**Crash consistency** (the store follows the snapshots of the recovery store, which Bytewax
takes at the end of an epoch). :meth:`FileBlockStore.state` first makes every appended byte
durable (``flush`` and ``fsync`` of the segment, ``fsync`` of the directory when a segment was
created or deleted) and only then returns the cursor: the segment the next block goes to and
that segment's length, and the next step. A snapshot therefore never points at bytes that a
crash could lose. Blocks appended after a snapshot (a crash after an append and before the next
snapshot, even a torn, half-written record) lie beyond its cursor: :meth:`FileBlockStore.restore`
truncates the cursor's segment to the cursor's offset and deletes every later segment, and the
replay of the input after the snapshot appends the very same blocks again (a block is a function
of the input alone: the ERM shard sorts its rows by partition and offset). Appends never touch a
segment before the cursor's, so the bytes of every block before the cursor are exactly those of
the snapshot's time. :meth:`~FileBlockStore.restore` refuses, with a precise
:class:`HistoryError`, a store whose segments the snapshot needs are missing or shorter than
its cursor (the history directory did not move with the recovery store) and a record whose
header does not belong where it lies.

**Deleting.** :meth:`~BlockStore.drop_before` deletes the segments all of whose blocks precede
the first block still needed. With ``durable`` (a recovery store: snapshots may be resumed), a
segment is deleted only once it is needed by none of the last ``keep_snapshots`` states handed
out either: Bytewax resumes from the last epoch *every* worker committed, which may be a
snapshot or two older than the one this shard took last. A resume from an older snapshot than
that finds its segments gone and stops with :class:`HistoryError` (never with other data).
Without ``durable`` (no recovery store: nothing is ever resumed) segments go at once.

**Permissions.** The rows are private data, as the recovery store is: directories are created
``0700`` and segments ``0600`` (whatever the umask), and an existing directory is narrowed to
``0700``.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol, runtime_checkable

import numpy as np

from dpstream.core._checks import integer_at_least
from dpstream.core._files import fsync_directory
from dpstream.core.erm.spec import Block
from dpstream.errors import InvalidParameterError, RecoveryMismatchError

__all__ = [
    "RECORD_OVERHEAD",
    "BlockStore",
    "FileBlockStore",
    "HistoryError",
    "MemoryBlockStore",
]

_MAGIC: Final = b"DPHB"
_VERSION: Final = 1
_HEADER: Final = struct.Struct("<4sHHIQQ")  # magic, version, 0, columns, step, rows
_DIGEST: Final = 16
RECORD_OVERHEAD: Final = _HEADER.size + _DIGEST
"""Bytes of one block record besides its rows (header and checksum)."""
_SEGMENT: Final = re.compile(r"segment-(\d{10})\.blocks")
_STATE_KIND: Final = "erm-history"
_DIR_MODE: Final = 0o700
_FILE_MODE: Final = 0o600


class HistoryError(RecoveryMismatchError):
    """A block history on disk is missing, shorter than its snapshot, or corrupt."""


@runtime_checkable
class BlockStore(Protocol):
    """The blocks of steps ``first .. end - 1`` of one schedule, appended in step order.

    A store begins empty at a step (:meth:`restore` with ``None``) or at a snapshot's
    :meth:`state`; the schedule appends each block once it committed its step, reads the
    ranges its computations train on, and drops the blocks no later computation can use.
    """

    @property
    def columns(self) -> int:
        """The feature columns of every block."""

    @property
    def first(self) -> int:
        """The first step still kept (``first == end``: none)."""

    @property
    def end(self) -> int:
        """The next step to append (one past the last appended)."""

    def append(self, step: int, block: Block) -> None:
        """Add the block of ``step`` (``step == end``)."""

    def read(self, first: int, last: int, then: Block | None = None) -> Block:
        """Return the rows of the blocks ``first .. last`` in order, then those of ``then``.

        ``first > last`` reads no stored block (only ``then``'s rows, or none).
        """

    def drop_before(self, step: int) -> None:
        """No block before ``step`` will be read again: forget them."""

    def flush(self) -> None:
        """Make every appended block durable (a no-op in memory)."""

    def state(self) -> Any:
        """Return what a snapshot must hold to restore the store (after :meth:`flush`)."""

    def restore(self, state: Any, *, first: int) -> None:
        """Take a snapshot's :meth:`state` (``None``: empty at ``first``).

        ``first`` is the first step the snapshot's schedule still needs.
        """


def _check_step(name: str, value: object) -> int:
    return integer_at_least(name, value, 0)


def _check_read(store: BlockStore, first: int, last: int) -> tuple[int, int]:
    first, last = _check_step("first", first), int(last)
    if first <= last and (first < store.first or last >= store.end):
        raise InvalidParameterError(  # a bug of the caller, never data-dependent
            f"blocks {first}..{last} are not kept (the store keeps {store.first}.."
            f"{store.end - 1})")
    return first, last


class _Steps:
    """What both stores share: the columns of every block and the first step still kept."""

    def __init__(self, columns: int) -> None:
        self._columns = integer_at_least("columns", columns, 1)
        self._first = 0

    @property
    def columns(self) -> int:
        """The feature columns of every block."""
        return self._columns

    @property
    def first(self) -> int:
        """The first step still kept."""
        return self._first


class MemoryBlockStore(_Steps):
    """The blocks in RAM (the default): the state is the blocks' arrays, as before stores.

    Args:
        columns: the feature columns of every block.

    """

    def __init__(self, columns: int) -> None:
        super().__init__(columns)
        self._blocks: list[Block] = []

    @property
    def end(self) -> int:
        """The next step to append."""
        return self._first + len(self._blocks)

    def append(self, step: int, block: Block) -> None:
        """Add the block of ``step`` (``step == end``)."""
        if step != self.end:
            raise InvalidParameterError(f"expected the block of step {self.end}, got {step!r}")
        self._blocks.append(block)

    def read(self, first: int, last: int, then: Block | None = None) -> Block:
        """Return the rows of blocks ``first .. last``, then ``then``'s (one copy at most)."""
        first, last = _check_read(self, first, last)
        parts = self._blocks[first - self._first: last - self._first + 1] if first <= last \
            else []
        if then is not None:
            parts = [*parts, then]
        if len(parts) == 1:
            return parts[0]
        return Block.concat(parts, self._columns)

    def drop_before(self, step: int) -> None:
        """Forget the blocks before ``step``."""
        step = min(_check_step("step", step), self.end)
        if step > self._first:
            del self._blocks[: step - self._first]
            self._first = step

    def flush(self) -> None:
        """Nothing to do: memory is not durable (the snapshot holds the blocks)."""

    def state(self) -> list[dict[str, Any]]:
        """The kept blocks as arrays (copies): the bytes of a pre-store snapshot."""
        return [b.to_state() for b in self._blocks]

    def restore(self, state: Any, *, first: int) -> None:
        """Take the blocks of a :meth:`state` (``None``: empty at ``first``).

        Raises:
            InvalidParameterError: ``state`` is a file store's cursor (its blocks are on
                disk) or malformed.

        """
        first = _check_step("first", first)
        if state is None:
            self._first, self._blocks = first, []
            return
        if isinstance(state, dict):
            raise InvalidParameterError(
                "this snapshot keeps its blocks in a file store (a history directory); "
                "resume it with that FileBlockStore, not in memory")
        try:
            blocks = [Block.from_state(b, self._columns) for b in state]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError(f"malformed block history: {exc!r}") from None
        self._first, self._blocks = first, blocks

    def __repr__(self) -> str:
        return f"MemoryBlockStore(blocks {self._first}..{self.end - 1})"


def _raw(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a writable-if-the-array-is view."""
    if array.size == 0:
        return memoryview(b"")
    return array.data.cast("B")


def _private_directory(directory: Path) -> None:
    """Create ``directory`` (and missing parents) mode 0700; narrow it to 0700 if it exists."""
    missing = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    for path in reversed(missing):
        try:
            path.mkdir(mode=_DIR_MODE)
        except FileExistsError:
            pass
        os.chmod(path, _DIR_MODE)
        fsync_directory(path.parent)  # the new entry survives a power loss
    if not directory.is_dir():
        raise HistoryError(f"the block history directory {directory} is not a directory")
    if stat.S_IMODE(directory.stat().st_mode) != _DIR_MODE:
        os.chmod(directory, _DIR_MODE)


class FileBlockStore(_Steps):
    """Append-only, checksummed segment files of one schedule's blocks (module docstring).

    The store starts unopened: :meth:`restore` (``None`` for a new schedule, which deletes
    whatever segments the directory holds) opens it.

    Args:
        directory: the store's own directory (created ``0700``; one store per directory).
        columns: the feature columns of every block.
        blocks_per_segment: ``P``, the blocks of one segment file.
        durable: whether snapshots of it may be resumed (a recovery store): :meth:`flush`
            fsyncs and deletion waits for ``keep_snapshots`` states (module docstring).
        keep_snapshots: with ``durable``, how many of the latest states handed out stay
            resumable (their segments are kept).

    """

    def __init__(self, directory: str | os.PathLike[str], columns: int, *,
                 blocks_per_segment: int = 64, durable: bool = True,
                 keep_snapshots: int = 3) -> None:
        super().__init__(columns)
        self.directory = Path(directory)
        self._per = integer_at_least("blocks_per_segment", blocks_per_segment, 1)
        self._durable = bool(durable)
        self._keep = integer_at_least("keep_snapshots", keep_snapshots, 1)
        self._open = False
        self._end = 0
        self._file: BinaryIO | None = None
        self._file_segment = -1
        self._dirty = False  # bytes appended since the last flush
        self._dir_dirty = False  # a segment created or deleted since the last flush
        self._given: list[int] = []  # the `first` of the latest states handed out

    # -- what a schedule sees --
    @property
    def end(self) -> int:
        """The next step to append."""
        return self._end

    def _segment_path(self, index: int) -> Path:
        return self.directory / f"segment-{index:010d}.blocks"

    def _segments(self) -> dict[int, Path]:
        found = {}
        for path in self.directory.iterdir():
            match = _SEGMENT.fullmatch(path.name)
            if match:
                found[int(match.group(1))] = path
        return found

    def _need_open(self) -> None:
        if not self._open:
            raise InvalidParameterError(
                "the file block store is not open: restore(state or None) first")

    def append(self, step: int, block: Block) -> None:
        """Append the block of ``step`` (``step == end``) to its segment.

        The record is written, not yet fsynced: :meth:`flush` (or :meth:`state`) does that.
        """
        self._need_open()
        if step != self._end:
            raise InvalidParameterError(f"expected the block of step {self._end}, got {step!r}")
        if block.z.shape[1] != self._columns:
            raise InvalidParameterError(
                f"a block of the store must have {self._columns} feature columns")
        z = np.ascontiguousarray(block.z, dtype="<f8")
        y = np.ascontiguousarray(block.y, dtype="<i8")
        header = _HEADER.pack(_MAGIC, _VERSION, 0, self._columns, step, block.size)
        digest = hashlib.blake2b(header, digest_size=_DIGEST)
        z_bytes, y_bytes = _raw(z), _raw(y)
        digest.update(z_bytes)
        digest.update(y_bytes)
        handle = self._handle(step // self._per)
        handle.write(header)
        handle.write(z_bytes)
        handle.write(y_bytes)
        handle.write(digest.digest())
        self._dirty = True
        self._end = step + 1

    def _handle(self, segment: int) -> BinaryIO:
        """The open segment file of ``segment`` (created 0600 if new), for appending."""
        if self._file is not None and self._file_segment == segment:
            return self._file
        self._close_file(sync=True)
        path = self._segment_path(segment)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _FILE_MODE)
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != _FILE_MODE:
                os.fchmod(fd, _FILE_MODE)
            self._file = os.fdopen(fd, "ab")
        except BaseException:
            os.close(fd)
            raise
        self._file_segment = segment
        self._dir_dirty = True
        return self._file

    def _close_file(self, *, sync: bool) -> None:
        if self._file is None:
            return
        self._file.flush()
        if sync and self._durable and self._dirty:
            os.fsync(self._file.fileno())
            self._dirty = False
        self._file.close()
        self._file, self._file_segment = None, -1

    def read(self, first: int, last: int, then: Block | None = None) -> Block:
        """Return the rows of blocks ``first .. last``, then ``then``'s, checking each record.

        The rows are read into one array allocated once (the range's row counts come from
        the records' headers first).

        Raises:
            HistoryError: a record is missing, misplaced or fails its checksum.

        """
        self._need_open()
        first, last = _check_read(self, first, last)
        if self._file is not None:
            self._file.flush()  # appended records are readable (not yet durable)
        extra = 0 if then is None else then.size
        if first > last:
            return Block.empty(self._columns) if then is None else then
        records = self._locate(first, last)
        rows = sum(r for _path, _offset, _step, r in records)
        z = np.empty((rows + extra, self._columns), dtype="<f8")
        y = np.empty(rows + extra, dtype="<i8")
        at = 0
        handles: dict[Path, io.BufferedReader] = {}
        try:
            for path, offset, step, r in records:
                handle = handles.get(path)
                if handle is None:
                    handle = handles[path] = open(path, "rb")  # noqa: SIM115 (closed below)
                self._read_record(handle, path, offset, step, z[at: at + r], y[at: at + r])
                at += r
        finally:
            for handle in handles.values():
                handle.close()
        if then is not None:
            z[at:] = then.z
            y[at:] = then.y
        return Block(z.astype(np.float64, copy=False), y.astype(np.int64, copy=False))

    def _locate(self, first: int, last: int) -> list[tuple[Path, int, int, int]]:
        """The (segment, offset, step, rows) of every record of steps ``first .. last``."""
        out: list[tuple[Path, int, int, int]] = []
        for segment in range(first // self._per, last // self._per + 1):
            path = self._segment_path(segment)
            for offset, step, rows in self._walk(path, segment):
                if first <= step <= last:
                    out.append((path, offset, step, rows))
        if [s for _p, _o, s, _r in out] != list(range(first, last + 1)):
            raise HistoryError(
                f"the block history in {self.directory} does not hold blocks {first}..{last} "
                "in order (a segment was replaced or damaged); start a new flow instance")
        return out

    def _walk(self, path: Path, segment: int) -> list[tuple[int, int, int]]:
        """The (offset, step, rows) of the records of one segment, from their headers."""
        try:
            size = path.stat().st_size
            handle = open(path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            raise HistoryError(
                f"the block history segment {path.name} is missing from {self.directory}: "
                "a shard's history directory must move with its recovery store (it holds the "
                "rows its schedule may still train on); resume where the history is, or start "
                "a new flow instance") from None
        found = []
        offset = 0
        with handle:
            while offset < size:
                header = handle.read(_HEADER.size)
                step, rows = self._check_header(header, path, offset)
                if step // self._per != segment:
                    raise HistoryError(f"the block history segment {path.name} holds a "
                                       f"record of step {step}, which belongs to another "
                                       "segment")
                length = _HEADER.size + 8 * rows * (self._columns + 1) + _DIGEST
                if offset + length > size:
                    raise HistoryError(
                        f"the block history segment {path.name} ends inside the record of step "
                        f"{step}: it was cut short")
                found.append((offset, step, rows))
                offset += length
                handle.seek(offset)
        return found

    def _check_header(self, header: bytes, path: Path, offset: int) -> tuple[int, int]:
        if len(header) < _HEADER.size:
            raise HistoryError(f"the block history segment {path.name} ends inside a record "
                               "header: it was cut short")
        magic, version, _zero, columns, step, rows = _HEADER.unpack(header)
        if magic != _MAGIC or version != _VERSION or columns != self._columns:
            raise HistoryError(
                f"the block history segment {path.name} has an invalid record "
                f"(format {magic!r} version {version}, {columns} columns; this store reads "
                f"{_MAGIC!r} version {_VERSION} with {self._columns} columns)")
        return int(step), int(rows)

    def _read_record(self, handle: io.BufferedReader, path: Path, offset: int, step: int,
                     z: np.ndarray, y: np.ndarray) -> None:
        handle.seek(offset)
        header = handle.read(_HEADER.size)
        got_step, rows = self._check_header(header, path, offset)
        if got_step != step or rows != z.shape[0]:
            raise HistoryError(f"the block history segment {path.name} changed while read "
                               f"(step {step})")
        digest = hashlib.blake2b(header, digest_size=_DIGEST)
        for array in (z, y):
            view = _raw(array)
            if view.nbytes and handle.readinto(view) != view.nbytes:
                raise HistoryError(f"the block history segment {path.name} ends inside the "
                                   f"record of step {step}")
            digest.update(view)
        if handle.read(_DIGEST) != digest.digest():
            raise HistoryError(
                f"the block history segment {path.name} fails its checksum at the record of "
                f"step {step}: the file was damaged; the rows cannot be "
                "trusted, start a new flow instance (or restore the recovery store and its "
                "history together from a backup)")

    def drop_before(self, step: int) -> None:
        """Forget the blocks before ``step``; delete the segments no state needs (docstring)."""
        self._need_open()
        step = min(_check_step("step", step), self._end)
        if step > self._first:
            self._first = step
            self._delete_unneeded()

    def _delete_unneeded(self) -> None:
        """Delete the segments before the first block needed now and by the states kept."""
        bound = min([self._first, *self._given[-self._keep:]]) if self._durable else self._first
        below = bound // self._per  # segments < below hold only blocks < bound
        for index, path in self._segments().items():
            if index < below and index != self._file_segment:
                path.unlink(missing_ok=True)
                self._dir_dirty = True

    def flush(self) -> None:
        """Make every appended block durable: flush and fsync the segment and the directory."""
        self._need_open()
        if self._file is not None:
            self._file.flush()
            if self._durable and self._dirty:
                os.fsync(self._file.fileno())
        self._dirty = False
        if self._durable and self._dir_dirty:
            fsync_directory(self.directory)
        self._dir_dirty = False

    def state(self) -> dict[str, Any]:
        """Flush, then return the cursor: the next block's segment, its length, the next step.

        The cursor holds no data and does not grow with the history.
        """
        self._need_open()
        self.flush()
        segment = self._end // self._per
        path = self._segment_path(segment)
        try:
            offset = path.stat().st_size
        except FileNotFoundError:
            offset = 0
        self._given = [*self._given[-(self._keep - 1):], self._first] if self._keep > 1 \
            else [self._first]
        self._delete_unneeded()
        return {"kind": _STATE_KIND, "version": _VERSION, "columns": self._columns,
                "per_segment": self._per, "segment": segment, "offset": offset,
                "end": self._end}

    def restore(self, state: Any, *, first: int) -> None:
        """Open at a snapshot's cursor (``None``: a new, empty history at ``first``).

        Bytes after the cursor (blocks appended after the snapshot, a torn record) are cut
        off, later segments and those before ``first``'s deleted; then every record of
        ``first .. end - 1`` is located from its header (checksums are checked on read). A
        :class:`MemoryBlockStore` state (a list of blocks, from a snapshot made before this
        store was used) is written into a new history.

        Raises:
            HistoryError: a segment the snapshot needs is missing or shorter than its cursor,
                or holds a misplaced record.
            InvalidParameterError: a malformed state, or one of another store format.

        """
        first = _check_step("first", first)
        self._close_file(sync=False)
        _private_directory(self.directory)
        # the resumed snapshot stays resumable until newer ones replace it: a crash before
        # the next snapshot commits resumes from it again
        self._given = [first]
        if state is None or isinstance(state, list):
            for path in self._segments().values():
                path.unlink()
            self._dir_dirty = True
            self._first = self._end = first
            self._open = True
            for i, block in enumerate(state or ()):
                self.append(first + i, Block.from_state(block, self._columns))
            return
        try:
            if (state["kind"] != _STATE_KIND or state["version"] != _VERSION
                    or state["columns"] != self._columns or state["per_segment"] != self._per):
                raise InvalidParameterError(
                    f"not a block history cursor of this store (kind {state['kind']!r}, "
                    f"version {state['version']}, {state['columns']} columns, "
                    f"{state['per_segment']} blocks a segment)")
            segment, offset, end = int(state["segment"]), int(state["offset"]), int(state["end"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed block history cursor: {exc!r}") from None
        if segment != end // self._per or offset < 0 or not 0 <= first <= end:
            raise InvalidParameterError("malformed block history cursor: inconsistent steps")
        segments = self._segments()
        for index, path in segments.items():
            if index > segment or (index < first // self._per and first < end) \
                    or (first == end and index < segment):
                path.unlink()
                self._dir_dirty = True
        tail = self._segment_path(segment)
        size = tail.stat().st_size if tail.exists() else 0
        if size < offset:
            raise HistoryError(
                f"the block history segment {tail.name} in {self.directory} is "
                f"{'missing' if not tail.exists() else 'shorter than its snapshot wrote it'}: "
                "a shard's history directory must move "
                "with its recovery store; resume where the history is, or start a new flow "
                "instance")
        if size > offset:  # blocks appended after the snapshot, maybe a torn record
            with open(tail, "r+b") as handle:
                handle.truncate(offset)
                handle.flush()
                if self._durable:
                    os.fsync(handle.fileno())
            self._dir_dirty = True
        self._first, self._end = first, end
        self._open = True
        if first < end:
            self._locate(first, end - 1)  # every needed record is where it belongs
        if self._durable:
            self.flush()

    def close(self) -> None:
        """Flush (fsync when ``durable``) and close the open segment."""
        self._close_file(sync=True)

    def __repr__(self) -> str:
        return f"FileBlockStore({str(self.directory)!r}, blocks {self._first}..{self._end - 1})"
