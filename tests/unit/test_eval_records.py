"""var_core.eval.records and the condition set: schema, atomic writes, reuse keys, seeds."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from var_core.accel.presets import get_preset
from var_core.engine import SamplingConfig
from var_core.eval import records as rec
from var_core.eval.lightning import ConditionSet, sample_seed, shard_indices


def _config(arm="a", policy="baseline", **kw):
    return rec.RunConfig(arm=arm, family="test", policy=get_preset(policy), model="official-tiny", weights=None,
                         sampling=SamplingConfig(), conditions=ConditionSet.balanced(6, 10, 3), **kw)


def test_sample_seeds_depend_only_on_base_seed_and_index():
    assert sample_seed(0, 5) == sample_seed(0, 5)
    assert sample_seed(0, 5) != sample_seed(1, 5) and sample_seed(0, 5) != sample_seed(0, 6)
    cs = ConditionSet.balanced(12, 5, 9)
    assert cs.labels[:6] == (0, 1, 2, 3, 4, 0)
    assert cs.seeds[7] == sample_seed(9, 7) and 0 <= cs.seeds[7] < 2 ** 63
    assert ConditionSet.balanced(12, 5, 9).content_hash() == cs.content_hash()
    assert ConditionSet.balanced(12, 5, 8).content_hash() != cs.content_hash()


@pytest.mark.parametrize("n,bs,world", [(10, 3, 1), (10, 3, 2), (64, 16, 2), (5, 2, 4)])
def test_shards_are_whole_batches_covering_every_sample_once(n, bs, world):
    shards = [shard_indices(n, bs, r, world) for r in range(world)]
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(n))
    batches = [list(range(s, min(s + bs, n))) for s in range(0, n, bs)]
    for r, shard in enumerate(shards):  # each shard re-chunked by bs gives exactly the original batches
        chunks = [shard[i:i + bs] for i in range(0, len(shard), bs)]
        assert chunks == [b for j, b in enumerate(batches) if j % world == r]


def test_record_schema_and_atomic_write(tmp_path):
    config = _config()
    record = rec.new_record(config)
    record["status"] = "complete"
    rec.validate_record(record)
    assert record["key"]["samples"] == config.conditions.content_hash()
    assert record["policy"] == get_preset("baseline").to_dict()
    assert "timed_region" in record["timing"] and record["timing"]["warmup_generations"] == 1
    record["metrics"] = {"x": [1.0, float("nan")]}
    path = rec.write_json_atomic(tmp_path / "arms" / "a.json", record)
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]  # no temporary file left
    loaded = json.loads(path.read_text())
    assert loaded["metrics"]["x"] == [1.0, None]  # strict JSON: NaN written as null
    assert rec.read_record(path)["arm"] == "a"
    bad = dict(record)
    del bad["key"]
    with pytest.raises(ValueError, match="missing 'key'"):
        rec.validate_record(bad)


def test_find_reusable_matches_the_key_only(tmp_path):
    config = _config(arm="nova", policy="nova")
    record = rec.new_record(config)
    record["status"] = "complete"
    json_path, pt_path = rec.record_paths(tmp_path, "nova")
    rec.write_json_atomic(json_path, record)
    assert rec.find_reusable(tmp_path, config)["arm"] == "nova"
    assert rec.find_reusable(tmp_path, _config(arm="renamed", policy="nova")) is not None  # matched by key
    assert rec.find_reusable(tmp_path, config, need_tensors=True) is None  # tensors missing
    assert rec.find_reusable(tmp_path, _config(arm="nova", policy="fastvar")) is None
    assert rec.find_reusable(tmp_path, _config(arm="nova", policy="nova", batch_size=3)) is not None
    other = rec.RunConfig(arm="nova", family="test", policy=get_preset("nova"), model="official-tiny",
                          weights=None, sampling=SamplingConfig(cfg=2.0),
                          conditions=ConditionSet.balanced(6, 10, 3))
    assert rec.find_reusable(tmp_path, other) is None
    record["status"] = "running"
    rec.write_json_atomic(json_path, record)
    assert rec.find_reusable(tmp_path, config) is None  # unfinished records are never reused


def test_provenance_fields():
    info = rec.package_versions()
    assert info["torch"] and info["lightning"] and info["python"]
    git = rec.git_info()
    assert set(git) == {"sha", "dirty"}
    assert rec.to_jsonable({"a": (1, float("inf")), "b": math.nan}) == {"a": [1, None], "b": None}
    name = "no-linkage(fastvar)/x y"
    assert rec.arm_slug(name) == "no-linkage_fastvar_x_y-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    assert rec.arm_slug("scorer.upsample=area") == "scorer.upsample=area"  # safe names are their own slug
    a, b = rec.record_paths("out", "scorer.upsample=nearest"), rec.record_paths("out", "scorer.upsample=area")
    assert a[0].name == "scorer.upsample=nearest.json" and a[1].name == "scorer.upsample=nearest.pt" and a != b


def test_arm_names_that_differ_only_in_symbols_get_distinct_record_files(tmp_path):
    # the linkage family's no-linkage† and no-linkage‡ once shared arms/no-linkage.json (one replaced the other)
    dagger, ddagger = rec.record_paths(tmp_path, "no-linkage†"), rec.record_paths(tmp_path, "no-linkage‡")
    assert dagger[0] != ddagger[0] and dagger[1] != ddagger[1]


def test_a_record_under_the_old_slug_is_found_only_for_the_arm_it_names(tmp_path):
    (tmp_path / "arms").mkdir()
    (tmp_path / "arms" / "no-linkage.json").write_text(json.dumps({"arm": "no-linkage‡"}))
    assert rec.record_paths(tmp_path, "no-linkage‡")[0].name == "no-linkage.json"
    assert rec.record_paths(tmp_path, "no-linkage†")[0].name != "no-linkage.json"
