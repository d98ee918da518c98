"""Exits non-zero unless the wheel holds a compiled module for every name given: a setup.py that finds no CUDA
toolkit builds a wheel without its extensions, and the image must not ship one."""

import sys
import zipfile
from pathlib import Path


def main(wheel: str, *modules: str) -> None:
    names = {Path(n).name.split(".")[0] for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")}
    missing = [m for m in modules if m not in names]
    if missing:
        sys.exit(f"{wheel} has no compiled {', '.join(missing)}: the build found no CUDA toolkit (CUDA_HOME, nvcc) "
                 "or no CUDA build of torch in the base image")


if __name__ == "__main__":
    main(*sys.argv[1:])
