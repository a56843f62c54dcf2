"""A lying insider: a learner holding the run key that claims the most tokens a round
accepts and publishes its own steps reversed and enlarged, among honest learners on a real
directory. With ``RunConfig.robust`` its weight is capped at an honest learner's share, and
in a round it shares with two or more honest learners its term in the mean is at most its
share of the round's radius about the center (``protocol.robust``; the record says so), so
the honest learners still learn and θ stays bounded among 4 learners. Among 2 the rounds
the insider has to itself are bounded only by the momentum's norm, and its weight by 1/K
only when both took as many steps: that gap is open (docs/reliability.md), and
``tests/protocol/test_protocol_bounds.py`` pins the two-learner rules without a node.
Without ``robust`` (the default) the insider weighs what it claims."""

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from reliability_helpers import CONFIG, FAST, Trainer, history, newest_theta, tiny_model

import gradientmail
from gradientmail import NodeOptions
from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol.bounds import TOKENS_RATIO
from gradientmail.protocol.records import Participant, RunConfig
from gradientmail.protocol.screening import TrustedLoss

pytestmark = pytest.mark.anyio

SECRET = "the run's secret, which the insider holds"
_CENTERED = re.compile(
    r"distance (?P<distance>\S+) from the round's center over the radius (?P<radius>\S+) "
)
_RAISED = re.compile(
    r"(?:applied alone it|the final models' mean) raises the trusted loss "
    r"from (?P<baseline>\S+) to (?P<trial>\S+)"
)
ROUNDS = 16
INSIDER = "mallory"


class Insider(Trainer):
    """Takes an honest SGD step, then moves ``gain`` times that step the other way."""

    def __init__(self, model: torch.nn.Module, seed: int, gain: float) -> None:
        super().__init__(model, seed)
        self.gain = gain

    def step(self) -> None:
        before = [p.detach().clone() for p in self.model.parameters()]
        super().step()
        with torch.no_grad():
            for param, old in zip(self.model.parameters(), before, strict=True):
                param.copy_(old - self.gain * (param - old))


def _loss(model: torch.nn.Module, trainer: Trainer) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(trainer.x), trainer.y))


async def _member(
    root: Path,
    name: str,
    seed: int,
    config: RunConfig,
    gain: float,
    losses: dict[str, tuple[float, float]],
    options: NodeOptions = FAST,
) -> None:
    model = tiny_model(seed)
    insider = name == INSIDER
    trainer = Insider(model, seed, gain) if insider else Trainer(model, seed)
    tokens = config.max_tokens_per_step if insider else 16
    async with (
        LocalMailbox(root) as box,
        gradientmail.node(
            model, box, learner=name, config=config, options=options, run_key=SECRET
        ) as node,
    ):
        first = _loss(model, trainer)
        with anyio.fail_after(120):
            while node.state.round < ROUNDS:
                trainer.step()
                await node.step(tokens=tokens)
                await anyio.sleep(0.002)
    losses[name] = (first, _loss(model, trainer))


async def _shared_rounds(
    root: Path, honest: int, gain: float, robust: bool, overlap: int | None = None
) -> tuple[list[tuple[Participant, list[int]]], dict[str, tuple[float, float]], float]:
    """Runs ``honest`` learners and the insider to ``ROUNDS``; the insider's participations
    in rounds it shared, each with the steps of the others that took part, each learner's
    first and last loss, and the newest θ's norm (``overlap``: ``RunConfig.overlap``)."""
    config = msgspec.structs.replace(CONFIG, grace=2.0, robust=robust, overlap=overlap)
    losses: dict[str, tuple[float, float]] = {}
    names = [f"honest-{k}" for k in range(honest)]
    async with anyio.create_task_group() as tg:
        for seed, name in enumerate([*names, INSIDER]):
            tg.start_soon(_member, root, name, seed, config, gain, losses)
    async with LocalMailbox(root) as box:
        records = await history(box)
        theta = await newest_theta(box)
    # A round the insider has to itself (the others closed, or not yet publishing) it
    # weighs all of; under ``robust`` its delta is then bounded by the fragment's momentum.
    mine = [
        (p, [o.steps for o in r.participants if o.learner != INSIDER])
        for r in records
        for p in r.participants
        if p.learner == INSIDER and len(r.participants) > 1
    ]
    assert mine, "the insider shared no round"
    norm = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in theta.values()]))
    return mine, losses, float(norm)


def _share(insider: Participant, others: list[int]) -> float:
    """The most weight ``capped_counts`` leaves the insider in a round beside honest
    learners of ``others`` steps (each claiming the same tokens per step, the round's lower
    median): ``TOKENS_RATIO`` × its judged steps against theirs."""
    judged = min(max(insider.steps, 1), CONFIG.sync_every)
    mine = TOKENS_RATIO * judged
    return mine / (mine + sum(others))


async def test_a_lying_insider_among_four_moves_a_round_at_most_its_share_of_the_radius(
    tmp_path: Path,
) -> None:
    """In a round the insider shares with two or more honest learners (not a final one),
    its term in the mean, weight × distance from the round's center, is at most its share
    of the round's steps times its radius (the record names both when it is outside;
    inside, its weight is at most that share: an honest learner's tokens per step, however
    many it claims), and four times its own steps reversed put
    it beyond twice the radius of at least one such round, where it weighs nothing. The
    repeatable mode puts every learner in every round."""
    honest = 3
    mine, losses, norm = await _shared_rounds(tmp_path, honest, 4.0, robust=True, overlap=2)
    crowded = [(p, _share(p, others)) for p, others in mine if len(others) >= 2 and p.steps >= 1]
    assert crowded, "the insider shared no round with two or more honest learners"
    for p, share in crowded:
        note = _CENTERED.search(str(p.bounded))
        if note is None:  # within the radius: its share at most
            assert p.weight <= share + 1e-9, (p.weight, share, p.bounded)
            continue
        distance, radius = float(note["distance"]), float(note["radius"])
        assert p.weight * distance <= radius * share * (1 + 1e-5), (p.weight, distance, radius)
    assert 0.0 in [p.weight for p, _ in crowded], [p.weight for p, _ in crowded]
    # Every shared round, two included: at most its share of the steps (half of a round of
    # two only when both took as many).
    assert all(p.weight <= _share(p, others) + 1e-9 for p, others in mine), [
        (p.weight, p.steps, others) for p, others in mine
    ]
    start = torch.linalg.vector_norm(
        torch.cat([p.detach().reshape(-1) for p in tiny_model(0).parameters()])
    )
    assert norm < 3 * float(start), f"θ grew from {float(start):.3g} to {norm:.3g}"
    for name, (first, last) in losses.items():
        if name != INSIDER:
            assert last < first, f"{name} did not learn: loss {first:.4g} -> {last:.4g}"


async def test_by_default_a_lying_insider_weighs_what_it_claims(tmp_path: Path) -> None:
    """Without ``robust`` the insider's claim of the most tokens a round accepts buys it
    nearly all of every round it shares with 3 honest learners, and nothing is bounded
    (a final round, its snapshot without steps, is the plain mean of the models it holds)."""
    mine, _, _ = await _shared_rounds(tmp_path, 3, 2.0, robust=False)
    trained = [p.weight for p, _ in mine if p.steps >= 1]
    assert trained, [(p.steps, p.weight) for p, _ in mine]
    assert min(trained) > 0.99, [(p.steps, p.weight) for p, _ in mine]
    assert all(p.bounded is msgspec.UNSET for p, _ in mine)


def _trusted_loss() -> TrustedLoss:
    """The operator's trusted loss: the tiny model's error on a fixed batch (here the honest
    learner's own data; a real run holds data out, docs/reliability.md)."""
    model = tiny_model(0)
    batch = Trainer(model, 0)

    def loss(state: Mapping[str, torch.Tensor]) -> float:
        model.load_state_dict(state)
        return _loss(model, batch)

    return loss


async def test_a_trusted_loss_screens_out_a_lying_insiders_deltas_in_a_round_of_two(
    tmp_path: Path,
) -> None:
    """Among 2, no rule that treats both alike tells which one lies. With
    ``NodeOptions.trusted_loss`` at the honest learner's node (the insider, untrusted, closes
    no rounds: ``syncer=False``), the insider's deltas, its steps reversed
    (gradient ascent on its own data) are rejected (``loss``) where they raise the trusted
    loss, each rejection naming both losses; the honest learner learns and θ stays bounded
    (``benchmarks/bench_insider.py`` measures what the screen saves on a real task)."""
    config = msgspec.structs.replace(CONFIG, grace=2.0, robust=True)
    losses: dict[str, tuple[float, float]] = {}
    trusted = replace(FAST, trusted_loss=_trusted_loss())
    untrusted = replace(FAST, syncer=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_member, tmp_path, "honest-0", 0, config, 1.0, losses, trusted)
        tg.start_soon(_member, tmp_path, INSIDER, 1, config, 1.0, losses, untrusted)
    async with LocalMailbox(tmp_path) as box:
        records = await history(box)
        theta = await newest_theta(box)
    screened = [
        (r.learner, r.steps, r.detail)
        for record in records
        for r in record.rejected
        if r.reason == "loss"
    ]
    assert any(who == INSIDER and steps >= 1 for who, steps, _ in screened), screened
    for _, _, detail in screened:
        raised = _RAISED.fullmatch(str(detail))
        assert raised is not None, detail
        assert float(raised["trial"]) > float(raised["baseline"]), detail
    first, last = losses["honest-0"]
    assert last < first, f"the honest learner did not learn: loss {first:.4g} -> {last:.4g}"
    start = torch.linalg.vector_norm(
        torch.cat([p.detach().reshape(-1) for p in tiny_model(0).parameters()])
    )
    norm = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in theta.values()]))
    assert float(norm) < 3 * float(start), f"θ grew from {float(start):.3g} to {float(norm):.3g}"
