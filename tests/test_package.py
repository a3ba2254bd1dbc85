"""The built wheel works outside the checkout: everything installs under ``rolecall`` (no top-level ``runtime``,
``data``, ``train``, ``calibrate`` or ``configs`` to collide with a user's), console scripts run and model aliases
ship as package data."""

import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ROOT,
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("rolecall-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    py = bin_dir / "python"
    # Dependencies come from this interpreter's site-packages, appended after the new venv's own.
    new_site = subprocess.run([py, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                              text=True, check=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    with open(os.path.join(new_site, "zz_deps.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ""}

    def run(*cmd):
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    where = run(str(py), "-c", "import rolecall.runtime, rolecall.configs, rolecall.data\n"
                "for m in (rolecall.runtime, rolecall.configs, rolecall.data): print(m.__file__)")
    assert ROOT not in where and where.count("site-packages") == 3
    for name in ("runtime", "data", "train", "calibrate", "configs"):  # only the namespace is installed
        gone = subprocess.run([str(py), "-c", f"import {name}"], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert gone.returncode == 1 and f"No module named '{name}'" in gone.stderr, name
    top = subprocess.run([str(py), "-c", "import site, os; print(sorted(os.listdir(site.getsitepackages()[0])))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert not {"'runtime'", "'data'", "'train'", "'calibrate'", "'configs'"} & set(top.strip("[]\n").split(", "))
    aliases = run(str(py), "-c", "from rolecall.core.models import list_aliases; print(' '.join(list_aliases()))")
    assert {"qwen-14b", "smollm2-135m", "llama-70b"} <= set(aliases.split())
    assert run(str(py), "-c", "import rolecall.data.longbench as lb; print(len(lb.TASKS))").strip() == "16"  # its table ships
    assert "inspect" in run(str(bin_dir / "rolecall"), "--help")
    assert "--model" in run(str(bin_dir / "calibrate-delta"), "--help")
    assert "--target" in run(str(bin_dir / "train-heads"), "--help")


def test_registry_imports_on_lookup_and_refuses_unknown_names():
    from rolecall.core.registry import Registry

    reg = Registry("widget", KeyError)
    reg["lazy"] = "json:dumps"  # a "module:attr" entry is imported when looked up

    @reg.register("eager")
    def eager():
        return 1

    import json

    assert reg.lookup("lazy") is json.dumps and reg.lookup("eager") is eager and sorted(reg) == ["eager", "lazy"]
    with pytest.raises(KeyError, match="unknown widget 'nope'; choose one of eager, lazy"):
        reg.lookup("nope")
    named = Registry("source", ValueError, choices="a or b:PATH", lead="choose")
    with pytest.raises(ValueError, match=r"unknown source 'x:y'; choose a or b:PATH"):
        named.lookup("x", shown="x:y")


def test_config_files_read_the_same_way_everywhere(tmp_path):
    from rolecall.calibrate.config import CalibrateConfig, read_yaml
    from rolecall.core.configfile import ConfigError, layered, read_config

    assert read_yaml("smollm2-135m") == read_config("smollm2-135m", "calibration config", "calibrate")  # by name
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_config(bad, "training config", "train")
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of option: value, got list"):
        read_config(bad, "training config", "train")
    with pytest.raises(ConfigError, match="no such file, and not one of configs/calibrate/ .*smollm2-135m"):
        read_config("nope", "calibration config", "calibrate")
    config = layered(CalibrateConfig, {"stride": 8}, {"stride": None, "warmup": 1}, what="c")  # None: unset flag
    assert (config.stride, config.warmup) == (8, 1)
    with pytest.raises(ConfigError, match="c: unknown options 'x', 'y'; known options: "):
        layered(CalibrateConfig, {"x": 1, "y": 2}, what="c")


def test_shipped_config_files_are_named_model_or_model_dot_variant():
    """configs/calibrate/ and configs/train/ hold ``<model>.yaml`` or ``<model>.<variant>.yaml``, where
    ``<model>`` is an alias in configs/models/ (a dot may sit inside an alias: qwen-1.5b), and the file's own
    ``model:`` is that alias."""
    import yaml

    root = Path(ROOT) / "configs"
    models = {p.name.removesuffix(".yaml") for p in (root / "models").glob("*.yaml")}
    assert {"smollm2-135m", "llama3-8b-1048k", "qwen-1.5b"} <= models
    for folder in ("calibrate", "train"):
        files = sorted((root / folder).iterdir())
        assert files, folder
        for path in files:
            if path.name == "__init__.py":
                continue
            assert path.suffix == ".yaml", f"configs/{folder}/{path.name}: not <model>[.<variant>].yaml"
            stem = path.name.removesuffix(".yaml")
            owners = [m for m in models if stem == m or (stem.startswith(f"{m}.") and len(stem) > len(m) + 1)]
            assert owners, f"configs/{folder}/{path.name}: {stem!r} is neither a model in configs/models/ nor <model>.<variant>"
            doc = yaml.safe_load(path.read_text())
            assert doc.get("model") in owners, f"configs/{folder}/{path.name}: model {doc.get('model')!r}"


def test_unknown_config_names_fail_in_one_line(capsys):
    from rolecall.core.configfile import ConfigError, read_config, shipped

    # an old name of a shipped config is no name: nothing of the kind shipped in a release
    for name, folder in (("nope", "train"), ("lycheedecode", "train"), ("llama3-8b-1048k", "calibrate"),
                         ("llama3-8b-1048k.nope", "train")):
        with pytest.raises(ConfigError) as e:
            read_config(name, "a config", folder)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"a config {name!r}: no such file, and not one of "
                                                          f"configs/{folder}/ (")
        assert all(shipped_name in message for shipped_name in shipped(folder))
    assert capsys.readouterr().err == ""
