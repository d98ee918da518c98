"""Runs apex's setup.py (in the current folder) building only the extensions named in APEX_EXTENSIONS: its --cuda_ext
builds a dozen, most of which vitctl never loads, and each costs minutes per CUDA arch."""

import os
import runpy
import sys

import setuptools


def main() -> None:
    wanted = set(os.environ.get("APEX_EXTENSIONS", "").split())
    setup = setuptools.setup

    def subset(**kwargs):
        chosen = [e for e in kwargs.get("ext_modules", []) if e.name in wanted]
        missing = wanted - {e.name for e in chosen}
        if missing:
            sys.exit(f"apex_subset: this apex has no extension {', '.join(sorted(missing))} (with APEX_CPP_EXT=1 "
                     "APEX_CUDA_EXT=1); fix APEX_EXTENSIONS or the apex ref")
        return setup(**{**kwargs, "ext_modules": chosen})

    setuptools.setup = subset
    sys.argv[0] = "setup.py"
    runpy.run_path("setup.py", run_name="__main__")


if __name__ == "__main__":
    main()
