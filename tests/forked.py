"""Worker processes forked from a server that imported torch and gradientmail once
(``multiprocessing``'s forkserver, one per pytest process): a fresh interpreter per worker
would import them again, for seconds of CPU each, before the worker's own work began.

A worker is still its own process (its own pid, signals, exit status, sockets); it runs its
script as ``__main__`` with its own ``sys.argv`` and environment, as ``python SCRIPT ARGS``
would, but what the script imports at its top that the server preloaded is not imported
again, and the interpreter's exit handlers (``atexit``) do not run when it ends.
"""

import multiprocessing
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch

PRELOADED = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "safetensors.torch",
    "trio",
    "anyio",
    "gradientmail",
    "gradientmail.sync",
    "gradientmail.mailbox.faults",
]
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(PRELOADED)


def _run_script(script: str, arguments: list[str], env: dict[str, str], output: str) -> None:
    """In a process forked from the server: what ``python script arguments`` does with
    ``env`` as its environment, its standard output and error to the file ``output``."""
    os.environ.clear()
    os.environ.update(env)
    # What OMP_NUM_THREADS=1 does at a fresh import of torch.
    torch.set_num_threads(1)
    with open(output, "wb") as out, open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [str(Path(script).parent), *paths]
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


class Forked:
    """A process running ``script`` with ``arguments`` and ``env`` (forked from the server),
    its standard output and error written to the file ``output``; waited on as a ``Popen``."""

    def __init__(self, script: Path, arguments: list[str], env: dict[str, str], output: Path):
        self.output = output
        self.process = FORKS.Process(
            target=_run_script, args=(str(script), arguments, env, str(output))
        )
        self.process.start()

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status once the process ended; ``subprocess.TimeoutExpired`` when it
        had not within ``timeout`` seconds."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.process.name), timeout or 0.0)
        return self.process.exitcode

    def read(self) -> str:
        """What it wrote to its standard output and error so far."""
        return self.output.read_text(errors="replace")

    def send_signal(self, signum: int) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        self.process.kill()
