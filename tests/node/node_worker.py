"""One node in its own process, for the multi-process tests.

    python node_worker.py MAILBOX_URL LEARNER SEED UNTIL_ROUND BACKEND OUT_DIR PARTIES

Joins the run, waits at the barrier ``start`` until ``PARTIES`` nodes have joined (so that a
process that starts late still trains from the first round), trains the tiny model until the
node has seen ``UNTIL_ROUND``, closes with flush, and writes ``OUT_DIR/LEARNER.json`` (its
final state, drop reports and how long it waited at the barrier) and
``OUT_DIR/LEARNER.safetensors`` (its final weights).
"""

import json
import sys
import time
from pathlib import Path

import anyio
import safetensors.torch
from node_helpers import CONFIG, FAST, Recorder, tiny_model, train

from gradientmail._node import node as open_node
from gradientmail.events import StepsDropped
from gradientmail.mailbox import open as open_mailbox
from gradientmail.patterns import Barrier

# Generous: a loaded machine may take tens of seconds to start a process and import torch.
BARRIER_TIMEOUT = 120.0


async def main(url: str, learner: str, seed: int, until: int, parties: int, out: Path) -> None:
    sink = Recorder()
    model = tiny_model(seed)
    async with (
        open_mailbox(url) as mailbox,
        open_node(
            model, mailbox, learner=learner, config=CONFIG, options=FAST, sinks=[sink]
        ) as node,
    ):
        # After joining, before the first step: no round can close before every node is in.
        started = time.monotonic()
        met = await Barrier(mailbox, learner, poll_interval=0.02).wait(
            "start", parties=parties, timeout=BARRIER_TIMEOUT
        )
        waited = time.monotonic() - started
        await train(node, model, seed=seed, until_round=until, limit=120)
    state = node.state
    drops = [
        {"fragment": e.fragment, "steps": e.steps, "tokens": e.tokens}
        for e in sink.events
        if isinstance(e, StepsDropped)
    ]
    report = {
        "steps": state.steps,
        "tokens": state.tokens,
        "versions": list(state.versions),
        "drops": drops,
        "committed": state.rounds_committed,
        "met": sorted(met),
        "waited": waited,
    }
    (out / f"{learner}.json").write_text(json.dumps(report))
    weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    safetensors.torch.save_file(weights, str(out / f"{learner}.safetensors"))


if __name__ == "__main__":
    url, learner, seed, until, backend, out, parties = sys.argv[1:]
    anyio.run(main, url, learner, int(seed), int(until), int(parties), Path(out), backend=backend)
