"""``LocalMailbox``'s key space on disk: the one-to-one mapping between keys and the names
of their files below ``objects/`` (the module docstring of ``local`` describes the layout).

Pure string functions: no filesystem access.
"""

from collections.abc import Sequence

__all__ = ["FILE_MARK", "entry_key", "key_of", "key_path", "unescape"]

_PIECE_BYTES = 240
FILE_MARK = "%"
_MORE_MARK = "%+"
_DOT_MARK = "%"
_DOT_NAMES = (_DOT_MARK + ".", _DOT_MARK + "..")


def _escape(text: str) -> str:
    return text.replace("%", "%25")


def unescape(text: str) -> str:
    """A name's text with its ``%`` escapes undone."""
    return text.replace("%25", "%")


def _pieces(segment: str) -> list[str]:
    """``segment`` escaped and cut, at character boundaries, into names of bounded length."""
    if len(segment) <= _PIECE_BYTES and segment.isascii() and "%" not in segment:
        # Every key the run writes: nothing to escape, one byte a character, one piece.
        return [segment]
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for char in segment:
        escaped = _escape(char)
        width = len(escaped.encode("utf-8"))
        if size + width > _PIECE_BYTES:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(escaped)
        size += width
    pieces.append("".join(current))
    return pieces


def _directory_name(piece: str) -> str:
    """The directory name of a segment's last piece: the piece itself, unless it is ``.``
    or ``..`` (a long segment's tail can be), which would name this directory or its
    parent; those get the dot mark: ``%.`` and ``%..`` are no escaped piece, in which a
    ``%`` is always followed by ``25``."""
    return _DOT_MARK + piece if piece in (".", "..") else piece


def key_path(key: str) -> tuple[str, ...]:
    """The names, relative to ``objects/``, of the file that holds ``key`` (already checked).

    One-to-one: distinct keys get distinct names, none of them empty, ``.`` or ``..``, so
    every path stays below ``objects/``.
    """
    names: list[str] = []
    segments = key.split("/")
    for index, segment in enumerate(segments):
        pieces = _pieces(segment)
        names.extend(piece + _MORE_MARK for piece in pieces[:-1])
        last = index == len(segments) - 1
        names.append(pieces[-1] + FILE_MARK if last else _directory_name(pieces[-1]))
    return tuple(names)


def entry_key(key_so_far: str, name: str, *, is_file: bool) -> str | None:
    """The key text that a directory entry ``name`` adds; None for an entry that is not ours.

    A directory's text ends in ``/`` unless it is a piece of a longer segment; a file's text
    completes a key.
    """
    if is_file:
        if not name.endswith(FILE_MARK):
            return None
        return key_so_far + unescape(name[: -len(FILE_MARK)])
    if name.endswith(_MORE_MARK):
        return key_so_far + unescape(name[: -len(_MORE_MARK)])
    if name.endswith(FILE_MARK):
        return None
    if name in _DOT_NAMES:
        return key_so_far + name[len(_DOT_MARK) :] + "/"
    return key_so_far + unescape(name) + "/"


def key_of(names: Sequence[str]) -> str:
    """The key that ``key_path`` mapped to ``names``: its inverse."""
    key = ""
    for name in names[:-1]:
        partial = entry_key(key, name, is_file=False)
        if partial is None:
            raise ValueError(f"{'/'.join(names)!r} is not an object path")
        key = partial
    partial = entry_key(key, names[-1], is_file=True)
    if partial is None:
        raise ValueError(f"{'/'.join(names)!r} is not an object path")
    return partial
