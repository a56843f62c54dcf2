"""A Hugging Face Trainer in two DDP processes on the CPU, started as torchrun starts them,
is one learner: its ranks end on the same committed weights, the follower never touches the
store."""

import json
import os
from pathlib import Path

import anyio
import pytest
import safetensors.torch
from group_helpers import TESTS, launch
from node_helpers import assert_holds_committed, records

from gradientmail.mailbox import LocalMailbox

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("hf_ddp_worker.py")


def test_a_ddp_trainer_is_one_learner(tmp_path: Path) -> None:
    from trainer_worker import STEPS, tiny_gpt2

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            (str(TESTS / "integrations"), str(TESTS / "node"), str(TESTS), str(TESTS.parent))
        ),
    }
    for code, output in launch(WORKER, str(run), "hf", str(out), env=env):
        assert code == 0, output[-6000:]
    leader, follower = (json.loads((out / f"hf.{r}.json").read_text()) for r in range(2))
    assert leader["world"] == follower["world"] == 2
    for key in ("steps", "tokens", "versions", "round"):
        assert leader[key] == follower[key], key
    assert leader["steps"] == STEPS
    assert follower["store_requests"] == 0

    async def check() -> None:
        box = LocalMailbox(run)
        history = await records(box)
        assert {p.learner for r in history for p in r.participants} == {"hf"}
        for rank in range(2):
            model = tiny_gpt2()
            weights = safetensors.torch.load_file(str(out / f"hf.{rank}.safetensors"))
            model.load_state_dict(weights, strict=False)
            await assert_holds_committed(box, model, leader["versions"])

    anyio.run(check)
