"""Tests of the scripts in benchmarks/, each loaded from its file (the folder is not a package users import)."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (registered in ``sys.modules``: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def refusal(capsys, script, argv: list[str]) -> str:
    """``script.main(argv)`` refused: exit status 2, returned (an error the run found) or raised (a usage error),
    and one line on stderr, ``<script>.py: error: ...``, without a traceback. Returns that line."""
    try:
        code = script.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (code, err)
    assert err.startswith(f"{Path(script.__file__).name}: error: "), err
    return err
