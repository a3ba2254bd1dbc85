"""Every command the README and ``docs/`` show parses with today's flags: a flag renamed, removed or given a
value of another kind fails here, not in a reader's shell. Every Python snippet they mark to run runs as shown.

Commands are the lines of code blocks (fenced or indented) that start a console script (``rolecall``,
``calibrate-delta``, ``train-heads``), a benchmark script or a launcher running one of them, and inline
code that starts a benchmark script. Each is parsed, not run; what the parser itself refuses counts, and checks
that need the files or the GPU named in the command (run before any work) are left to the command.

A snippet is marked to run by the line ``<!-- documented-snippet: run -->`` right before its fenced ``python``
block; it runs verbatim in a fresh interpreter, from the repository root, on the CPU."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"(rolecall|calibrate-delta|train-heads|python3? -m (rolecall\.(calibrate|train)(\.cli)?|benchmarks\.\w+)|accelerate launch|"
                    r"torchrun)(\s|$)")
# argparse's own refusals of the command's shape; a command's later checks (files, a GPU) are not these
SHAPE_ERRORS = ("unrecognized arguments", "invalid choice", "the following arguments are required",
                "expected one argument", "expected at least one argument", "invalid int value", "invalid float value",
                "not allowed with argument", "ambiguous option")
MODULES = {"rolecall.calibrate": "calibrate-delta", "rolecall.calibrate.cli": "calibrate-delta",
           "rolecall.train": "train-heads", "rolecall.train.cli": "train-heads"}


def code_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, line) of each code line of a markdown text, backslash continuations joined, and of each
    inline code span outside code that starts a benchmark script with arguments (a span may wrap)."""
    out, fenced, joined, start, prose = [], False, "", 0, []

    def paragraph() -> None:
        found = re.findall(r"`(python3?\s+-m\s+benchmarks\.\w+ [^`]+)`", " ".join(line for _, line in prose))
        out.extend((prose[0][0], " ".join(span.split())) for span in found)
        prose.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            paragraph()
            fenced = not fenced
        elif fenced or line.startswith("    "):
            paragraph()
            joined, start = (joined + " " + line.strip(), start) if joined else (line.strip(), number)
            if joined.endswith("\\"):
                joined = joined[:-1].rstrip()
                continue
            out.append((start, joined.removeprefix("$ ")))
            joined = ""
        elif line.strip():
            prose.append((number, line))
        else:
            paragraph()
    paragraph()
    return out


def commands(path: Path) -> list[tuple[str, list[str]]]:
    """(where, argv from the program's name on) of each documented command in ``path``; output shown after a
    command (``rolecall decode: error: ...``) is not one."""
    found = []
    for number, line in code_lines(path.read_text()):
        if not SCRIPT.match(line) or ": error:" in line:
            continue
        line = re.sub(r"(?<=\s)\.\.\.(?=\s|$)", "", line)  # a bare "..." stands for options left out
        found.append((f"{path.relative_to(ROOT)}:{number}", shlex.split(line, comments=True)))
    return found


def program(argv: list[str]) -> tuple[str, list[str]]:
    """The program a documented command runs and its own arguments: through ``python -m``, ``accelerate launch``
    or ``torchrun`` (their options skipped) to the script or module."""
    if argv[0] in ("accelerate", "torchrun"):
        rest = argv[2:] if argv[0] == "accelerate" else argv[1:]
        i = 0
        while i < len(rest) and rest[i].startswith("-") and rest[i] != "-m":
            i += 1 if "=" in rest[i] or rest[i + 1].startswith("-") else 2  # an option and its value
        rest = rest[i:]
        if rest[0] == "-m":
            return MODULES[rest[1]], rest[2:]
        name = re.sub(r"^\$\(which (.+)\)$", r"\1", rest[0])
        return (name if name in MODULES.values() else rest[0]), rest[1:]
    if argv[0].startswith("python"):
        if argv[1] == "-m":
            return MODULES.get(argv[2], argv[2]), argv[3:]
        return argv[1], argv[2:]
    return argv[0], argv[1:]


def parse(name: str, args: list[str]) -> None:
    """Parse ``args`` with the program ``name``'s parser (its checks on the flags' values included)."""
    if name == "rolecall":
        from rolecall.cli import SUBCOMMANDS, build_parser

        chosen = next((a for a in args if not a.startswith("-")), None)
        build_parser(chosen if chosen in SUBCOMMANDS else "").parse_args(args)
    elif name in ("calibrate-delta", "train-heads"):
        module = importlib.import_module("rolecall.calibrate.cli" if name == "calibrate-delta" else "rolecall.train.cli")
        module.build_parser().parse_args(args)
    else:
        script = re.fullmatch(r"benchmarks\.(\w+)", name)
        assert script, f"{name}: no parser known for this program"
        importlib.import_module(f"benchmarks.{script[1]}").parse_args(args)


DOCUMENTED = [c for path in DOCUMENTS for c in commands(path)]
RUN_MARK = "<!-- documented-snippet: run -->"


def marked_snippets(text: str) -> list[tuple[int, str]]:
    """(first code line's number, code) of each fenced ``python`` block that follows a line ``RUN_MARK``."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != RUN_MARK:
            continue
        assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", f"line {i + 1}: {RUN_MARK} must precede ```python"
        end = next((k for k in range(i + 2, len(lines)) if lines[k].lstrip().startswith("```")), None)
        assert end is not None, f"line {i + 2}: the python block never closes"
        out.append((i + 3, "\n".join(lines[i + 2:end]) + "\n"))
    return out


SNIPPETS = [(f"{path.relative_to(ROOT)}:{number}", code) for path in DOCUMENTS
            for number, code in marked_snippets(path.read_text())]


def test_the_documents_show_commands_of_every_kind():
    """The extraction finds what the README shows: each console script, benchmark scripts and launchers."""
    programs = {program(argv)[0] for _, argv in DOCUMENTED}
    assert {"rolecall", "calibrate-delta", "train-heads", "benchmarks.quality", "benchmarks.decode",
            "benchmarks.kernels", "benchmarks.memory"} <= programs
    assert any(argv[0] == "accelerate" for _, argv in DOCUMENTED)
    assert len(DOCUMENTED) > 40


def test_extraction_joins_continuations_and_reads_launchers():
    text = ("Run\n\n```bash\nrolecall eval --model m \\\n    --lengths 1 2  # a comment\nrolecall decode: error: x\n"
            "```\n\n    accelerate launch --config_file c.yaml --num_processes 8 -m rolecall.train --target 32\n\n"
            "and `python -m benchmarks.memory\n--models 32b` then `rolecall decode --prompts`.\n")
    lines = code_lines(text)
    assert lines == [(4, "rolecall eval --model m --lengths 1 2  # a comment"), (6, "rolecall decode: error: x"),
                     (9, "accelerate launch --config_file c.yaml --num_processes 8 -m rolecall.train --target 32"),
                     (11, "python -m benchmarks.memory --models 32b")]
    argvs = [shlex.split(line, comments=True) for _, line in lines if SCRIPT.match(line) and ": error:" not in line]
    assert [program(a) for a in argvs] == [("rolecall", ["eval", "--model", "m", "--lengths", "1", "2"]),
                                           ("train-heads", ["--target", "32"]),
                                           ("benchmarks.memory", ["--models", "32b"])]


def test_a_renamed_flag_is_caught(monkeypatch, capsys):
    """The check can fail: a flag the parser does not know, or a value of the wrong kind, is a shape error, while
    a refusal of what the flags name (a missing GPU, file or manifest) is left to the command."""
    monkeypatch.setattr("rolecall.cli.Parser.check_writable", lambda *a, **k: None)
    for args in (["decode", "--prompt", "x", "--max-tokens", "5"], ["eval", "--lengths", "many"]):
        with pytest.raises(SystemExit):
            parse("rolecall", args)
        err = capsys.readouterr().err
        assert any(s in err for s in SHAPE_ERRORS), err
    with pytest.raises(SystemExit):
        parse("benchmarks.kernels", ["--contexts", "100"])  # a value the script checks: not the parser's shape
    err = capsys.readouterr().err
    assert "--contexts takes" in err and not any(s in err for s in SHAPE_ERRORS)


@pytest.mark.parametrize("where, argv", DOCUMENTED, ids=[w for w, _ in DOCUMENTED])
def test_each_documented_command_parses(where, argv, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # an output folder a parser makes on its way lands here
    monkeypatch.setattr("rolecall.cli.Parser.check_writable", lambda *a, **k: None)
    name, args = program(argv)
    try:
        parse(name, args)
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and not any(s in err for s in SHAPE_ERRORS), f"{where}: {' '.join(argv)}\n{err}"


def test_the_readme_python_snippet_is_marked_to_run():
    """The README's Python API snippet is among those run, and the marker finds only what follows it."""
    assert any(where.startswith("README.md:") and "rolecall.attach" in code for where, code in SNIPPETS)
    text = "x\n<!-- documented-snippet: run -->\n```python\nprint(1)\n```\n\n```python\nprint(2)\n```\n"
    assert marked_snippets(text) == [(4, "print(1)\n")]


@pytest.mark.slow
@pytest.mark.parametrize("where, code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_each_marked_snippet_runs(where, code, tmp_path):
    """Verbatim, in a fresh interpreter from the repository root (the paths it names are the repository's), with
    no GPU visible: what the page promises a reader on a CPU."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600)
    assert done.returncode == 0, f"{where}: the snippet failed\n{done.stderr[-4000:]}"
