"""What the pod of a generation step needs on Kubernetes, as dagster-k8s reads it.

dagster-k8s takes pod settings from the `dagster-k8s/config` tag: on an op (the step's pod
under `k8s_job_executor`) or on a run (the run's pod under `K8sRunLauncher`, one pod per run,
which Dagster recommends when the parallelism comes from partitions). Either way they are
merged over the deployment's defaults (the Helm values' `runK8sConfig`). A generation asset
declared with `kubernetes=KubernetesStep(...)` carries the tag on its op; `run_tags` gives the
same tag for a job's runs. dagster-k8s itself is not needed to declare them.
"""

import json
from collections.abc import Iterable
from typing import Any

import dagster as dg
from pydantic import BaseModel, Field, field_validator

K8S_CONFIG_TAG = "dagster-k8s/config"
GPU_RESOURCE = "nvidia.com/gpu"


class KubernetesStep(BaseModel):
    """The pod of a generation step: its GPUs, the volume its model folders come from, its
    environment and the nodes it may run on."""

    gpus: int = Field(default=1, description="GPUs of the pod (its nvidia.com/gpu limit); the resource's "
                                                   "tensor_parallel_size x data_parallel_size should equal it.")
    model_volume_claim: str | None = Field(
        default=None, description="A PersistentVolumeClaim holding model folders, mounted read-only at "
                                  "model_mount_path (the resource's model_id is then a folder under it). None: the "
                                  "model is in the image, or model_id is an object-store URL the pod fetches.")
    model_mount_path: str = Field(default="/models", description="Where model_volume_claim is mounted.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables of the pod's container.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pod must match, e.g. "
                                          "{'nvidia.com/gpu.product': 'NVIDIA-H100-80GB-HBM3'}.")

    @field_validator("gpus")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be 0 or more")
        return value

    def k8s_config(self) -> dict[str, Any]:
        """The `dagster-k8s/config` value: container resources, environment and mounts, and the
        pod's volumes, node selector and the toleration of GPU nodes' usual taint."""
        container: dict[str, Any] = {}
        pod: dict[str, Any] = {}
        if self.gpus:
            container["resources"] = {"limits": {GPU_RESOURCE: str(self.gpus)}}
            pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        if self.env:
            container["env"] = [{"name": name, "value": value} for name, value in sorted(self.env.items())]
        if self.model_volume_claim:
            container["volume_mounts"] = [{"name": "models", "mount_path": self.model_mount_path, "read_only": True}]
            pod["volumes"] = [{"name": "models", "persistent_volume_claim": {
                "claim_name": self.model_volume_claim, "read_only": True}}]
        if self.node_selector:
            pod["node_selector"] = dict(self.node_selector)
        return {"container_config": container, "pod_spec_config": pod}

    def tags(self) -> dict[str, str]:
        """The op (or run) tags that carry `k8s_config`."""
        return {K8S_CONFIG_TAG: json.dumps(self.k8s_config(), sort_keys=True)}


def run_tags(assets: Iterable[dg.AssetsDefinition]) -> dict[str, str]:
    """Run tags for a job over `assets` under `K8sRunLauncher` (one pod per run): the
    `dagster-k8s/config` tag of the generation asset among them that asks for the most GPUs.

    Raises:
        DagsterInvalidDefinitionError: none of them declares a Kubernetes pod.
    """
    declared = [asset.op.tags[K8S_CONFIG_TAG] for asset in assets if K8S_CONFIG_TAG in asset.op.tags]
    if not declared:
        raise dg.DagsterInvalidDefinitionError(
            "none of these assets declares a Kubernetes pod: pass kubernetes=KubernetesStep(gpus=...) to "
            "build_generation_asset (or `kubernetes:` in the component's defs.yaml)")

    def gpus(tag: str) -> int:
        limits = json.loads(tag)["container_config"].get("resources", {}).get("limits", {})
        return int(limits.get(GPU_RESOURCE, 0))

    return {K8S_CONFIG_TAG: max(declared, key=gpus)}
