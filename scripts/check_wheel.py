"""What the built wheel and sdist must hold (run by scripts/package.sh): the package with its
py.typed marker and every subpackage, the console script, torch as the only requirement
outside the extras, no tests; the sdist carries what the wheel is built from."""

from __future__ import annotations

import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path


def main(wheel: str, sdist: str) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packages = {"core", "look", "diagnose", "explain", "extract", "show", "integrations"}
    for required in ["hookscope/__init__.py", "hookscope/py.typed"] + [
        f"hookscope/{p}/__init__.py" for p in sorted(packages)
    ]:
        assert required in names, f"{wheel} lacks {required}"
    assert not [n for n in names if n.startswith(("tests/", "bench/"))], "tests in the wheel"
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(info).decode())
    requires = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert [r.replace(" ", "") for r in requires] == ["torch>=2.11"], requires
    points = zipfile.ZipFile(wheel).read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "hookscope = hookscope.show:main" in points, points
    with tarfile.open(sdist) as archive:
        members = {Path(*Path(m).parts[1:]).as_posix() for m in archive.getnames()}
    for required in ("pyproject.toml", "README.md", "src/hookscope/py.typed"):
        assert required in members, f"{sdist} lacks {required}"
    print(f"{Path(wheel).name}: {len(names)} files; {Path(sdist).name}: {len(members)} entries")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
