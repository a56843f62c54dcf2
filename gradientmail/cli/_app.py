"""The ``gradientmail`` command: argument parsing, dispatch, and how failures are reported.

Exit status: 0 success; 1 the run or the store is not usable (the message says why and what
to do); 2 a usage error (argparse's own); 130 interrupted by Ctrl-C where that is not the
normal way to stop. Expected failures (``UsageError``, gradientmail's own errors, filesystem
errors, an S3 error such as a missing bucket) print one line, no traceback, unless
``--debug`` is given; anything else is a bug and shows its traceback.
"""

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from gradientmail.errors import GradientmailError, MailboxUnavailable, RunMismatch, UsageError
from gradientmail.protocol.records import RunConfig

__all__ = ["main", "parser"]

# Commands import what they need when they run, so that parsing (and ``--help``) stays fast.
Handler = Callable[[argparse.Namespace], int]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _status(args: argparse.Namespace) -> int:
    import anyio

    from gradientmail.cli.status import status

    try:
        anyio.run(
            lambda: status(
                args.url,
                last=args.last,
                as_json=args.json,
                watch=args.watch,
                interval=args.interval,
                lease_timeout=args.lease_timeout,
            )
        )
    except KeyboardInterrupt:
        if not args.watch:
            raise
    return 0


def _export(args: argparse.Namespace) -> int:
    import anyio

    from gradientmail.cli.export import export

    sources = anyio.run(export, args.url, args.out)
    for source in sources:
        origin = "Θ⁰ (no round yet)" if source.round is None else f"round {source.round}"
        print(
            f"fragment {source.fragment}: version {source.version} from {origin}, "
            f"{source.tensors} tensors, {source.parameters:,} parameters"
        )
    print(f"wrote {args.out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    import anyio

    from gradientmail.cli.report import report, summary

    doc = anyio.run(lambda: report(args.url, args.out, progress=args.progress, events=args.events))
    print(f"wrote {args.out}: {summary(doc)}")
    return 0


def _syncer(args: argparse.Namespace) -> int:
    from gradientmail.cli.syncer import syncer

    return syncer(args.url, learner=args.learner, backend=args.backend, trusted=args.trusted_loss)


def _keygen(args: argparse.Namespace) -> int:
    from gradientmail.cli.identity_commands import keygen

    print(keygen(args.path))
    return 0


def _admit(args: argparse.Namespace) -> int:
    import anyio

    from gradientmail.cli.identity_commands import admit_at

    anyio.run(admit_at, args.url, args.learner, args.public_key)
    print(f"admitted {args.public_key} for {args.learner}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    import anyio

    from gradientmail.cli.identity_commands import revoke_at

    anyio.run(revoke_at, args.url, args.public_key)
    print(f"revoked {args.public_key}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gradientmail.demo.runner import run_demo, settings_from

    return run_demo(settings_from(args))


def parser() -> argparse.ArgumentParser:
    """The command line's parser; each subcommand sets ``handler``."""
    top = argparse.ArgumentParser(
        prog="gradientmail",
        description="Train one PyTorch model on many machines that share nothing but a bucket.",
    )
    top.add_argument("--debug", action="store_true", help="show a traceback for every failure")
    commands = top.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _demo_command(commands)
    _status_command(commands)
    _syncer_command(commands)
    _export_command(commands)
    _report_command(commands)
    _identity_commands(commands)
    return top


def _demo_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    demo = commands.add_parser(
        "demo",
        help="train a small transformer with several learner processes on a local store",
        description="Start (or resume) a real run: LEARNERS learner processes train a ~1M "
        "parameter transformer on their own shards of a synthetic language of known entropy "
        "(or of a text file), synchronizing through the store; a live view shows progress, "
        "and a summary table and a plot of evaluation loss follow.",
    )
    demo.add_argument(
        "--store",
        default="gradientmail-demo",
        help="mailbox URL or directory of the run (default: ./gradientmail-demo)",
    )
    demo.add_argument(
        "--learners", type=_positive_int, default=3, help="learner processes (default 3)"
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=200, help="local steps per learner (default 200)"
    )
    demo.add_argument(
        "--batch-size", type=_positive_int, default=16, help="sequences per step (default 16)"
    )
    demo.add_argument(
        "--context", type=_positive_int, default=64, help="tokens per sequence (default 64)"
    )
    _demo_run_options(demo)
    _demo_training_options(demo)
    demo.set_defaults(handler=_demo)


def _demo_run_options(demo: argparse.ArgumentParser) -> None:
    """The run's split, schedule and encoding a demo takes, and its inner learning rate."""
    defaults = RunConfig()
    demo.add_argument(
        "--fragments",
        type=_positive_int,
        default=defaults.fragments,
        help=f"model fragments (default {defaults.fragments}, RunConfig's)",
    )
    demo.add_argument(
        "--sync-every",
        type=_positive_int,
        default=defaults.sync_every,
        help=f"local steps between syncs of a fragment (default {defaults.sync_every}, "
        "RunConfig's)",
    )
    demo.add_argument(
        "--encoding",
        choices=("fp32", "bf16", "int8", "int4", "topk"),
        default="fp32",
        help="encoding of deltas and updates (default fp32; topk: RunConfig.sparse(), 1%% "
        "of each chunk at 2 bits)",
    )
    demo.add_argument(
        "--lr", type=_positive_float, default=3e-3, help="inner AdamW learning rate (default 3e-3)"
    )


def _demo_training_options(demo: argparse.ArgumentParser) -> None:
    """What the demo trains on, with which model and loop, and how it shows progress."""
    demo.add_argument(
        "--data",
        type=Path,
        default=None,
        help="train on the bytes of this text file instead of the synthetic language",
    )
    demo.add_argument(
        "--model",
        choices=("tiny", "small", "medium"),
        default="small",
        help="model size: tiny (~30k), small (~1M, default), medium (~10M)",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seed of the language, the model and the data streams"
    )
    demo.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="event loop of the demo and its learner processes (default asyncio)",
    )
    demo.add_argument(
        "--eval-every",
        type=_positive_float,
        default=5.0,
        help="seconds between evaluations of the global model (default 5)",
    )
    demo.add_argument(
        "--no-live", action="store_true", help="print plain progress lines instead of the live view"
    )


def _status_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    status = commands.add_parser(
        "status",
        help="show a run: manifest, fragments, recent rounds, leases, totals",
        description="Read the run at URL and show its manifest, the newest version of each "
        "fragment, the newest rounds, the round in flight, the leases and totals.",
    )
    status.add_argument("url", help="mailbox URL or directory of the run")
    status.add_argument("--last", type=int, default=10, help="rounds to list (default 10)")
    status.add_argument(
        "--json", action="store_true", help="print one JSON document instead of tables"
    )
    status.add_argument(
        "--watch", action="store_true", help="refresh until Ctrl-C and judge which leases are live"
    )
    status.add_argument(
        "--interval",
        type=_positive_float,
        default=2.0,
        help="seconds between refreshes (default 2)",
    )
    status.add_argument(
        "--lease-timeout",
        type=_positive_float,
        default=10.0,
        help="a lease whose beat has not changed for this long is not live (default 10)",
    )
    status.set_defaults(handler=_status)


def _syncer_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    syncer = commands.add_parser(
        "syncer",
        help="host a syncer-only node (closes rounds) until Ctrl-C or SIGTERM",
        description="Join the run at URL as a node without a model that only closes rounds; "
        "events go to stdout as JSON lines. SIGINT or SIGTERM stops it cleanly.",
    )
    syncer.add_argument("url", help="mailbox URL or directory of the run")
    syncer.add_argument(
        "--learner", default=None, help="this node's id (default: syncer-<host>-<pid>)"
    )
    syncer.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="event loop (default asyncio)",
    )
    syncer.add_argument(
        "--trusted-loss",
        metavar="MODULE:NAME",
        default=None,
        help="screen each round's deltas with this function of the parameters' tensors by name "
        "(a loss on data no learner sees; NodeOptions.trusted_loss)",
    )
    syncer.set_defaults(handler=_syncer)


def _export_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    export = commands.add_parser(
        "export",
        help="write the run's newest committed model to a safetensors file",
        description="Assemble the newest committed version of every fragment into one "
        "safetensors file with the model's parameter names and dtypes.",
    )
    export.add_argument("url", help="mailbox URL or directory of the run")
    export.add_argument("--out", type=Path, required=True, help="the safetensors file to write")
    export.set_defaults(handler=_export)


def _report_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    report = commands.add_parser(
        "report",
        help="write one self-contained HTML page of a run's figures",
        description="Read the run at URL and write one HTML file that loads nothing else: "
        "the shared model's evaluations where the run recorded them, rounds over time, "
        "participants and weights per round, each learner's waiting and bytes, the split.",
    )
    report.add_argument("url", help="mailbox URL or directory of the run")
    report.add_argument("--out", type=Path, required=True, help="the HTML file to write")
    report.add_argument(
        "--progress",
        type=Path,
        default=None,
        help="evaluations of the shared model, JSON lines with loss and round or tokens "
        "(default: eval.jsonl in the run's directory)",
    )
    report.add_argument(
        "--events",
        type=Path,
        default=None,
        help="directory of the learners' event logs (default: events/ in the run's directory)",
    )
    report.set_defaults(handler=_report)


def _identity_commands(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    keygen = commands.add_parser(
        "keygen",
        help="write a new learner key or admission key to a file and print its public key",
        description="Write a new Ed25519 key to PATH (PEM, mode 0600) and print its public "
        "key. As a learner key: admit the public key, and the node loads the file with "
        "LearnerKey.load(PATH). As the operator's admission key: give the public key to every "
        "node as NodeOptions(admission_key=...) and the file to admit and revoke through "
        "GRADIENTMAIL_ADMISSION_KEY_FILE.",
    )
    keygen.add_argument("path", type=Path, help="the private key file to create")
    keygen.set_defaults(handler=_keygen)
    admit = commands.add_parser(
        "admit",
        help="admit a learner's public key to a run with learner identities",
        description="Let PUBLIC_KEY sign for LEARNER in the run at URL; the run key is read "
        "from GRADIENTMAIL_RUN_KEY, the admission key from the file "
        "GRADIENTMAIL_ADMISSION_KEY_FILE names.",
    )
    admit.add_argument("url", help="mailbox URL or directory of the run")
    admit.add_argument("learner", help="the learner id the key speaks for")
    admit.add_argument("public_key", help="64 hex digits, as `gradientmail keygen` prints")
    admit.set_defaults(handler=_admit)
    revoke = commands.add_parser(
        "revoke",
        help="revoke a learner's public key in a run with learner identities",
        description="From now on, snapshots signed with PUBLIC_KEY are rejected (revoked) "
        "and its lease beats ignored; the run key is read from GRADIENTMAIL_RUN_KEY, the "
        "admission key from the file GRADIENTMAIL_ADMISSION_KEY_FILE names.",
    )
    revoke.add_argument("url", help="mailbox URL or directory of the run")
    revoke.add_argument("public_key", help="64 hex digits of the key to revoke")
    revoke.set_defaults(handler=_revoke)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _expected(error: BaseException) -> bool:
    if isinstance(error, UsageError | GradientmailError | OSError):
        return True
    botocore = sys.modules.get("botocore.exceptions")
    return botocore is not None and isinstance(error, botocore.ClientError | botocore.BotoCoreError)


def _describe(error: BaseException) -> str:
    if isinstance(error, UsageError):
        return str(error)
    if isinstance(error, MailboxUnavailable):
        return f"the store is out of reach: {error}"
    if isinstance(error, RunMismatch):
        return f"this does not match the run in the store: {error}"
    return f"{type(error).__name__}: {error}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    args = parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        leaves = _leaves(error)
        if not all(_expected(leaf) for leaf in leaves):
            raise
        if args.debug:
            traceback.print_exception(error)
        for leaf in leaves:
            print(f"gradientmail: error: {_describe(leaf)}", file=sys.stderr)
        return 1
