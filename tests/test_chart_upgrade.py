"""
The documented upgrade works from every earlier state of the chart.

An operator who installed the chart at any earlier commit upgrades with the
command the docs give.  Helm 4's C{--reuse-values} renders the new chart
with the old release's values alone (Helm's C{pkg/action/upgrade.go}: the
chart's defaults are replaced by the old chart's defaults coalesced with the
old release's own values), so every value added since is missing: from 11 of
the chart's 18 earlier C{values.yaml} states the docs' commands failed
(C{nil pointer evaluating interface {}.enabled}, C{.nri.gate}, schema
C{missing property 'gate'}).  C{--reset-then-reuse-values} takes the new
chart's defaults and puts the operator's own values over them.

Each earlier state of C{values.yaml} is kept, as C{git show} gave it, under
C{tests/fixtures/chart-values/} (C{NN-COMMIT.yaml}).  For each, every
C{helm upgrade} the docs give is taken as the first upgrade after an install
at that state (the commands before it in the same walk applied there), with
the value flag the doc's command carries, and today's chart is rendered by
Helm's engine from exactly the values Helm's upgrade would hand it:

- C{--reuse-values}: the chart's defaults are the old release's (the
  fixture, with the operator's values over it), and the operator's values
  with the command's C{--set} over them;
- C{--reset-then-reuse-values}, or C{-f FILE} holding the operator's values:
  the new chart's defaults, the operator's values, the command's C{--set};
- C{--reset-values}, or neither flag with a C{--set}: the new chart's
  defaults and the command's C{--set} alone (the operator's image and paths
  are lost: caught here by the image check).

The render must succeed, keep the operator's image, put every object where
the old release had it, and carry the gate the walk has reached.  The real
C{helm upgrade} with the documented flag, from the chart at an earlier commit
to this one on a live API server, is C{tests/cluster/test_upgrade.py}.
"""

from __future__ import annotations

import functools
import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import attrs
import helm_python as helm
import pytest
import yaml
from support import REPO
from test_chart import CHART, RELEASE, merge, notes, sets
from test_doc_namespace import commands

FIXTURES = sorted((REPO / "tests" / "fixtures" / "chart-values").glob("*.yaml"))
#: The flag every documented upgrade carries.
DOCUMENTED = "--reset-then-reuse-values"
MODES = {"--reuse-values", "--reset-then-reuse-values", "--reset-values"}
CLUSTER_SCOPED = {"Namespace", "MutatingWebhookConfiguration"}


@attrs.frozen
class Command:
    """One documented C{helm install} or C{helm upgrade}, as Helm reads its flags."""

    where: str
    text: str
    mode: str | None
    values_file: bool
    sets: dict[str, Any]
    namespace: str | None

    @classmethod
    def parse(cls, where: str, text: str) -> Command:
        words = shlex.split(text)
        mode = None
        values_file = False
        expressions = []
        namespace = None
        for index, word in enumerate(words):
            following = words[index + 1] if index + 1 < len(words) else ""
            if word in MODES:
                mode = word
            elif word in ("-f", "--values") or word.startswith("--values="):
                values_file = True
            elif word == "--set":
                expressions.append(following)
            elif word.startswith("--set="):
                expressions.append(word.split("=", 1)[1])
            elif word in ("-n", "--namespace"):
                namespace = following
        return cls(where, text, mode, values_file, sets(*expressions), namespace)


def documented(verb: str) -> list[Command]:
    return [c for c in _documented() if c.text.startswith(f"helm {verb} ")]


@functools.cache
def _documented() -> tuple[Command, ...]:
    """Every helm command of the docs, parsed once a run."""
    return tuple(Command.parse(where, text) for where, text in commands()
                 if text.startswith("helm "))


def find(verb: str, document: str, containing: str) -> Command:
    """The one C{helm VERB} in C{document} whose text contains C{containing}."""
    (found,) = [c for c in documented(verb)
                if c.where.split(":")[0] == document and containing in c.text]
    return found


@attrs.frozen
class Walk:
    """An install, then the upgrades a doc gives after it, in its order."""

    install: tuple[str, str]
    upgrades: tuple[tuple[str, str], ...]


WALKS = {
    "rollout": Walk(("docs/rollout.md", "hostPIDBroker.enabled=false"), (
        ("docs/rollout.md", "hostPIDBroker.enabled=true"),
        ("docs/rollout.md", "maxSurge=0"),
        ("docs/rollout.md", "hostPIDBroker.enabled=false"))),
    "the chart's README": Walk(("deploy/helm/hostpid-broker/README.md", "image.repository"), (
        ("deploy/helm/hostpid-broker/README.md", "hostPIDBroker.enabled=true"),)),
    "the webhook path": Walk(("docs/paths.md", "webhook.enabled=true"), (
        ("docs/paths.md", "hostPIDBroker.enabled=true"),
        ("docs/paths.md", "webhook.gate=true"))),
    "the NRI path": Walk(("docs/rollout.md", "hostPIDBroker.enabled=false"), (
        ("docs/rollout.md", "hostPIDBroker.enabled=true"),
        ("docs/nri.md", "nri.gate=true"))),
}
#: A release installed before the chart went into the release's namespace
#: (stored in C{default}, the chart creating C{hostpid}): the chart's README
#: gives its own first upgrade.
MIGRATION = ("deploy/helm/hostpid-broker/README.md", "namespace.create=true")


def old_layout(fixture: Path) -> bool:
    return bool(yaml.safe_load(fixture.read_text())["namespace"]["create"])


def crossings() -> list[tuple[str, int]]:
    """Every (walk, upgrade) position, each taken in turn as the one that crosses charts."""
    return [(name, index) for name, walk in WALKS.items() for index in range(len(walk.upgrades))]


@functools.cache
def chart_with_defaults(fixture: Path | None, scratch: Path) -> Path:
    """Today's chart; with C{fixture}, its defaults replaced by that earlier state."""
    if fixture is None:
        return CHART
    copy = scratch / fixture.stem
    if not copy.exists():
        shutil.copytree(CHART, copy)
        shutil.copyfile(fixture, copy / "values.yaml")
    return copy


def upgrade_inputs(command: Command, fixture: Path, operator: dict[str, Any]
                   ) -> tuple[Path | None, dict[str, Any]]:
    """
    What Helm's upgrade renders today's chart with, for C{command} run on a
    release installed at C{fixture} with the operator's values C{operator}:
    (whose defaults, the values), by the rule of Helm's C{pkg/action/upgrade.go}
    for the command's flag.
    """
    if command.mode == "--reset-values" or (
            command.mode is None and not command.values_file and command.sets):
        return None, command.sets
    if command.mode == "--reuse-values":
        return fixture, merge(operator, command.sets)
    # --reset-then-reuse-values; -f FILE (the operator's values file) is the same input.
    return None, merge(operator, command.sets)


@functools.cache
def _render(defaults: Path, values_json: str, namespace: str) -> list[dict[str, Any]]:
    with helm.Chart.load(defaults) as chart:
        rendered = chart.render(json.loads(values_json), name=RELEASE, namespace=namespace,
                                revision=2, is_install=False, is_upgrade=True)
    return [doc for template, text in sorted(rendered.items()) if template.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def render_upgrade(defaults: Path, values: dict[str, Any], namespace: str
                   ) -> list[dict[str, Any]]:
    """Helm's render; one per distinct input (the fixtures give many identical ones)."""
    return _render(defaults, json.dumps(values, sort_keys=True), namespace)


@attrs.frozen
class Outcome:
    error: str | None
    docs: list[dict[str, Any]]


def cross(walk: Walk, index: int, fixture: Path, scratch: Path,
          mode: str | None = None) -> tuple[Outcome, dict[str, Any], str]:
    """
    Install at C{fixture} with the walk's install command, run the walk's
    upgrades before C{index} there, then upgrade to today's chart with the
    one at C{index} (its documented flag, or C{mode}).  Returns the outcome,
    the operator's values after it, and where the objects must be.
    """
    operator = documented_install(walk).sets
    namespace = "hostpid"
    expected_namespace = "hostpid"
    upgrades = [find("upgrade", *u) for u in walk.upgrades]
    if old_layout(fixture):
        # The old layout: the release lives in default, its objects in hostpid; the chart's
        # README installed it, and its one upgrade for that layout is the crossing.
        namespace, upgrades, index = "default", [find("upgrade", *MIGRATION)], 0
        operator = documented_install(WALKS["the chart's README"]).sets
    for earlier in upgrades[:index]:
        operator = merge(operator, earlier.sets)
    command = upgrades[index]
    if mode is not None:
        command = attrs.evolve(command, mode=mode)
    defaults, values = upgrade_inputs(command, fixture, operator)
    try:
        docs = render_upgrade(chart_with_defaults(defaults, scratch), values, namespace)
    except helm.HelmError as refused:
        return Outcome(f"{command.where}: {refused}", []), operator, expected_namespace
    return Outcome(None, docs), merge(operator, command.sets), expected_namespace


#: The reader's own registry, in place of the docs' placeholder (which is the chart's
#: default): a value of the operator's that an upgrade must keep.
OWN_REPOSITORY = "registry.internal/gpu/hostpid-broker"


def documented_install(walk: Walk) -> Command:
    command = find("install", *walk.install)
    assert "image" in command.sets, command.text
    return attrs.evolve(command, sets=merge(command.sets, {
        "image": {"repository": OWN_REPOSITORY}}))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("charts")


def test_every_earlier_state_is_kept() -> None:
    """20 states of values.yaml before chart 0.2.0, 5 of them the old namespace layout."""
    assert len(FIXTURES) == 20
    assert sum(old_layout(f) for f in FIXTURES) == 5


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_the_documented_upgrades_work_from_each_earlier_state(fixture: Path, scratch: Path
                                                              ) -> None:
    failures = []
    for name, index in crossings():
        walk = WALKS[name]
        outcome, operator, namespace = cross(walk, index, fixture, scratch)
        if outcome.error is not None:
            failures.append(outcome.error)
            continue
        daemonset = next(d for d in outcome.docs if d["kind"] == "DaemonSet"
                         and d["metadata"]["name"] == "hostpid-broker")
        image = daemonset["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image.startswith(operator["image"]["repository"] + ":"), \
            (name, index, "the operator's image was lost", image)
        env = {e["name"]: e.get("value")
               for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["LIBVGPU_HOSTPID_BROKER"] == \
            ("1" if operator.get("hostPIDBroker", {}).get("enabled") else "0"), (name, index)
        assert {d["metadata"].get("namespace") for d in outcome.docs
                if d["kind"] not in CLUSTER_SCOPED} == {namespace}, (name, index)
    assert failures == []


def test_every_documented_upgrade_names_the_flag_that_keeps_both() -> None:
    """
    Every C{helm upgrade} in the docs and in the NOTES carries
    C{--reset-then-reuse-values} (the new chart's defaults, the operator's
    values over them), or C{-f} a values file with no C{--reuse-values}:
    never C{--reuse-values} (new values missing), never a bare C{--set}
    (the operator's values dropped).
    """
    found = documented("upgrade")
    for values in (sets("hostPIDBroker.enabled=true", "webhook.enabled=true",
                        "webhook.gate=true", "nri.enabled=true", "nri.gate=true"),
                   sets("nri.enabled=true"), sets("hostPIDBroker.enabled=true"), None):
        found += [Command.parse("NOTES", line.strip())
                  for line in notes(values).splitlines()
                  if line.strip().startswith("helm upgrade")]
    assert len(found) >= 10
    wrong = [(c.where, c.text) for c in found
             if not (c.mode == DOCUMENTED or (c.values_file and c.mode is None))]
    assert wrong == []


def test_the_old_flag_fails_from_earlier_states(scratch: Path) -> None:
    """
    The control: the same walks with C{--reuse-values}, as the docs had it,
    fail from earlier states, with the messages operators saw; the check
    above would have failed on the old docs.
    """
    failed = {}
    for fixture in FIXTURES:
        for name, index in crossings():
            outcome, _, _ = cross(WALKS[name], index, fixture, scratch, mode="--reuse-values")
            if outcome.error is not None:
                failed[fixture.stem] = outcome.error
                break  # one failing documented command is the operator's failed upgrade
    # 13 of the 20 when this was written: every state before the NRI plugin's gate value.
    assert len(failed) >= 11, sorted(failed)
    assert {f.stem for f in FIXTURES if old_layout(f)} <= set(failed), \
        "every state of the old namespace layout fails its migration with --reuse-values"
    assert any("nil pointer evaluating" in e for e in failed.values()), failed
    assert any("missing property 'gate'" in e for e in failed.values()), failed


def test_a_bare_set_loses_the_operators_values(scratch: Path) -> None:
    """The other trap the check catches: C{helm upgrade --set ...} alone."""
    walk = WALKS["rollout"]
    outcome, operator, _ = cross(walk, 0, FIXTURES[-1], scratch, mode="--reset-values")
    assert outcome.error is None
    daemonset = next(d for d in outcome.docs if d["kind"] == "DaemonSet")
    image = daemonset["spec"]["template"]["spec"]["containers"][0]["image"]
    assert not image.startswith(operator["image"]["repository"] + ":"), image
