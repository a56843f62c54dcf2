"""A synchronous training loop in its own process, for the signal tests.

    python signal_worker.py DIRECTORY BACKEND

Joins the run in DIRECTORY through ``gradientmail.sync.node(..., handle_signals=True)``,
prints ``training`` once its first round is committed, and trains until a signal ends it.
"""

import sys

from node_helpers import CONFIG, FAST, Trainer, tiny_model

import gradientmail.sync


def main(directory: str, backend: str) -> None:
    model = tiny_model()
    trainer = Trainer(model, seed=1)
    with gradientmail.sync.node(
        model,
        directory,
        learner="worker",
        config=CONFIG,
        options=FAST,
        backend=backend,  # type: ignore[arg-type]
        handle_signals=True,
    ) as node:
        announced = False
        while True:
            trainer.step()
            node.step(tokens=16)
            if not announced and node.state.rounds_committed > 0:
                print("training", flush=True)
                announced = True


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
