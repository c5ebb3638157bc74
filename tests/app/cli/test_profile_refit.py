"""`python -m app profile --refit OLD.json`: a profile's efficiency factors fitted again from the
measurements it stores, with the current cost model, on any machine (no device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.__main__ import main
from planning.efficiency import OpEfficiency
from planning.hardware import hardware_preset

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
H200X2 = ROOT / "examples" / "profiles" / "h200x2.json"


def _refit(tmp_path: Path, profile: dict, name: str = "new.json") -> dict:
    old = tmp_path / f"old-{name}"
    old.write_text(json.dumps(profile))
    out = tmp_path / name
    assert main(["profile", "--refit", str(old), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_refit_of_a_current_profile_changes_nothing(tmp_path: Path) -> None:
    # The shipped two-H200 profile was refitted with this cost model: a second refit is a fixed point.
    stored = json.loads(H200X2.read_text())
    again = _refit(tmp_path, stored)
    assert again["efficiency"] == pytest.approx(stored["efficiency"], rel=1e-6)
    for row in again["measurements"]["validation"].values():  # the profile reproduces every measured step
        assert row["profile_s"] == pytest.approx(row["measured_s"], rel=1e-3)
    assert again["measurements"]["refit"]["efficiency_before"] == stored["efficiency"]
    assert {k: again[k] for k in ("peak_flops", "hbm_bw", "preset")} == {k: stored[k] for k in ("peak_flops", "hbm_bw", "preset")}
    hw = hardware_preset("h200-141g").with_profile(tmp_path / "new.json")
    assert hw.peak_flops == stored["peak_flops"] and OpEfficiency.from_dict(again["efficiency"])


def test_refit_follows_the_stored_timings(tmp_path: Path) -> None:
    # A profile whose optimizer step was measured twice as slow gets half the optimizer factor;
    # the others do not move (the optimizer step has a term of its own).
    stored = json.loads(H200X2.read_text())
    slower = json.loads(json.dumps(stored))
    slower["measurements"]["engine"]["optimizer_s"] *= 2
    refit = _refit(tmp_path, slower)
    assert refit["efficiency"]["optimizer"] == pytest.approx(stored["efficiency"]["optimizer"] / 2, rel=0.02)
    assert refit["efficiency"]["gemm"] == pytest.approx(stored["efficiency"]["gemm"], rel=1e-6)


@pytest.mark.parametrize("change, named", [
    (lambda p: p["measurements"]["model"].update(name="mystery"), "measurements.model.name"),
    (lambda p: p["measurements"]["model"].update(hidden_size=7), "measurements.model.hidden_size"),
    (lambda p: p.pop("measurements"), "measurements"),
    (lambda p: p.update(preset="b200"), "b200"),
])
def test_unreadable_profiles_exit_2_naming_the_field(tmp_path: Path, change, named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    profile = json.loads(H200X2.read_text())
    change(profile)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(profile))
    assert main(["profile", "--refit", str(old), "--out", str(tmp_path / "new.json")]) == 2
    err = capsys.readouterr().err
    assert named in err and not (tmp_path / "new.json").exists()
