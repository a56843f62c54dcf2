"""The integrations' edges: a missing framework names its extra; a Trainer that runs several
processes, or cannot count tokens for a token-weighted run, is refused with a clear error."""

import importlib
import re
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from node_helpers import CONFIG, FAST, tiny_model
from sync_support import leases


@pytest.mark.parametrize(
    ("module", "framework", "extra"),
    [
        ("gradientmail.integrations.transformers", "transformers", "transformers"),
        ("gradientmail.integrations.lightning", "lightning.pytorch", "lightning"),
    ],
)
def test_a_missing_framework_names_the_extra(
    module: str, framework: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, framework, None)
    with pytest.raises(ImportError, match=rf"pip install 'gradientmail\[{extra}\]'"):
        importlib.import_module(module)


def test_the_trainers_refuse_ddp_before_joining(tmp_path: Path) -> None:
    from gradientmail.integrations import lightning, transformers

    hf = transformers.GradientmailCallback(str(tmp_path), learner="a", options=FAST)
    with pytest.raises(RuntimeError, match=r"runs 2 processes but torch.distributed is not"):
        hf.on_train_begin(SimpleNamespace(world_size=2), None, None, model=tiny_model())
    pl = lightning.GradientmailCallback(str(tmp_path), learner="a", options=FAST)
    with pytest.raises(RuntimeError, match="runs 4 processes"):
        pl.on_train_start(SimpleNamespace(world_size=4, global_step=0), tiny_model())
    assert not (tmp_path / "objects").exists(), "a refused trainer touched the store"


def test_a_token_weighted_run_needs_a_token_count(tmp_path: Path) -> None:
    from gradientmail.integrations.transformers import GradientmailCallback

    callback = GradientmailCallback(str(tmp_path), learner="a", config=CONFIG, options=FAST)
    args = SimpleNamespace(world_size=1, include_num_input_tokens_seen="no")
    model = tiny_model()
    with pytest.raises(ValueError, match="include_num_input_tokens_seen=True"):
        callback.on_train_begin(args, SimpleNamespace(num_input_tokens_seen=0), None, model=model)
    assert callback.node is not None
    assert leases(tmp_path) == {}
    with pytest.raises(ValueError, match="tokens_per_step must be a non-negative int"):
        GradientmailCallback(str(tmp_path), learner="a", tokens_per_step=-1)


def test_the_readme_lists_every_extra_of_the_project() -> None:
    root = Path(__file__).parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    listed = re.findall(r"^\| `([a-z]+)` \|", (root / "README.md").read_text(), re.MULTILINE)
    assert sorted(listed) == sorted(project["optional-dependencies"])
    # The README says S3 is in the base install.
    assert any(d.startswith("aiobotocore") for d in project["dependencies"])
