"""
The CDI project's own JSON schema, read where Debian installs it (never
copied into this project), for validating the specs we write.

The schema is two files: C{schema.json} refers to C{defs.json} by a relative
C{$ref}, so both are put in one C{referencing} registry under those names.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import REQUIRE_PRIVILEGED, require_tool

#: The Debian package that ships the schema (installed by .ci/run).
SCHEMA_PACKAGE = "golang-github-container-orchestrated-devices-container-device-interface-dev"


def schema_directory() -> Path:
    """The installed C{.../container-device-interface/schema} directory."""
    listed = subprocess.run(
        [require_tool("dpkg"), "-L", SCHEMA_PACKAGE], capture_output=True, text=True, timeout=60,
        check=False,
    )
    for line in listed.stdout.splitlines():
        path = Path(line)
        if path.name == "schema.json" and path.parent.name == "schema":
            return path.parent
    reason = f"the CDI JSON schema needs the Debian package {SCHEMA_PACKAGE}"
    if REQUIRE_PRIVILEGED:
        pytest.fail(f"HOSTPID_REQUIRE_PRIVILEGED=1 but {reason}")
    pytest.skip(reason)


def cdi_validator() -> Any:
    """A Draft 7 validator for C{schema.json}, resolving C{defs.json} by registry."""
    from jsonschema import Draft7Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    directory = schema_directory()
    schema = json.loads((directory / "schema.json").read_text())
    defs = json.loads((directory / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resources([
        ("schema.json", Resource.from_contents(schema, default_specification=DRAFT7)),
        ("defs.json", Resource.from_contents(defs, default_specification=DRAFT7)),
    ])
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema, registry=registry)


def schema_errors(spec: Any) -> list[str]:
    """Every schema violation in C{spec}, as readable lines (empty when valid)."""
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in cdi_validator().iter_errors(spec)
    ]
