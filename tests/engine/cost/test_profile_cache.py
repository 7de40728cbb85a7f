"""The on-disk profile cache (adaserve.engine.cost.profile_cache): round trip, key separation, bad files."""

from __future__ import annotations

import logging
import math

import pytest

from adaserve.engine.cache_dir import CACHE_DIR_ENV, default_cache_dir
from adaserve.engine.cost.cost_model import CostModel, FitReport
from adaserve.engine.cost.profile_cache import ProfileCache, ProfileKey

KEY = ProfileKey(device="NVIDIA H100 80GB HBM3", model="llama-3.1-8b@3f2a9c", dtype="bfloat16",
                 engine_version="0.1.0")


def profile_data() -> dict:
    model = CostModel(alpha=2.0e-7, gamma=3.0e-5, delta=8.0e-3)
    rep = FitReport(n_samples=20, mean_rel_error=0.01, max_rel_error=0.03, r2=0.99)
    return {"budget": 512, "cost_model": model.to_dict(), "fit": rep.to_dict()}


def test_cache_round_trip(tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    assert cache.load(KEY) is None  # directory does not exist yet: a miss, not an error
    data = profile_data()
    path = cache.save(KEY, data)
    assert path.parent == tmp_path / "profiles" and path.name == f"{KEY.digest()}.json"
    got = cache.load(KEY)
    assert got == data
    assert CostModel.from_dict(got["cost_model"]).to_dict() == data["cost_model"]
    cache.save(KEY, {"budget": 256})  # overwrite in place
    assert cache.load(KEY) == {"budget": 256}
    assert [p.name for p in (tmp_path / "profiles").iterdir()] == [path.name]  # no temp files left


@pytest.mark.parametrize("field", ["device", "model", "dtype", "engine_version"])
def test_cache_key_separation(tmp_path, field):
    cache = ProfileCache(tmp_path)
    cache.save(KEY, {"budget": 512})
    other = ProfileKey(**{**KEY.to_dict(), field: "something else"})
    assert other.digest() != KEY.digest()
    assert cache.load(other) is None
    assert cache.load(ProfileKey(**KEY.to_dict())) == {"budget": 512}  # equal key, same file


@pytest.mark.parametrize(
    "content", ["", "{not json", '{"format": 1, "key": ', "[1, 2]", '{"format": 99, "data": {}}', "\udcff"]
)
def test_corrupt_cache_file_is_a_miss(tmp_path, caplog, content):
    cache = ProfileCache(tmp_path)
    path = cache.save(KEY, {"budget": 512})
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.cost.profile_cache"):
        assert cache.load(KEY) is None
    assert caplog.records
    cache.save(KEY, {"budget": 128})  # a later save repairs it
    assert cache.load(KEY) == {"budget": 128}


def test_cache_file_of_another_key_is_a_miss(tmp_path, caplog):
    cache = ProfileCache(tmp_path)
    other = ProfileKey(**{**KEY.to_dict(), "device": "NVIDIA A100-SXM4-80GB"})
    cache.save(other, {"budget": 156})
    cache.path_for(other).replace(cache.path_for(KEY))  # e.g. a file copied under the wrong name
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.cost.profile_cache"):
        assert cache.load(KEY) is None
    assert caplog.records


def test_cache_save_rejects_non_json(tmp_path):
    cache = ProfileCache(tmp_path)
    with pytest.raises(ValueError):
        cache.save(KEY, {"budget": math.nan})
    with pytest.raises(ValueError):
        cache.save(KEY, {"budget": object()})
    with pytest.raises(ValueError):
        cache.save(KEY, [1, 2])  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_profile_key_validation_and_digest():
    with pytest.raises(ValueError):
        ProfileKey(device="", model="m", dtype="bf16", engine_version="1")
    with pytest.raises(ValueError):
        ProfileKey(device="d", model="m", dtype=None, engine_version="1")  # type: ignore[arg-type]
    d = KEY.digest()
    assert d == ProfileKey(**KEY.to_dict()).digest() and len(d) == 32 and int(d, 16) >= 0


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    assert ProfileCache().dir == tmp_path / "x"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "adaserve" / "profiles"
