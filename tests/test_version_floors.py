"""The version floors of pyproject.toml against the pins of constraints.txt and the code.

Every dependency (runtime and the ``test`` extra) has a pin in constraints.txt, and that pin
satisfies the floor (so ``make setup`` installs a set the floors allow); the floors are at
least what the code needs: ``jax.enable_x64`` as a context manager (jax 0.8.0) and ``tomllib``
(Python 3.11, so no ``tomli`` fallback is left).
"""
from __future__ import annotations

import os
import re
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = {"jax": ("jax.enable_x64(", "0.8.0")}
"""Package: (an API the code calls, the first version that has it)."""


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["project"]


def _pins() -> dict:
    pins = {}
    with open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8") as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                assert version, f"constraints.txt: {line!r} is not a name==version pin"
                pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements():
    project = _project()
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project.get("optional-dependencies", {}).values() for r in extra]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def _floor(req: Requirement) -> Version:
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert lows, f"pyproject.toml: {req} states no floor"
    return max(lows)


def _source():
    for folder, _, files in os.walk(os.path.join(ROOT, "powerlens")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as fh:
                    yield path, fh.read()


def test_every_dependency_is_pinned_within_its_floor():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"pyproject.toml depends on {req.name}, which constraints.txt does not pin"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}"
        assert _floor(req) <= pins[name]


def test_the_floors_cover_what_the_code_calls():
    floors = {canonicalize_name(r.name): _floor(r) for r in _requirements()}
    code = "".join(text for _, text in _source())
    for package, (api, first) in NEEDS.items():
        assert api in code                                   # still used: the entry is not stale
        assert floors[package] >= Version(first), f"the code calls {api} (new in {package} {first}), " \
                                                  f"but pyproject allows {package} {floors[package]}"


def test_python_floor_is_311_and_no_tomli_fallback_is_left():
    requires = SpecifierSet(_project()["requires-python"])
    assert Version("3.11") in requires and Version("3.10") not in requires
    assert Version(f"{sys.version_info.major}.{sys.version_info.minor}") in requires
    assert not any("tomli" in r.name for r in _requirements())
    for path, text in _source():
        assert not re.search(r"^\s*(import tomli\b|from tomli\b)", text, re.M), f"{path}: a tomli fallback"
