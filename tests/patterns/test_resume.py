"""``LocalState``: a restarted learner gets back its optimizer state, step and data position;
a missing file is a first start; a foreign file is refused by name."""

from pathlib import Path

import pytest
import torch

from gradientmail.patterns import LocalState, Resumed


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def test_a_restart_gets_back_the_optimizer_step_and_position(tmp_path: Path) -> None:
    state = LocalState(tmp_path / "local" / "host-3.pt")
    assert state.load() is None
    _, optimizer = _trained(steps=3)
    state.save(step=3, optimizer=optimizer, position={"epoch": 0, "batch": 12}, extra={"lr": 0.1})
    _, fresh = _trained(steps=0)
    resumed = state.load(optimizer=fresh)
    assert resumed == Resumed(step=3, position={"epoch": 0, "batch": 12}, extra={"lr": 0.1})
    saved, loaded = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for key in saved:
        for name, value in saved[key].items():
            assert torch.equal(value, loaded[key][name]), name
    assert [p.name for p in state.path.parent.iterdir()] == ["host-3.pt"]


def test_a_file_it_did_not_write_or_a_missing_optimizer_is_refused(tmp_path: Path) -> None:
    state = LocalState(tmp_path / "host-3.pt")
    state.path.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="is not a learner's local state"):
        state.load()
    _, optimizer = _trained(steps=1)
    state.save(step=1, optimizer=optimizer)
    with pytest.raises(ValueError, match=r"pass load\(optimizer=...\)"):
        state.load()
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        state.save(step=-1)
