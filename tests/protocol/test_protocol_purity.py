"""The protocol core imports no event loop, no mailbox and nothing that does I/O for it."""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import torch

import gradientmail.protocol
from gradientmail.protocol.codec import digest, encode_fragment
from gradientmail.protocol.records import FragmentSpec, ParamSpec

# torch itself imports asyncio, so the loaded-modules check cannot forbid it; the source
# check below does.
LOADED = ("anyio", "trio", "gradientmail.mailbox", "gradientmail._node", "aiobotocore", "httpx")
IMPORTED = (*LOADED, "asyncio", "threading", "time", "gradientmail.clock", "gradientmail.events")

# The package's own __init__ re-exports the node, the events and the patterns (which do use
# anyio), so the probe stands a bare package in for it: what is loaded is then exactly what
# the protocol modules import themselves.
PROBE = """
import importlib, json, pkgutil, sys, types
package = types.ModuleType("gradientmail")
package.__path__ = [sys.argv[1]]
sys.modules["gradientmail"] = package
import torch
import gradientmail.protocol as protocol
for info in pkgutil.iter_modules(protocol.__path__):
    importlib.import_module(f"gradientmail.protocol.{info.name}")
from gradientmail.protocol.codec import digest, encode_fragment
from gradientmail.protocol.records import FragmentSpec, ParamSpec
spec = FragmentSpec(index=2, params=(ParamSpec(name="w", shape=(3, 5), dtype="float32"),))
tensor = torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7
blobs = {enc: digest(encode_fragment([tensor], spec, enc, block_size=4))
         for enc in ("fp32", "bf16", "int8", "int4")}
print(json.dumps({"modules": sorted(sys.modules), "blobs": blobs}))
"""


def test_no_protocol_module_imports_an_event_loop_or_the_mailbox() -> None:
    modules = [info.name for info in pkgutil.iter_modules(gradientmail.protocol.__path__)]
    assert {"keys", "records", "codec", "fragments", "aggregation", "outer", "merge"} <= set(
        modules
    )
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(Path(gradientmail.protocol.__path__[0]).parent)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    probe = json.loads(result.stdout)
    loaded = probe["modules"]
    offending = [
        name for name in loaded for bad in LOADED if name == bad or name.startswith(bad + ".")
    ]
    assert offending == []
    # Another process, another hash seed: blob bytes do not depend on it.
    spec = FragmentSpec(index=2, params=(ParamSpec(name="w", shape=(3, 5), dtype="float32"),))
    tensor = torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7
    for encoding, sha in probe["blobs"].items():
        assert digest(encode_fragment([tensor], spec, encoding, block_size=4)) == sha


def test_no_protocol_source_imports_io_time_or_threads() -> None:
    offending = []
    for path in Path(gradientmail.protocol.__path__[0]).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offending += [
                f"{path.name}: {name}"
                for name in names
                for bad in IMPORTED
                if name == bad or name.startswith(bad + ".")
            ]
    assert offending == []
