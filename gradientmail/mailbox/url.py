"""``open(url)``: a mailbox from one string, for command lines and configuration files."""

import os
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

from gradientmail.mailbox._base import Mailbox
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.memory import MemoryMailbox

if TYPE_CHECKING:
    from gradientmail.mailbox.s3 import RequestChecksums, S3Mailbox

__all__ = ["ACCEPTED_FORMS", "open"]

ACCEPTED_FORMS = (
    "memory://",
    "file:///absolute/path",
    "a plain path (relative or absolute)",
    "s3://bucket/prefix?endpoint_url=...&region=...&checksums=when_required",
)

_S3_OPTIONS = frozenset({"endpoint_url", "region", "checksums"})


def _malformed(url: str, problem: str) -> ValueError:
    forms = "".join(f"\n  {form}" for form in ACCEPTED_FORMS)
    return ValueError(f"malformed mailbox URL {url!r}: {problem}; accepted forms:{forms}")


def open(url: str) -> Mailbox:
    """Build the mailbox that ``url`` names, without any I/O; enter it to use it.

    - ``memory://``: a fresh ``MemoryMailbox``.
    - ``file:///abs/path`` or a plain path (no ``scheme://``): a ``LocalMailbox`` there.
    - ``s3://bucket/prefix?endpoint_url=...&region=...&checksums=when_required``: an
      ``S3Mailbox``; every query parameter is optional, ``checksums`` is
      ``when_supported`` (the default) or ``when_required``.

    Raises ``ValueError`` showing the accepted forms for anything else: an unknown scheme,
    a ``file://`` URL with a host or a relative path, an ``s3://`` URL without a bucket, an
    unknown or repeated query parameter.
    """
    if not isinstance(url, str) or not url:
        raise _malformed(str(url), "expected a non-empty string")
    if "://" not in url:
        return LocalMailbox(os.path.expanduser(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        if parts.netloc or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise _malformed(url, "memory:// takes nothing after it")
        return MemoryMailbox()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise _malformed(url, f"file:// URLs name a local path, not the host {parts.netloc!r}")
        path = unquote(parts.path)
        if not path.startswith("/") or parts.query or parts.fragment:
            raise _malformed(url, "file:// needs an absolute path and nothing after it")
        return LocalMailbox(path)
    if scheme == "s3":
        return _s3(url)
    raise _malformed(url, f"unknown scheme {parts.scheme!r}")


def _s3(url: str) -> "S3Mailbox":
    from gradientmail.mailbox.s3 import S3Mailbox

    parts = urlsplit(url)
    if not parts.netloc or parts.fragment:
        raise _malformed(url, "s3:// needs a bucket and takes no '#fragment'")
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise _malformed(url, f"unreadable query ({exc})") from exc
    unknown = sorted(set(query) - _S3_OPTIONS)
    if unknown:
        raise _malformed(url, f"unknown parameter(s) {', '.join(unknown)}")
    repeated = sorted(name for name, values in query.items() if len(values) > 1)
    if repeated:
        raise _malformed(url, f"parameter(s) given twice: {', '.join(repeated)}")
    options = {name: values[0] for name, values in query.items()}
    checksums = options.get("checksums", "when_supported")
    request_checksums: RequestChecksums
    if checksums == "when_supported":
        request_checksums = "when_supported"
    elif checksums == "when_required":
        request_checksums = "when_required"
    else:
        raise _malformed(
            url, f"checksums must be when_supported or when_required, not {checksums!r}"
        )
    try:
        return S3Mailbox(
            parts.netloc,
            unquote(parts.path),
            endpoint_url=options.get("endpoint_url") or None,
            region=options.get("region") or None,
            request_checksums=request_checksums,
        )
    except ValueError as exc:
        raise _malformed(url, str(exc)) from exc
