"""The built wheel works outside the checkout: console scripts run and model aliases ship as package data."""

import os
import site
import subprocess
import sys
import venv

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

    where = run(str(py), "-c", "import runtime, configs; print(runtime.__file__); print(configs.__file__)")
    assert ROOT not in where and "site-packages" in where
    aliases = run(str(py), "-c", "from runtime.models import list_aliases; print(' '.join(list_aliases()))")
    assert {"qwen-14b", "smollm2-135m", "llama-70b"} <= set(aliases.split())
    assert "inspect" in run(str(bin_dir / "rolecall"), "--help")
    assert "--model" in run(str(bin_dir / "calibrate-delta"), "--help")
    assert "--target" in run(str(bin_dir / "train-heads"), "--help")


def test_registry_imports_on_lookup_and_refuses_unknown_names():
    from runtime.registry import Registry

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
    from calibrate.config import CalibrateConfig, read_yaml
    from runtime.configfile import ConfigError, layered, read_config

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
