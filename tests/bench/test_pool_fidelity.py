"""bench/pool_fidelity.py: the pairs of several bench logs pooled per config, each emulation column
on the side of the pace it ran with, whichever way the run was configured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from pool_fidelity import main, parse  # noqa: E402

LOGS = Path(__file__).resolve().parents[2] / "bench" / "logs"


def _pair(config: str, i: int, real: float, pred: float, emu_err: str, realc: float, uncal: float) -> str:
    return (f"{config} pair {i}/2: real {real:.4f} s  predicted {pred:.4f} s (+0.00%)  emulated 0.2000 s "
            f"({emu_err}% against its own record 0.2000 s, +1.00% from the first)  with the real compute "
            f"{realc:.4f} s (+0.00%)  without the loaded runs 0.2 s (+0.00%)  one pass {pred:.4f} s  "
            f"uncalibrated {uncal:.4f} s  compute against the record's: plain slices -1.00%, loaded runs +1.00%")


def _log(tmp: Path, name: str, pace_way: str | None) -> Path:
    lines = [_pair("tiny_moe_w2_pp2", 1, 0.2000, 0.2040, "+3.00", 0.2000, 0.1600),
             _pair("tiny_moe_w2_pp2", 2, 0.1000, 0.0990, "-1.00", 0.1010, 0.0800),
             "tiny_moe_w2_pp2 pair 1/2: waits for a core: record 2.55% of compute"]
    if pace_way:
        lines.append(f"tiny_moe_w2_pp2: emulated as configured +1.00% (pairs +3.00, -1.00), {pace_way} following "
                     "the sandbox rank's pace -0.50% (pairs -0.50, +0.20) pair-wise against the second record, "
                     "in the same turns")
    (tmp / name).write_text("\n".join(lines) + "\n")
    return tmp / name


def test_a_log_gives_each_pairs_errors(tmp_path: Path):
    cols = parse(_log(tmp_path, "a.log", None))["tiny_moe_w2_pp2"]
    assert cols["predicted"] == pytest.approx([0.02, -0.01])
    assert cols["uncalibrated"] == pytest.approx([-0.2, -0.2])
    assert cols["with the real compute"] == pytest.approx([0.0, 0.01])
    assert cols["emulated as configured"] == pytest.approx([0.03, -0.01])


@pytest.mark.parametrize("way, following, not_following", [
    ("with", [-0.005, 0.002], [0.03, -0.01]),        # the pace off by default: the other way followed it
    ("without", [0.03, -0.01], [-0.005, 0.002]),     # the pace on by default
])
def test_the_emulations_go_by_the_pace_they_ran_with(tmp_path: Path, way, following, not_following):
    cols = parse(_log(tmp_path, "a.log", way))["tiny_moe_w2_pp2"]
    assert cols["following the pace"] == pytest.approx(following)
    assert cols["not following"] == pytest.approx(not_following)
    assert "emulated as configured" not in cols


def test_pooled_medians_span_the_logs(tmp_path: Path, capsys):
    main([str(_log(tmp_path, "a.log", "with")), str(_log(tmp_path, "b.log", "without"))])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny_moe_w2_pp2"))
    # predicted: +2, -1, +2, -1 -> median +0.50%; following: -0.5, +0.2, +3, -1 -> median -0.15%
    assert "+0.50% [" in row and "-0.15% [" in row and "( 4)" in row


def test_a_log_without_pairs_is_an_error(tmp_path: Path):
    (tmp_path / "x.log").write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no pairs"):
        parse(tmp_path / "x.log")


def test_the_kept_logs_parse():
    for log in sorted(LOGS.glob("fidelity_item*.log")):
        cols = parse(log)
        # a run of the bench may take only some configs (`--configs`: item 34's took ep2 and tp2)
        assert cols and set(cols) <= {f"tiny_moe_w2_{c}" for c in ("pp2", "dp2", "tp2", "ep2")}, log
        # a run stopped early (`_partial`) may have reached its last config's first pair only
        least = 1 if log.stem.endswith("_partial") else 2
        assert all(len(c["predicted"]) >= least for c in cols.values()), log


def test_the_pace_line_fidelity_prints_is_the_one_pooled(tmp_path: Path):
    """bench/fidelity.py's line for `--other-pace` (either default) parses here, each side kept."""
    from types import SimpleNamespace

    from fidelity import VARIANTS, _pairs  # noqa: E402

    pace = next(v for v in VARIANTS if v.flag == "other_pace")
    for on in (True, False):
        line = (f"tiny_moe_w2_tp2: emulated as configured {_pairs([0.01, -0.03, 0.02])}, "
                f"{pace.describe(SimpleNamespace(follow_pace=on))} {_pairs([-0.005, 0.004, 0.0])} "
                "pair-wise against the second record, in the same turns")
        log = tmp_path / f"{on}.log"
        log.write_text(_pair("tiny_moe_w2_tp2", 1, 0.2, 0.2, "+1.00", 0.2, 0.18) + "\n" + line + "\n")
        cols = parse(log)["tiny_moe_w2_tp2"]
        configured, other = [0.01, -0.03, 0.02], [-0.005, 0.004, 0.0]
        assert cols["following the pace"] == pytest.approx(configured if on else other)
        assert cols["not following"] == pytest.approx(other if on else configured)


@pytest.mark.parametrize("on, column", [(True, "following the pace"), (False, "not following")])
def test_the_header_says_how_the_emulations_ran_as_configured(tmp_path: Path, on, column):
    from fidelity import PACED_HEADER  # noqa: E402

    log = _log(tmp_path, "a.log", None)
    log.write_text(log.read_text() + f"\n60 steps per run (57 measured), S=1, ...; {PACED_HEADER[on]}; error = ...\n")
    cols = parse(log)["tiny_moe_w2_pp2"]
    assert cols[column] == pytest.approx([0.03, -0.01]) and "emulated as configured" not in cols
    with pytest.raises(SystemExit, match="its header says"):
        parse(log, "not following" if on else "following the pace")


def test_a_log_that_does_not_say_is_named_on_the_command_line(tmp_path: Path, capsys):
    log = _log(tmp_path, "a.log", None)
    main([f"{log}=following"])
    out = capsys.readouterr().out
    assert "following the pace" in out and "emulated as configured" not in out
    with pytest.raises(SystemExit):
        main([f"{log}=sideways"])
