import pytest


def refused_line(capsys) -> str:
    """The one line a refused run printed last (no traceback)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


def usage_error(capsys, main, argv: list[str]) -> str:
    """``main(argv)`` stopped by its parser (``SystemExit``, exit status 2): the one line it printed last."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return refused_line(capsys)
