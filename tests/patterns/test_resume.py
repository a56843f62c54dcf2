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


class _Crash(Exception):
    pass


def _nested_loop(
    state: LocalState, trained: list[tuple[int, int]], ends: list[int], crash_at: tuple[int, int]
) -> None:
    """The recipe's epoch × batch loop (3 epochs of 4 batches), saving after every batch and
    every epoch's end, raising ``_Crash`` before training ``crash_at``."""
    resumed = state.load() or Resumed(step=0, position=None, extra={"lr": 1.0, "best": 9.0})
    lr, best, step = resumed.extra["lr"], resumed.extra["best"], resumed.step
    for epoch in range(1, 4):
        for batch in range(4):
            if resumed.trained(epoch, batch):
                continue
            if (epoch, batch) == crash_at:
                raise _Crash
            trained.append((epoch, batch))
            step += 1
            state.save(step=step, position=(epoch, batch), extra={"lr": lr, "best": best})
        if resumed.trained(epoch, 4):
            continue
        ends.append(epoch)
        lr, best = lr / 4, best - 1
        state.save(step=step, position=(epoch, 4), extra={"lr": lr, "best": best})


@pytest.mark.parametrize("crash_at", [(2, 0), (2, 3), (3, 1)])
def test_a_nested_loop_resumes_where_it_stopped(tmp_path: Path, crash_at: tuple[int, int]) -> None:
    state = LocalState(tmp_path / "host-0.pt")
    trained: list[tuple[int, int]] = []
    ends: list[int] = []
    with pytest.raises(_Crash):
        _nested_loop(state, trained, ends, crash_at)
    _nested_loop(state, trained, ends, crash_at=(0, 0))
    assert trained == [(e, b) for e in range(1, 4) for b in range(4)]
    assert ends == [1, 2, 3]
    resumed = state.load()
    assert resumed is not None
    assert (resumed.step, resumed.position) == (12, (3, 4))
    assert resumed.extra == {"lr": 1.0 / 4**3, "best": 6.0}


def test_trained_refuses_a_position_that_is_not_a_tuple_of_ints() -> None:
    assert not Resumed(step=0, position=None).trained(1, 0)
    assert Resumed(step=5, position=(1, 4)).trained(1, 4)
    assert not Resumed(step=5, position=(1, 4)).trained(2, 0)
    with pytest.raises(ValueError, match="not a tuple of 2 ints"):
        Resumed(step=5, position=12).trained(1, 0)
