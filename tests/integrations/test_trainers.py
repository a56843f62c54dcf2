"""The Hugging Face and Lightning callbacks: two learners, each a real ``Trainer`` in its own
process on one ``LocalMailbox``, train a tiny GPT-2 built from a config (no download), with
gradient accumulation; rounds are committed with both, and each ends holding committed
weights. (The processes are forked from a server that imported torch and gradientmail once:
``forked``.)"""

import json
import os
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from forked import Forked
from sync_support import check_holds_committed, committed, leases

WORKER = Path(__file__).with_name("trainer_worker.py")
TESTS = Path(__file__).parents[1]
LEARNERS = ("host-0", "host-1")
# Two processes importing torch and a framework on a loaded 2-core machine.
LIMIT = 240.0


def _run_pair(framework: str, tmp_path: Path) -> None:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(str(p) for p in (TESTS / "node", TESTS, TESTS.parent)),
        "HF_HUB_OFFLINE": "1",
    }
    run = tmp_path / "run"
    workers = [
        Forked(
            WORKER,
            [framework, str(run), learner, str(seed), str(tmp_path)],
            env,
            tmp_path / f"{learner}.log",
        )
        for seed, learner in enumerate(LEARNERS)
    ]
    deadline = time.monotonic() + LIMIT
    try:
        for worker in workers:
            worker.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for learner, worker in zip(LEARNERS, workers, strict=True):
        assert worker.returncode == 0, f"{learner} failed:\n{worker.read()[-4000:]}"
    records = committed(run)
    assert len(records) >= 4
    together = [r for r in records if {p.learner for p in r.participants} == set(LEARNERS)]
    assert together, "no round averaged both learners"
    assert leases(run) == {}
    from trainer_worker import STEPS, tiny_gpt2

    for learner in LEARNERS:
        report = json.loads((tmp_path / f"{learner}.json").read_text())
        assert report["steps"] == STEPS, "one step() per optimizer step"
        assert report["tokens"] > 0
        model = _named_as(tiny_gpt2(), framework)
        weights = safetensors.torch.load_file(tmp_path / f"{learner}.safetensors")
        assert set(weights) == {name for name, _ in model.named_parameters()}
        model.load_state_dict(weights, strict=False)  # the causal masks are buffers
        check_holds_committed(run, model, report["versions"])


def _named_as(model: torch.nn.Module, framework: str) -> torch.nn.Module:
    """``model`` under the names the framework's worker saved it with."""
    if framework != "lightning":
        return model
    wrapper = torch.nn.Module()
    wrapper.model = model  # a LightningModule holding it as .model
    return wrapper


@pytest.mark.slow
def test_two_hugging_face_trainers_train_one_model(tmp_path: Path) -> None:
    _run_pair("transformers", tmp_path)


@pytest.mark.slow
def test_two_lightning_trainers_train_one_model(tmp_path: Path) -> None:
    _run_pair("lightning", tmp_path)
