"""benchmarks/kernels.py refuses bad shape lists in one line before anything is timed (or a GPU is looked for)."""

import sys

import pytest


@pytest.mark.parametrize("flags, says", [
    (["--contexts", "32k"], "--contexts takes comma-separated context lengths, got '32k'"),
    (["--batches", "1,0"], "--batches must be at least 1 each, got '1,0'"),
    (["--rows", "8,x"], "--rows takes comma-separated row counts, got '8,x'"),
])
def test_bad_shape_lists_are_refused_in_one_line(monkeypatch, capsys, flags, says):
    from benchmarks import kernels

    monkeypatch.setattr(sys, "argv", ["kernels.py", *flags])
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: pytest.fail("looked for a GPU first"))
    with pytest.raises(SystemExit) as done:
        kernels.main()
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and says in err and "\n" not in err
