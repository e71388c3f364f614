"""
The chart's version changes whenever the chart does.

An operator decides how to upgrade from what the version tells: C{helm
history}, C{helm list} and the C{helm.sh/chart} label show it, and the
chart's C{CHANGELOG.md} says, per version, what changed and what to do.  The
chart stayed C{0.1.0} through 27 changes (new values, new objects, a new
namespace layout), so nothing told an upgrade across them from a no-op.

The rule held here: C{deploy/helm/chart-versions.txt} records, for every
version of the chart, the digest of its files (L{chart_digest}: every file
C{helm package} ships, by path and content).  The test fails when the chart's
files are not the ones recorded for the version C{Chart.yaml} names: editing a
template, a value or the README without a new version and a new line fails;
so does a new version without its line or without its section in the chart's
C{CHANGELOG.md}.  Versions only grow (SemVer order) and no two name the same
files.  A version's line may be rewritten only while that version is
unreleased (a merge of two branches into one release); that is a decision a
reviewer sees in the diff of the record, never a side effect of an edit.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import shutil
from pathlib import Path

import yaml
from support import REPO

CHART = REPO / "deploy" / "helm" / "hostpid-broker"
RECORD = REPO / "deploy" / "helm" / "chart-versions.txt"
CHART_CHANGELOG = CHART / "CHANGELOG.md"
LINE = re.compile(r"^(\d+)\.(\d+)\.(\d+) sha256:([0-9a-f]{64})$")


def ignored(relative: str, patterns: list[str]) -> bool:
    """What C{.helmignore} leaves out of the package (its simple glob form)."""
    name = relative.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(relative, p) for p in patterns)


def chart_digest(chart: Path) -> str:
    """
    SHA-256 over every file of C{chart} that C{helm package} ships: each
    file's path relative to the chart and the SHA-256 of its content, sorted
    by path.  A rename, an added or removed file and any byte changed all
    change it; file times and modes (which a checkout does not keep) do not.
    """
    helmignore = chart / ".helmignore"
    patterns = [line.strip() for line in helmignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")] if helmignore.exists() else []
    entries = []
    for path in sorted(chart.rglob("*")):
        relative = path.relative_to(chart).as_posix()
        if path.is_file() and not ignored(relative, patterns):
            entries.append(f"{relative}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n")
    return hashlib.sha256("".join(entries).encode()).hexdigest()


def recorded() -> list[tuple[tuple[int, int, int], str]]:
    """The record's lines, in file order: ((major, minor, patch), digest)."""
    lines = []
    for number, text in enumerate(RECORD.read_text().splitlines(), 1):
        if not text.strip() or text.startswith("#"):
            continue
        match = LINE.match(text)
        assert match, f"{RECORD.relative_to(REPO)}:{number}: not 'X.Y.Z sha256:HEX': {text!r}"
        major, minor, patch, digest = match.groups()
        lines.append(((int(major), int(minor), int(patch)), digest))
    return lines


def dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def chart_version(chart: Path = CHART) -> str:
    return str(yaml.safe_load((chart / "Chart.yaml").read_text())["version"])


def test_the_chart_is_the_one_recorded_for_its_version() -> None:
    """
    The files are those recorded for C{Chart.yaml}'s version, and that
    version is the newest recorded: a change to the chart without a new
    version (and its line) fails here, naming what to do.
    """
    version = chart_version()
    digest = chart_digest(CHART)
    lines = recorded()
    newest = dotted(lines[-1][0])
    assert version == newest, (
        f"Chart.yaml names version {version}, the newest in {RECORD.relative_to(REPO)} "
        f"is {newest}")
    assert digest == lines[-1][1], (
        f"the files of {CHART.relative_to(REPO)} changed since version {version} was "
        f"recorded: give the chart a new version in Chart.yaml, say what changed in its "
        f"CHANGELOG.md, and add the line '{{NEW VERSION}} sha256:{digest}' to "
        f"{RECORD.relative_to(REPO)} (rewrite {version}'s line instead only if {version} "
        f"was never released)")


def test_versions_only_grow_and_each_names_other_files() -> None:
    lines = recorded()
    versions = [version for version, _ in lines]
    assert versions == sorted(set(versions)), "SemVer order, each version once"
    digests = [digest for _, digest in lines]
    assert len(set(digests)) == len(digests), "two versions recorded for the same files"


def test_every_version_has_its_changelog_section() -> None:
    sections = re.findall(r"^## (\d+\.\d+\.\d+)\b", CHART_CHANGELOG.read_text(), re.MULTILINE)
    assert sorted(sections) == sorted(dotted(v) for v, _ in recorded()), \
        "one section in the chart's CHANGELOG.md per recorded version"


def test_appversion_follows_the_distribution() -> None:
    """
    C{appVersion} is the software's version (the image tag by default, the
    C{app.kubernetes.io/version} label): the distribution's, from
    C{setup.cfg}.  C{version} is the chart's own, recorded above.
    """
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == setup["metadata"]["version"]


def test_the_digest_sees_every_change_to_the_chart(tmp_path: Path) -> None:
    """
    The control: the check above fails for each kind of change a chart can
    get without its version, and not for what C{helm package} leaves out.
    """
    copy = tmp_path / "hostpid-broker"
    shutil.copytree(CHART, copy)
    assert chart_digest(copy) == chart_digest(CHART)
    before = chart_digest(copy)

    (copy / "values.yaml.orig").write_text("an editor's backup: .helmignore leaves it out\n")
    assert chart_digest(copy) == before

    notes = copy / "templates" / "NOTES.txt"
    notes.write_text(notes.read_text() + " ")
    edited = chart_digest(copy)
    assert edited != before, "one byte of a template"

    (copy / "templates" / "extra.yaml").write_text("")
    added = chart_digest(copy)
    assert added not in (before, edited), "a new, even empty, file"

    (copy / "templates" / "extra.yaml").rename(copy / "templates" / "other.yaml")
    assert chart_digest(copy) not in (before, edited, added), "a rename"
