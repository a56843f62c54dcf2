"""A large ``bytes`` built in place: one allocation, filled through a writable view and
handed out without a copy.

Filling a ``bytearray`` and converting it with ``bytes(...)`` holds the object twice at the
end; joining chunks does too. Both that and ``io.BytesIO`` (whose ``getvalue`` hands out its
own ``bytes`` when no view is exported) also zero the whole buffer first: a memset pass that
cost 0.42 s of a 0.60 s chunked read of a 1 GiB file from the page cache (two cores,
``benchmarks/bench_transfer.py --large``), where ``open(...).read()`` took 0.43 s.

So on CPython a ``Filling`` asks the interpreter for an uninitialized ``bytes``
(``PyBytes_FromStringAndSize(NULL, size)``, as ``os.read`` does) and writes into it through
a view of its character array before anyone else holds it: the object is new, referenced
only here, and its hash not yet computed, which is how CPython fills its own ``bytes``. The
layout is checked once at import by filling a small object and reading it back; where that
fails, or on another interpreter, it falls back to ``io.BytesIO``. Used by the codec (a blob
encoded chunk by chunk) and the mailboxes (an object read in chunks or in parallel ranges).
Pure; the caller's thread.
"""

import ctypes
import io
import sys

__all__ = ["Filling"]


def _uninitialized(size: int) -> tuple[bytes, "ctypes.Array[ctypes.c_char]"]:
    """A new ``bytes`` of ``size`` unspecified bytes and a ctypes array over its contents
    (every view of which keeps a reference to the array: ``Filling.done`` counts them)."""
    data: bytes = _new_bytes(None, size)
    return data, (ctypes.c_char * size).from_address(id(data) + _CONTENTS)


def _layout_holds() -> bool:
    """Whether ``_uninitialized`` writes where ``bytes`` keeps its contents (checked on a
    small object: its value read back after writing through the array)."""
    try:
        data, array = _uninitialized(16)
        with memoryview(array).cast("B") as view:
            view[:] = b"gradientmail-ok!"
    except (AttributeError, TypeError, ValueError):
        return False
    return data == b"gradientmail-ok!"


if sys.implementation.name == "cpython":
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    _new_bytes.restype = ctypes.py_object
    # PyBytesObject's ob_sval: the one byte counted in the basic size holds the terminator.
    _CONTENTS = bytes.__basicsize__ - 1
    _IN_PLACE = _layout_holds()
else:  # pragma: no cover - torch runs on CPython
    _IN_PLACE = False


class Filling:
    """``size`` bytes, writable through ``view`` until ``done`` returns them as ``bytes``
    (the same memory: no copy). Their value is unspecified until written: the caller writes
    every byte it returns. Not thread-safe by itself: threads may write disjoint parts of
    ``view`` at once, but ``done`` runs after every writer finished."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a buffer of {size} bytes")
        self._size = size
        self._io: io.BytesIO | None = None
        self._data = b""
        if _IN_PLACE and size:
            self._data, self._array = _uninitialized(size)
            self.view = memoryview(self._array).cast("B")
            return
        self._io = io.BytesIO()
        if size:
            self._io.seek(size - 1)
            self._io.write(b"\0")
        self.view = self._io.getbuffer()

    def done(self, length: int | None = None) -> bytes:
        """The bytes filled (the first ``length`` only, when given: a copy of them when that
        is short of the size); ``view`` is released. Raises ``BufferError`` while a view
        taken of ``view`` is still alive."""
        self.view.release()
        if self._io is None:
            # A view still alive (a slice of ``view``) holds the array; writing through it
            # would change the bytes handed out.
            if sys.getrefcount(self._array) > 2:
                raise BufferError("a view of the filled bytes is still alive")
            data, self._data = self._data, b""
            return data if length is None or length == self._size else data[:length]
        # Raises BufferError while a view of the bytes is still exported, where getvalue
        # would silently copy them.
        self._io.truncate(self._size if length is None else length)
        data = self._io.getvalue()
        self._io.close()
        return data
