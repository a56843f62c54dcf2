"""moto's S3 server with each object PUT handled alone, for the tests' ``MotoServer``.

moto checks a PUT's ``If-None-Match: *`` and then writes, with no lock between, so two
racing conditional PUTs of one key can both succeed; S3 and Ceph's gateway let exactly one.
Handling object PUTs one at a time makes moto's condition as atomic as theirs.

    python moto_server.py -H 127.0.0.1 -p PORT
"""

import sys
import threading
from typing import Any

from moto.s3.responses import S3Response
from moto.server import main

_ALONE = threading.Lock()
_put_object = S3Response.put_object


def _put_object_alone(self: S3Response) -> Any:
    with _ALONE:
        return _put_object(self)


S3Response.put_object = _put_object_alone  # type: ignore[method-assign]

if __name__ == "__main__":
    main(sys.argv[1:])
