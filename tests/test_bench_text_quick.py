"""The real-text benchmark's repeat and timing modes at their quick size, end to end: two
learner processes, the first running the syncer, on the standard library's text with the
plain-SGD inner optimizer, the result file's per-seed and over-seed figures, and the
generated page's section for it; the fp32 pair run in both orders, and the wall target
judged on it; the rerun mode's rows and the spread of excesses that share a sign.

Results and the page go to a temporary directory. About half a minute each on two idle
cores.
"""

import json
import math
import sys
from pathlib import Path

import pytest
from bench_helpers import ROOT, run_benchmark

from gradientmail.protocol.records import RunConfig


def test_repeat_mode_measures_every_arm_and_the_page_shows_it(tmp_path: Path) -> None:
    results, docs = tmp_path / "results", tmp_path / "docs"
    run_benchmark(
        "bench_text.py",
        *("--size", "quick", "--mode", "repeat", "--seeds", "0", "--results", str(results)),
    )
    result = json.loads((results / "text-repeat-quick.json").read_text(encoding="utf-8"))
    assert result["parameters"]["learners"] == 2
    assert result["parameters"]["inner"] == "sgd"
    row = result["figures"]["per_seed"]["0"]
    assert set(row) == {"dp", "single", "gm-defaults", "gm-unpaced", "gm-overlap-5"}
    runs = result["figures"]["arms"]["0"]
    assert runs["gm-overlap-5"]["config"]["overlap"] == 5
    assert runs["gm-unpaced"]["config"]["overlap"] is None
    gm = row["gm-defaults"]
    assert gm["rounds_committed"] > 0
    assert isinstance(gm["beats_single"], bool)
    assert gm["excess_over_dp"] == gm["bits_per_byte"] - row["dp"]["bits_per_byte"]
    config = result["figures"]["arms"]["0"]["gm-defaults"]["config"]
    defaults = result["parameters"]["defaults"]
    assert config == defaults
    assert result["figures"]["over_seeds"]["gm-defaults"]["runs"] == 1

    run_benchmark("report.py", "--results", str(results), "--docs", str(docs))
    page = (docs / "benchmarks.md").read_text(encoding="utf-8")
    section = page.split("## 8. Real text over seeds")[1]
    assert "Repeatability" in section
    assert "runs below single" in section
    assert "spread of the excess over DP" in page.split("## 1.")[0]
    assert "with overlap 5, spread of the excess over DP" in page.split("## 1.")[0]
    unpaced = RunConfig(overlap=None)
    assert (
        f"`gm-unpaced`: F={unpaced.fragments} (`{unpaced.pattern}`), H={unpaced.sync_every}, "
        f"outer {unpaced.outer_lr} / {unpaced.outer_momentum}, quorum "
        f"{unpaced.quorum_fraction} / grace {unpaced.grace} s, unpaced"
    ) in section


def test_timing_mode_runs_each_pair_in_both_orders_and_the_page_judges_on_it(
    tmp_path: Path,
) -> None:
    # torchft is the bench extra's (a benchmark dependency only), not the dev install's.
    pytest.importorskip("torchft")
    results = tmp_path / "results"
    run_benchmark(
        "bench_text.py", *("--size", "quick", "--mode", "timing", "--results", str(results))
    )
    timing = json.loads((results / "text-timing-quick.json").read_text(encoding="utf-8"))
    assert timing["parameters"]["order"] == ["gm", "torchft", "torchft", "gm"]
    pair = timing["figures"]["pairs"]["10"]
    gm, ft = pair["gm"], pair["torchft"]
    assert len(gm) == len(ft) == 2
    assert all(run["wall_seconds"] > 0 and run["bits_per_byte"] > 0 for run in gm + ft)
    assert pair["wall_ratio"] == (gm[0]["wall_seconds"] + gm[1]["wall_seconds"]) / (
        ft[0]["wall_seconds"] + ft[1]["wall_seconds"]
    )
    assert pair["wall_ratio_gm_first"] == gm[0]["wall_seconds"] / ft[0]["wall_seconds"]
    assert pair["wall_ratio_torchft_first"] == gm[1]["wall_seconds"] / ft[1]["wall_seconds"]

    # The page judges the wall target on both orders, not on the matrix's own pair (given
    # here as 2.0 so that the two verdicts differ whenever the pairs' ratio is at most 1).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _page
    import bench_text
    import report_text_runs
    import report_text_versus

    page = _page.Page(tmp_path / "docs")
    versus = {
        "10": {
            "bits_per_byte_ratio": 1.0,
            "excess_over_dp": [0.1, 0.2],
            "wall_ratio": 2.0,
            "train_ratio": 2.0,
            "cpu_ratio": 2.0,
            "bytes_ratio": 1.5,
        }
    }
    paced = timing["parameters"]["overlap"]
    assert paced == RunConfig().overlap
    result = {
        "parameters": {"size": "quick", "overlap": paced, "harness": bench_text.HARNESS},
        "figures": {"versus_torchft": versus, "arms": {}},
        "timing": timing,
    }
    report_text_versus.versus(page, result)
    report_text_versus.timing(page, timing)
    wall = next(row for row in page.targets if "wall time" in row[0])
    assert wall[2].startswith(f"{pair['wall_ratio']:.3f} (each pair in both orders")
    assert "the matrix's own pair 2.00" in wall[2]
    assert wall[3] == _page.verdict(pair["wall_ratio"] <= 1.0)
    text = "\n".join(page.lines)
    assert "Wall time with each fp32 pair run in both orders (gm, torchft, torchft, gm)" in text
    measured = pair["measured"]
    assert measured["overlap"] == paced
    assert measured["git_commit"] == timing["git_commit"]
    assert measured["harness"] == bench_text.HARNESS
    assert measured["syncer_in"] == 0
    assert (
        f"| 10 | {report_text_runs.pacing(paced)} | {measured['date'][:10]} | fair; the syncer "
        "in learner 0's process | "
        f"{gm[0]['wall_seconds']:.0f}, {gm[1]['wall_seconds']:.0f} |"
    ) in text
    assert timing["git_commit"][:7] not in text

    # --keep: another invocation that runs no pair of H 10 keeps it, with its own ``measured``.
    import bench_text_timing

    stored = timing["parameters"]
    assert bench_text_timing.kept(results / "text-timing-quick.json", stored, [20]) == {"10": pair}
    assert bench_text_timing.kept(results / "text-timing-quick.json", stored, [10]) == {}
    with pytest.raises(SystemExit, match="steps differ"):
        bench_text_timing.kept(
            results / "text-timing-quick.json", stored | {"steps": stored["steps"] + 1}, [20]
        )

    # A timing file whose gradientmail runs were paced otherwise than the matrix's arm does
    # not judge that arm's pair.
    other = _page.Page(tmp_path / "docs")
    otherwise = {"measured": {"overlap": 2 if paced is None else None}}
    report_text_versus.versus(
        other,
        result | {"figures": {"versus_torchft": versus, "arms": {"gm-fp32-H10": otherwise}}},
    )
    wall = next(row for row in other.targets if "wall time" in row[0])
    assert wall[2] == "2.00"
    assert wall[3] == _page.verdict(False)


def test_keep_adds_arms_to_the_stored_runs_and_times_only_pairs_from_one_invocation(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torchft")
    results, docs = tmp_path / "results", tmp_path / "docs"
    quick = ("bench_text.py", "--size", "quick", "--results", str(results))
    # The pair run in one invocation is timed.
    run_benchmark(*quick, "--only", "dp", "gm-fp32-H10", "torchft-fp32-H10", "--overlap", "none")
    path = results / "text-quick.json"
    first = json.loads(path.read_text(encoding="utf-8"))
    versus = first["figures"]["versus_torchft"]["10"]
    gm, ft = first["figures"]["arms"]["gm-fp32-H10"], first["figures"]["arms"]["torchft-fp32-H10"]
    assert versus["measured_together"] is True
    assert versus["wall_ratio"] == gm["wall_seconds"] / ft["wall_seconds"]

    assert first["parameters"]["seed"] == 0
    # Another seed keeps nothing of this one's; a file that names no seed ran seed 0.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_text

    with pytest.raises(SystemExit, match="seed"):
        bench_text.kept(path, first["parameters"] | {"seed": 1}, [])
    unsaid = tmp_path / "unsaid.json"
    unsaid.write_text(
        json.dumps(
            first | {"parameters": {k: v for k, v in first["parameters"].items() if k != "seed"}}
        )
    )
    assert set(bench_text.kept(unsaid, first["parameters"], [])) == set(first["figures"]["arms"])

    # One arm of the pair run again: the other runs are kept, and the pair is not timed.
    run_benchmark(*quick, "--keep", "--only", "torchft-fp32-H10")
    second = json.loads(path.read_text(encoding="utf-8"))
    arms = second["figures"]["arms"]
    assert second["parameters"]["arms"] == ["dp", "gm-fp32-H10", "torchft-fp32-H10"]
    for arm in ("dp", "gm-fp32-H10"):
        assert arms[arm]["bits_per_byte"] == first["figures"]["arms"][arm]["bits_per_byte"]
        assert arms[arm]["measured"] == {
            "date": first["date"],
            "git_commit": first["git_commit"],
            "overlap": None,
            "harness": first["parameters"]["harness"],
            "syncer_in": 0,
        }
    assert arms["torchft-fp32-H10"]["measured"]["overlap"] == RunConfig().overlap
    assert arms["torchft-fp32-H10"]["measured"]["date"] == second["date"]
    versus = second["figures"]["versus_torchft"]["10"]
    assert versus["measured_together"] is False
    assert versus["wall_ratio"] is None
    assert versus["bits_per_byte_ratio"] == (
        arms["gm-fp32-H10"]["bits_per_byte"] / arms["torchft-fp32-H10"]["bits_per_byte"]
    )

    # The page's section for the size (the report shows the sizes a full run has, not quick).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _page
    import report_text

    page = _page.Page(docs)
    report_text.size_section(page, second | {"timing": None})
    section = "\n".join(page.lines)
    wall = next(row for row in page.targets if "wall time" in row[0])
    assert "Measured in 2 invocations" in section
    assert (
        f"- {first['date']}, gradientmail unpaced, the syncer in learner 0's process: dp, "
        in section
    )
    assert first["git_commit"][:7] not in section
    # Its gradientmail arms all come from the first invocation.
    assert "gradientmail's learners are unpaced" in section
    assert wall[2] == "not measured: its arms come from two invocations"
    assert wall[3] == _page.verdict(None)

    # A torchft run of the earlier harness kept beside fair ones: the file judges nothing.
    fair = first["parameters"]["harness"]
    assert fair
    earlier = json.loads(path.read_text(encoding="utf-8"))
    del earlier["parameters"]["harness"]
    earlier["figures"]["arms"]["torchft-fp32-H10"]["measured"]["harness"] = None
    path.write_text(json.dumps(earlier), encoding="utf-8")
    run_benchmark(*quick, "--keep", "--only", "gm-fp32-H10")
    third = json.loads(path.read_text(encoding="utf-8"))
    assert "harness" not in third["parameters"]
    assert third["figures"]["arms"]["gm-fp32-H10"]["measured"]["harness"] == fair

    # Runs of another task are not kept.
    changed = second | {"parameters": second["parameters"] | {"steps": 7}}
    path.write_text(json.dumps(changed), encoding="utf-8")
    import bench_text

    with pytest.raises(SystemExit, match=r"measured another task \(steps differ\)"):
        bench_text.kept(path, second["parameters"], ["dp"])


def test_rerun_rows_and_the_spread_of_excesses_that_share_a_sign() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_text_seeds as seeds

    rerun = seeds.MODES["rerun"]
    assert seeds.rows(rerun) == [(f"0#{n}", 0) for n in range(1, seeds.RERUNS + 1)]
    assert seeds.rows(seeds.MODES["repeat"]) == [(str(s), s) for s in range(5)]
    assert seeds.config("gm-overlap-5") == RunConfig(overlap=5)
    assert seeds.config("gm-defaults") == RunConfig()
    assert seeds.config("gm-unpaced") == RunConfig(overlap=None)

    def arms(gm: float) -> dict[str, dict[str, float]]:
        return {"dp": {"bits_per_byte": 3.0, "wall_seconds": 1.0}} | {
            "gm-defaults": {"bits_per_byte": gm, "wall_seconds": 1.0}
        }

    below = seeds.figures({"0#1": arms(2.96), "0#2": arms(2.98)})["over_seeds"]["gm-defaults"]
    assert below["excess_spread"] == pytest.approx(2.0)
    across = seeds.figures({"0#1": arms(2.96), "0#2": arms(3.02)})["over_seeds"]["gm-defaults"]
    assert across["excess_spread"] is None

    import report_text_seeds

    order = report_text_seeds.row_order
    assert sorted(["0#10", "1#1", "0#2"], key=order) == ["0#2", "0#10", "1#1"]
    assert order("3") == (3, 0)


def test_the_fair_harness_builds_torchft_without_init_sync_and_judges_both_on_the_mean_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The comparison is fair only while torchft starts without overwriting learners from
    # one of them and both systems are judged by one function on the mean of the learners'
    # models; the learners' processes are stood in for (no training), the rest is real.
    pytest.importorskip("torchft")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _launch
    import bench_text_arms
    import bench_text_data
    import bench_text_eval
    import bench_text_fair
    import bench_text_task as task
    import bench_text_torchft
    import torch
    import torchft

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    built: dict[str, object] = {}

    class Refused(Exception):
        pass

    def manager(**options: object) -> None:
        built.update(options)
        raise Refused

    monkeypatch.setattr(torchft, "Manager", manager)
    spec = bench_text_arms.worker_spec(
        "quick", 0, tmp_path / "worker", lighthouse="http://127.0.0.1:1"
    )
    spec |= {"system": "torchft", "sync_every": 10, "fragments": task.FRAGMENTS}
    spec |= {"outer_lr": 0.7, "outer_momentum": 0.9}
    (tmp_path / "worker").mkdir()
    with pytest.raises(Refused):
        bench_text_torchft.worker(spec, 0)
    assert built["init_sync"] is False

    size = task.SIZES["quick"]
    learners = task.learners("quick")
    saved = []
    for k in range(learners):
        model = GPT(task.model_config(size), seed=k)
        saved.append({name: t.clone() for name, t in model.state_dict().items()})

    launched: list[dict] = []  # type: ignore[type-arg]

    def launch(script: Path, spec: dict, **_: object) -> dict:
        launched.append(spec)
        scratch = Path(spec["scratch"])
        scratch.mkdir(parents=True, exist_ok=True)
        for k, state in enumerate(saved):
            torch.save(state, bench_text_eval.model_path(scratch, k))
        learner = {"final_loss": 9.0, "curve": [[0.0, 9.0]], "train_seconds": 1.0}
        learner |= {"cpu_seconds": 1.0, "lag_steps": [], "bytes_up": 1, "bytes_down": 1}
        learner |= {"allreduce_bytes": 1, "allreduce_payload_bytes": 1}
        learner |= {"syncs": 1, "failed_syncs": 0}
        syncer = {"rounds": [], "bytes_up": 0, "bytes_down": 0, "cpu_seconds": 0.0}
        syncer |= {"bytes_by_kind": {}}
        reports = {str(k): learner | {"index": k} for k in range(learners)} | {"syncer": syncer}
        return {"reports": reports, "wall_seconds": 1.0, "events": {}, "peak_store_bytes": 0}

    monkeypatch.setattr(_launch, "launch", launch)
    gm = bench_text_arms.run_gradientmail("quick", 0, 10, "fp32", tmp_path / "gm", False)
    ft = bench_text_arms.run_torchft("quick", 0, 10, tmp_path / "torchft", False)

    mean = GPT(task.model_config(size), seed=0)
    mean.load_state_dict({name: sum(s[name] for s in saved) / len(saved) for name in saved[0]})
    corpus = bench_text_data.stdlib_corpus(shards=learners, seed=0)
    expected = evaluate(mean, corpus.evaluation(*size["final_eval"], length=32))
    assert gm["final_loss"] == ft["final_loss"] == pytest.approx(expected, rel=1e-6)
    assert gm["bits_per_byte_by_learner"] == [9.0 / math.log(2)] * learners
    assert gm["learner_spread"] == ft["learner_spread"] > 0
    assert set(gm["load"]) == set(ft["load"]) == {"start", "end"}

    # Both systems' outer optimizers are tuned on a seed the reported rows do not use, over
    # one grid that holds torchft's example's setting and gradientmail's default.
    assert {(0.7, 0.9), (1.0, 0.6)} <= set(bench_text_fair.OUTER_GRID)
    assert bench_text_fair.TUNING_SEED not in bench_text_fair.SEEDS
    launched.clear()
    tuned = bench_text_fair.tune("gm", "quick", 10, tmp_path / "tune", lambda _: None)
    assert [
        (s["seed"], s["config"]["outer_lr"], s["config"]["outer_momentum"]) for s in launched
    ] == [
        (bench_text_fair.TUNING_SEED, lr, momentum) for lr, momentum in bench_text_fair.OUTER_GRID
    ]
    assert [point["outer"] for point in tuned["points"]] == [
        list(point) for point in bench_text_fair.OUTER_GRID
    ]
    launched.clear()
    bench_text_fair._run("torchft", "quick", 0, 10, tmp_path / "ft-outer", (0.7, 0.6))
    assert (launched[0]["outer_lr"], launched[0]["outer_momentum"]) == (0.7, 0.6)

    # A comparison longer than one sitting: interrupted after its tenth run (the eight
    # tuning runs and two of the pair's four), taken up with keep, it runs the two left
    # only, and the file holds the whole pair; another overlap is another comparison.
    monkeypatch.setattr(bench_text_fair, "run_local", lambda *_: {"bits_per_byte": 3.0})
    launched.clear()

    def interrupted(script: Path, spec: dict, **options: object) -> dict:
        if len(launched) == 10:
            raise KeyboardInterrupt
        return launch(script, spec, **options)

    monkeypatch.setattr(_launch, "launch", interrupted)
    results, sync = tmp_path / "fair", {"overlap": 0}
    with pytest.raises(KeyboardInterrupt):
        bench_text_fair.run(results, "quick", None, [0], lambda _: None, changes=sync)
    monkeypatch.setattr(_launch, "launch", launch)
    launched.clear()
    path = bench_text_fair.run(results, "quick", None, [0], lambda _: None, True, sync)
    assert [spec["system"] for spec in launched] == ["torchft", "gm"]
    assert all(spec["config"]["overlap"] == 0 for spec in launched if spec["system"] == "gm")
    done = json.loads(path.read_text())["figures"]
    assert [run["turn"] for run in done["runs"]["10"]["0"]["gm"]] == [0, 3]
    assert done["pairs"]["10"]["seeds_complete"] == 1
    with pytest.raises(SystemExit, match="overlap"):
        bench_text_fair.run(results, "quick", None, [0], lambda _: None, True, None)


def test_the_page_judges_gradientmail_against_torchft_only_on_the_fair_harness(
    tmp_path: Path,
) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _page
    import bench_text
    import report_fair
    import report_text_versus

    versus = {
        "50": {
            "bits_per_byte_ratio": 0.99,
            "excess_over_dp": [0.27, 0.29],
            "wall_ratio": 0.96,
            "train_ratio": 0.96,
            "cpu_ratio": 0.9,
            "bytes_ratio": 0.5,
        }
    }
    result = {
        "parameters": {"size": "full", "overlap": 2},
        "figures": {"versus_torchft": versus, "arms": {}},
        "timing": None,
    }
    earlier = _page.Page(tmp_path / "docs")
    report_text_versus.versus(earlier, result)
    assert [row[3] for row in earlier.targets] == [report_fair.NOT_JUDGED] * 2
    fair = _page.Page(tmp_path / "docs")
    result["parameters"]["harness"] = bench_text.HARNESS
    report_text_versus.versus(fair, result)
    assert [row[3] for row in fair.targets] == [_page.verdict(True)] * 2
    assert "0.274 | 0.256" in "\n".join(report_fair.earlier("full"))

    def run(bits: float, wall: float) -> dict:
        load = {"start": [1.0], "end": [2.0]}
        return {"bits_per_byte": bits, "wall_seconds": wall, "load": load, "bytes_per_learner": 2e6}

    runs = {
        str(seed): {"gm": [run(3.1, 10), run(3.1, 10)], "torchft": [run(3.0, 9), run(3.0, 11)]}
        for seed in (0, 1, 2)
    }
    import bench_text_fair

    dp = {str(seed): {"bits_per_byte": 2.9} for seed in (0, 1, 2)}
    pairs = bench_text_fair.figures({"20": {"runs": runs}}, dp)
    assert pairs["20"]["seeds_complete"] == 3
    assert pairs["20"]["gm_median_excess"] == pytest.approx(0.2)
    assert pairs["20"]["torchft_median_excess"] == pytest.approx(0.1)
    assert pairs["20"]["wall_ratio"] == pytest.approx(1.0)
    tuning = {"seed": 100, "points": [{"outer": [0.7, 0.9], "bits_per_byte": 3.0}]}
    tuning["best"] = [0.7, 0.9]
    import _harness

    parameters = {
        "size": "small",
        "seeds": [0, 1, 2],
        "order": list(bench_text_fair.ORDER),
        "gm_outer": [1.0, 0.6],
        "torchft": {"outer_grid": [[0.7, 0.9]], "tuning_seed": 100},
    }
    document = _harness.header("text-fair-small", quick=False, parameters=parameters)
    document["figures"] = {"pairs": pairs, "tuning": {"20": tuning}, "runs": {"20": runs}}
    page = _page.Page(tmp_path / "docs")
    report_fair.section(page, document)
    assert [row[3] for row in page.targets] == [_page.verdict(False), _page.verdict(True)]
    assert "| 20 | 0 | 3.1000 (0.2000) | 3.0000 (0.1000) | 10, 10 | 9, 11 |" in "\n".join(
        page.lines
    )
    assert "gradientmail on its defaults (1.0 / 0.6)" in "\n".join(page.lines)

    # Both systems tuned on one grid: the page names each one's grid and picked point.
    gm_tuning = {"seed": 100, "points": [{"outer": [1.0, 0.6], "bits_per_byte": 3.2}]}
    gm_tuning["best"] = [1.0, 0.6]
    del parameters["gm_outer"]
    parameters["gm"] = {"outer_grid": [[1.0, 0.6]], "tuning_seed": 100}
    document = _harness.header("text-fair-small", quick=False, parameters=parameters)
    document["figures"] = {"pairs": pairs, "tuning": {"20": tuning}, "runs": {"20": runs}}
    document["figures"]["gm_tuning"] = {"20": gm_tuning}
    page = _page.Page(tmp_path / "docs")
    report_fair.section(page, document)
    text = "\n".join(page.lines)
    assert "gradientmail's from the same grid on the same seed" in text
    assert "gradientmail's grid on seed 100 (bits per byte): H 20: 1.0 / 0.6 3.2000." in text
    assert "torchft's grid on seed 100 (bits per byte): H 20: 0.7 / 0.9 3.0000." in text
    assert "| 1.0/0.6 / 0.7/0.9 |" in text


def test_launch_refuses_to_kill_the_learner_that_hosts_the_syncer(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _launch

    spec = {"scratch": str(tmp_path / "run"), "learners": 2, "syncer_in": 0}
    kill = _launch.Kill(index=0, at_step=1, restart_after=0.0)
    with pytest.raises(ValueError, match="learner 0 runs the syncer"):
        _launch.launch(ROOT / "benchmarks" / "bench_text.py", spec, services=(), kill=kill)
    assert not (tmp_path / "run").exists()
