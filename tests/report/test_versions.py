"""Versioned artifacts: numbers only grow, `latest` follows, inputs are hashed, nothing half-written."""

from __future__ import annotations

import json
import os
import threading

import pytest

from prism_core.report import versions


def _publish(root, job="job", value=1.0, **inputs):
    metrics = {"mode": "emulated", "world_size": 2, "ranks": {"0": {"iteration_time_s": value}}}
    return versions.publish(root / job, job, {"metrics.json": json.dumps(metrics), "plots/a.png": b"\x89PNG"},
                            inputs or {"config": "c1"}, {"bare graph": "/g"})


def test_versions_count_up_and_latest_follows(tmp_path):
    assert versions.latest(tmp_path / "job") is None and versions.numbers(tmp_path / "job") == []
    first, second = _publish(tmp_path, value=1.0), _publish(tmp_path, value=2.0)
    assert (first.number, second.number) == (1, 2)
    assert versions.latest(tmp_path / "job").number == 2
    assert os.readlink((tmp_path / "job") / versions.LATEST) == "2"
    assert versions.load(tmp_path / "job", 1).metrics["ranks"]["0"]["iteration_time_s"] == 1.0
    assert (second.path / "plots" / "a.png").read_bytes() == b"\x89PNG"
    assert second.record["inputs"] == {"config": "c1"} and second.record["stages"] == {"bare graph": "/g"}
    assert sorted(second.record["files"]) == ["metrics.json", "plots/a.png"]
    # another job's versions are its own
    assert _publish(tmp_path, job="other").number == 1


def test_concurrent_publishers_get_distinct_numbers(tmp_path):
    got, errors = [], []

    def one(i):
        try:
            got.append(_publish(tmp_path, value=float(i)).number)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(got) == list(range(1, 9))
    assert versions.latest(tmp_path / "job").number == 8
    assert not [p for p in (tmp_path / "job").iterdir() if p.name.startswith(".")]


def test_latest_ends_at_the_highest_when_a_lower_publisher_repoints_last(tmp_path, monkeypatch):
    """The interleaving the threads above hit only now and then, forced: version 2's publisher
    has checked the pointer, version 3 is published in full, then 2's replace lands."""
    _publish(tmp_path)
    real_replace, later = os.replace, []

    def replace(src, dst):
        if not later:
            later.append(None)
            later.append(_publish(tmp_path).number)
        real_replace(src, dst)

    monkeypatch.setattr(versions.os, "replace", replace)
    assert _publish(tmp_path).number == 2 and later == [None, 3]
    assert versions.latest(tmp_path / "job").number == 3


def test_a_failed_publish_leaves_nothing(tmp_path):
    _publish(tmp_path)
    with pytest.raises(FileNotFoundError):
        versions.publish(tmp_path / "job", "job", {"metrics.json": tmp_path / "missing.json"}, {}, {})
    assert versions.numbers(tmp_path / "job") == [1]
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["1", "latest"]


def test_content_hashes_follow_content(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "x").write_text("1")
    first = versions.hash_tree(a)
    (a / "x").write_text("2")
    assert versions.hash_tree(a) != first
    assert versions.hash_json({"b": 1, "a": 2}) == versions.hash_json({"a": 2, "b": 1})
