"""What the collect stage's output directory is keyed by, and `prism collect` on the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_core import cli
from prism_core.collect.stage import input_key
from prism_core.config import config_from_dict, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_key_follows_what_shapes_the_graph_only(tmp_path):
    base = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml")
    key = input_key(base)
    for same in (["emulation.slots=4"], ["job.timeout_s=5"], ["emulation.ranks_of_interest=1"]):
        assert input_key(load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", same)) == key, same
    for other in (["job.iterations=9"], ["model.hidden_size=64"], ["parallel.overlap_p2p=false"], ["job.seed=7"]):
        assert input_key(load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", other)) != key, other


def test_key_follows_the_script_source(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    cfg = config_from_dict({"name": "s", "job": {"program": str(script), "world_size": 2}})
    key = input_key(cfg)
    script.write_text("print(2)\n")
    assert input_key(cfg) != key


@pytest.mark.timeout(300)
def test_cli_collects_then_reuses(tmp_path, capsys):
    args = ["collect", str(CONFIGS / "tiny_moe_w2_pp2.yaml"), "--set", "job.iterations=3", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    assert "collected in" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "reused (inputs unchanged)" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_cli_collects_in_rules_mode_into_its_own_directory(tmp_path, capsys):
    base = ["collect", str(CONFIGS / "tiny_moe_w2_pp2.yaml"), "--set", "job.iterations=3", "--out", str(tmp_path)]
    assert cli.main(base) == 0
    assert cli.main(base + ["--set", "emulation.collect_mode=rules"]) == 0
    out = capsys.readouterr().out
    assert out.count("collected in") == 2
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_cli_reports_an_unloadable_rule(tmp_path, capsys):
    args = ["collect", str(CONFIGS / "tiny_moe_w2_pp2.yaml"), "--set", "emulation.collect_mode=rules",
            "--set", "emulation.rules=no_such_module:rule", "--set", "job.iterations=3", "--out", str(tmp_path)]
    assert cli.main(args) != 0
    assert "no_such_module" in capsys.readouterr().err
