"""``gradientmail keygen``, ``admit`` and ``revoke`` on a run with learner identities made by
a real node in a real directory."""

import stat
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
from cli_helpers import cli
from torch import nn

from gradientmail._node import NodeOptions
from gradientmail._node import node as open_node
from gradientmail.errors import RunMismatch
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol.identities import AdmissionKey, LearnerKey
from gradientmail.protocol.records import RunConfig

SECRET = "a run key of sixteen bytes or more"
OPTIONS = NodeOptions(poll_interval=0.02, lease_every=0.1, lease_timeout=1.0)


async def _join(directory: Path, learner: str, key: LearnerKey, admission_key: str) -> None:
    async with open_node(
        nn.Linear(4, 2),
        LocalMailbox(directory),
        learner=learner,
        config=RunConfig(fragments=1),
        options=replace(OPTIONS, learner_key=key, admission_key=admission_key),
        run_key=SECRET,
    ):
        pass


def test_keygen_admit_and_revoke(tmp_path: Path) -> None:
    path = tmp_path / "b.pem"
    made = cli("keygen", str(path))
    assert made.returncode == 0, made.stderr
    public = made.stdout.strip()
    key = LearnerKey.load(path)
    assert key.public == public
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = cli("keygen", str(path))
    assert again.returncode == 1
    assert "exists" in again.stderr
    assert LearnerKey.load(path) == key

    operator = tmp_path / "operator.pem"
    made = cli("keygen", str(operator))
    assert made.returncode == 0, made.stderr
    admission_key = made.stdout.strip()
    assert AdmissionKey.load(operator).public == admission_key

    run = tmp_path / "run"
    anyio.run(_join, run, "a", LearnerKey.generate(), admission_key)
    with pytest.raises(RunMismatch, match="not admitted"):
        anyio.run(_join, run, "b", key, admission_key)
    env = {"GRADIENTMAIL_RUN_KEY": SECRET, "GRADIENTMAIL_ADMISSION_KEY_FILE": str(operator)}
    keyless = cli("admit", str(run), "b", public, env_extra={**env, "GRADIENTMAIL_RUN_KEY": ""})
    assert keyless.returncode == 1
    assert "GRADIENTMAIL_RUN_KEY" in keyless.stderr
    bad = cli("admit", str(run), "b", "abc", env_extra=env)
    assert bad.returncode == 1
    assert "64 lowercase hex" in bad.stderr
    admitted = cli("admit", str(run), "b", public, env_extra=env)
    assert admitted.returncode == 0, admitted.stderr
    anyio.run(_join, run, "b", key, admission_key)
    revoked = cli("revoke", str(run), public, env_extra=env)
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(RunMismatch, match="revoked"):
        anyio.run(_join, run, "b", key, admission_key)
    wrong = cli("revoke", str(run), public, env_extra={**env, "GRADIENTMAIL_RUN_KEY": "x" * 20})
    assert wrong.returncode == 1
    assert "another key" in wrong.stderr


def test_admit_and_revoke_need_the_runs_admission_key(tmp_path: Path) -> None:
    run = tmp_path / "run"
    operator = AdmissionKey.generate()
    anyio.run(_join, run, "a", LearnerKey.generate(), operator.public)
    public = LearnerKey.generate().public
    run_key_only = {"GRADIENTMAIL_RUN_KEY": SECRET, "GRADIENTMAIL_ADMISSION_KEY_FILE": ""}
    for command in (("admit", str(run), "b", public), ("revoke", str(run), public)):
        missing = cli(*command, env_extra=run_key_only)
        assert missing.returncode == 1
        assert "set GRADIENTMAIL_ADMISSION_KEY_FILE to the file of the run's admission key" in (
            missing.stderr
        )
        assert "gradientmail keygen" in missing.stderr
        assert "Traceback" not in missing.stderr
    absent = tmp_path / "absent.pem"
    unreadable = cli(
        "admit",
        str(run),
        "b",
        public,
        env_extra={**run_key_only, "GRADIENTMAIL_ADMISSION_KEY_FILE": str(absent)},
    )
    assert unreadable.returncode == 1
    assert f"GRADIENTMAIL_ADMISSION_KEY_FILE: {absent}: cannot read" in unreadable.stderr
    other = tmp_path / "other.pem"
    other.write_bytes(AdmissionKey.generate().pem())
    wrong = cli(
        "admit",
        str(run),
        "b",
        public,
        env_extra={**run_key_only, "GRADIENTMAIL_ADMISSION_KEY_FILE": str(other)},
    )
    assert wrong.returncode == 1
    assert f"the run's admission key is {operator.public}" in wrong.stderr
    assert "Traceback" not in wrong.stderr
