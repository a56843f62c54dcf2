"""How ``S3Mailbox`` classifies what fails: the transfers that failed on the way
(``TRANSIENT``) and the error codes of a store in trouble (``TRANSIENT_CODES``), which
become ``MailboxUnavailable``, and the codes only the user can fix (``ADVICE``, what
``S3AccessError`` says to do about each).
"""

import urllib.parse

from botocore.exceptions import (
    ChecksumError,
    ClientError,
    ConnectionError,
    HTTPClientError,
    IncompleteReadError,
)

__all__ = ["ADVICE", "TRANSIENT", "TRANSIENT_CODES", "error_code", "shown_endpoint"]

# A transfer that failed on the way (refused, timed out, dropped, cut short, or whose bytes
# arrived damaged): the store may be fine and a retry may succeed.
TRANSIENT = (ConnectionError, HTTPClientError, IncompleteReadError, ChecksumError)
TRANSIENT_CODES = frozenset(
    {
        # Throttling: AWS's SlowDown (503), R2's TooManyRequests (429), and the other
        # spellings botocore's standard retries treat as throttling.
        "SlowDown",
        "TooManyRequests",
        "TooManyRequestsException",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        # The store's own trouble.
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        # A conflicting operation on the same bucket or key is in progress.
        "OperationAborted",
    }
)


def error_code(exc: ClientError) -> str | None:
    """The store's error code in ``exc``; None when it gave none."""
    code = exc.response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


_MISSING = "does not exist: create it (e.g. `aws s3 mb s3://{bucket}`) or fix the bucket's name"
_DENIED = (
    "refused access: give credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
    "AWS_PROFILE) allowed to list, get, put and delete objects in this bucket and prefix"
)
_CREDENTIALS = (
    "rejected the credentials: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
    "AWS_PROFILE), and AWS_SESSION_TOKEN for temporary ones, for this endpoint"
)
_UNSUPPORTED = (
    "does not implement a request gradientmail needs (a conditional PUT, say): use a store "
    "that does (docs/mailbox.md lists those known to qualify)"
)
_REGION = "is in another region: give its region in the URL (?region=...) or AWS_DEFAULT_REGION"
ADVICE = {
    "NoSuchBucket": _MISSING,
    "AccessDenied": _DENIED,
    "AllAccessDisabled": _DENIED,
    "AccountProblem": _DENIED,
    "InvalidAccessKeyId": _CREDENTIALS,
    "SignatureDoesNotMatch": _CREDENTIALS,
    "InvalidToken": _CREDENTIALS,
    "ExpiredToken": _CREDENTIALS,
    "TokenRefreshRequired": _CREDENTIALS,
    "AuthorizationHeaderMalformed": _REGION,
    "PermanentRedirect": _REGION,
    "IllegalLocationConstraintException": _REGION,
    "NotImplemented": _UNSUPPORTED,
}
"""The error codes ``S3AccessError`` explains: the bucket, the access or the region is wrong,
or the store lacks a feature the mailbox needs."""


def shown_endpoint(endpoint: str) -> str:
    """``endpoint`` without any user or password a URL might carry."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.username is None and parts.password is None:
        return endpoint
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
