"""
A Pod (a dict, as the API server stores it) and device plugin allocation
responses turned into CRI requests the way the kubelet turns them.

Pure functions of their inputs, so a test can print what it sends.  Each
step names the kubelet code it follows (kubernetes/kubernetes, pkg/kubelet):

- C{kuberuntime/kuberuntime_sandbox.go} C{generatePodSandboxConfig}: the
  PodSandboxConfig: metadata, labels (C{labels.go} C{newPodLabels}), and
  annotations, which are the pod's own annotations and nothing else
  (C{labels.go} C{newPodAnnotations} returns C{pod.Annotations}); a
  host-network pod gets no hostname; the log directory is
  C{<root>/<namespace>_<name>_<uid>} (C{kubelet/util} C{BuildPodLogsDirectory}).
- C{cm/devicemanager/pod_devices.go} C{deviceRunContainerOptions}: every
  allocation response of the container's resources folded into one set of
  options; an env, a mount's container path or an annotation already set by
  an earlier response is skipped; CDI device names are kept once each;
  device specs become the ContainerConfig's C{devices}.
- C{kubelet_pods.go} C{GenerateRunContainerOptions}: the device options
  first, then the container's own env (C{makeEnvironmentVariables}) and its
  volume mounts (C{makeMounts}: a hostPath volume becomes a mount of its
  path, read-only as the volumeMount says, propagation from
  C{mountPropagation}, private by default) appended after them.
- C{kuberuntime/kuberuntime_container.go} C{generateContainerConfig} and
  C{makeMounts}: the ContainerConfig: envs and mounts in that order, then
  the termination message file bound at C{terminationMessagePath}; C{labels.go}
  C{newContainerAnnotations}: the container's annotations are the device
  options' annotations plus the kubelet's own C{io.kubernetes.container.*}
  keys, never the pod's; C{makeCDIDevices}: the C{CDI_devices} field.
- C{kuberuntime/security_context.go} C{determineEffectiveSecurityContext}
  and C{helpers.go} C{namespacesForPod}: run-as user and group, no new
  privileges when C{allowPrivilegeEscalation} is false, and the namespaces:
  node network for C{hostNetwork}, a PID namespace of the container's own
  unless C{shareProcessNamespace} or C{hostPID}.

What the kubelet adds that these tests leave out, because nothing here
depends on it: service link env variables, the C{/etc/hosts} file, the
service account token volume, DNS config, resources and cgroup limits,
C{$(VAR)} expansion in command and args, and the container hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

#: C{pkg/kubelet/types/labels.go}.
POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
POD_UID_LABEL = "io.kubernetes.pod.uid"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"

DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"

_PROPAGATION = {None: "PROPAGATION_PRIVATE", "None": "PROPAGATION_PRIVATE",
                "HostToContainer": "PROPAGATION_HOST_TO_CONTAINER",
                "Bidirectional": "PROPAGATION_BIDIRECTIONAL"}


@attrs.frozen
class KubeMount:
    """C{kubecontainer.Mount}: one bind the runtime makes."""

    container_path: str
    host_path: str
    read_only: bool = False
    propagation: str = "PROPAGATION_PRIVATE"


@attrs.frozen
class KubeDevice:
    """C{kubecontainer.DeviceInfo}: one device node the runtime adds."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@attrs.frozen
class RunContainerOptions:
    """The parts of C{kubecontainer.RunContainerOptions} a ContainerConfig is made from."""

    envs: tuple[tuple[str, str], ...] = ()
    mounts: tuple[KubeMount, ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    cdi_devices: tuple[str, ...] = ()
    devices: tuple[KubeDevice, ...] = ()


def device_options(responses: Iterable[Mapping[str, Any]]) -> RunContainerOptions:
    """
    Allocation responses (the device plugin API's JSON field names, as
    C{hostpid allocate} writes them) folded as the device manager folds them;
    the first setting of an env, mount path or annotation wins.  (Go walks a
    response's env and annotation maps in random order; sorted here.)
    """
    envs: dict[str, str] = {}
    mounts: dict[str, KubeMount] = {}
    annotations: dict[str, str] = {}
    cdi: list[str] = []
    devices: list[KubeDevice] = []
    for response in responses:
        for key, value in sorted(response.get("envs", {}).items()):
            envs.setdefault(key, value)
        for mount in response.get("mounts", []):
            path = mount["containerPath"]
            mounts.setdefault(path, KubeMount(path, mount["hostPath"],
                                              bool(mount.get("readOnly", False))))
        for key, value in sorted(response.get("annotations", {}).items()):
            annotations.setdefault(key, value)
        for device in response.get("cdiDevices", []):
            if device["name"] not in cdi:
                cdi.append(device["name"])
        # Device specs are appended as they come (pod_devices.go: one
        # DeviceInfo per spec, no de-duplication).
        devices.extend(KubeDevice(d["containerPath"], d["hostPath"], d.get("permissions", "rw"))
                       for d in response.get("devices", []))
    return RunContainerOptions(tuple(envs.items()), tuple(mounts.values()),
                               tuple(annotations.items()), tuple(cdi), tuple(devices))


def _pod_spec(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    spec: Mapping[str, Any] = pod.get("spec", {})
    return spec


def container_options(pod: Mapping[str, Any], container: Mapping[str, Any],
                      devices: RunContainerOptions) -> RunContainerOptions:
    """C{GenerateRunContainerOptions}: the device options, then env and volume mounts."""
    volumes = {volume["name"]: volume for volume in _pod_spec(pod).get("volumes", [])}
    mounts = list(devices.mounts)
    for volume_mount in container.get("volumeMounts", []):
        volume = volumes[volume_mount["name"]]
        if "hostPath" not in volume:
            raise NotImplementedError(f"volume {volume['name']!r}: only hostPath is modelled")
        mounts.append(KubeMount(
            volume_mount["mountPath"], volume["hostPath"]["path"],
            bool(volume_mount.get("readOnly", False)),
            _PROPAGATION[volume_mount.get("mountPropagation")],
        ))
    envs = [*devices.envs, *((env["name"], env.get("value", ""))
                             for env in container.get("env", []))]
    return attrs.evolve(devices, envs=tuple(envs), mounts=tuple(mounts))


def pod_log_directory(root: Path, pod: Mapping[str, Any]) -> Path:
    meta = pod["metadata"]
    return root / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


def _namespaces(pb: ModuleType, pod: Mapping[str, Any]) -> Any:
    spec = _pod_spec(pod)
    if spec.get("hostPID"):
        pid = pb.NODE
    elif spec.get("shareProcessNamespace"):
        pid = pb.POD
    else:
        pid = pb.CONTAINER
    return pb.NamespaceOption(
        network=pb.NODE if spec.get("hostNetwork") else pb.POD,
        pid=pid,
        ipc=pb.NODE if spec.get("hostIPC") else pb.POD,
    )


#: The size of a user-namespaced pod's mapping (the kubelet's
#: C{userNsLength}, 65,536 IDs from a multiple of it).
USERNS_SIZE = 65536


def user_namespace(pb: ModuleType, host_base: int) -> Any:
    """
    The CRI C{UserNamespace} the kubelet sends for a C{hostUsers: false}
    pod (C{pkg/kubelet/userns}: mode C{POD}, one mapping of
    L{USERNS_SIZE} IDs from C{host_base}, the same for UIDs and GIDs).
    """
    assert host_base % USERNS_SIZE == 0 and host_base >= USERNS_SIZE, host_base
    mapping = [pb.IDMapping(host_id=host_base, container_id=0, length=USERNS_SIZE)]
    return pb.UserNamespace(mode=pb.POD, uids=mapping, gids=mapping)


def apply_user_namespace(pb: ModuleType, config: Any, host_base: int) -> None:
    """
    What the kubelet adds to a sandbox or container config for a
    C{hostUsers: false} pod: the user namespace in the namespace options
    and, on a container, the pod's mapping on every CRI mount (which the
    runtime makes an idmapped mount: C{applyPlatformSpecificContainerConfig}
    in C{kuberuntime_container_linux.go}, docs/userns.md).
    """
    userns = user_namespace(pb, host_base)
    config.linux.security_context.namespace_options.userns_options.CopyFrom(userns)
    for mount in getattr(config, "mounts", ()):
        mount.uidMappings.extend(userns.uids)
        mount.gidMappings.extend(userns.gids)


def sandbox_config(pb: ModuleType, pod: Mapping[str, Any], log_root: Path,
                   cgroup_parent: str, attempt: int = 0) -> Any:
    """C{generatePodSandboxConfig}."""
    meta = pod["metadata"]
    labels = {**meta.get("labels", {}), POD_NAME_LABEL: meta["name"],
              POD_NAMESPACE_LABEL: meta["namespace"], POD_UID_LABEL: meta["uid"]}
    security = pb.LinuxSandboxSecurityContext(namespace_options=_namespaces(pb, pod))
    run_as_user = _pod_spec(pod).get("securityContext", {}).get("runAsUser")
    if run_as_user is not None:
        security.run_as_user.value = run_as_user
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=meta["name"], uid=meta["uid"],
                                       namespace=meta["namespace"], attempt=attempt),
        log_directory=str(pod_log_directory(log_root, pod)),
        labels=labels,
        annotations=dict(meta.get("annotations", {})),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=cgroup_parent, security_context=security),
    )
    if not _pod_spec(pod).get("hostNetwork"):
        config.hostname = meta["name"]
    return config


def container_annotations(container: Mapping[str, Any],
                          options: RunContainerOptions) -> dict[str, str]:
    """C{newContainerAnnotations}: device plugin annotations, then the kubelet's own."""
    annotations = dict(options.annotations)
    annotations.update({
        "io.kubernetes.container.restartCount": "0",
        "io.kubernetes.container.terminationMessagePath":
            container.get("terminationMessagePath", DEFAULT_TERMINATION_MESSAGE_PATH),
        "io.kubernetes.container.terminationMessagePolicy":
            container.get("terminationMessagePolicy", "File"),
        "io.kubernetes.container.type": "container",
    })
    return annotations


def container_config(pb: ModuleType, pod: Mapping[str, Any], container: Mapping[str, Any],
                     options: RunContainerOptions, image: str,
                     termination_log: Path) -> Any:
    """
    C{generateContainerConfig}, for C{options} from L{container_options};
    C{termination_log} is the (existing) file the kubelet creates under the
    pod's container directory and binds at C{terminationMessagePath}.
    """
    meta = pod["metadata"]
    mounts = [pb.Mount(container_path=m.container_path, host_path=m.host_path,
                       readonly=m.read_only, propagation=getattr(pb, m.propagation))
              for m in options.mounts]
    mounts.append(pb.Mount(
        container_path=container.get("terminationMessagePath", DEFAULT_TERMINATION_MESSAGE_PATH),
        host_path=str(termination_log)))
    security = pb.LinuxContainerSecurityContext(namespace_options=_namespaces(pb, pod))
    effective = {**_pod_spec(pod).get("securityContext", {}),
                 **container.get("securityContext", {})}
    if "runAsUser" in effective:
        security.run_as_user.value = effective["runAsUser"]
    if "runAsGroup" in effective:
        security.run_as_group.value = effective["runAsGroup"]
    security.no_new_privs = effective.get("allowPrivilegeEscalation") is False
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=container["name"], attempt=0),
        image=pb.ImageSpec(image=image, user_specified_image=container["image"]),
        command=list(container.get("command", [])),
        args=list(container.get("args", [])),
        working_dir=container.get("workingDir", ""),
        envs=[pb.KeyValue(key=k, value=v) for k, v in options.envs],
        mounts=mounts,
        devices=[pb.Device(container_path=d.container_path, host_path=d.host_path,
                           permissions=d.permissions) for d in options.devices],
        labels={POD_NAME_LABEL: meta["name"], POD_NAMESPACE_LABEL: meta["namespace"],
                POD_UID_LABEL: meta["uid"], CONTAINER_NAME_LABEL: container["name"]},
        annotations=container_annotations(container, options),
        log_path=f"{container['name']}/0.log",
        linux=pb.LinuxContainerConfig(security_context=security),
        CDI_devices=[pb.CDIDevice(name=name) for name in options.cdi_devices],
    )


def gpu_pod(name: str, uid: str, *, resources: Mapping[str, str] | None = None,
            annotations: Mapping[str, str] | None = None, run_as_user: int = 1000,
            command: Sequence[str] = ()) -> dict[str, Any]:
    """A one-container host-network pod, as a user would write it (before admission)."""
    limits = dict(resources) if resources is not None else {"nvidia.com/gpu": "1"}
    container: dict[str, Any] = {
        "name": "workload",
        "image": "hostpid.test/cri-e2e:1",
        "command": list(command),
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": uid,
                     "annotations": dict(annotations or {})},
        "spec": {
            "hostNetwork": True,
            "securityContext": {"runAsUser": run_as_user, "runAsGroup": run_as_user},
            "containers": [container],
        },
    }
