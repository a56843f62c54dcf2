"""One node's timings and roles: everything about a node that is not the run's to decide."""

import math
from dataclasses import dataclass

from gradientmail.protocol.identities import AdmissionKey, LearnerKey, check_public_key
from gradientmail.protocol.screening import TrustedLoss

__all__ = ["NodeOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeOptions:
    """How one node paces itself. Every duration is in seconds on the node's clock.

    Most nodes set none: the defaults serve a node on S3 or a shared directory. A learner
    that never closes rounds sets ``syncer=False``; a run with learner identities sets
    ``learner_key`` and ``admission_key``; tests and single-machine runs shorten
    ``poll_interval`` and the lease's timings.

    poll_interval
        How often the receive loop lists new round records and the syncer re-reads the
        round it is closing or following. A snapshot of the node's own learner landing in
        the store ends the pause at once (``runtime.Nudge``).
    due_poll_interval
        How often instead while a round the node waits on is due: a learner from publishing
        a snapshot until it has seen that round's record, a syncer closing a round that has
        a snapshot but is not ready, or whose first snapshot the pace of its recent rounds
        says is near (``protocol.cadence``). Every poll slept past the moment the last snapshot or
        the record landed is lag that every learner trains through before the round
        reaches its weights (``docs/protocol.md``, "Closing a round"). At most ``2 ×
        grace`` after the snapshot that made the round due; never slower than
        ``poll_interval`` (``pause``).
    wait_poll_interval
        How often instead while the learner's ``step()`` waits for a round's version
        (``RunConfig.overlap``; every step that snapshots in the synchronous mode), and a
        syncer closing a due round of a synchronous run: those learners do not train until
        they see the record, so every poll slept past the moment the last snapshot or the
        record landed is idle time. Where recent rounds' snapshots spread over several due
        pauses (``protocol.cadence.Cadence.loose``), the syncer polls so only while one
        snapshot can complete the round. Never slower than the due pace.
    lease_every, lease_timeout
        The node beats its lease every ``lease_every``; others count it gone when its beat
        has not changed for ``lease_timeout`` (which must exceed ``lease_every``).
    claim_timeout
        A follower takes over a claimed round when no record lands this long after the
        round's first snapshot (or after it began following, whichever is later).
    creation_timeout
        A node waiting for another to create the run takes over creation when no Θ⁰
        fragment lands for this long.
    close_timeout
        Closing with flush gives up once nothing has landed for this long.
    syncer
        Whether this node takes part in closing rounds.
    max_retry_delay
        The longest backoff between retries of a transient store failure.
    group_timeout
        In a learner group (``group=``), the longest a rank waits in ``step()`` for the
        others; past it every waiting rank raises ``GroupFailed``.
    learner_key
        This node's own key (``LearnerKey``) in a run with learner identities: it signs the
        node's snapshots and lease beats, and a node with one creates such a run (with a
        run key and ``admission_key`` only). None: the run has none.
    admission_key
        With ``learner_key``: the operator's admission public key (64 hex digits,
        ``AdmissionKey.public``), the only key whose admissions and revocations count. A
        node creating the run names it in the manifest; a node joining refuses a run that
        names another. Never the private key: nodes do not hold it.
    trusted_loss
        A syncer's evaluation on data no learner sees (``protocol.screening``): called in a
        worker thread with every parameter's tensors by name (load them with
        ``load_state_dict(state, strict=False)``: no buffers, tied parameters once), it
        returns a loss. Each round
        this node closes, a delta that, applied alone, raises it above the committed θ's is
        rejected (``loss``); it costs one call per round and one per delta. Make it
        deterministic (one fixed batch), and give it to every node that closes rounds:
        learners the operator does not trust run with ``syncer=False``. What it raises
        fails the node. None: rounds are not screened.

    Raises ``ValueError`` naming the option when a value is out of range.
    """

    poll_interval: float = 1.0
    due_poll_interval: float = 0.05
    wait_poll_interval: float = 0.005
    lease_every: float = 2.0
    lease_timeout: float = 10.0
    claim_timeout: float = 30.0
    creation_timeout: float = 30.0
    close_timeout: float = 60.0
    syncer: bool = True
    max_retry_delay: float = 30.0
    group_timeout: float = 60.0
    learner_key: LearnerKey | None = None
    admission_key: str | None = None
    trusted_loss: TrustedLoss | None = None

    def pause(self, *, due: bool, waiting: bool = False) -> float:
        """The pause before the next poll: while a round is due ``due_poll_interval``, and
        ``wait_poll_interval`` while a step waits on it (each at most the slower paces),
        else ``poll_interval``."""
        if not due:
            return self.poll_interval
        paced = min(self.due_poll_interval, self.poll_interval)
        return min(self.wait_poll_interval, paced) if waiting else paced

    def _check_trusted_loss(self) -> None:
        if self.trusted_loss is not None and not callable(self.trusted_loss):
            raise TypeError(
                "NodeOptions.trusted_loss must be a function from the parameters' tensors by "
                f"name to a loss, got {self.trusted_loss!r}"
            )

    def _check_keys(self) -> None:
        if self.learner_key is not None and not isinstance(self.learner_key, LearnerKey):
            raise TypeError(
                f"NodeOptions.learner_key must be a LearnerKey, got {self.learner_key!r}"
            )
        if isinstance(self.admission_key, AdmissionKey):
            raise TypeError(
                "NodeOptions.admission_key is the admission key's public key "
                "(AdmissionKey.public): a node never holds the private key"
            )
        if (self.learner_key is None) != (self.admission_key is None):
            raise ValueError(
                "NodeOptions.learner_key and NodeOptions.admission_key go together: a run with "
                "learner identities needs the operator's admission public key (`gradientmail "
                "keygen` makes the pair), a run without them has none"
            )
        if self.admission_key is not None:
            try:
                check_public_key(self.admission_key)
            except ValueError as exc:
                raise ValueError(f"NodeOptions.admission_key: {exc}") from None

    def __post_init__(self) -> None:
        for name in (
            "poll_interval",
            "due_poll_interval",
            "wait_poll_interval",
            "lease_every",
            "lease_timeout",
            "claim_timeout",
            "creation_timeout",
            "close_timeout",
            "max_retry_delay",
            "group_timeout",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"NodeOptions.{name} must be a number of seconds, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"NodeOptions.{name} must be a positive, finite number of seconds, "
                    f"got {value!r}"
                )
        if self.lease_timeout <= self.lease_every:
            raise ValueError(
                f"NodeOptions.lease_timeout ({self.lease_timeout}) must exceed lease_every "
                f"({self.lease_every}), or a live node would be judged gone between beats"
            )
        self._check_keys()
        self._check_trusted_loss()
        if not isinstance(self.syncer, bool):
            raise TypeError(f"NodeOptions.syncer must be a bool, got {self.syncer!r}")
