"""benchmarks/report.py's host_cpu: the host's CPU model from /proc/cpuinfo, else platform's name for it."""

import builtins
import io
import platform


def test_host_cpu_reads_the_model_name_and_falls_back_to_platform(monkeypatch):
    from benchmarks.report import host_cpu

    real_open = builtins.open
    cpuinfo = "processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU @ 2.00GHz\nflags\t: a b\n"

    def fake_open(path, *args, **kwargs):
        return io.StringIO(cpuinfo) if path == "/proc/cpuinfo" else real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert host_cpu() == "Example CPU @ 2.00GHz"

    def no_file(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(builtins, "open", no_file)
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert host_cpu() == "arm"

    arm_cpuinfo = "processor\t: 0\nBogoMIPS\t: 2000.00\nCPU implementer\t: 0x41\n"  # no model name line
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(arm_cpuinfo) if path == "/proc/cpuinfo"
                        else real_open(path, *a, **k))
    assert host_cpu() == "arm"
