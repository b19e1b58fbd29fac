"""deploy/k8s and deploy/ray manifests are schema-valid offline, and a typo'd field name fails.

What is validated:
- built-in kinds (Deployment, Service, HorizontalPodAutoscaler) against the Kubernetes 1.33 OpenAPI
  JSON schemas shipped by ``kubernetes-validate``, strict (an unknown field is an error);
- the pod templates inside the RayService the same way (as a core/v1 ``PodTemplate``);
- RayService, PodMonitor, ServiceMonitor and ScrapeConfig against ``deploy/k8s/schemas/*.json``:
  hand-written minimal schemas of the CRD fields these manifests use (unknown fields are errors; the
  schemas are not the full upstream CRDs, so a field we never use is refused, not checked);
- the RayService's ``serveConfigV2`` and ``deploy/ray/serve_config.yaml`` with Ray's own
  ``ServeDeploySchema`` (when ray is installed) and their app args with ``config_from_args`` (keys,
  values and the ``dartree serve`` flags of the units).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (requirements-dev.txt)")
import jsonschema  # noqa: E402 - a dependency of kubernetes-validate

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"
CRD_SCHEMAS = {("ray.io/v1", "RayService"): "rayservice.json",
               ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
               ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
               ("monitoring.coreos.com/v1alpha1", "ScrapeConfig"): "scrapeconfig.json"}


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def check_serve_config(text_or_dict) -> None:
    """A Ray Serve config: Ray's schema (if ray is installed) and our app args."""
    from services.ray_config import config_from_args

    cfg = yaml.safe_load(text_or_dict) if isinstance(text_or_dict, str) else text_or_dict
    try:
        from ray.serve.schema import ServeDeploySchema
    except ImportError:
        pass
    else:
        ServeDeploySchema.model_validate(cfg)
    for app in cfg["applications"]:
        assert app["import_path"] == "services.ray_serve:app_builder"
        config_from_args(app.get("args", {}))


def validate(doc: dict) -> None:
    """Raise (jsonschema / kubernetes_validate / ValueError) unless ``doc`` is valid."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in CRD_SCHEMAS:
        kv.validate(doc, K8S_VERSION, strict=True)
        return
    schema = json.loads((K8S / "schemas" / CRD_SCHEMAS[key]).read_text())
    jsonschema.validate(doc, schema)
    if key[1] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        for group in groups:
            kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                         "template": group["template"]}, K8S_VERSION, strict=True)
        check_serve_config(doc["spec"]["serveConfigV2"])


@pytest.mark.parametrize("name", ["rayservice.yaml", "deployment.yaml"])
def test_manifests_are_valid(name):
    docs = documents(name)
    assert docs
    for doc in docs:
        validate(doc)


def test_manifests_have_what_the_issue_asks_for():
    ray = {d["kind"]: d for d in documents("rayservice.yaml")}
    assert {"RayService", "PodMonitor", "ScrapeConfig"} <= set(ray)
    worker = ray["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    assert worker["terminationGracePeriodSeconds"] >= 60
    app = yaml.safe_load(ray["RayService"]["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert app["num_gpus"] == 1 and app["max_replicas"] > app["min_replicas"]
    plain = {d["kind"]: d for d in documents("deployment.yaml")}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ServiceMonitor"} <= set(plain)
    assert plain["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == \
        "dartree_num_requests_running"
    pod = plain["Deployment"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"


def test_ray_serve_config_file_is_valid():
    check_serve_config((ROOT / "deploy" / "ray" / "serve_config.yaml").read_text())


def _rename(obj, path: list, new_key: str):
    """A copy of ``obj`` with the key at ``path`` renamed to ``new_key`` (a typo)."""
    obj = copy.deepcopy(obj)
    node = obj
    for p in path[:-1]:
        node = node[p]
    node[new_key] = node.pop(path[-1])
    return obj


@pytest.mark.parametrize("name,kind,path,typo", [
    ("deployment.yaml", "Deployment", ["spec", "template", "spec", "containers", 0, "readinessProbe"], "readinesProbe"),
    ("deployment.yaml", "Deployment", ["spec", "template", "spec", "terminationGracePeriodSeconds"],
     "terminationGracePeriodSecond"),
    ("deployment.yaml", "HorizontalPodAutoscaler", ["spec", "maxReplicas"], "maxReplica"),
    ("deployment.yaml", "Service", ["spec", "selector"], "selecter"),
    ("deployment.yaml", "ServiceMonitor", ["spec", "endpoints"], "endpoint"),
    ("rayservice.yaml", "RayService", ["spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplicas"], "maxReplica"),
    ("rayservice.yaml", "RayService", ["spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec",
                                       "containers", 0, "readinessProbe"], "readynessProbe"),
    ("rayservice.yaml", "RayService", ["spec", "serveConfigV2"], "serveConfigv2"),
    ("rayservice.yaml", "PodMonitor", ["spec", "podMetricsEndpoints"], "podMetricEndpoints"),
    ("rayservice.yaml", "ScrapeConfig", ["spec", "httpSDConfigs"], "httpSdConfigs"),
])
def test_a_typo_fails(name, kind, path, typo):
    (doc,) = [d for d in documents(name) if d["kind"] == kind]
    validate(doc)
    with pytest.raises((jsonschema.ValidationError, kv.ValidationError)):
        validate(_rename(doc, path, typo))


def test_a_typo_in_the_serve_app_args_fails():
    (doc,) = [d for d in documents("rayservice.yaml") if d["kind"] == "RayService"]
    bad = copy.deepcopy(doc)
    bad["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace("max_replicas:", "max_replica:")
    with pytest.raises(ValueError, match="unknown app argument"):
        validate(bad)
    bad["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace("--max-running", "--max-runing")
    with pytest.raises(ValueError, match="unknown dartree serve flag"):
        validate(bad)


def test_ray_prometheus_config_discovers_the_units():
    cfg = yaml.safe_load((ROOT / "deploy" / "ray" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["dartree-units"]["http_sd_configs"][0]["url"].endswith("/metrics/targets")
