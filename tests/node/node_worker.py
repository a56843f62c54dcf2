"""One node in its own process, for the multi-process tests.

    python node_worker.py MAILBOX_URL LEARNER SEED UNTIL_ROUND BACKEND OUT_DIR

Trains the tiny model until the node has seen ``UNTIL_ROUND``, closes with flush, and
writes ``OUT_DIR/LEARNER.json`` (its final state and drop reports) and
``OUT_DIR/LEARNER.safetensors`` (its final weights).
"""

import json
import sys
from pathlib import Path

import anyio
import safetensors.torch
from node_helpers import CONFIG, FAST, Recorder, tiny_model, train

from gradientmail.events import StepsDropped
from gradientmail.node import node as open_node


async def main(url: str, learner: str, seed: int, until: int, out: Path) -> None:
    sink = Recorder()
    model = tiny_model(seed)
    async with open_node(
        model, url, learner=learner, config=CONFIG, options=FAST, sinks=[sink]
    ) as node:
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
    }
    (out / f"{learner}.json").write_text(json.dumps(report))
    weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    safetensors.torch.save_file(weights, str(out / f"{learner}.safetensors"))


if __name__ == "__main__":
    url, learner, seed, until, backend, out = sys.argv[1:]
    anyio.run(main, url, learner, int(seed), int(until), Path(out), backend=backend)
