"""The "restricted" Pod Security Standard (Kubernetes, policy version latest: the baseline controls and the
restricted ones), as rules over a pod spec, written from the standard's text
(kubernetes.io/docs/concepts/security/pod-security-standards), not from any generator's code.

violations(pod_spec) lists what a namespace labelled pod-security.kubernetes.io/enforce=restricted would
refuse, checking the pod and every container (containers, initContainers, ephemeralContainers).
"""

from __future__ import annotations

CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")

ALLOWED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                        "projected", "secret"}
"""Restricted: the only volume types (hostPath, among others, is refused)."""
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}
"""Restricted: seccompProfile.type, on the pod or on every container; none may say Unconfined."""
ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}
"""Restricted: every container drops ALL and adds back at most these."""
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
"""Baseline: unset or false."""
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
"""Baseline: the sysctls a pod may set."""


def containers(pod: dict) -> list[tuple[str, dict]]:
    return [(f"{kind}[{c.get('name', i)}]", c) for kind in CONTAINER_LISTS for i, c in enumerate(pod.get(kind) or [])]


def violations(pod: dict) -> list[str]:
    """What the restricted profile refuses in `pod` (a pod spec as parsed YAML)."""
    found: list[str] = []
    pod_sc = pod.get("securityContext") or {}
    listed = containers(pod)
    if not listed:
        found.append("no container to check")
    for key in HOST_NAMESPACES:
        if pod.get(key):
            found.append(f"pod: {key} is true")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("pod: windowsOptions.hostProcess")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"pod: sysctl {sysctl.get('name')}")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUME_TYPES:
            found.append(f"volume {volume.get('name')}: type {sorted(kinds - ALLOWED_VOLUME_TYPES)} not allowed")
    found += _identity(pod_sc, "pod")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_TYPES:
        found.append(f"pod: seccompProfile {pod_seccomp}")
    for where, container in listed:
        sc = container.get("securityContext") or {}
        found += _identity(sc, where)
        if sc.get("privileged"):
            found.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation is not false")
        if not (sc.get("runAsNonRoot") is True or (pod_non_root and sc.get("runAsNonRoot") is None)):
            found.append(f"{where}: runAsNonRoot is not true (pod or container)")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in SECCOMP_TYPES:
            found.append(f"{where}: seccompProfile {seccomp}")
        if seccomp is None and pod_seccomp not in SECCOMP_TYPES:
            found.append(f"{where}: no seccompProfile RuntimeDefault or Localhost (pod or container)")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{where}: capabilities do not drop ALL")
        added = set(capabilities.get("add") or []) - ADDABLE_CAPABILITIES
        if added:
            found.append(f"{where}: adds capabilities {sorted(added)}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{where}: windowsOptions.hostProcess")
        if sc.get("procMount") not in (None, "Default"):
            found.append(f"{where}: procMount {sc.get('procMount')}")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{where}: hostPort {port['hostPort']}")
    return found


def _identity(sc: dict, where: str) -> list[str]:
    """runAsUser 0 and SELinux user/role/type, which the pod and each container may set."""
    found = []
    if sc.get("runAsUser") == 0:
        found.append(f"{where}: runAsUser 0")
    if sc.get("runAsNonRoot") is False:
        found.append(f"{where}: runAsNonRoot false")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("user") or selinux.get("role"):
        found.append(f"{where}: seLinuxOptions user/role")
    if selinux.get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t",
                                   "container_engine_t"):
        found.append(f"{where}: seLinuxOptions type {selinux.get('type')}")
    return found


def job_pods(manifest: dict) -> list[dict]:
    """The pod specs a generated job makes: the TrainJob's runtime patch of its pod template (with the trainer's
    container there), each of a PyTorchJob's replica templates."""
    if manifest["kind"] == "TrainJob":
        pods = []
        for patch in manifest["spec"].get("runtimePatches") or []:
            for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
                pods.append(job["template"]["spec"]["template"]["spec"])
        return pods
    return [role["template"]["spec"] for role in manifest["spec"]["pytorchReplicaSpecs"].values()]


def check_job(manifest: dict) -> None:
    """AssertionError listing the violations of every pod in a job manifest."""
    pods = job_pods(manifest)
    assert pods, "no pod template in the manifest"
    problems = [problem for pod in pods for problem in violations(pod)]
    assert not problems, problems
