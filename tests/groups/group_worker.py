"""One rank of a learner group (or a single-process learner), for the group tests.

    python group_worker.py RUN LEARNER RANK WORLD PORT HOW SCENARIO OUT PARTIES UNTIL

``HOW`` is how the training loop meets the node: ``thread-trio`` (``run_in_thread`` under
trio), ``sync-asyncio`` (``gradientmail.sync``) or ``async-asyncio`` / ``async-trio``.
``SCENARIO``: ``train`` (train until the node has seen round ``UNTIL``, close with flush),
``raise`` (rank 1 raises before its 6th step), ``hang`` (rank 1 stops stepping after 5
steps), ``kill`` (rank 1 writes ``OUT/LEARNER.stepping`` after 5 steps and waits to be
killed). A group's ranks train a DDP model (gloo, CPU) on different batches; after every
``step()`` every rank compares its parameters with rank 0's. With ``GM_FSDP=1`` a group's
model is sharded with FSDP2's ``fully_shard`` on a CPU mesh instead (the ranks hold
different rows: nothing to compare per step); ``GM_HIDDEN`` sets the model's hidden width;
``GM_FAULTS`` (the async ways only) puts a ``FaultyMailbox`` injecting every kind of fault
at that rate between each rank's node and its directory. Writes ``OUT/LEARNER.RANK.json``
(state, drops, mismatches, faults met, what was raised and when) and, unless it raised,
``OUT/LEARNER.RANK.safetensors`` (its final weights, gathered whole from a sharded model).
"""

import dataclasses
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import safetensors.torch
import torch
import torch.distributed as dist
from node_helpers import CONFIG, FAST, Recorder, Trainer, tiny_model
from torch.nn.parallel import DistributedDataParallel

import gradientmail
import gradientmail.sync
from gradientmail.events import StepsDropped
from gradientmail.mailbox import LocalMailbox, Mailbox
from gradientmail.mailbox.faults import Faults, FaultyMailbox
from gradientmail.patterns import Barrier

GROUP_TIMEOUT = float(os.environ.get("GM_GROUP_TIMEOUT", "60"))
OPTIONS = dataclasses.replace(
    FAST, group_timeout=GROUP_TIMEOUT, syncer=os.environ.get("GM_SYNCER", "1") == "1"
)
STEP_LIMIT = 2000
FSDP = os.environ.get("GM_FSDP", "0") == "1"
FAULTS = float(os.environ.get("GM_FAULTS", "0"))
HIDDEN = int(os.environ.get("GM_HIDDEN", "16"))


class Rank:
    """What one rank does around each step."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.rank, self.world = args["rank"], args["world"]
        self.model = tiny_model(args["seed"], HIDDEN)
        self.trained = self.model
        self.sharded = FSDP and self.world > 1
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            self.trained = fully_shard(self.model, mesh=init_device_mesh("cpu", (self.world,)))
        elif self.world > 1:
            self.trained = DistributedDataParallel(self.model)
        self.trainer = Trainer(self.trained, args["seed"] * 10 + self.rank)
        self.mismatches = 0
        self.steps = 0
        self.sink = Recorder()
        self.node: Any = None
        self.faults = 0

    def before_step(self) -> None:
        """Train one step; play the scenario's part for rank 1 (after the step's backward,
        whose all-reduce is DDP's, bounded by the process group's own timeout)."""
        self.trainer.step()
        scenario, out = self.args["scenario"], self.args["out"]
        if self.rank == 1 and self.steps == 5:
            if scenario == "raise":
                (out / f"{self.args['learner']}.raised-at").write_text(repr(time.time()))
                raise RuntimeError("rank 1's training failed")
            if scenario in ("hang", "kill"):
                (out / f"{self.args['learner']}.stepping").write_text(repr(time.time()))
                time.sleep(600)

    def after_step(self) -> None:
        self.steps += 1
        if self.world == 1 or self.sharded:
            return
        flat = torch.cat([p.detach().flatten() for p in self.model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat)
        self.mismatches += sum(not torch.equal(g, gathered[0]) for g in gathered)

    def done(self, round: int) -> bool:
        return round >= self.args["until"] or self.steps >= STEP_LIMIT


def report(rank: Rank, raised: BaseException | None) -> None:
    args = rank.args
    state = rank.node.state if rank.node is not None else None
    name = f"{args['learner']}.{rank.rank}"
    drops = [
        {"fragment": e.fragment, "steps": e.steps, "tokens": e.tokens}
        for e in rank.sink.events
        if isinstance(e, StepsDropped)
    ]
    body = {
        "steps": state.steps if state else rank.steps,
        "tokens": state.tokens if state else 0,
        "versions": list(state.versions) if state else [],
        "round": state.round if state else -1,
        "world": state.world if state else rank.world,
        "bytes_published": state.bytes_published if state else 0,
        "bytes_downloaded": state.bytes_downloaded if state else 0,
        "group_sent": state.group_bytes_sent if state else 0,
        "group_received": state.group_bytes_received if state else 0,
        "drops": drops,
        "mismatches": rank.mismatches,
        "faults": rank.faults,
        "local_steps": rank.steps,
        "raised": None if raised is None else type(raised).__name__,
        "message": None if raised is None else str(raised),
        "at": time.time(),
    }
    (args["out"] / f"{name}.json").write_text(json.dumps(body))
    if raised is not None:
        return
    weights = {
        n: (p.full_tensor() if rank.sharded else p).detach().contiguous()  # type: ignore[operator]
        for n, p in rank.model.named_parameters()
    }
    safetensors.torch.save_file(weights, str(args["out"] / f"{name}.safetensors"))


async def meet(rank: Rank, mailbox: LocalMailbox) -> None:
    """Every learner in before the first step: the leaders meet at a barrier in the store,
    then each group's ranks meet at theirs."""
    args = rank.args
    if rank.rank == 0:
        await Barrier(mailbox, args["learner"], poll_interval=0.02).wait(
            "start", parties=args["parties"], timeout=120.0
        )
    if rank.world > 1:
        await anyio.to_thread.run_sync(dist.barrier)


async def run_async(rank: Rank, group: Any) -> None:
    args = rank.args
    async with LocalMailbox(args["run"]) as mailbox:
        store: Mailbox = mailbox
        if FAULTS:
            store = FaultyMailbox(mailbox, Faults.uniform(FAULTS), seed=args["seed"] + rank.rank)
        await train_async(rank, group, mailbox, store)
    if isinstance(store, FaultyMailbox):
        rank.faults = store.counts.total


async def train_async(rank: Rank, group: Any, mailbox: LocalMailbox, store: Mailbox) -> None:
    """The block of ``run_async``: the node on ``store``, the learners meeting on
    ``mailbox`` (the plain one)."""
    args = rank.args
    async with (
        gradientmail.node(
            rank.trained,
            store,
            learner=args["learner"],
            config=CONFIG,
            options=OPTIONS,
            sinks=[rank.sink],
            group=group,
        ) as node,
    ):
        rank.node = node
        await meet(rank, mailbox)
        if args["how"].startswith("thread"):

            def loop(handle: gradientmail.StepHandle) -> None:
                while not rank.done(handle.node.state.round):
                    rank.before_step()
                    handle.step(tokens=16 * rank.world)
                    rank.after_step()

            await node.run_in_thread(loop)
        else:
            while not rank.done(node.state.round):
                await anyio.to_thread.run_sync(rank.before_step)
                await node.step(tokens=16 * rank.world)
                await anyio.to_thread.run_sync(rank.after_step)


def run_sync(rank: Rank, group: Any) -> None:
    args = rank.args
    with gradientmail.sync.node(
        rank.trained,
        str(args["run"]),
        learner=args["learner"],
        config=CONFIG,
        options=OPTIONS,
        sinks=[rank.sink],
        group=group,
        backend="asyncio",
    ) as node:
        rank.node = node

        async def meet_here() -> None:
            async with LocalMailbox(args["run"]) as mailbox:
                await meet(rank, mailbox)

        anyio.run(meet_here)
        while not rank.done(node.state.round):
            rank.before_step()
            node.step(tokens=16 * rank.world)
            rank.after_step()


def main() -> None:
    run, learner, rank_, world, port, how, scenario, out, parties, until = sys.argv[1:]
    args: dict[str, Any] = {
        "run": Path(run),
        "learner": learner,
        "rank": int(rank_),
        "world": int(world),
        "how": how,
        "scenario": scenario,
        "out": Path(out),
        "parties": int(parties),
        "until": int(until),
        "seed": sum(map(ord, learner)),
    }
    group = None
    if args["world"] > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group(
            "gloo", rank=args["rank"], world_size=args["world"], timeout=timedelta(seconds=90)
        )
        group = dist.new_group(backend="gloo")
    rank = Rank(args)
    raised = None
    try:
        if how.startswith("sync"):
            run_sync(rank, group)
        else:
            anyio.run(run_async, rank, group, backend=how.split("-")[1])
    except Exception as exc:
        raised = exc
    report(rank, raised)
    # A failed group's collective may still wait on a peer that will never answer, and
    # Python's exit would wait for it (torch.distributed's behaviour): leave at once.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
