"""`python -m tidal ...` runs tidal's command-line tool (the same binary as `tidal`)."""

import os
import shutil
import sys


def cli_path() -> str:
    """The `tidal` binary: TIDAL_CLI, installed with the package (tidal/bin/tidal, by pip),
    next to the package in a build tree (build/tidal for build/python/tidal), or on PATH."""
    env = os.environ.get("TIDAL_CLI")
    if env:
        return env
    here = os.path.dirname(os.path.realpath(__file__))
    package = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(package, "bin", "tidal"),
                      os.path.join(package, "..", "..", "tidal"),
                      os.path.join(here, "..", "..", "build", "tidal")):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.normpath(candidate)
    found = shutil.which("tidal")
    if found:
        return found
    sys.exit("tidal: the command-line tool was not found: build it (cmake --build build), put "
             "it on PATH, or set TIDAL_CLI to its path")


def main() -> None:
    path = cli_path()
    os.execv(path, [path] + sys.argv[1:])


if __name__ == "__main__":
    main()
