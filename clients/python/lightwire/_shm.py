"""POSIX shared-memory segments owned by the client.

``multiprocessing.shared_memory.SharedMemory`` names have no leading "/"; the sidecar API
wants the ``shm_open`` name, with it (``ShmSegment.shm_name``).

Ownership: the client creates the segment, registers it with the sidecar (which maps it) and
unlinks it exactly once (``ShmSegment.unlink``/``close``). CPython (< 3.13) registers every
segment it creates *or attaches* with ``multiprocessing.resource_tracker``, which unlinks what
is still registered when the process tree exits and warns about "leaked shared_memory
objects". We keep the tracker registration of segments we create (so a crashed trainer's
segments are still removed) and remove it in the same call that unlinks the segment, so a
normal lifecycle leaves the tracker nothing to do and prints nothing.
"""

import itertools
import os
import secrets
import threading

from multiprocessing import shared_memory

_counter = itertools.count()
_lock = threading.Lock()


class _SharedMemory(shared_memory.SharedMemory):
    """SharedMemory whose finaliser tolerates live exports (a tensor still viewing the
    mapping keeps it mapped until that tensor dies; that is not an error)."""

    def __del__(self):
        try:
            self.close()
        except (OSError, BufferError):
            pass


class ShmSegment(object):
    """A POSIX shared-memory segment of ``size`` bytes created by this process.

    Attributes: ``name`` (Python's, no "/"), ``shm_name`` (the ``shm_open`` name with "/"),
    ``size``, ``buf`` (a writable memoryview), ``buffer_id`` (set by the caller once the
    segment is registered with a sidecar, else None).
    """

    def __init__(self, size, name=None):
        size = int(size)
        if size <= 0:
            raise ValueError("lightwire: a shared-memory segment needs size > 0")
        if name is None:
            with _lock:
                n = next(_counter)
            name = "lightwire-%d-%d-%s" % (os.getpid(), n, secrets.token_hex(4))
        name = name.lstrip("/")
        self._shm = _SharedMemory(name=name, create=True, size=size)
        self.name = self._shm.name.lstrip("/")
        self.size = size
        self.buffer_id = None
        self._unlinked = False
        self._closed = False

    @property
    def shm_name(self):
        return "/" + self.name

    @property
    def buf(self):
        return self._shm.buf

    def unlink(self):
        """Remove the name (exactly once; later calls do nothing). Mappings stay valid."""
        if self._unlinked:
            return
        self._unlinked = True
        # SharedMemory.unlink() does shm_unlink and removes the resource_tracker registration.
        self._shm.unlink()

    def close(self):
        """Unlink (if not done) and unmap. If a tensor or memoryview still views the mapping,
        the unmapping is left to the garbage collector (when the last view dies)."""
        self.unlink()
        if self._closed:
            return
        self._closed = True
        try:
            self._shm.close()
        except BufferError:
            pass  # exported views still alive; _SharedMemory.__del__ retries quietly

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "ShmSegment(%r, size=%d, buffer_id=%r)" % (self.shm_name, self.size, self.buffer_id)
