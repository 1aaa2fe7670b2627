"""The templates of the cluster's files, and the filters they write values with.

They live in the project's top-level ``templates/`` and ship inside the package
(``cosyvoice_lb/templates`` links there; setup.cfg's package data takes the folder whole), so
a checkout, an editable install and a wheel all find them the one way: Jinja's
:class:`~jinja2.PackageLoader` over the package.
"""

from __future__ import annotations

import re
from importlib import resources

import jinja2

PACKAGE, FOLDER = "cosyvoice_lb", "templates"


def quote_nginx(value: object) -> str:
    text = str(value)
    if re.fullmatch(r"[\w./:@+-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def escape_supervisor(value: object) -> str:
    return str(value).replace("%", "%%")


def supervisor_env(env: dict[str, str]) -> str:
    def quote(v: str) -> str:
        return '"' + v.replace("%", "%%").replace('"', '\\"') + '"'

    return ",".join(f"{k}={quote(v)}" for k, v in sorted(env.items()))


def template_environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(PACKAGE, FOLDER),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(nq=quote_nginx, sv=escape_supervisor, svenv=supervisor_env)
    return env


def read(name: str) -> str:
    """A file of the templates folder as it is (the control panel's page)."""
    return resources.files(PACKAGE).joinpath(FOLDER).joinpath(name).read_text(encoding="utf-8")
