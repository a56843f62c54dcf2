"""A plain script's top-level loop with ``gradientmail.sync.open`` and no ``close()``, in its
own process, for the exit tests.

    python open_worker.py DIRECTORY BACKEND ENDING

Prints every event of its node as ``event Kind flushing`` lines and ``training`` once its
first round is committed. ENDING: ``finish`` ends the script after three committed rounds,
``raise`` raises ``ValueError`` then, ``signal`` trains until a signal ends it.
"""

import sys

from node_helpers import CONFIG, FAST, Trainer, tiny_model

import gradientmail.sync
from gradientmail.events import Closing, Event


def show(event: Event) -> None:
    flushing = event.flushing if isinstance(event, Closing) else ""
    _line(f"event {type(event).__name__} {flushing}")


def _line(text: str) -> None:
    """One write per line: the sink's thread and the loop print at once, and ``print``
    writes a line's text and its end apart, which could interleave two lines."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


directory, backend, ending = sys.argv[1:]
model = tiny_model()
trainer = Trainer(model, seed=1)
node = gradientmail.sync.open(
    model,
    directory,
    learner="worker",
    config=CONFIG,
    options=FAST,
    sinks=[show],
    backend=backend,  # type: ignore[arg-type]
    handle_signals=ending == "signal",
)
announced = False
while True:
    # One reading per pass: "training" is printed before any ending, however fast rounds come.
    committed = node.state.rounds_committed
    if not announced and committed > 0:
        _line("training")
        announced = True
    if ending != "signal" and committed >= 3:
        break
    trainer.step()
    node.step(tokens=16)
if ending == "raise":
    raise ValueError("the loop failed")
