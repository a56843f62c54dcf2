"""``LocalMailbox``'s ``list``: the keys below ``objects/`` that match a prefix and sort
after a key, from directory entries alone (never a file's contents).

It starts in the directory of the prefix's whole segments, prunes subtrees that cannot
match or lie wholly at or before ``after``, never follows a symbolic link to a directory,
skips entries the layout never makes, and returns keys in UTF-8 byte order. Blocking: it
runs in a worker thread.
"""

import os
from pathlib import Path

from gradientmail.mailbox._local_layout import FILE_MARK, entry_key, key_path, unescape
from gradientmail.mailbox._local_reads import open_subdirectory

__all__ = ["list_local_keys"]


def _may_hold(partial: str, prefix: str, after: str) -> bool:
    """Whether a directory whose keys all start with ``partial`` can hold a key to list."""
    if not (partial.startswith(prefix) or prefix.startswith(partial)):
        return False
    # Every key under ``partial`` sorts before ``after`` when they differ within ``partial``.
    return not (partial < after and not after.startswith(partial))


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _joined(names: list[str]) -> str:
    """``names``, each followed by a NUL (which no name holds), as one string."""
    return "\0".join(names) + "\0"


def _by_name(names: list[str]) -> tuple[list[str], list[str]]:
    """``names`` split into files and directories by the layout's marks alone."""
    if _joined(names).count(FILE_MARK + "\0") == len(names):
        return names, []
    files = [name for name in names if name.endswith(FILE_MARK)]
    directories = [name for name in names if not name.endswith(FILE_MARK)]
    return files, directories


def _typed_files(directory: int) -> list[str]:
    """The names in ``directory`` that end in the file mark and are not directories, by
    each entry's type (``d_type``, no ``stat`` where the filesystem provides it)."""
    files: list[str] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.endswith(FILE_MARK):
                continue
            try:
                if not entry.is_dir(follow_symlinks=False):
                    files.append(entry.name)
            except FileNotFoundError:
                continue
    return files


def _file_keys(files: list[str], key_so_far: str, prefix: str, after: str) -> list[str]:
    """The keys of the objects named ``files`` (each ending in the mark) in the directory
    whose keys start with ``key_so_far``, less those that do not match ``prefix`` and
    ``after``; unsorted."""
    if not files:
        return []
    joined = _joined(files)
    if joined.count(FILE_MARK) == len(files):
        # No name holds an escape: one replace and one split build every key.
        keys = (key_so_far + joined.replace(FILE_MARK + "\0", "\0" + key_so_far)).split("\0")
        # What follows the last NUL: ``key_so_far`` alone.
        keys.pop()
    else:
        keys = [key_so_far + unescape(name[: -len(FILE_MARK)]) for name in files]
    if key_so_far.startswith(prefix) and key_so_far > after:
        # Every key here extends ``key_so_far``, so every key matches.
        return keys
    return [key for key in keys if key.startswith(prefix) and key > after]


def _walk(directory: int, key_so_far: str, prefix: str, after: str, keys: list[str]) -> None:
    """Append to ``keys`` those under the open ``directory`` that match ``prefix`` and
    ``after``, where every key starts with ``key_so_far``.

    The names come from ``os.listdir``, which skips the per-entry objects of
    ``os.scandir``, and the layout's marks tell files from directories. A directory is
    entered only if it opens as one (never through a symbolic link). A file-named entry
    could still be a directory that is not ours: where the filesystem counts
    subdirectories in the link count (2 plus one per subdirectory: ext4, xfs, tmpfs, zfs)
    and every subdirectory was entered, the count proves there is none (unless a
    subdirectory appeared between the count and the listing, alongside a stranger's);
    otherwise (a subdirectory pruned, a stranger's, or btrfs, which reports 1) each
    file-named entry's type is read.
    """
    links = os.fstat(directory).st_nlink
    files, directories = _by_name(os.listdir(directory))
    entered = 0
    for name in directories:
        partial = entry_key(key_so_far, name, is_file=False)
        if partial is None or not _may_hold(partial, prefix, after):
            continue
        child = open_subdirectory(directory, name)
        if child is None:
            continue
        entered += 1
        try:
            _walk(child, partial, prefix, after, keys)
        finally:
            os.close(child)
    if files and entered != links - 2:
        files = _typed_files(directory)
    keys.extend(_file_keys(files, key_so_far, prefix, after))


def list_local_keys(objects: Path, prefix: str, after: str) -> list[str]:
    """The keys below ``objects`` that start with ``prefix`` and sort after ``after``, in
    UTF-8 byte order; empty when ``objects`` does not exist."""
    # Every key that starts with the prefix's whole segments lies below their
    # directory: start there rather than reading each directory above it.
    parent, slash, _ = prefix.rpartition("/")
    key_so_far = parent + slash
    if not _may_hold(key_so_far, prefix, after):
        return []
    try:
        fd = os.open(objects, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return []
    for name in key_path(key_so_far + "k")[:-1]:
        try:
            child = open_subdirectory(fd, name)
        finally:
            os.close(fd)
        if child is None:
            return []
        fd = child
    keys: list[str] = []
    try:
        _walk(fd, key_so_far, prefix, after, keys)
    finally:
        os.close(fd)
    if not "".join(keys).isascii():
        # A name that is not UTF-8 (decoded with surrogate escapes) is never ours.
        keys = [key for key in keys if _is_utf8(key)]
    # For strings without surrogates, code point order is UTF-8 byte order.
    keys.sort()
    return keys
