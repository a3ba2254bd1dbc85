"""benchmarks/paired.py on hand-made grid summaries: the paired differences in points, the one-point verdict,
the refusals, and the same bytes on a rerun."""

import json
import math
from pathlib import Path

import pytest

from tests.benchmarks import load_benchmark, refusal


def load_script():
    return load_benchmark("paired")


def row(label, policy, budget, scores):
    mean = sum(scores) / len(scores)
    return {"label": label, "policy": policy, "budget": budget, "scores": scores,
            "score": {"score": mean, "n": len(scores), "interval": [mean - 0.1, mean + 0.1]}}


def write_grid(folder: Path, rows):
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"model": "tiny", "rows": rows}))


FULL = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


@pytest.fixture
def grids(tmp_path):
    level = list(FULL)  # equal on every prompt: 0 [0, 0], within one point
    worse = [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # loses two of eight prompts
    quest = [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    write_grid(tmp_path / "a", [row("full", "full", None, FULL), row("delta", "delta", 1024, level),
                                row("lychee", "lychee", 1024, worse), row("quest", "quest", 1024, quest),
                                row("delta", "delta", 256, worse)])
    write_grid(tmp_path / "b", [row("full", "full", None, FULL[:4]), row("lychee", "lychee", 1024, FULL[:4])])
    return tmp_path


def test_differences_are_paired_in_points_with_the_one_point_verdict(grids, tmp_path, capsys):
    paired = load_script()
    out = tmp_path / "out"
    assert paired.main(["--grid", f"A={grids / 'a'}", "--grid", f"B={grids / 'b'}", "--out", str(out)]) == 0
    data = json.loads((out / "paired.json").read_text())
    a, b = data["grids"]
    assert [r["label"] for r in a["rows"]] == ["delta", "lychee", "quest"]  # budget 256's row left out
    delta, lychee, quest = a["rows"]
    assert delta["vs_full"] == {"mean": 0.0, "interval": [0.0, 0.0], "n": 8, "significant": False}
    assert delta["within_one_point"] and not lychee["within_one_point"]
    # lychee − full per prompt: 0 except −1 on two of eight: mean −25 points, the normal interval by hand
    d = [x - y for x, y in zip([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], FULL)]
    mean = sum(d) / 8
    half = 1.959964 * math.sqrt(sum((x - mean) ** 2 for x in d) / 7) / math.sqrt(8)
    assert lychee["vs_full"]["mean"] == pytest.approx(100 * mean) == pytest.approx(-25.0)
    assert lychee["vs_full"]["interval"] == pytest.approx([100 * (mean - half), 100 * (mean + half)])
    assert lychee["vs_full"]["significant"] is (mean + half < 0)
    assert lychee["vs_quest"]["mean"] == pytest.approx(0.0) and quest["vs_quest"] is None
    assert delta["vs_quest"]["mean"] == pytest.approx(25.0)  # delta finds the two prompts Quest misses
    assert b["rows"][0]["vs_quest"] is None and b["rows"][0]["within_one_point"]  # no Quest row there
    table = (out / "PAIRED.md").read_text()
    assert "| lychee | 0.375 | -25.0 [" in table and "| delta | 0.625 | +0.0 [+0.0, +0.0] | yes | +25.0 [" in table
    assert table in capsys.readouterr().out
    assert a["folder"] == "a"  # outside the working directory: its name only, no machine's path
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    paired.main(["--grid", f"A={grids / 'a'}", "--grid", f"B={grids / 'b'}", "--out", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # the same bytes on a rerun
    assert set(first) == {"paired.png", "paired.json", "PAIRED.md"}


def test_rows_and_budget_choose_what_is_compared(grids, tmp_path):
    paired = load_script()
    out = tmp_path / "out"
    paired.main(["--grid", f"A={grids / 'a'}", "--rows", "quest", "delta", "--out", str(out)])
    assert [r["label"] for r in json.loads((out / "paired.json").read_text())["grids"][0]["rows"]] == ["quest", "delta"]
    paired.main(["--grid", f"A={grids / 'a'}", "--budget", "256", "--out", str(out)])
    only = json.loads((out / "paired.json").read_text())["grids"][0]["rows"]
    assert [r["label"] for r in only] == ["delta"] and only[0]["vs_full"]["mean"] == pytest.approx(-25.0)


def test_bad_inputs_are_one_line_errors_before_anything_is_written(grids, tmp_path, capsys):
    """A grid it cannot use, found when reading it, is refused like a bad flag: one line ``paired.py: error: ...``,
    exit status 2."""
    paired = load_script()
    out = tmp_path / "out"

    def refused(*argv):
        return refusal(capsys, paired, [*argv, "--out", str(out)])

    assert refused("--grid", f"A={tmp_path / 'absent'}") == (
        f"paired.py: error: --grid A: no file {tmp_path / 'absent' / 'summary.json'}; give a folder that "
        "benchmarks/quality.py wrote (its --out), or run it into this one first")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{")
    assert refused("--grid", f"B={tmp_path / 'broken'}").startswith(f"paired.py: error: --grid B: "
                                                                     f"{tmp_path / 'broken' / 'summary.json'} is not JSON")
    assert "no row at --budget 512; it has budgets [256, 1024]" in refused("--grid", f"A={grids / 'a'}", "--budget", "512")
    assert "none of them is a row at --budget 1024" in refused("--grid", f"A={grids / 'a'}", "--rows", "lethe")
    write_grid(tmp_path / "nofull", [row("delta", "delta", 1024, FULL)])
    assert "no full-attention row" in refused("--grid", f"N={tmp_path / 'nofull'}")
    write_grid(tmp_path / "short", [row("full", "full", None, FULL), row("delta", "delta", 1024, FULL[:3])])
    assert "row delta has 3 prompts and full 8" in refused("--grid", f"S={tmp_path / 'short'}")
    assert "write it as NAME=FOLDER" in refused("--grid", str(grids / "a"))  # a usage error: the parser's
    assert "--budget must be at least 1, got 0" in refused("--grid", f"A={grids / 'a'}", "--budget", "0")
    assert not out.exists()
