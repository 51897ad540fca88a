"""Big notebook values reach the ranks of this machine through shared memory, written once, mapped copy-on-write.

A CPU tensor's storage or a NumPy array of ``MIN_BYTES`` or more is not pickled into the payload: the kernel writes
its bytes once into a file without a name on a tmpfs (``O_TMPFILE`` in ``/dev/shm``, or the directory
``GPUMAGIC_SHM`` names), and the payload carries only where to find it: the kernel's pid, the file's descriptor
number there, its device, inode and size. Each rank opens it through ``/proc/<kernel pid>/fd/<n>``, which only
processes of the kernel's own user may do, checks it is that very file, and maps it ``MAP_PRIVATE``: every rank
reads the same pages, and a rank that writes to its copy gets its own pages (fork's semantics), never changing the
kernel's or another rank's. Having no name, the memory is freed by the kernel: when it closes the file and the
last rank that mapped it ends, or when the kernel dies however it dies (a SIGKILL included); nothing is left in
``/dev/shm`` to sweep.

What travels this way: tensors on the CPU (``torch.Tensor``, ``nn.Parameter``; views keep sharing their storage,
``requires_grad`` is kept), NumPy arrays of plain dtypes, and so whatever holds them (lists, dicts, datasets,
pandas' blocks). What does not, by value as before: smaller values, GPU tensors (torch pickles them through the
host), tensor subclasses, tensors carrying attributes or hooks, object arrays, and every payload that leaves this
machine (Slurm, other nodes, background jobs, whose payload waits on disk).

The kernel keeps a value's file while the value lives unchanged, so the next launch or cell does not write it
again: a tensor is unchanged while its storage and version (bumped by in-place changes) are; an array while its
bytes equal the file's. A file no launch or cell uses is closed after ``KEEP_S`` (``GPUMAGIC_SHM_KEEP``
seconds; 0: at the end of each launch or cell), when its value is freed or changed, or when the kernel ends.
A tensor changed through another object sharing its memory (``X.numpy()[0] = 1``) keeps its version: change it
through the tensor, or ``X.add_(0)``, before the next launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from gpumagic.errors import GpumagicError
from gpumagic.run_dirs import private
from gpumagic.units import format_bytes

log = logging.getLogger(__name__)

SHM_VARIABLE = "GPUMAGIC_SHM"  # the tmpfs directory the files are made in; "off": every value by value
KEEP_VARIABLE = "GPUMAGIC_SHM_KEEP"  # seconds an unused value's file is kept for the next launch or cell
DEFAULT_DIRECTORY = "/dev/shm"
MIN_BYTES = 1 << 20
KEEP_S = 300.0
_CHUNK = 8 << 20  # bytes compared at a time


class SharedValueGone(GpumagicError):
    """A rank could not open a value the kernel shared: the kernel ended, or it is not this user's."""


@dataclass(frozen=True)
class SegmentRef:
    """Where a rank finds a shared value: ``/proc/<pid>/fd/<fd>``, which must be the file ``(device, inode)`` of
    ``nbytes``. ``kind``: ``"torch"`` (rebuilt as a storage) or ``"numpy"`` (a buffer)."""

    pid: int
    fd: int
    device: int
    inode: int
    nbytes: int
    kind: str

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # memoized by the pickler: the tensors that share a storage in the notebook share one in the rank
        attach = attach_storage if self.kind == "torch" else attach_buffer
        return attach, (self.pid, self.fd, self.device, self.inode, self.nbytes)


# --- the rank's side -------------------------------------------------------------------------------------------


def attach_buffer(pid: int, fd: int, device: int, inode: int, nbytes: int) -> mmap.mmap:
    """The kernel's file mapped copy-on-write (``MAP_PRIVATE``): read shared, written privately.

    Raises:
        SharedValueGone: the kernel ended or closed the file, or the file is not the one the kernel meant.
    """
    where = f"/proc/{pid}/fd/{fd}"
    try:
        opened = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise SharedValueGone(
            f"a notebook value shared through {where} cannot be opened ({os.strerror(err.errno or 0)}): the kernel "
            "that sent it ended or freed it; run the cell again from the kernel"
        ) from None
    try:
        info = os.fstat(opened)
        if (
            not stat.S_ISREG(info.st_mode)
            or (info.st_dev, info.st_ino) != (device, inode)
            or info.st_size != nbytes
            or info.st_uid != os.getuid()
        ):
            raise SharedValueGone(f"{where} is no longer the notebook value the kernel shared; run the cell again")
        return mmap.mmap(opened, nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(opened)


def attach_storage(pid: int, fd: int, device: int, inode: int, nbytes: int) -> Any:
    """A ``torch.UntypedStorage`` over the kernel's file, copy-on-write (``attach_buffer``); it keeps the map."""
    # lazy: torch takes seconds to import; only ranks rebuilding a shared tensor need it
    import torch

    return torch.frombuffer(attach_buffer(pid, fd, device, inode, nbytes), dtype=torch.uint8).untyped_storage()


def rebuild_tensor(
    storage: Any, dtype: Any, offset: int, size: tuple, stride: tuple, requires_grad: bool, parameter: bool
) -> Any:
    """The tensor the kernel had, over ``storage`` (``attach_storage``)."""
    # lazy: as attach_storage
    import torch

    tensor = torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def rebuild_array(buffer: mmap.mmap, dtype: Any, shape: tuple, order: str) -> Any:
    """The array the kernel had, over ``buffer`` (``attach_buffer``): writable, copy-on-write."""
    # lazy: numpy only where an array was shared
    import numpy

    return numpy.ndarray(shape, dtype, buffer=buffer, order=order)


# --- the kernel's side -----------------------------------------------------------------------------------------


class _Segment:
    """One value's file: open in the kernel while a launch or cell holds it, or while it is kept for the next."""

    def __init__(self, fd: int, nbytes: int, kind: str, key: Hashable) -> None:
        info = os.fstat(fd)
        self.fd, self.nbytes, self.key = fd, nbytes, key
        self.ref = SegmentRef(os.getpid(), fd, info.st_dev, info.st_ino, nbytes, kind)
        self.holders = 0
        self.last_used = time.monotonic()
        self.version: int | None = None  # a tensor's ``_version`` when it was written
        self.finalizer: Any = None  # forgets it when its value is freed

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SharedStore:
    """The kernel's shared files, by value (``key``), closed when unused for ``keep_s``, stale or freed."""

    def __init__(self, directory: str, keep_s: float) -> None:
        self.directory, self.keep_s = directory, keep_s
        self.pid = os.getpid()
        self._lock = threading.RLock()
        self._segments: dict[Hashable, _Segment] = {}
        self._stale: list[_Segment] = []  # replaced or freed, still held by a launch or cell
        self._timer: threading.Timer | None = None
        self.writes = 0  # files written: a value written once is not written again while it is kept

    # what the pickler asks --------------------------------------------------------------------------------------

    def tensor_segment(self, tensor: Any) -> _Segment:
        """The file holding ``tensor``'s whole storage, written now unless it holds the storage as it is; held
        (``release`` it), so that no sweep closes it before the ranks map it.

        Raises:
            OSError: the file cannot be made or written (a full tmpfs: ENOSPC).
        """
        storage = tensor.untyped_storage()
        key = ("torch", storage.data_ptr(), storage.nbytes())
        with self._lock:  # held while writing: one file per value, whichever thread asks
            known = self._segments.get(key)
            if known is not None and known.version == tensor._version:
                known.holders += 1
                return known
            if known is not None:
                self._retire(known)
            data = memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")
            segment = self._add(key, data, "torch", storage)  # a new storage may take its address
            segment.version = tensor._version
            return segment

    def array_segment(self, array: Any) -> tuple[_Segment, str]:
        """The file holding ``array``'s bytes (C order, or F for a Fortran-ordered array), and that order; written
        now unless its bytes are those of the file kept for this array; held, as ``tensor_segment``'s.

        Raises:
            OSError: as ``tensor_segment``.
        """
        # lazy: numpy is imported already: the array is one
        import numpy

        if array.flags.c_contiguous:
            flat, order = array.reshape(-1), "C"
        elif array.flags.f_contiguous:
            flat, order = array.T.reshape(-1), "F"
        else:
            flat, order = numpy.ascontiguousarray(array).reshape(-1), "C"
        data = memoryview(flat.view(numpy.uint8))
        key = ("numpy", id(array), array.shape, array.dtype.str, order)
        with self._lock:
            known = self._segments.get(key)
            if known is not None and _same_bytes(known.fd, data):
                known.holders += 1
                return known, order
            if known is not None:
                self._retire(known)
            return self._add(key, data, "numpy", array), order  # a new array may take its id

    def _add(self, key: Hashable, data: memoryview, kind: str, owner: Any) -> _Segment:
        """A new file holding ``data``, offered for ``key`` until ``owner`` (the value) is freed."""
        segment = _Segment(self._write(data), len(data), kind, key)
        segment.finalizer = weakref.finalize(owner, self._forget, segment)
        segment.holders = 1
        self._segments[key] = segment
        return segment

    def _write(self, data: memoryview) -> int:
        """A nameless file in ``directory`` holding ``data``: its descriptor."""
        fd = os.open(self.directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            # written whole before any rank maps it (a full tmpfs is ENOSPC here, never SIGBUS in a rank); not
            # posix_fallocate first: writing into its pages took 10 s for 3.8 GB on tmpfs, against 2.7 s
            private.write_all(fd, data)
            self.writes += 1
            return fd
        except BaseException:
            os.close(fd)
            raise

    # freeing ----------------------------------------------------------------------------------------------------

    def release(self, segments: list[_Segment]) -> None:
        """A launch or cell is done with ``segments`` (one hold each time a segment is listed): its ranks have
        mapped them (or ended)."""
        with self._lock:
            now = time.monotonic()
            for segment in segments:
                segment.holders -= 1
                segment.last_used = now
        self.sweep()

    def sweep(self) -> None:
        """Close the files nobody holds that are stale or unused for ``keep_s``; come back when the next is due."""
        with self._lock:
            now = time.monotonic()
            for segment in list(self._segments.values()):
                if segment.holders == 0 and now - segment.last_used >= self.keep_s:
                    self._retire(segment)
            for segment in [s for s in self._stale if s.holders == 0]:
                self._stale.remove(segment)
                segment.close()
            self._schedule(now)

    def close_all(self) -> None:
        """The kernel ends: close every file (the ranks still running keep their maps)."""
        with self._lock:
            for segment in [*self._segments.values(), *self._stale]:
                segment.close()
            self._segments.clear()
            self._stale.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def held_bytes(self) -> int:
        """The bytes of the files open now."""
        with self._lock:
            return sum(s.nbytes for s in [*self._segments.values(), *self._stale] if s.fd >= 0)

    def _retire(self, segment: _Segment) -> None:
        """Stop offering ``segment``; close it once no launch or cell holds it."""
        with self._lock:
            if self._segments.get(segment.key) is segment:
                del self._segments[segment.key]
            if segment.finalizer is not None:
                segment.finalizer.detach()
            if segment.holders:
                self._stale.append(segment)
            else:
                segment.close()

    def _forget(self, segment: _Segment) -> None:
        """Its value was freed (a weakref finalizer: any thread, any moment)."""
        with self._lock:
            if self._segments.get(segment.key) is segment:  # still offered: not retired already
                self._retire(segment)

    def _schedule(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        unheld = [s.last_used for s in self._segments.values() if s.holders == 0]
        if unheld:
            self._timer = threading.Timer(max(0.0, min(unheld) + self.keep_s - now) + 0.01, self.sweep)
            self._timer.daemon = True
            self._timer.start()


def _same_bytes(fd: int, data: memoryview) -> bool:
    """Whether the file ``fd`` holds ``data``, compared a chunk at a time at memory speed."""
    if os.fstat(fd).st_size != len(data):
        return False
    with mmap.mmap(fd, len(data), prot=mmap.PROT_READ) as kept:
        view = memoryview(kept)
        try:
            return all(
                view[start : start + _CHUNK] == data[start : start + _CHUNK] for start in range(0, len(data), _CHUNK)
            )
        finally:
            view.release()


class SharedBatch:
    """The files one launch or one cell's ranks map: the pickler's ``reduce`` for big values, holding each file
    until ``release`` (the ranks have mapped them). A file that cannot be made is said once, as one line on
    stderr, and that value and the rest of the batch travel by value."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self.held: list[_Segment] = []
        self.refused: str | None = None
        self._done: dict[int, tuple[Any, Any]] = {}  # id -> (the value, kept alive, its reduction): pickled twice
        torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
        self._tensor_types = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
        self._array_type = numpy.ndarray if numpy is not None else None

    def reduce(self, obj: Any) -> Any:
        """A reduction that sends ``obj`` through a shared file, or ``NotImplemented``: by value."""
        kind = type(obj)
        if self.refused is not None or (kind not in self._tensor_types and kind is not self._array_type):
            return NotImplemented
        done = self._done.get(id(obj))
        if done is not None:  # a group's digest pickled it already this cell
            return done[1]
        try:
            reduction = self._reduce_tensor(obj) if kind in self._tensor_types else self._reduce_array(obj)
        except Exception:  # a kind of tensor or array not foreseen: by value, as before
            log.debug("a %s is not shared; it travels by value", kind.__name__, exc_info=True)
            return NotImplemented
        if reduction is not NotImplemented:
            self._done[id(obj)] = (obj, reduction)
        return reduction

    def _reduce_tensor(self, tensor: Any) -> Any:
        if (
            tensor.device.type != "cpu"
            or tensor.layout is not _torch().strided
            or tensor.is_quantized
            or tensor.is_conj()
            or tensor.is_neg()
            or (tensor.requires_grad and not tensor.is_leaf)  # torch's own pickle says why it refuses
            or tensor._backward_hooks
            or getattr(tensor, "__dict__", None)
            or tensor.untyped_storage().nbytes() < MIN_BYTES
        ):
            return NotImplemented
        segment = self._segment(lambda: self.store.tensor_segment(tensor), tensor.untyped_storage().nbytes())
        if segment is None:
            return NotImplemented
        parameter = type(tensor) is not _torch().Tensor
        shape = (tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        return rebuild_tensor, (segment.ref, *shape, tensor.requires_grad, parameter)

    def _reduce_array(self, array: Any) -> Any:
        if array.dtype.hasobject or array.nbytes < MIN_BYTES:
            return NotImplemented
        found: list[str] = []

        def make() -> _Segment:
            segment, order = self.store.array_segment(array)
            found.append(order)
            return segment

        segment = self._segment(make, array.nbytes)
        if segment is None:
            return NotImplemented
        return rebuild_array, (segment.ref, array.dtype, array.shape, found[0])

    def _segment(self, make: Callable[[], _Segment], nbytes: int) -> _Segment | None:
        try:
            segment = make()
        except OSError as err:
            self.refused = os.strerror(err.errno or 0)
            log.debug("a value could not be shared; it travels by value", exc_info=True)
            full = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)
            advice = "free space there, or set" if full else "set"
            sys.stderr.write(
                f"gpumagic: cannot share a {format_bytes(nbytes)} value through {self.store.directory} "
                f"({self.refused}): it and the rest of these values travel by value, a copy in each rank; "
                f"{advice} {SHM_VARIABLE} to another tmpfs directory\n"
            )
            return None
        self.held.append(segment)  # held by the store for this batch, once per time it was asked
        return segment

    def release(self) -> None:
        """The ranks have what they were sent (or ended): the files may be closed when no longer kept."""
        held, self.held = self.held, []
        self._done.clear()
        self.store.release(held)


def _torch() -> Any:
    return sys.modules["torch"]


_STORE: SharedStore | None = None
_STORE_LOCK = threading.Lock()


def shared_batch() -> SharedBatch | None:
    """A batch for one launch or cell whose ranks all run on this machine, or None where values cannot be shared
    (``GPUMAGIC_SHM=off``, no such directory, a system without ``O_TMPFILE``): the old path, by value."""
    store = kernel_store()
    return None if store is None else SharedBatch(store)


@contextlib.contextmanager
def sharing() -> Iterator[SharedBatch | None]:
    """``shared_batch()`` for a block whose ranks have mapped what they were sent when it ends: released then."""
    batch = shared_batch()
    try:
        yield batch
    finally:
        if batch is not None:
            batch.release()


def kernel_store() -> SharedStore | None:
    """This process's store, made on first use (again in a forked child, whose files are its parent's)."""
    global _STORE
    with _STORE_LOCK:
        if _STORE is not None and _STORE.pid == os.getpid():
            return _STORE
        directory = os.environ.get(SHM_VARIABLE, "").strip() or DEFAULT_DIRECTORY
        if directory.lower() == "off" or not hasattr(os, "O_TMPFILE") or not os.path.isdir(directory):
            if directory.lower() != "off":
                log.debug("no shared memory at %s: big values travel by value", directory)
            return None
        _STORE = SharedStore(directory, _keep_s())
        return _STORE


def close_kernel_store() -> None:
    """Close every shared file of this kernel (it ends); the next use makes the store again from the
    environment (``GPUMAGIC_SHM``, ``GPUMAGIC_SHM_KEEP``)."""
    global _STORE
    with _STORE_LOCK:
        if _STORE is not None and _STORE.pid == os.getpid():
            _STORE.close_all()
        _STORE = None


def _keep_s() -> float:
    text = os.environ.get(KEEP_VARIABLE, "").strip()
    if not text:
        return KEEP_S
    try:
        return max(0.0, float(text))
    except ValueError:
        log.warning(
            "%s=%r is not a number of seconds; keeping unused shared values %.0f s", KEEP_VARIABLE, text, KEEP_S
        )
        return KEEP_S
