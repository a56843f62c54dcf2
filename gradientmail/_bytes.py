"""A large ``bytes`` built in place: one allocation, filled through a writable view and
handed out without a copy.

Filling a ``bytearray`` and converting it with ``bytes(...)`` holds the object twice at the
end; joining chunks does too. ``io.BytesIO`` keeps its contents in a ``bytes`` object and
``getvalue`` returns that very object when no view of it is exported (CPython since 3.5),
so a ``BytesIO`` grown to ``size`` and written through ``getbuffer`` is the one allocation.
Used by the codec (a blob encoded chunk by chunk) and the mailboxes (an object read in
chunks or in parallel ranges). Pure; the caller's thread.
"""

import io

__all__ = ["Filling"]


class Filling:
    """``size`` zero bytes, writable through ``view`` until ``done`` returns them as
    ``bytes`` (the same memory: no copy). Not thread-safe by itself: threads may write
    disjoint parts of ``view`` at once, but ``done`` runs after every writer finished."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a buffer of {size} bytes")
        self._io = io.BytesIO()
        self._size = size
        if size:
            self._io.seek(size - 1)
            self._io.write(b"\0")
        self.view = self._io.getbuffer()

    def done(self, length: int | None = None) -> bytes:
        """The bytes filled (the first ``length`` only, when given); ``view`` is released.
        Raises ``BufferError`` while a view taken of ``view`` is still alive."""
        self.view.release()
        # Raises BufferError while a view of the bytes is still exported, where getvalue
        # would silently copy them.
        self._io.truncate(self._size if length is None else length)
        data = self._io.getvalue()
        self._io.close()
        return data
