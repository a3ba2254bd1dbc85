"""benchmarks/calibrate.py --end-to-end on the CPU: every phase of a calibrate-delta run timed, the traces forced
to their full length, transformers' generation projected beside the engine's."""

import importlib
import json

import pytest


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.calibrate")


def test_end_to_end_times_every_phase_and_projects_transformers(bench, tmp_path, capsys, one_thread):
    argv = ["--shape", "tiny", "--traces", "3", "--length", "80", "--min-context", "16", "--stride", "8",
            "--prompt-tokens", "20", "--hf-steps", "4", "--end-to-end", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    r = json.loads((tmp_path / "calibrate_end_to_end.json").read_text())
    assert list(r["phases_s"]) == ["load", "generation", "recording", "selection", "writing"]
    assert r["total_s"] == pytest.approx(sum(r["phases_s"].values()))
    hf = r["transformers_generate"]
    assert hf["steps_timed"] == 4 and hf["batch"] == 3
    assert hf["projected_s"] == pytest.approx(1 * 60 * hf["s_per_step"])  # one batch of 3, 60 new tokens each
    assert hf["projected_over_engine"] == pytest.approx(hf["projected_s"] / r["phases_s"]["generation"])
    assert len(r["delta_layers"]) == 1 and "calibrate-delta end to end" in capsys.readouterr().out


def test_prompt_tokens_must_leave_room_to_generate(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--end-to-end", "--length", "64", "--prompt-tokens", "64"])
    assert "--prompt-tokens must be below --length (64)" in capsys.readouterr().err
