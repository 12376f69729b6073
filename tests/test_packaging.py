"""The wheel holds every subpackage: the explicit list in pyproject.toml is checked against the tree.

An editable install finds every folder on disk and hides a subpackage missing from the list
(issue 25: a wheel had no ``abstractdiff.optim``, so ``ad.train`` failed once installed).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_in_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = config["package-dir"]
    on_disk = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join((package, *rel.parts)) if rel.parts else package
            deeper = [other for other in dirs if other != package and len(other) > len(package)]
            if not any(name.startswith(other + ".") for other in deeper):  # mapped to a folder of its own
                on_disk.add(name)
    assert on_disk <= listed, f"subpackages missing from pyproject's packages list: {sorted(on_disk - listed)}"
