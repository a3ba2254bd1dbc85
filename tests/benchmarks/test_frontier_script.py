"""benchmarks/frontier.py on hand-made grid summaries and decode rows: which row wins, which TPOT it gets."""

import json
from pathlib import Path

import pytest

from tests.benchmarks import load_benchmark, refusal


def load_script():
    return load_benchmark("frontier")


def row(label, policy, budget, score, n, keys, params=None, manifest=None, task=None):
    cell = {"score": score, "n": n, "interval": [score - 0.05, score + 0.05]}
    return {"label": label, "policy": policy, "budget": budget, "params": params or {}, "manifest": manifest,
            "score": cell, "tasks": {task: cell} if task else {}, "attended_fraction": keys}


def write_grid(folder: Path, rows):
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"model": "tiny", "rows": rows}))


@pytest.fixture
def inputs(tmp_path):
    write_grid(tmp_path / "a", [row("full", "full", None, 0.9, 400, 1.0),
                                row("quest", "quest", 1024, 0.7, 400, 0.5),
                                row("delta-refine4", "delta", 1024, 0.8, 400, 0.55, {"refine": 4}, "d.safetensors"),
                                row("vattention", "vattention", 1024, 0.85, 400, 1.6)])
    write_grid(tmp_path / "b", [row("full", "full", None, 0.5, 100, 1.0),  # fewer prompts: a's full stays
                                row("quest", "quest", 256, 0.4, 100, 0.2),
                                row("vattention-delta", "vattention", 256, 0.6, 100, 0.3, manifest="d.safetensors")])
    decode = {"gpu": "GPU X", "rows": [
        {"model": "7b", "policy": "full", "budget": None, "context": 32768, "batch": 8, "tpot_ms": 8.0},
        {"model": "7b", "policy": "quest", "budget": 1024, "context": 32768, "batch": 8, "tpot_ms": 6.0},
        {"model": "7b", "policy": "quest", "budget": 256, "context": 32768, "batch": 8, "tpot_ms": 5.0},
        {"model": "7b", "policy": "delta-refine", "budget": 1024, "context": 32768, "batch": 8, "tpot_ms": 6.5},
        {"model": "7b", "policy": "vattention", "budget": 256, "context": 32768, "batch": 8, "tpot_ms": 7.0},
        {"model": "7b", "policy": "quest", "budget": 1024, "context": 131072, "batch": 8, "tpot_ms": 99.0}]}
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    return tmp_path


def test_rows_take_the_larger_sample_and_the_matching_decode_case(inputs, capsys):
    frontier = load_script()
    out = inputs / "out"
    assert frontier.main(["--grid", str(inputs / "a"), str(inputs / "b"), "--decode", str(inputs / "decode.json"),
                          "--out", str(out)]) == 0
    rows = {(r["label"], r["budget"]): r for r in json.loads((out / "frontier.json").read_text())["rows"]}
    assert set(rows) == {("full", None), ("quest", 1024), ("quest", 256), ("delta-refine4", 1024),
                         ("vattention", 1024), ("vattention-delta", 256)}
    assert rows[("full", None)]["score"] == 0.9 and rows[("full", None)]["n"] == 400
    tpot = {k: r["tpot_ms"] for k, r in rows.items()}
    assert tpot == {("full", None): 8.0, ("quest", 1024): 6.0, ("quest", 256): 5.0, ("delta-refine4", 1024): 6.5,
                    ("vattention", 1024): None,  # standalone vAttention: decode.py times it on DELTA's roles only
                    ("vattention-delta", 256): 7.0}
    table = (out / "FRONTIER.md").read_text()
    assert "| quest | 256 | 0.400 [0.350, 0.450] | 100 | 0.200 | 5.00 | – |" in table
    assert "| vattention | 1024 | 0.850 [0.800, 0.900] | 400 | 1.600 | – | – |" in table  # past Quest's keys
    assert (out / "frontier.png").stat().st_size > 0 and table in capsys.readouterr().out


def test_case_override_task_and_errors(inputs, capsys):
    frontier = load_script()
    out = inputs / "out"
    frontier.main(["--grid", str(inputs / "a"), "--decode", str(inputs / "decode.json"), "--case", "vattention=quest",
                   "--out", str(out)])
    rows = {r["label"]: r for r in json.loads((out / "frontier.json").read_text())["rows"]}
    assert rows["vattention"]["tpot_ms"] == 6.0  # quest's 1024-budget row, by hand
    elsewhere = inputs / "elsewhere"

    def refused(*argv):
        return refusal(capsys, frontier, ["--grid", str(inputs / "a"), *argv, "--out", str(elsewhere)])

    assert "--task niah: no scored row of that task" in refused("--task", "niah")
    assert "no rows at --context 4096 --batch 8; they have [(32768, 8), (131072, 8)]" in refused(
        "--decode", str(inputs / "decode.json"), "--context", "4096")
    assert "--reference nosuch: no row of that label with a budget in the grids; choose from delta-refine4, quest, " \
           "vattention" in refused("--reference", "nosuch")
    assert "expected LABEL=CASE" in refused("--case", "quest")
    assert "--batch must be at least 1, got 0" in refused("--batch", "0")
    assert refusal(capsys, frontier, ["--grid", str(inputs / "missing"), "--out", str(elsewhere)]).startswith(
        f"frontier.py: error: --grid: no file {inputs / 'missing' / 'summary.json'}; give a folder")
    assert not elsewhere.exists()  # every refusal comes before anything is written


def test_a_decode_file_it_cannot_read_is_refused_in_one_line_naming_it(inputs, capsys):
    frontier = load_script()
    (inputs / "notes.txt").write_text("not json")
    (inputs / "summary-like.json").write_text(json.dumps({"model": "tiny"}))
    fix = "give a JSON that benchmarks/decode.py wrote (its --out)"
    for name, says in (("absent.json", f"no file {inputs / 'absent.json'}"),
                       ("notes.txt", f"{inputs / 'notes.txt'} is not JSON (Expecting value, line 1)"),
                       ("summary-like.json", f"{inputs / 'summary-like.json'} holds no list of rows"),
                       ("a", f"cannot read {inputs / 'a'} (Is a directory)")):
        err = refusal(capsys, frontier, ["--grid", str(inputs / "a"), "--decode", str(inputs / "decode.json"),
                                         str(inputs / name), "--out", str(inputs / "out")])
        assert err == f"frontier.py: error: --decode: {says}; {fix}"
    assert not (inputs / "out").exists()


def test_several_decode_files_merge_and_a_later_one_wins(inputs):
    frontier = load_script()
    extra = {"gpu": "GPU Y", "rows": [
        {"model": "7b", "policy": "quest", "budget": 1024, "context": 32768, "batch": 8, "tpot_ms": 5.5},
        {"model": "7b", "policy": "delta-refine", "budget": 2048, "context": 32768, "batch": 8, "tpot_ms": 9.0}]}
    (inputs / "extra.json").write_text(json.dumps(extra))
    out = inputs / "out"
    frontier.main(["--grid", str(inputs / "a"), "--decode", str(inputs / "decode.json"), str(inputs / "extra.json"),
                   "--out", str(out)])
    report = json.loads((out / "frontier.json").read_text())
    tpot = {r["label"]: r["tpot_ms"] for r in report["rows"]}
    assert tpot["quest"] == 5.5 and tpot["delta-refine4"] == 6.5 and tpot["full"] == 8.0
    assert report["decode"]["gpu"] == "GPU X"


def test_rows_against_the_reference_at_equal_keys_paired_within_a_grid(tmp_path):
    """Quest at keys 0.2 (0.4) and 0.5 (0.7); a row at 0.3 reads Quest's frontier at weight 2/3 on the first:
    0.5, so it is 10 points ahead, paired over the four prompts of its grid; a row of another grid at 0.35 is
    compared unpaired; a row past Quest's measured keys is not compared."""
    frontier = load_script()

    def scored(label, budget, score, keys, scores):
        return {**row(label, label.split("-")[0], budget, score, len(scores), keys), "scores": scores}

    write_grid(tmp_path / "g", [scored("quest", 256, 0.4, 0.2, [0, 1, 0, 0.6]),
                                scored("quest", 1024, 0.7, 0.5, [1, 1, 0, 0.8]),
                                scored("lychee-x", 512, 0.6, 0.3, [1, 1, 0, 0.4]),
                                scored("delta", 4096, 0.9, 0.9, [1, 1, 1, 0.6])])
    write_grid(tmp_path / "h", [row("delta-y", "delta", 1024, 0.65, 100, 0.35)])
    out = tmp_path / "out"
    assert frontier.main(["--grid", str(tmp_path / "g"), str(tmp_path / "h"), "--out", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads((out / "frontier.json").read_text())["rows"]}
    paired = rows["lychee-x"]["vs_reference"]
    # differences 2/3, 0, 0, -4/15: mean 0.1, sample sd 0.39814, half-width 1.959964 * 0.39814 / 2
    assert paired["paired"] and paired["between"] == [256, 1024] and paired["mean"] == pytest.approx(0.1)
    assert paired["interval"] == pytest.approx([0.1 - 0.390170, 0.1 + 0.390170], abs=1e-5)
    unpaired = rows["delta-y"]["vs_reference"]  # weight 1/2; each half-width 0.05, independent
    assert not unpaired["paired"] and unpaired["mean"] == pytest.approx(0.1)
    assert unpaired["interval"] == pytest.approx([0.1 - 0.05 * 1.5 ** 0.5, 0.1 + 0.05 * 1.5 ** 0.5])
    assert rows["delta"]["vs_reference"] is None and rows["quest"]["vs_reference"] is None
    assert "scores" not in rows["quest"]
    table = (out / "FRONTIER.md").read_text()
    assert "| lychee-x | 512 | 0.600 [0.550, 0.650] | 4 | 0.300 | – | +10.0 [-29.0, +49.0] |" in table
    assert "| delta-y | 1024 | 0.650 [0.600, 0.700] | 100 | 0.350 | – | +10.0 [+3.9, +16.1] * (unpaired) |" in table
