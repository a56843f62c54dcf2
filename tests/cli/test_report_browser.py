"""The report opened in a real headless Chromium (Debian's package; ``nox -s report``
installs it with ``.ci/chromium`` when it is missing): it renders, every figure decodes, and
the browser reports no console message and no error. Marked ``browser``: the plain test
run leaves it out (``-m "not browser"`` in pyproject.toml)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_helpers import WrittenRun
from test_report import EVENTS, PROGRESS, observed

from gradientmail.cli.report import content
from gradientmail.cli.report_page import page

pytestmark = pytest.mark.browser

# Injected into a copy of the page only: the page itself runs no script.
PROBE = """<script>
window.addEventListener("error", (e) => {
  document.body.dataset.errors = (document.body.dataset.errors || "") + e.message + ";";
});
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  document.body.dataset.images = images.length;
  document.body.dataset.drawn = images.filter((i) => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.height = document.documentElement.scrollHeight;
});
</script>"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("no chromium on PATH: install Debian's package with .ci/chromium")
    return found


def rendered(path: Path) -> tuple[str, str]:
    """The DOM Chromium holds once ``path`` has loaded, and what it logged."""
    result = subprocess.run(
        [
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
            "--v=0", "--virtual-time-budget=10000", "--dump-dom", path.as_uri(),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def test_the_report_renders_in_chromium_without_errors(
    written_run: WrittenRun, tmp_path: Path
) -> None:
    text = page(content(observed(written_run), PROGRESS, EVENTS))
    probed = tmp_path / "report.html"
    probed.write_text(text.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom, log = rendered(probed)
    body = re.search(r"<body([^>]*)>", dom)
    assert body is not None, dom[:500]
    attributes = dict(re.findall(r'data-([a-z]+)="([^"]*)"', body.group(1)))
    assert attributes.get("images") == "6", attributes
    assert attributes.get("drawn") == "6", attributes
    assert int(attributes["height"]) > 2000, attributes
    assert "errors" not in attributes, attributes
    assert "CONSOLE" not in log, log
    for heading in ("The shared model", "The fragment split"):
        assert f"<h2>{heading}</h2>" in dom


def test_the_probe_sees_a_broken_figure(tmp_path: Path) -> None:
    """The check can fail: an undecodable figure is not drawn, a script error is seen."""
    broken = tmp_path / "broken.html"
    broken.write_text(
        '<html><body><img src="data:image/png;base64,AAAA"><script>nope();</script>'
        + PROBE
        + "</body></html>"
    )
    dom, log = rendered(broken)
    assert 'data-drawn="0"' in dom
    assert "CONSOLE" in log
