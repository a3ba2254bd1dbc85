def refused_line(capsys) -> str:
    """The one line a refused run printed last (no traceback)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]
