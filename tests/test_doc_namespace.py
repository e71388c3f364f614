"""
One namespace in every command of the docs, and every object those commands
name is where they look for it.

A new user copies the commands in order: C{docs/paths.md} installed the chart
with C{--namespace default} and then waited on
C{kubectl -n hostpid rollout status daemonset/hostpid-broker}, which fails
(the DaemonSet was in C{default}).  So every C{helm} and C{kubectl} command in
C{README.md}, C{docs/*.md} and the chart's README that names a namespace names
C{hostpid} (an upper-case placeholder such as C{NAMESPACE} is the reader's
own), and every object a C{kubectl -n hostpid} command names
(C{daemonset/NAME}, C{deployment/NAME}, C{get KIND NAME}, C{-l
app.kubernetes.io/name=NAME}) is rendered by the chart, installed in
C{hostpid} with every part the docs turn on, in that namespace.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from support import REPO
from test_chart import render, sets

#: The namespace the docs install into.
NAMESPACE = "hostpid"

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             REPO / "deploy" / "helm" / "hostpid-broker" / "README.md"]

COMMAND = re.compile(r"\b(helm|kubectl)\s[^`\n]*")
NAMESPACE_FLAG = re.compile(r"(?:^|\s)(?:-n|--namespace)[\s=]+(\S+)")
KINDS = {"daemonset": "DaemonSet", "ds": "DaemonSet", "deployment": "Deployment",
         "deploy": "Deployment", "service": "Service", "svc": "Service",
         "networkpolicy": "NetworkPolicy", "secret": "Secret",
         "serviceaccount": "ServiceAccount", "poddisruptionbudget": "PodDisruptionBudget"}
SLASHED = re.compile(r"\b(" + "|".join(KINDS) + r")/([a-z0-9][a-z0-9.-]*)")
GOTTEN = re.compile(r"\bget\s+(" + "|".join(KINDS) + r")\s+([a-z0-9][a-z0-9.-]*)")
LABELLED = re.compile(r"-l\s+app\.kubernetes\.io/name=([a-z0-9-]+)")


def commands() -> list[tuple[str, str]]:
    """Every helm and kubectl command in the docs, continuation lines joined, with where."""
    found = []
    for path in DOCUMENTS:
        text = path.read_text().replace("\\\n", " ")
        for number, line in enumerate(text.splitlines(), 1):
            for match in COMMAND.finditer(line):
                found.append((f"{path.relative_to(REPO)}:{number}", match.group(0)))
    return found


def namespaced(command: str) -> str | None:
    match = NAMESPACE_FLAG.search(command)
    return match.group(1) if match else None


def is_placeholder(name: str) -> bool:
    return name.isupper() or name.startswith("$")


def test_every_command_names_the_one_namespace() -> None:
    found = commands()
    assert len(found) > 20, "the docs' commands were found"
    wrong = [(where, command) for where, command in found
             if (ns := namespaced(command)) is not None
             and ns != NAMESPACE and not is_placeholder(ns)]
    assert wrong == []


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    docs = render(sets("hostPIDBroker.enabled=true", "webhook.enabled=true",
                       "webhook.gate=true", "webhook.mode=mounts", "nri.enabled=true"),
                  namespace=NAMESPACE)
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def test_every_object_the_commands_name_is_in_that_namespace() -> None:
    rendered = objects()
    pod_names = {doc["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name")
                 for doc in rendered.values() if doc["kind"] in ("DaemonSet", "Deployment")}
    named = []
    missing = []
    for where, command in commands():
        if not command.startswith("kubectl") or namespaced(command) != NAMESPACE:
            continue
        for kind, name in [*SLASHED.findall(command), *GOTTEN.findall(command)]:
            named.append(name)
            doc = rendered.get((KINDS[kind], name))
            if doc is None or doc["metadata"].get("namespace") != NAMESPACE:
                missing.append((where, f"{kind}/{name}"))
        for name in LABELLED.findall(command):
            named.append(name)
            if name not in pod_names:
                missing.append((where, f"pods labelled {name}"))
    assert {"hostpid-broker", "hostpid-webhook"} <= set(named)
    assert missing == []


def test_the_check_finds_a_wrong_namespace() -> None:
    """The control: the very commands that once disagreed are caught."""
    old = "helm install hostpid-broker deploy/helm/hostpid-broker --namespace default"
    assert namespaced(old) == "default"
    assert namespaced("kubectl -n hostpid rollout status daemonset/hostpid-broker") == NAMESPACE
    assert SLASHED.findall("kubectl -n hostpid rollout status deployment/hostpid-webhook") == [
        ("deployment", "hostpid-webhook")]
    assert namespaced("kubectl -n NAMESPACE delete pod NAME") == "NAMESPACE"
    assert is_placeholder("NAMESPACE") and not is_placeholder("default")


def test_paths_document_is_among_those_checked() -> None:
    assert Path(REPO / "docs" / "paths.md") in DOCUMENTS
