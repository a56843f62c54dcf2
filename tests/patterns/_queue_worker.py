"""One consumer process for the multi-process shared_queue tests (run with sys.executable).

It meets the others at barrier ``start``, consumes ``units`` units of two items each from a
LocalMailbox directory, writing ``{unit} {k}`` per item to ``--out`` (flushed at once, so
the lines survive a SIGKILL), then meets the others at barrier ``done`` and writes
``{out}.done`` (JSON: what it claimed, who it met at ``done``).

With ``--hang-at K`` the K-th unit it loads yields its first item and then blocks forever
in the loader, as a node that dies mid-unit; the unit's id goes to ``{out}.hang`` first.
"""

import argparse
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio

from gradientmail.mailbox import LocalMailbox
from gradientmail.patterns import Barrier, shared_queue


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("store", type=Path)
    parser.add_argument("learner")
    parser.add_argument("--units", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--start-parties", type=int, required=True)
    parser.add_argument("--done-parties", type=int, default=0)
    parser.add_argument("--hang-at", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    return parser.parse_args()


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


async def main(args: argparse.Namespace) -> None:
    units = {f"u{i:03d}": f"u{i:03d}" for i in range(args.units)}
    loads = 0

    def load(unit: str) -> Iterator[str]:
        nonlocal loads
        loads += 1
        if loads == args.hang_at:
            write_atomically(args.out.with_name(args.out.name + ".hang"), unit)
            yield f"{unit} 0"
            threading.Event().wait()
        for k in range(2):
            time.sleep(args.delay)
            yield f"{unit} {k}"

    async with LocalMailbox(args.store) as mailbox:
        barrier = Barrier(mailbox, args.learner, poll_interval=0.02)
        await barrier.wait("start", parties=args.start_parties, timeout=60)
        with args.out.open("a") as out:
            async with shared_queue(
                units, mailbox=mailbox, learner=args.learner, load=load, prefetch=4
            ) as queue:
                async for line in queue:
                    out.write(line + "\n")
                    out.flush()
        met: list[str] = []
        if args.done_parties:
            met = sorted(await barrier.wait("done", parties=args.done_parties, timeout=60))
    write_atomically(
        args.out.with_name(args.out.name + ".done"),
        json.dumps({"claimed": list(queue.claimed), "met": met}),
    )


if __name__ == "__main__":
    arguments = parse()
    anyio.run(main, arguments, backend=arguments.backend)
