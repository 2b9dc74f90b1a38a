"""Tests of prism_core.config: validation messages, YAML loading, --set overrides and script paths."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from prism_core.config import ConfigError, PrismConfig, config_from_dict, load_config, parse_override
from prism_core.topology import Topology

BASE: dict[str, Any] = {"name": "t", "job": {"world_size": 2}}


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _write(tmp_path: Path, raw: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


@pytest.fixture(params=["dict", "file"])
def load(request, tmp_path):
    """Validate a raw dict either directly or through a YAML file and load_config."""
    def _load(raw: dict[str, Any], overrides: list[str] | None = None) -> PrismConfig:
        if request.param == "dict":
            assert not overrides
            return config_from_dict(raw)
        return load_config(_write(tmp_path, raw), overrides)
    return _load


# ----------------------------------------------------------------------------------------------
# Valid configs


def test_minimal_config_loads_with_defaults(load) -> None:
    cfg = load(BASE)
    assert cfg.name == "t"
    assert cfg.job.world_size == 2 and cfg.job.is_builtin and cfg.job.program == "builtin:moe_gpt"
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep) == (1, 1, 2, 1)
    assert cfg.emulation.ranks_of_interest == [0]


def test_dp_derived_from_world_size(load) -> None:
    cfg = load(_merge(BASE, {"job": {"world_size": 8}, "parallel": {"tp": 2, "pp": 2, "microbatches": 2}}))
    assert cfg.parallel.dp == 2
    assert Topology.from_config(cfg).world_size == 8


def test_dp_given_and_consistent_is_kept(load) -> None:
    cfg = load(_merge(BASE, {"job": {"world_size": 12}, "parallel": {"tp": 2, "dp": 6, "ep": 3},
                          "model": {"num_experts": 6}}))
    assert cfg.parallel.dp == 6 and cfg.parallel.ep == 3


# ----------------------------------------------------------------------------------------------
# Invalid configs: each must name the offending field


BAD = {
    "world_size_not_multiple": ({"job": {"world_size": 6}, "parallel": {"tp": 4}}, "job.world_size"),
    "dp_inconsistent": ({"job": {"world_size": 4}, "parallel": {"dp": 3}}, "parallel.dp"),
    "ep_not_dividing_dp": ({"job": {"world_size": 4}, "parallel": {"ep": 3}}, "parallel.ep"),
    "layers_not_split_by_pp": ({"parallel": {"pp": 2, "microbatches": 2}, "model": {"num_layers": 3}},
                               "model.num_layers"),
    "layers_not_split_by_pp_vpp": ({"parallel": {"pp": 2, "vpp": 2, "microbatches": 2}, "model": {"num_layers": 6}},
                                   "model.num_layers"),
    "microbatches_below_pp": ({"parallel": {"pp": 2, "microbatches": 1}}, "parallel.microbatches"),
    "microbatches_not_multiple_interleaved": ({"parallel": {"pp": 2, "vpp": 2, "microbatches": 3}},
                                              "parallel.microbatches"),
    "vpp_without_pp": ({"parallel": {"vpp": 2}}, "parallel.vpp"),
    "experts_not_split_by_ep": ({"parallel": {"ep": 2}, "model": {"num_experts": 3}}, "model.num_experts"),
    "topk_above_experts": ({"model": {"num_experts": 2, "moe_router_topk": 3}}, "model.moe_router_topk"),
    "rank_of_interest_outside": ({"emulation": {"ranks_of_interest": [0, 2]}}, "emulation.ranks_of_interest"),
    "rank_of_interest_negative": ({"emulation": {"ranks_of_interest": [-1]}}, "emulation.ranks_of_interest"),
    "rank_of_interest_twice": ({"emulation": {"ranks_of_interest": [1, 1]}}, "emulation.ranks_of_interest"),
    "sandbox_above_slots": ({"emulation": {"slots": 2, "sandbox": 3}}, "emulation.sandbox"),
    "iterations_equal_warmup": ({"job": {"iterations": 1, "warmup": 1}}, "job.iterations"),
    "iterations_below_warmup": ({"job": {"iterations": 2, "warmup": 3}}, "job.iterations"),
    "heads_not_split_by_tp": ({"parallel": {"tp": 2},
                               "model": {"num_attention_heads": 3, "num_query_groups": 1, "hidden_size": 96}},
                              "model.num_attention_heads"),
    "unknown_builtin": ({"job": {"program": "builtin:nope"}}, "job.program"),
    "script_not_py": ({"job": {"program": "train.sh"}}, "job.program"),
    "bad_type": ({"parallel": {"pp": "two"}}, "parallel.pp"),
    "zero_size": ({"parallel": {"tp": 0}}, "parallel.tp"),
}


@pytest.mark.parametrize("patch, field", list(BAD.values()), ids=list(BAD))
def test_bad_config_names_the_field(load, patch: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(_merge(BASE, patch))
    assert f"{field}:" in str(err.value), str(err.value)


def test_heads_error_is_about_tp_not_hidden_size() -> None:
    raw = _merge(BASE, {"parallel": {"tp": 2},
                        "model": {"num_attention_heads": 3, "num_query_groups": 1, "hidden_size": 96}})
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    msg = str(err.value)
    assert "parallel.tp=2" in msg and "model.hidden_size:" not in msg
    config_from_dict(_merge(raw, {"parallel": {"tp": 1}}))  # the same model is fine without tensor parallelism


@pytest.mark.parametrize("raw, key", [
    (_merge(BASE, {"bogus": 1}), "bogus"),
    (_merge(BASE, {"parallel": {"ppp": 2}}), "parallel.ppp"),
    (_merge(BASE, {"job": {"world_sise": 2}}), "job.world_sise"),
])
def test_unknown_keys_are_errors(load, raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(raw)
    assert f"{key}: unknown key" in str(err.value), str(err.value)


def test_missing_world_size(load) -> None:
    with pytest.raises(ConfigError) as err:
        load({"name": "t", "job": {"iterations": 3}})
    assert "job.world_size: required and missing" in str(err.value)


def test_several_problems_reported_together() -> None:
    raw = _merge(BASE, {"job": {"iterations": 1}, "emulation": {"slots": 1, "sandbox": 2}})
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert "job.iterations:" in str(err.value) and "emulation.sandbox:" in str(err.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------------------------
# YAML files


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: t\njob: {world_size: [2\n", "broken.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and "YAML" in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and "does not exist" in str(err.value)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_non_mapping_file(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)


def test_validation_error_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, _merge(BASE, {"parallel": {"ppp": 2}}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)


# ----------------------------------------------------------------------------------------------
# --set overrides


def test_overrides_take_effect(tmp_path: Path) -> None:
    path = _write(tmp_path, _merge(BASE, {"parallel": {"microbatches": 2}}))
    assert load_config(path).parallel.pp == 1
    cfg = load_config(path, ["parallel.pp=2", "job.world_size=4"])
    assert cfg.parallel.pp == 2 and cfg.job.world_size == 4 and cfg.parallel.dp == 2
    # the later override wins
    assert load_config(path, ["job.world_size=4", "job.world_size=6"]).job.world_size == 6


def test_override_order_independent_of_validation(tmp_path: Path) -> None:
    """Validation happens after all overrides, so an intermediate invalid state is fine."""
    path = _write(tmp_path, _merge(BASE, {"parallel": {"microbatches": 2}}))
    cfg = load_config(path, ["job.world_size=4", "parallel.pp=2"])
    assert (cfg.job.world_size, cfg.parallel.pp) == (4, 2)


def test_list_override_of_ints(tmp_path: Path) -> None:
    path = _write(tmp_path, _merge(BASE, {"job": {"world_size": 4}}))
    cfg = load_config(path, ["emulation.ranks_of_interest=0,3"])
    assert cfg.emulation.ranks_of_interest == [0, 3]
    assert load_config(path, ["emulation.ranks_of_interest=2"]).emulation.ranks_of_interest == [2]


def test_list_override_of_strings() -> None:
    assert parse_override("job.args=--a,--b") == ("job.args", ["--a", "--b"])
    # numbers and YAML booleans in a list of strings stay text
    assert parse_override("job.args=--steps,10,on,--lr=0.1") == ("job.args", ["--steps", "10", "on", "--lr=0.1"])


def test_builtin_takes_no_script_args(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="job.args:"):
        load_config(_write(tmp_path, BASE), ["job.args=--a"])


def test_string_override_stays_text(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, BASE), ["name=2024"])
    assert cfg.name == "2024"


def test_override_of_scalar_types(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, BASE),
                      ["parallel.overlap_p2p=false", "model.lr=0.5", "emulation.collect_mode=rules"])
    assert cfg.parallel.overlap_p2p is False and cfg.model.lr == 0.5 and cfg.emulation.collect_mode == "rules"


def test_bad_override_value_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, BASE), ["parallel.pp=two"])
    assert "parallel.pp:" in str(err.value)


@pytest.mark.parametrize("override, key, suggestion", [
    ("parallel.ppp=2", "parallel.ppp", "did you mean parallel.pp?"),
    ("paralel.tp=2", "paralel", "did you mean parallel?"),
    ("emulation.slot=3", "emulation.slot", "did you mean emulation.slots?"),
])
def test_unknown_override_key_suggests(tmp_path: Path, override: str, key: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, BASE), [override])
    msg = str(err.value)
    assert f"unknown key {key!r}" in msg and suggestion in msg, msg


def test_unknown_override_key_without_near_miss_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, BASE), ["parallel.zzzzzz=1"])
    assert "parallel.zzzzzz" in str(err.value) and "known:" in str(err.value) and "microbatches" in str(err.value)


def test_override_without_equals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, BASE), ["parallel.pp"])
    assert "KEY=VALUE" in str(err.value)


def test_override_into_a_scalar(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, BASE), ["job.world_size.x=1"])
    assert "job.world_size" in str(err.value) and "takes a value" in str(err.value)


def test_override_creates_missing_section(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    assert "parallel" not in yaml.safe_load(path.read_text())
    cfg = load_config(path, ["parallel.tp=2"])
    assert cfg.parallel.tp == 2 and cfg.parallel.dp == 1


def test_override_fills_empty_section(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: t\njob:\n  world_size: 2\nparallel:\n")
    cfg = load_config(path, ["parallel.tp=2"])
    assert cfg.parallel.tp == 2


def test_overrides_do_not_touch_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, BASE)
    before = path.read_text()
    load_config(path, ["job.world_size=4"])
    assert path.read_text() == before and load_config(path).job.world_size == 2


# ----------------------------------------------------------------------------------------------
# User training scripts


def _script_setup(tmp_path: Path, monkeypatch, job: dict[str, Any]) -> Path:
    cfg_dir = tmp_path / "configs"
    (cfg_dir / "scripts").mkdir(parents=True)
    (cfg_dir / "scripts" / "train.py").write_text("print('hi')\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return _write(cfg_dir, {"name": "s", "job": job})


def test_script_path_relative_to_config_dir(tmp_path: Path, monkeypatch) -> None:
    path = _script_setup(tmp_path, monkeypatch, {"program": "scripts/train.py", "world_size": 2})
    cfg = load_config(path)
    program = Path(cfg.job.program)
    assert program.is_absolute()
    assert program == (tmp_path / "configs" / "scripts" / "train.py").resolve()
    assert not cfg.job.is_builtin


def test_missing_script(tmp_path: Path, monkeypatch) -> None:
    path = _script_setup(tmp_path, monkeypatch, {"program": "scripts/nope.py", "world_size": 2})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "job.program" in str(err.value) and "nope.py" in str(err.value)


def test_script_skips_builtin_model_checks(tmp_path: Path, monkeypatch) -> None:
    path = _script_setup(tmp_path, monkeypatch,
                         {"program": "scripts/train.py", "world_size": 3, "args": ["--steps", "5"]})
    cfg = load_config(path)
    assert cfg.job.world_size == 3 and cfg.job.args == ["--steps", "5"]
    # model and parallel shape only the built-in workload: a script config must not carry them
    with pytest.raises(ConfigError, match="parallel: model and parallel settings only shape"):
        load_config(path, ["parallel.tp=2"])
    with pytest.raises(ConfigError, match="job.world_size:"):
        load_config(path, ["parallel.tp=2", "job.program=builtin:moe_gpt"])


def test_script_still_gets_job_checks(tmp_path: Path, monkeypatch) -> None:
    path = _script_setup(tmp_path, monkeypatch, {"program": "scripts/train.py", "world_size": 3})
    with pytest.raises(ConfigError, match="emulation.ranks_of_interest:"):
        load_config(path, ["emulation.ranks_of_interest=0,3"])
