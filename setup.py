"""The repository's top-level folders are mapped into the one package ``rolecall``: ``runtime/`` installs as
``rolecall.runtime``, ``calibrate/`` as ``rolecall.calibrate`` and so on, so nothing lands in site-packages
under a name of its own. Everything else about the distribution is in ``pyproject.toml``."""

from setuptools import find_packages, setup

PARTS = ("core", "runtime", "eval", "cli", "calibrate", "train", "data", "configs")

setup(
    packages=["rolecall"] + [f"rolecall.{name}" for name in find_packages(include=[f"{p}*" for p in PARTS])],
    package_dir={"rolecall": "rolecall", **{f"rolecall.{p}": p for p in PARTS}},
)
