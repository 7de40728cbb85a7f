"""The chart ships the repository's CRDs unchanged: the AdaServeDeployment CRD, and kopf's peering CRDs
that --peering requires."""

from __future__ import annotations

import pytest

from tests.chart.helpers import CHART, ROOT, Render, only

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
