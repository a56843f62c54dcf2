"""The typed layer over a mailbox: the only place that turns a run's bytes into records.

``Store`` wraps one ``Mailbox`` for one node, composing the store's parts: the requests it
makes (``_requests``), the run's small objects signed and checked (``_objects``), blobs
(``_blobs``), the manifest and creation (``_creation``), leases (``_leases``), snapshots
(``_snapshots``), round claims (``_claims``) and round records with their chain
(``_records``, ``gradientmail._history``). Every operation retries ``MailboxUnavailable``
with backoff on the node's clock (``mailbox.retrying``, up to ``max_retry_delay`` between
tries, forever unless the call says otherwise) and lets every other error propagate at once;
decodes what it reads strictly (``RecordError``) and verifies every blob against its sha256
(``CorruptBlob``); and counts its requests and bytes for ``Store.stats``.

Everything read is hostile until checked: a manifest or record that does not decode, verify
or describe its key is skipped for the key's next successor (``keys.record_slot``,
``keys.manifest_slot``), remembered, and listed in ``Store.ignored`` (docs/protocol.md, "The
run in the store"). A create-once write whose reply was lost counts as ours when its retry
finds our bytes at the key (claims and records name their writer).

Runs in the node's tasks on the event loop; hashing of large payloads goes to a worker
thread (``anyio.to_thread``). Cancellation interrupts the request in progress; a cancelled
create-once write may or may not have landed (the caller's next read tells).
"""

from collections.abc import Mapping

from gradientmail._history import History
from gradientmail.clock import Clock
from gradientmail.mailbox import Mailbox
from gradientmail.protocol.identities import LearnerKey, Signing
from gradientmail.protocol.signing import RunKey
from gradientmail.store._blobs import Blobs, sha256
from gradientmail.store._claims import RoundClaims
from gradientmail.store._creation import Creation
from gradientmail.store._leases import Leases
from gradientmail.store._objects import RunObjects
from gradientmail.store._records import Records
from gradientmail.store._requests import Requests, StoreStats
from gradientmail.store._snapshots import Snapshots

__all__ = ["Store", "StoreStats", "sha256"]


class Store:
    """Typed, counted, retried access to one run's objects in ``mailbox``.

    ``attempts`` bounds the tries of each operation (None: retry transient failures until
    the operation succeeds or is cancelled). With ``run_key`` (a signed run) every object it
    writes is signed and every object it reads is checked: a manifest or record that does
    not verify raises ``SignatureError``, a claim that does not verify names nobody, and a
    snapshot comes with its problem for the round to reject. The store does not own the
    mailbox: whoever opened it closes it.

    ``unverified`` (read-only use, without ``run_key``): read a signed run without checking
    anything, for a reader that says so (``RunReader``); otherwise a signed run's manifest
    read without its key raises ``RunMismatch``. ``learner_key``: this node's own key in a
    run with learner identities (``protocol.identities``).

    Each operation is the method of the same name of one of its parts (bound in
    ``__init__``), whose docstring states its contract.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        clock: Clock | None = None,
        max_retry_delay: float = 30.0,
        attempts: int | None = None,
        run_key: RunKey | None = None,
        unverified: bool = False,
        learner_key: LearnerKey | None = None,
    ) -> None:
        requests = Requests(
            mailbox, clock=clock, max_retry_delay=max_retry_delay, attempts=attempts
        )
        objects = RunObjects(
            requests, run_key=run_key, learner_key=learner_key, unverified=unverified
        )
        history = History(checked=not objects.unverified)
        blobs, creation = Blobs(requests), Creation(objects, history)
        leases, snapshots, claims = Leases(objects), Snapshots(objects), RoundClaims(objects)
        records = Records(objects, history, claims)
        self.mailbox = mailbox
        self._requests, self._objects = requests, objects
        self.get = requests.get
        self.get_range = requests.get_range
        self.list_keys = requests.list_keys
        self.delete = requests.delete
        self.create = requests.create
        self.refresh_identities = objects.refresh_identities
        self.put_blob = blobs.put_blob
        self.get_blob = blobs.get_blob
        self.blob_ranges = blobs.blob_ranges
        self.delta_blobs = blobs.delta_blobs
        self.manifest = creation.manifest
        self.create_manifest = creation.create_manifest
        self.create_claims = creation.create_claims
        self.claim_creation = creation.claim_creation
        self.put_init_marker = creation.put_init_marker
        self.init_markers = creation.init_markers
        self.beat = leases.beat
        self.own_beats = leases.own_beats
        self.leases = leases.leases
        self.lease_beats = leases.lease_beats
        self.put_snapshot = snapshots.put_snapshot
        self.snapshots = snapshots.snapshots
        self.snapshot_learners = snapshots.snapshot_learners
        self.learners_by_round = snapshots.learners_by_round
        self.round_claims = claims.round_claims
        self.claim_round = claims.claim_round
        self.record = records.record
        self.put_record = records.put_record
        self.record_rounds = records.record_rounds

    @property
    def run_key(self) -> RunKey | None:
        return self._objects.run_key

    @property
    def signing(self) -> Signing:
        """How this store signs and checks (``RunObjects.signing``)."""
        return self._objects.signing

    @property
    def ignored(self) -> Mapping[str, str]:
        """The newest keys skipped as junk (malformed, unverified or misfiled objects at
        create-once keys), each with why."""
        return self._objects.ignored

    @property
    def stats(self) -> StoreStats:
        return self._requests.stats

    def __repr__(self) -> str:
        stats = self.stats
        return (
            f"Store({self.mailbox!r}, up={stats.bytes_up}, down={stats.bytes_down}, "
            f"requests={dict(stats.requests)})"
        )
