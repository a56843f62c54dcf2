"""``gradientmail.mailbox.open``: every accepted form, and clear refusals of the rest."""

from pathlib import Path

import pytest

import gradientmail.mailbox
from gradientmail.mailbox import LocalMailbox, MemoryMailbox, S3Mailbox


def test_memory() -> None:
    assert isinstance(gradientmail.mailbox.open("memory://"), MemoryMailbox)


def test_file_urls_and_plain_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = gradientmail.mailbox.open(f"file://{tmp_path}/run%20one")
    assert isinstance(opened, LocalMailbox)
    assert opened.directory == tmp_path / "run one"
    localhost = gradientmail.mailbox.open(f"file://localhost{tmp_path}")
    assert isinstance(localhost, LocalMailbox)
    assert localhost.directory == tmp_path
    plain = gradientmail.mailbox.open(str(tmp_path / "x"))
    assert isinstance(plain, LocalMailbox)
    assert plain.directory == tmp_path / "x"
    relative = gradientmail.mailbox.open("runs/mine")
    assert isinstance(relative, LocalMailbox)
    assert relative.directory == Path("runs/mine")
    monkeypatch.setenv("HOME", str(tmp_path))
    home = gradientmail.mailbox.open("~/runs")
    assert isinstance(home, LocalMailbox)
    assert home.directory == tmp_path / "runs"


def test_s3() -> None:
    plain = gradientmail.mailbox.open("s3://bucket/runs/one")
    assert isinstance(plain, S3Mailbox)
    assert (plain.bucket, plain.prefix) == ("bucket", "runs/one/")
    assert "at aws" in repr(plain)
    full = gradientmail.mailbox.open(
        "s3://bucket/p?endpoint_url=http://127.0.0.1:9000&region=eu-west-1&checksums=when_required"
    )
    assert isinstance(full, S3Mailbox)
    assert "http://127.0.0.1:9000" in repr(full)
    whole = gradientmail.mailbox.open("s3://bucket")
    assert isinstance(whole, S3Mailbox)
    assert whole.prefix == ""


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("", "non-empty"),
        ("ftp://host/x", "unknown scheme 'ftp'"),
        ("memory://something", "memory:// takes nothing"),
        ("file://host/x", "not the host 'host'"),
        ("file://relative", "not the host 'relative'"),
        ("file:///x?y=1", "absolute path and nothing after"),
        ("s3://", "needs a bucket"),
        ("s3:///prefix", "needs a bucket"),
        ("s3://bucket/p?color=blue", "unknown parameter(s) color"),
        ("s3://bucket/p?region=a&region=b", "given twice: region"),
        ("s3://bucket/p?checksums=always", "checksums must be"),
        ("s3://bucket/p?novalue", "unreadable query"),
        ("s3://bucket/a/../b", "invalid mailbox prefix"),
    ],
)
def test_malformed_urls_show_the_accepted_forms(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match="malformed mailbox URL") as caught:
        gradientmail.mailbox.open(url)
    message = str(caught.value)
    assert problem in message
    assert "memory://" in message
    assert "file:///absolute/path" in message
    assert "s3://bucket/prefix?endpoint_url=" in message
