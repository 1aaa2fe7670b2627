"""Print the package's dependencies, from setup.cfg's install_requires, one a line.

The image's build stage installs them before it copies the code, so that their layer is
reused while only the code changes: ``python docker/requirements.py setup.cfg``."""

from __future__ import annotations

import configparser
import sys


def requirements(setup_cfg: str) -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    lines = (line.split("#", 1)[0].strip() for line in parser["options"]["install_requires"].splitlines())
    return [line for line in lines if line]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
