"""S3-compatible object storage as a mailbox: AWS S3, Cloudflare R2, MinIO, Hugging Face
Storage Buckets, moto.

Natively async over aiobotocore with its httpx backend, on asyncio and trio alike. A request
body goes out in 1 MiB pieces (the session of ``_s3_client``), each one socket write under a
write timeout of ``read_timeout``, through an iterator a cancelled request can drop safely. The
store must give strong read-after-write and list-after-write, an atomic ``If-None-Match: *``
on PUT and ``ListObjectsV2`` in UTF-8 byte order (``list`` cuts at ``after`` itself). An
object over ``multipart_threshold`` bytes is written by a multipart upload (a HEAD first, the
completion conditional, aborted by whatever ends it early: ``_s3_parts``) and read by
parallel ranged GETs, each conditional on the first response's ETag.

``put_if_absent`` returns False on a 412 ``PreconditionFailed``. Connection failures,
timeouts, throttling, other 5xx answers and a checksum mismatch become ``MailboxUnavailable``
once botocore's retries are spent (a 429 at once), a 409 ``ConditionalRequestConflict``
after three tries. A missing bucket, denied access, rejected credentials, a bucket in
another region and a 501 raise ``S3AccessError``, a ``ClientError`` with the same
``response`` naming the bucket and endpoint, never retried. Every other ``ClientError``
propagates unchanged; a payload above 5 TiB raises ``ValueError`` before anything is sent; a
bulk delete's first per-key failure is mapped the same way. Details and measurements:
docs/mailbox.md, "S3Mailbox".
"""

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self

import anyio
from botocore.exceptions import ClientError, HTTPClientError

from gradientmail.errors import MailboxUnavailable, StoreAccessError
from gradientmail.mailbox._base import (
    MAX_KEY_BYTES,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
)
from gradientmail.mailbox._s3_client import RequestChecksums as RequestChecksums
from gradientmail.mailbox._s3_client import client_config, session
from gradientmail.mailbox._s3_errors import (
    ADVICE,
    TRANSIENT,
    TRANSIENT_CODES,
    error_code,
    shown_endpoint,
)
from gradientmail.mailbox._s3_listing import list_s3_keys
from gradientmail.mailbox._s3_parts import MIN_PART_BYTES
from gradientmail.mailbox._s3_reads import get_object, get_range
from gradientmail.mailbox._s3_writes import put_in_parts, put_once

__all__ = ["MAX_OBJECT_BYTES", "S3AccessError", "S3Mailbox"]

MAX_OBJECT_BYTES = 5 * 2**40
"""The largest object S3 stores (5 TiB, by a multipart upload)."""
_MAX_PUT_BYTES = 5 * 2**30
"""The largest single PUT S3 accepts."""

_PART_SIZE = 16 * 2**20
_MULTIPART_THRESHOLD = 32 * 2**20
_PART_CONCURRENCY = 8
_DELETE_CHUNK = 1000


class S3AccessError(ClientError, StoreAccessError):  # type: ignore[misc]  # botocore is untyped
    """The store refused an operation for a reason only the user can fix: the bucket does
    not exist, access to it is denied, the credentials are rejected, it lives in another
    region, or the store does not implement a request the mailbox needs (the codes in
    ``ADVICE`` of ``_s3_errors``).

    A ``StoreAccessError`` (the node fails at once; nothing retries it) and a
    ``ClientError`` carrying the store's ``response`` and ``operation_name`` unchanged,
    so that callers catching ``ClientError`` or reading ``response["Error"]["Code"]`` keep
    working; the message names the bucket, the endpoint and the store's error code, and
    says what to do. It never contains a credential: the store's own message is left out
    (its ``response`` may echo the access key id), and the endpoint is shown without any
    user or password. ``S3Mailbox`` raises it with the botocore error chained.
    """

    def __init__(
        self, error_response: Any, operation_name: str, bucket: str, endpoint: str | None
    ) -> None:
        super().__init__(error_response, operation_name)
        self.bucket = bucket
        self.endpoint = endpoint
        code = error_response.get("Error", {}).get("Code", "Unknown")
        advice = ADVICE.get(code, "was refused").format(bucket=bucket)
        self.args = (
            f"bucket {bucket!r} at {shown_endpoint(endpoint) if endpoint else 'AWS'} {advice} "
            f"({code} from {operation_name})",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.response, self.operation_name, self.bucket, self.endpoint)


def _normalized_prefix(prefix: str) -> str:
    stripped = prefix.strip("/")
    if not stripped:
        return ""
    check_prefix(stripped)
    return stripped + "/"


class S3Mailbox:
    """Keys live under ``prefix`` in ``bucket``; credentials come from the standard AWS
    chain (environment, shared files, instance roles) and are never logged.

    Parameters
    ----------
    bucket
        An existing bucket; operations on a missing one raise ``S3AccessError``.
    prefix
        Scopes the mailbox inside the bucket (``"runs/a"`` and ``"runs/a/"`` are the same);
        empty for the whole bucket.
    endpoint_url
        None for AWS; the service URL for R2, MinIO, moto or any other S3-compatible store.
    region
        Signing region; None lets botocore resolve it from the environment.
    max_concurrency
        Requests in flight at once (an anyio ``CapacityLimiter``), also the connection pool size.
    part_size, multipart_threshold, part_concurrency
        An object over ``multipart_threshold`` bytes (at most 5 GiB) travels in parts of
        ``part_size`` bytes (5 MiB to 5 GiB; larger where 10,000 parts would not hold it),
        ``part_concurrency`` of them in flight at once (within ``max_concurrency``): see
        "Large objects" above. The defaults are measured (``benchmarks/bench_transfer.py``).
    request_checksums
        ``"when_supported"`` sends a CRC32 of every uploaded object for the store to verify
        (botocore's default flexible checksum: a SHA-256 cost a quarter of a 64 MiB put's
        time, and blobs are checked end to end against their sha256 address by every
        reader anyway) and validates response checksums; ``"when_required"`` sends only the
        checksums S3 mandates, for stores that reject flexible checksums (Hugging Face
        Storage Buckets).
    connect_timeout, read_timeout
        Seconds per connection attempt, and per socket read or write (a request body goes
        out 1 MiB per write: a link slower than 1 MiB per ``read_timeout`` per request
        fails); each attempt of botocore's standard retries gets them anew.

    Under trio, aiobotocore cannot query EC2 instance or container metadata, so credentials
    must come from the environment or the shared files; entering raises ``RuntimeError``
    saying so when the chain reaches a metadata lookup.

    The client, its connection pool and the limiter exist between ``__aenter__`` and
    ``__aexit__``, in the event loop that entered; operations outside that raise
    ``RuntimeError``. Leaving closes every connection (shielded from cancellation) and leaves
    no task behind. Each operation is a cancellation point; a cancelled ``put_if_absent``
    may or may not have created its object.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_concurrency: int = 8,
        part_size: int = _PART_SIZE,
        multipart_threshold: int = _MULTIPART_THRESHOLD,
        part_concurrency: int = _PART_CONCURRENCY,
        request_checksums: RequestChecksums = "when_supported",
        connect_timeout: float = 3.0,
        read_timeout: float = 20.0,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}: give the bare name, no '/'")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, not {max_concurrency}")
        if not MIN_PART_BYTES <= part_size <= _MAX_PUT_BYTES:
            raise ValueError(
                f"part_size must be from {MIN_PART_BYTES} (5 MiB, S3's smallest part) to "
                f"{_MAX_PUT_BYTES} bytes, not {part_size}"
            )
        if not part_size <= multipart_threshold <= _MAX_PUT_BYTES:
            raise ValueError(
                f"multipart_threshold must be from part_size ({part_size}) to {_MAX_PUT_BYTES} "
                f"bytes (5 GiB, S3's largest single PUT), not {multipart_threshold}"
            )
        if part_concurrency < 1:
            raise ValueError(f"part_concurrency must be at least 1, not {part_concurrency}")
        self._part_size = part_size
        self._multipart_threshold = multipart_threshold
        self._part_concurrency = part_concurrency
        if request_checksums not in ("when_supported", "when_required"):
            raise ValueError(
                f"request_checksums must be 'when_supported' or 'when_required', "
                f"not {request_checksums!r}"
            )
        self._bucket = bucket
        self._prefix = _normalized_prefix(prefix)
        self._endpoint_url = endpoint_url
        self._region = region
        self._max_concurrency = max_concurrency
        self._checksums: RequestChecksums = request_checksums
        self._config = client_config(
            max_concurrency=max_concurrency,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            checksums=request_checksums,
        )
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def prefix(self) -> str:
        """The normalized prefix: empty, or ending in ``/``."""
        return self._prefix

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError(f"{self!r} is already open; a mailbox is entered once at a time")
        stack = AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                session().create_client(
                    "s3",
                    endpoint_url=self._endpoint_url,
                    region_name=self._region,
                    config=self._config,
                )
            )
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            if isinstance(exc, HTTPClientError):
                # Creating the client does no I/O but the credential chain's metadata
                # lookups, which aiobotocore can only make on asyncio.
                raise RuntimeError(
                    f"{self!r} could not resolve AWS credentials ({exc}); give them through "
                    "the environment or the shared credentials file (instance and container "
                    "metadata credentials are not available under trio)"
                ) from exc
            raise
        self._stack = stack
        self._limiter = anyio.CapacityLimiter(self._max_concurrency)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        self._client = None
        self._limiter = None
        if stack is not None:
            with anyio.CancelScope(shield=True):
                await stack.aclose()

    def __repr__(self) -> str:
        where = shown_endpoint(self._endpoint_url) if self._endpoint_url else "aws"
        state = "open" if self._stack is not None else "closed"
        return f"S3Mailbox(s3://{self._bucket}/{self._prefix} at {where}, {state})"

    def _open(self) -> tuple[Any, anyio.CapacityLimiter]:
        if self._client is None or self._limiter is None:
            raise RuntimeError(f"{self!r} is not open: use it inside 'async with'")
        return self._client, self._limiter

    def _mapped(self, exc: ClientError, what: str) -> Exception:
        """What ``exc`` becomes at the mailbox's boundary: an ``S3AccessError`` when its code
        is one the user must fix, ``MailboxUnavailable`` when it is transient (throttling, a
        5xx other than 501) and so outlasted botocore's retries, else ``exc`` itself."""
        if isinstance(exc, S3AccessError):
            return exc
        code = error_code(exc)
        if code in ADVICE:
            endpoint = self._client.meta.endpoint_url if self._client is not None else None
            return S3AccessError(
                exc.response, exc.operation_name, self._bucket, endpoint or self._endpoint_url
            )
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in TRANSIENT_CODES or status == 429 or (isinstance(status, int) and status >= 500):
            return MailboxUnavailable(
                f"{what}: the store answered {code} ({status or 'in a 200 response'}) "
                f"to {exc.operation_name}"
            )
        unchanged: Exception = exc
        return unchanged

    @contextlib.contextmanager
    def _boundary(self, what: str) -> Iterator[None]:
        """Translate what escapes the block: transient failures to ``MailboxUnavailable``,
        the user's to ``S3AccessError`` (both chaining the original), the rest unchanged."""
        try:
            yield
        except ClientError as exc:
            mapped = self._mapped(exc, what)
            if mapped is exc:
                raise
            raise mapped from exc
        except TRANSIENT as exc:
            raise MailboxUnavailable(f"{what}: {exc}") from exc

    def _full_key(self, key: str) -> str:
        check_key(key)
        full = self._prefix + key
        if len(full.encode("utf-8")) > MAX_KEY_BYTES:
            raise ValueError(
                f"invalid mailbox key {key!r}: with the mailbox prefix {self._prefix!r} it "
                f"exceeds S3's {MAX_KEY_BYTES}-byte key limit; use a shorter prefix or key"
            )
        return full

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        full = self._full_key(key)
        if len(data) > MAX_OBJECT_BYTES:
            raise ValueError(
                f"{key!r}: {len(data)} bytes exceeds S3's 5 TiB object limit; use more fragments"
            )
        client, limiter = self._open()
        body = data if isinstance(data, bytes) else bytes(data)
        with self._boundary(f"put {key!r}"):
            if len(body) <= self._multipart_threshold:
                return await put_once(
                    client, limiter, bucket=self._bucket, key=key, full=full, body=body
                )
            return await put_in_parts(
                client,
                limiter,
                bucket=self._bucket,
                key=key,
                full=full,
                body=body,
                part_size=self._part_size,
                concurrency=self._part_concurrency,
                checksums=self._checksums,
            )

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        full = self._full_key(key)
        check_max_bytes(max_bytes)
        client, limiter = self._open()
        with self._boundary(f"get {key!r}"):
            return await get_object(
                client,
                limiter,
                bucket=self._bucket,
                key=key,
                full=full,
                max_bytes=max_bytes,
                threshold=self._multipart_threshold,
                part_size=self._part_size,
                concurrency=self._part_concurrency,
            )

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        full = self._full_key(key)
        check_range(start, end)
        client, limiter = self._open()
        with self._boundary(f"get {key!r} [{start}, {end})"):
            return await get_range(
                client, limiter, bucket=self._bucket, key=key, full=full, start=start, end=end
            )

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        check_prefix(prefix)
        client, limiter = self._open()
        with self._boundary(f"list {prefix!r}"):
            return await list_s3_keys(
                client, limiter, bucket=self._bucket, root=self._prefix, prefix=prefix, after=after
            )

    async def delete(self, keys: Iterable[str]) -> None:
        full_keys = [self._full_key(key) for key in keys]
        if not full_keys:
            return
        client, limiter = self._open()
        for start in range(0, len(full_keys), _DELETE_CHUNK):
            chunk = full_keys[start : start + _DELETE_CHUNK]
            with self._boundary(f"delete {len(chunk)} keys"):
                async with limiter:
                    response = await client.delete_objects(
                        Bucket=self._bucket,
                        Delete={"Objects": [{"Key": key} for key in chunk], "Quiet": True},
                    )
                # Per-key failures arrive in a 200 response, not as an exception.
                if errors := response.get("Errors"):
                    raise ClientError({"Error": errors[0]}, "DeleteObjects")
