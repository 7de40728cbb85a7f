"""The chart ships the repository's CRDs unchanged: the AdaServeDeployment CRD, and kopf's peering CRDs
that --peering requires."""

from __future__ import annotations

import pytest
import yaml

from adaserve.operator.spec import MSG_TENSOR_PARALLEL
from tests.chart.helpers import CHART, ROOT, Render, only
from tests.operator.schema import EXAMPLE_PATH, validate

# the repository's crds/ is the source; the chart carries copies because Helm reads only the chart directory
CRD_FILES = ["adaserve.io_adaservedeployments.yaml", "kopf.dev_peerings.yaml"]


@pytest.mark.parametrize("name", CRD_FILES)
def test_chart_crds_are_byte_identical_to_the_repository_crds(name: str) -> None:
    # Helm installs crds/ verbatim on first install; a stale copy would install an old schema
    repo, chart = ROOT / "crds" / name, CHART / "crds" / name
    assert repo.is_file(), f"{repo} is missing"
    assert chart.read_bytes() == repo.read_bytes(), f"stale copy: run  cp crds/{name} charts/adaserve/crds/"


def test_chart_ships_no_other_crds() -> None:
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(CRD_FILES)


def test_install_creates_the_adaserve_and_kopf_peering_crds(render: Render) -> None:
    crds = {d["metadata"]["name"]: d for d in only(render(crds=True), "CustomResourceDefinition")}
    assert set(crds) == {"adaservedeployments.adaserve.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    asd = crds["adaservedeployments.adaserve.io"]["spec"]
    assert (asd["group"], asd["scope"], asd["names"]["kind"]) == ("adaserve.io", "Namespaced", "AdaServeDeployment")
    assert "asd" in asd["names"]["shortNames"]
    assert [v["name"] for v in asd["versions"] if v["served"] and v["storage"]] == ["v1alpha1"]
    assert crds["clusterkopfpeerings.kopf.dev"]["spec"]["scope"] == "Cluster"
    assert crds["kopfpeerings.kopf.dev"]["spec"]["scope"] == "Namespaced"


def test_crds_are_not_templates(render: Render) -> None:
    # templates/ would put them under the release: uninstall would delete every AdaServeDeployment with them
    assert only(render(), "CustomResourceDefinition") == []


def test_the_installed_crd_refuses_more_ranks_than_gpus(render: Render) -> None:
    """The CRD as helm installs it checks tensorParallelSize against gpusPerWorker (the API server's own rule)."""
    crd = next(d for d in only(render(crds=True), "CustomResourceDefinition")
               if d["metadata"]["name"] == "adaservedeployments.adaserve.io")
    body = yaml.safe_load(EXAMPLE_PATH.read_text())
    body["spec"]["resources"].update(gpusPerWorker=2, tensorParallelSize=4)
    assert validate(body, crd) == [f"spec.resources.tensorParallelSize: {MSG_TENSOR_PARALLEL}"]
    body["spec"]["resources"].update(gpusPerWorker=4)
    assert validate(body, crd) == []
    body["spec"]["resources"].update(tensorParallelSize=0)
    assert validate(body, crd) == ["spec.resources.tensorParallelSize: 0 is less than the minimum of 1"]
