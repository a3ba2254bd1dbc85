"""Every benchmark script refuses an output it could not write, in one line, before any work (or any look for a
GPU): a folder of results under a regular file, or a JSON file there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, flags", [
    ("quality.py", ["--out", "afile/sub"]),
    ("paired.py", ["--grid", "g", "--out", "afile/sub"]),
    ("frontier.py", ["--grid", "g", "--out", "afile/sub"]),
    ("multi_gpu.py", ["--out", "afile/sub"]),
    ("calibrate.py", ["--out", "afile/sub"]),
    ("train_step.py", ["--json", "afile/sub.json"]),
    ("memory.py", ["--out", "afile/sub.json"]),
])
def test_an_output_under_a_file_is_refused_in_one_line(tmp_path, script, flags):
    (tmp_path / "afile").write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # what running it from the repository root gives
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{script[:-3]}", *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{script}: error: ") and "afile is a file, not a folder" in err
    assert not (tmp_path / "sub").exists()


def test_a_script_started_as_a_file_says_how_to_run_it(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip() == (
        "decode.py: run it from the repository root as python -m benchmarks.decode")
