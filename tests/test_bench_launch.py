"""The benchmarks' process launcher (``benchmarks/_launch.py``): when a learner process hosts
the syncer, its standard input closes once every other learner has written its report, not
once they have exited, so that the host's exit overlaps theirs."""

import json
import sys
import textwrap
from pathlib import Path

from bench_helpers import ROOT

WORKER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path

    spec = json.loads(Path(sys.argv[2]).read_text())
    scratch, role = Path(spec["scratch"]), sys.argv[3]
    if role == "0":
        sys.stdin.buffer.read()
        (scratch / "host-stopped").touch()
        (scratch / "result-0.json").write_text(json.dumps({"syncer": {}}))
    else:
        (scratch / f"result-{role}.json").write_text("{}")
        deadline = time.monotonic() + 60
        while not (scratch / "host-stopped").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        (scratch / f"saw-{role}").write_text(json.dumps((scratch / "host-stopped").exists()))
    """
)


def test_the_host_stops_once_the_others_reported_before_they_exit(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _launch

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    scratch = tmp_path / "run"
    spec = {"scratch": str(scratch), "learners": 3, "syncer_in": 0}
    launched = _launch.launch(script, spec, services=(), timeout=120)
    assert set(launched["reports"]) == {"0", "1", "2", "syncer"}
    for role in ("1", "2"):
        assert json.loads((scratch / f"saw-{role}").read_text()) is True
