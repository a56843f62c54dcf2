"""Sinks for the event bus: JSON lines, a console, and several sinks as one.

Both log sinks build their own structlog ``BoundLogger`` with their own processors and write
through their own ``structlog.WriteLogger``: nothing here reads or changes the application's
global structlog or logging configuration.

Levels (``level``): failures ``error``; takeovers, give-ups, cancelled publishes, rejected
snapshots, dropped steps and dropped events ``warning``; ``RoundRecorded`` ``debug``; the
rest ``info``.
"""

import logging
import os
import sys
import traceback
from collections.abc import Awaitable, Sequence
from typing import Any, Literal, TextIO, TypeAlias, assert_never

import msgspec
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from gradientmail.events._routes import Sink, sink_name
from gradientmail.events.kinds import (
    AwaitingCreator,
    Closed,
    Closing,
    CreatingRun,
    Event,
    EventsDropped,
    FollowingRound,
    FragmentAligned,
    GaveUp,
    Joined,
    LeaseReleased,
    PollFailed,
    PublishCancelled,
    PublishFailed,
    Recovered,
    RecoveryFailed,
    ReleaseFailed,
    RoundClaimed,
    RoundClosed,
    RoundCommitted,
    RoundFailed,
    RoundIncomplete,
    RoundRecorded,
    RoundSuperseded,
    SnapshotPublished,
    SnapshotRejected,
    StepsDropped,
    SyncerStopped,
    TookOverCreation,
    TookOverRound,
    Waiting,
    kind_name,
)

__all__ = ["Combined", "Level", "LogSink", "combined", "console", "fields", "json_logs", "level"]

log = logging.getLogger("gradientmail.events")

Level: TypeAlias = Literal["debug", "info", "warning", "error"]
"""A log level as structlog names it (``add_log_level``)."""

_RANK: dict[Level, int] = {"debug": 0, "info": 1, "warning": 2, "error": 3}


def level(event: Event) -> Level:
    """The level ``event`` is logged at. Exhaustive over ``Event``: a new kind that is not
    added here fails type checking."""
    match event:
        case (
            PublishFailed()
            | PollFailed()
            | ReleaseFailed()
            | RecoveryFailed()
            | RoundFailed()
            | SyncerStopped()
        ):
            return "error"
        case (
            TookOverCreation()
            | TookOverRound()
            | GaveUp()
            | PublishCancelled()
            | SnapshotRejected()
            | StepsDropped()
            | EventsDropped()
            | RoundIncomplete()
            | Waiting()
        ):
            return "warning"
        case RoundRecorded():
            return "debug"
        case (
            CreatingRun()
            | AwaitingCreator()
            | Joined()
            | FragmentAligned()
            | SnapshotPublished()
            | Closing()
            | Closed()
            | LeaseReleased()
            | Recovered()
            | RoundClaimed()
            | FollowingRound()
            | RoundClosed()
            | RoundCommitted()
            | RoundSuperseded()
        ):
            return "info"
        case _:
            assert_never(event)


_LEVEL_OF: dict[type, Level] = {}
"""``level`` by kind, filled on first use: a level depends on the kind alone, and a dict
lookup is a tenth of the cost of the ``match``."""


def _type_name(kind: type) -> str:
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _exception(error: BaseException) -> dict[str, str]:
    return {
        "type": _type_name(type(error)),
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


def _builtin(value: Any) -> Any:
    if isinstance(value, BaseException):
        return _exception(value)
    raise NotImplementedError(f"an event field of type {type(value).__name__} has no JSON form")


def fields(event: Event) -> dict[str, Any]:
    """Every field of ``event`` as JSON-ready builtins, ``learner`` first: records become
    objects (``msgspec.to_builtins``), tuples lists, and an exception an object with its
    ``type`` (qualified name), ``message`` and ``traceback`` (the text Python prints,
    chained causes included)."""
    result: dict[str, Any] = msgspec.to_builtins(event, enc_hook=_builtin)
    return result


def _leading_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    # Readers scan the first keys of a line; put the stable ones there.
    return {
        "timestamp": event_dict.pop("timestamp"),
        "level": event_dict.pop("level"),
        "event": event_dict.pop("event"),
        **event_dict,
    }


def _dumps(obj: Any, **_: Any) -> str:
    return msgspec.json.encode(obj).decode()


class LogSink:
    """A sync sink writing each event through a structlog logger of its own, one line per
    event at its ``level``; events below ``min_level`` are skipped. Called by the bus on the
    event-loop thread; each line is written and flushed under the stream's lock, so several
    sinks may share a stream. ``close()`` closes the file if this sink opened it, otherwise
    only flushes the stream."""

    def __init__(
        self,
        name: str,
        stream: TextIO,
        processors: Sequence[Processor],
        *,
        min_level: Level,
        owned: bool,
        exc_info: bool,
    ) -> None:
        if min_level not in _RANK:
            raise ValueError(f"min_level must be one of {', '.join(_RANK)}, got {min_level!r}")
        self.name = name
        self._stream = stream
        self._owned = owned
        self._exc_info = exc_info
        self._min = _RANK[min_level]
        self._logger = structlog.BoundLogger(
            structlog.WriteLogger(stream), processors=list(processors), context={}
        )

    def __repr__(self) -> str:
        return f"<LogSink {self.name} to {self._stream!r}>"

    def __call__(self, event: Event) -> None:
        lvl = _LEVEL_OF.get(type(event))
        if lvl is None:
            lvl = _LEVEL_OF[type(event)] = level(event)
        if _RANK[lvl] < self._min:
            return
        values = fields(event)
        if self._exc_info:
            error = getattr(event, "error", None)
            if isinstance(error, BaseException):
                values["error"] = f"{_type_name(type(error))}: {error}"
                values["exc_info"] = error
        getattr(self._logger, lvl)(kind_name(event), **values)

    def close(self) -> None:
        if self._owned:
            self._stream.close()
        else:
            self._stream.flush()


def _open(stream: TextIO | str | os.PathLike[str] | None) -> tuple[TextIO, bool]:
    if stream is None:
        return sys.stderr, False
    if isinstance(stream, str | os.PathLike):
        try:
            return open(stream, "a", encoding="utf-8"), True
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot open the event log {os.fspath(stream)!r} for appending: {exc.strerror}; "
                "pass a writable file path or an open text stream",
            ) from exc
    return stream, False


def json_logs(
    stream: TextIO | str | os.PathLike[str] | None = None, *, min_level: Level = "debug"
) -> LogSink:
    """A sink writing one JSON object per event and line to ``stream``: an open text stream
    (default ``sys.stderr``, looked up now), or a path opened for appending (``OSError``
    naming it if it cannot be).

    Each line holds ``timestamp`` (ISO-8601, UTC), ``level``, ``event`` (the kind in
    snake_case), ``learner`` and every other field of the event (see ``fields``): it parses
    back with any JSON reader.
    """
    file, owned = _open(stream)
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        _leading_keys,
        structlog.processors.JSONRenderer(serializer=_dumps),
    ]
    return LogSink("json_logs", file, processors, min_level=min_level, owned=owned, exc_info=False)


def console(
    stream: TextIO | str | os.PathLike[str] | None = None,
    *,
    min_level: Level = "info",
    colors: bool | None = None,
) -> LogSink:
    """A sink writing one human-readable line per event through structlog's
    ``ConsoleRenderer`` to ``stream`` (default ``sys.stderr``; a path is opened for
    appending), at the same levels as ``json_logs``; errors are followed by their traceback.
    ``colors`` defaults to whether the stream is a terminal. ``RoundRecorded`` (debug) is
    skipped unless ``min_level="debug"``.
    """
    file, owned = _open(stream)
    if colors is None:
        isatty = getattr(file, "isatty", None)
        colors = bool(isatty()) if callable(isatty) else False
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        structlog.dev.ConsoleRenderer(
            colors=colors, exception_formatter=structlog.dev.plain_traceback, sort_keys=False
        ),
    ]
    return LogSink("console", file, processors, min_level=min_level, owned=owned, exc_info=True)


class Combined:
    """An async sink handing every event to each of its sinks, in order, awaiting the async
    ones. A sink that raises is logged on ``gradientmail.events`` with its traceback and the
    rest still receive the event; ``aclose()`` closes each of them the same way."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        for sink in sinks:
            if not callable(sink):
                raise TypeError(f"combined() takes callables taking one event, got {sink!r}")
        self._sinks = tuple(sinks)
        self.name = "combined(" + ", ".join(sink_name(sink) for sink in self._sinks) + ")"

    def __repr__(self) -> str:
        return f"<Combined {self.name}>"

    async def __call__(self, event: Event) -> None:
        for sink in self._sinks:
            try:
                result = sink(event)
                if isinstance(result, Awaitable):
                    await result
            except Exception:
                log.exception(
                    "%s: event sink %s failed on %s; it keeps receiving later events",
                    event.learner,
                    sink_name(sink),
                    kind_name(event),
                )

    async def aclose(self) -> None:
        for sink in self._sinks:
            try:
                aclose = getattr(sink, "aclose", None)
                close = getattr(sink, "close", None)
                if callable(aclose):
                    await aclose()
                elif callable(close):
                    close()
            except Exception:
                log.exception("event sink %s failed to close", sink_name(sink))


def combined(*sinks: Sink) -> Combined:
    """One sink made of ``sinks``: each receives every event in the order given. See
    ``Combined``."""
    return Combined(sinks)
