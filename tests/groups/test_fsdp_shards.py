"""A sharded learner's rows (``_node.model_parameters.shards``) on a real ``fully_shard``
model of two gloo ranks on the CPU: every rank finds the rows ``fully_shard`` gave it
(``torch.chunk``'s cut: 17 + 16 rows of a 33-row weight, 1 + 0 of a 1-row bias), writable in
place; a node without ``sharded`` refuses the model, naming the parameter."""

import json
from pathlib import Path

from group_helpers import launch

WORKER = Path(__file__).with_name("shard_worker.py")


def test_each_rank_finds_the_rows_fully_shard_gave_it(tmp_path: Path) -> None:
    for code, output in launch(WORKER, str(tmp_path)):
        assert code == 0, output[-3000:]
    found = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in found] == [0, 1]
    for result in found:
        assert "sharded DTensor (FSDP2)" in result["refused"]
        for _, _, _, _, same, moved in result["rows"]:
            assert same
            assert moved
    cuts = {r["rank"]: {row[0]: (row[2], row[3]) for row in r["rows"]} for r in found}
    assert cuts[0] == {"0.weight": (0, 17), "0.bias": (0, 17), "2.weight": (0, 1), "2.bias": (0, 1)}
    assert cuts[1] == {
        "0.weight": (17, 33),
        "0.bias": (17, 33),
        "2.weight": (1, 1),
        "2.bias": (1, 1),
    }
