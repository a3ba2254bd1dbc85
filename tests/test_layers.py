"""Imports point down: the core imports nothing above it, and the inference part (the core and ``runtime``:
manifests, models, policies, kernels, engine, server) imports none of calibration, training, the datasets, the
evaluation or the command line, so a server can ship with it alone. Read from the source (every ``import`` and
``from ... import`` statement, at any depth, in every module), not by importing it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "runtime", "eval", "cli", "calibrate", "train", "data", "configs")
# what each part may import of rolecall (the root package itself holds only the version and a lazy attach)
ALLOWED = {
    "core": {"core"},
    "runtime": {"core", "runtime"},
    "data": {"core", "data", "cli"},
    "calibrate": {"core", "runtime", "data", "cli", "calibrate"},
    "train": {"core", "runtime", "data", "cli", "train"},
    "eval": {"core", "runtime", "data", "eval"},
    "cli": set(FOLDERS) - {"configs"},
    "configs": set(),
}


def rolecall_imports(path: Path) -> set[tuple[str, int]]:
    """(the part of rolecall imported, line) for each import statement of ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "rolecall":
                if len(parts) > 1:
                    found.add((parts[1], node.lineno))
                elif isinstance(node, ast.ImportFrom):  # from rolecall import calibrate, __version__
                    found |= {(a.name, node.lineno) for a in node.names if a.name in FOLDERS}
            elif parts[0] in FOLDERS:  # a bare top-level name: only the namespace is installed
                found.add(("<top-level " + parts[0] + ">", node.lineno))
    return found


def test_every_import_points_down():
    wrong = []
    for part in FOLDERS:
        for path in sorted((ROOT / part).rglob("*.py")):
            for target, line in rolecall_imports(path):
                if target not in ALLOWED[part]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_walk_sees_an_import_that_runs_back_up(tmp_path):
    """The check itself: a function-level import from the core into the runtime, a from-import of the root package
    and a bare top-level name are each found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rolecall.runtime.engine import Weights\n    import data.passkey\n"
                      "from rolecall import calibrate, __version__\n")
    assert rolecall_imports(module) == {("runtime", 2), ("<top-level data>", 3), ("calibrate", 4)}
