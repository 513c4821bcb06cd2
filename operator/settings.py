"""Operator settings from the environment (CPUSERVE_OPERATOR_*), set by the Helm chart's Deployment."""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cpuserve.engine.settings import OPERATOR_PREFIX


class OperatorSettings(BaseSettings):
    """What the cluster admin decides, as opposed to what an LLMService asks for."""

    model_config = SettingsConfigDict(env_prefix=OPERATOR_PREFIX, frozen=True, extra="ignore")

    image: str = Field("cpuserve:0.1.0", min_length=1)
    """Default serving image for LLMServices that name none."""
    image_pull_policy: str = Field("IfNotPresent", pattern=r"^(Always|IfNotPresent|Never)$")
    """Pull policy of every pod the operator creates."""
    namespaces: str = ""
    """Comma-separated namespaces to watch; empty: the whole cluster."""
    metrics_port: int = Field(8090, ge=0, le=65535)
    """Port of the operator's own Prometheus endpoint; 0 disables it."""
    resync_seconds: float = Field(60.0, gt=0, le=3600)
    """Interval of the drift-correcting timer."""
    retry_base_seconds: float = Field(5.0, gt=0, le=600)
    """First delay after the API server refused a child write; it doubles on each refusal in a row."""
    retry_max_seconds: float = Field(300.0, gt=0, le=3600)
    """Longest delay between retries of refused child writes."""
    max_ranks_per_replica: int = Field(8, ge=1, le=64)
    """Most sockets a replica group may span in this cluster."""
    numa_node_label: str = Field("cpuserve.dev/numa-pinning", min_length=1)
    """Node label (value "true") marking nodes whose kubelet pins CPUs and NUMA memory."""
    service_monitors: str = Field("auto", pattern=r"^(auto|always|never)$")
    """Emit ServiceMonitors: auto (when the CRD exists), always, never."""

    dashboard_url: str = Field("http://{head}.{headless}.{namespace}.svc:{port}", min_length=1)
    """Where the operator reaches an LLMService's Ray dashboard (Serve REST API); fields {head}, {headless},
    {namespace}, {port}, {name}."""
    pod_namespace: str = ""
    """The operator's own namespace (the chart sets it from the pod): NetworkPolicies let only it reach Ray's
    dashboard port. Empty: pods with the operator's labels in any namespace."""
    pod_labels: str = "app.kubernetes.io/name=cpuserve,app.kubernetes.io/component=operator"
    """The operator pods' labels, `k=v,k=v` (the chart sets its selector labels)."""

    def operator_pod_labels(self) -> dict[str, str]:
        """pod_labels as a matchLabels dict."""
        pairs = (item.split("=", 1) for item in self.pod_labels.split(",") if item.strip())
        return {k.strip(): v.strip() for k, v in pairs}

    def namespace_list(self) -> list[str]:
        """The watched namespaces, or [] for cluster-wide."""
        return [ns.strip() for ns in self.namespaces.split(",") if ns.strip()]
