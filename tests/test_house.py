"""The code, the tests and the docs say what is: no commit hashes, no issue or stop numbers,
no "was X, now Y" in them. History lives in CHANGELOG.md and the commit messages.

``CHECKED`` lists the paths these rules hold for; a page or folder not in it is not
checked. The patterns are pinned against text they must and must not match, so that
hex digests, key names (``ed25519``) and ordinary English pass."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECKED = (
    "gradientmail",
    "tests",
    "docs/architecture.md",
    "docs/benchmarks.md",
    "docs/cli.md",
    "docs/events.md",
    "docs/examples",
    "docs/integrations.md",
    "docs/mailbox.md",
    "docs/node.md",
    "docs/patterns.md",
    "docs/protocol.md",
    "docs/reliability.md",
    "README.md",
    "noxfile.py",
)

TEXT = frozenset({".py", ".md", ".toml", ".txt", ".html", ".js", ".css", ".json", ".yaml"})

HISTORY = {
    "a commit hash": re.compile(
        r"(?<![\w:/.\-])(?!ed25519\b)(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])"
        r"(?:[0-9a-f]{7,12}|[0-9a-f]{40})(?![\w:/\-])"
    ),
    "an issue or stop number": re.compile(
        r"\bissues?\s+#?\d+\b|\bstops?\s+#?\d+\b(?!\s+[a-z])", re.IGNORECASE
    ),
    "'was X, now Y'": re.compile(r"\bwas\b[^.;:!?]{0,160}?,\s+now\b", re.IGNORECASE),
    "'used to X. Now Y'": re.compile(
        r"\bused to\b[^.;!?]{0,160}\.\s+Now (?:the|they|it|we|a|an|each|every|this)\b"
    ),
    "a fix or commit as a point in time": re.compile(
        r"\b(?:before|after|since|until|with|without)\s+(?:the|this|that)\s+"
        r"(?:fix|commit|patch)\b(?!\s+point)|\bon\s+(?:today's\s+)?main\b",
        re.IGNORECASE,
    ),
}

FIRES = (
    "see (9165efc) for the numbers",
    "measured at `74a3c3ad3aeb`",
    "On 9165efc one learner went 0.70 -> 1.02",
    "commit 6a0b157dcaa08da69e6e4437e94ed8534a403848 measured it",
    "Learners publish together (issue 17): a round",
    "Issue 14 #7: run A's record",
    "as agreed at stop 36",
    "the decoder was strict,\n    now it is lenient",
    "Status and export used to trust raw bytes. Now they verify",
    "0.75 before the fix, 0.70 after",
    "On today's main it stays so for good",
)

PASSES = (
    'signature = "ed25519:" + "00" * 64',
    "an Ed25519 key (`ed25519`), an X25519 one",
    "from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey",
    'sha256="cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc"',
    'RUN = "0123456789abcdef0123456789abcdef"',
    "key_id `3f2a9c0b1d4e5f60`, 16 hex digits",
    "a digest (`sha256` of the blob), AdamW 3e-3, 1e10 steps, 0x7f800000, deadbeef",
    "stop the run for good; stop 3 learners' leases? no: stop them all",
    "the issue is the store: 17 rounds",
    "it was read whole, and the node now skips it",
    "the first claim was taken; now the syncer waits",
    "used to create the run when there is none. Now and then a round",
    "fixed at creation, with the fix point of the map; on the main thread",
    "a reader after the commit point sees the record",
)


def _files() -> list[Path]:
    found: list[Path] = []
    for name in CHECKED:
        path = ROOT / name
        assert path.exists(), f"{name} is in CHECKED but does not exist: remove it there"
        found += [path] if path.is_file() else sorted(path.rglob("*"))
    this = Path(__file__).resolve()
    return [
        p
        for p in found
        if p.is_file() and p.suffix in TEXT and "__pycache__" not in p.parts and p != this
    ]


def _history(text: str) -> list[tuple[int, str, str]]:
    """(line, rule, matched text) for every history pattern that matches ``text``."""
    return [
        (text.count("\n", 0, match.start()) + 1, rule, " ".join(match.group(0).split()))
        for rule, pattern in HISTORY.items()
        for match in pattern.finditer(text)
    ]


@pytest.mark.parametrize("text", FIRES)
def test_a_history_pattern_matches_history(text: str) -> None:
    assert _history(text), text


@pytest.mark.parametrize("text", PASSES)
def test_no_history_pattern_matches_ordinary_text(text: str) -> None:
    assert _history(text) == [], text


def test_the_checked_code_tests_and_docs_hold_no_history() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {rule}: {matched!r}"
        for path in _files()
        for line, rule, matched in _history(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "history belongs in CHANGELOG.md and commit messages; say what holds instead:\n"
        + "\n".join(found)
    )
