"""The example's GPU pods as dagster-k8s builds them, with no cluster and no model: the Kubernetes
Job of a generation step (k8s_job_executor, from the step's tags) and of a run of
daily_ticket_summaries_job (K8sRunLauncher, from the run's tags), merged over the run launcher's
defaults of example_pipelines/deploy/values.yaml as the Helm chart hands them to dagster-k8s."""

import json
import os
import re
from pathlib import Path

import dagster as dg
import jsonschema
import pytest
import yaml
from dagster._core.execution.api import create_execution_plan
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import (
    DagsterK8sJobConfig,
    UserDefinedDagsterK8sConfig,
    construct_dagster_k8s_job,
    get_user_defined_k8s_config,
)

from dagster_llm.kubernetes import GPU_RESOURCE, KubernetesStep, run_tags

REPO = Path(__file__).resolve().parents[2]
VALUES = yaml.safe_load((REPO / "example_pipelines" / "deploy" / "values.yaml").read_text())
MODEL = "/models/Qwen2.5-7B-Instruct"


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    import definitions

    return definitions.defs


def launcher_defaults() -> K8sContainerContext:
    """values.yaml's runK8sConfig as the chart writes it into dagster.yaml (run_k8s_config: its
    keys in snake_case, their contents as given) and the run launcher loads it."""
    run_k8s_config = VALUES["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    snake = {re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower(): value for key, value in run_k8s_config.items()}
    return K8sContainerContext(run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(snake))


def kubernetes_job(context: K8sContainerContext):
    """The V1Job that dagster-k8s creates for a step or a run with this container context."""
    job_config = DagsterK8sJobConfig(job_image="registry.example.com/dagster-llm:0.1.0",
                                     dagster_home="/opt/dagster/dagster_home", instance_config_map="dagster-instance")
    return construct_dagster_k8s_job(job_config, args=["dagster", "api", "execute_step"], job_name="dagster-test",
                                     user_defined_k8s_config=context.run_k8s_config)


def step_pod(tags: dict[str, str]):
    """As K8sStepHandler: the launcher's defaults, then the step's dagster-k8s/config tag."""
    step = K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(tags))
    return kubernetes_job(launcher_defaults().merge(step))


def step_tags(defs: dg.Definitions, asset: str, step: str) -> dict[str, str]:
    """The tags of `step` in the execution plan of the job that materializes `asset` from the UI."""
    job = defs.resolve_implicit_job_def_def_for_assets([dg.AssetKey(asset)])
    return dict(create_execution_plan(job).get_step_by_key(step).tags)


def assert_gpu_pod(v1_job) -> None:
    spec = v1_job.spec.template.spec
    [container] = spec.containers
    # The tag's GPU limit is merged over values.yaml's memory limit and requests.
    assert container.resources.limits == {GPU_RESOURCE: "1", "memory": "64Gi"}
    assert container.resources.requests == {"cpu": "4", "memory": "16Gi"}
    env = {var.name: var.value for var in container.env}
    assert env["DAGSTER_LLM_MODEL"] == MODEL and env["DAGSTER_LLM_DTYPE"] == "bfloat16"
    mounts = {mount.name: mount for mount in container.volume_mounts}
    assert (mounts["models"].mount_path, mounts["models"].read_only) == ("/models", True)
    assert MODEL.startswith(mounts["models"].mount_path + "/")
    assert mounts["dshm"].mount_path == "/dev/shm"
    volumes = {volume.name: volume for volume in spec.volumes}
    assert volumes["models"].persistent_volume_claim.claim_name == "llm-models"
    assert volumes["models"].persistent_volume_claim.read_only
    assert volumes["dshm"].empty_dir.medium == "Memory"
    assert [(t.key, t.operator, t.effect) for t in spec.tolerations] == [(GPU_RESOURCE, "Exists", "NoSchedule")]


@pytest.mark.parametrize("asset", ["ticket_summaries", "ticket_triage"])
def test_generation_step_pod_has_a_gpu_the_model_volume_and_env(defs, asset):
    assert_gpu_pod(step_pod(step_tags(defs, asset, asset)))


def test_other_steps_pods_have_no_gpu(defs):
    [container] = step_pod(step_tags(defs, "support_prompts", "support_prompts")).spec.template.spec.containers
    assert container.resources.limits == {"memory": "64Gi"}


def test_daily_job_run_pod_has_the_gpu(defs):
    """As K8sRunLauncher (one pod per run): the launcher's defaults, then the run's tags."""
    job = defs.resolve_job_def("daily_ticket_summaries_job")
    run = dg.DagsterRun(job_name=job.name, tags=job.run_tags)
    assert_gpu_pod(kubernetes_job(launcher_defaults().merge(K8sContainerContext.create_for_run(run, None, True))))


def test_no_gpus_means_no_gpu_limit_nor_toleration():
    spec = step_pod(KubernetesStep(gpus=0, model_volume_claim="llm-models").tags()).spec.template.spec
    assert GPU_RESOURCE not in spec.containers[0].resources.limits
    assert not spec.tolerations
    assert "models" in {volume.name for volume in spec.volumes}


def test_run_tags_of_assets_without_a_pod_name_the_fix(defs):
    with pytest.raises(dg.DagsterInvalidDefinitionError, match=r"kubernetes=KubernetesStep\(gpus="):
        run_tags([defs.resolve_assets_def("support_prompts")])


def test_run_tags_take_the_pod_with_the_most_gpus(defs):
    @dg.asset(op_tags=KubernetesStep(gpus=2).tags())
    def two_gpus(): ...

    tags = run_tags([defs.resolve_assets_def("ticket_summaries"), two_gpus])
    assert json.loads(tags["dagster-k8s/config"])["container_config"]["resources"]["limits"] == {GPU_RESOURCE: "2"}


@pytest.mark.skipif(not os.environ.get("DAGSTER_HELM_VALUES_SCHEMA"),
                    reason="DAGSTER_HELM_VALUES_SCHEMA: the chart's values.schema.json (helm pull dagster/dagster)")
def test_values_yaml_fits_the_charts_schema():
    """values.yaml overrides the chart's defaults, so the schema's `required` lists are left out, and
    so are its references to Kubernetes' definitions online (any value passes there)."""
    def offline(node):
        if isinstance(node, list):
            return [offline(value) for value in node]
        if not isinstance(node, dict):
            return node
        return {key: offline(value) for key, value in node.items()
                if key != "required" and not (key == "$ref" and value.startswith("http"))}

    schema = offline(json.loads(Path(os.environ["DAGSTER_HELM_VALUES_SCHEMA"]).read_text()))
    assert [error.message for error in jsonschema.Draft7Validator(schema).iter_errors(VALUES)] == []
