"""integrations/: every file reaches users (``fp8track integrations [--copy DIR]``, and the wheel
carries them), and the Transformer Engine debug configs ask only for statistics the nvdlfw bridge
understands."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from fp8track.cli import main
from fp8track.cli.integrations import integration_files, integrations_root

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "integrations"


def _walk(root: Path) -> list[str]:
    """Every file under root, found independently of the code under test."""
    out = []
    for dirpath, _, names in os.walk(root):
        out.extend(
            Path(dirpath, n).relative_to(root).as_posix() for n in names if n.endswith((".yaml", ".md"))
        )
    return sorted(out)


def test_lists_every_file(capsys):
    assert integrations_root() == SOURCE  # a source checkout (editable install) reads the folder itself
    expected = _walk(SOURCE)
    assert "lightning/fp8monitor.yaml" in expected and "te_debug/fp8_stats.yaml" in expected
    assert main(["integrations"]) == 0
    assert capsys.readouterr().out.split() == expected
    assert [p.as_posix() for p in integration_files()] == expected


def test_copies_every_file_and_refuses_to_overwrite(tmp_path, capsys):
    dest = tmp_path / "cfg"
    assert main(["integrations", "--copy", str(dest)]) == 0
    assert _walk(dest) == _walk(SOURCE)
    for rel in _walk(SOURCE):
        assert (dest / rel).read_bytes() == (SOURCE / rel).read_bytes()
    (dest / "lightning" / "fp8monitor.yaml").write_text("edited")
    capsys.readouterr()
    assert main(["integrations", "--copy", str(dest)]) == 1
    assert "use --force" in capsys.readouterr().err
    assert (dest / "lightning" / "fp8monitor.yaml").read_text() == "edited"
    assert main(["integrations", "--copy", str(dest), "--force"]) == 0
    assert (dest / "lightning" / "fp8monitor.yaml").read_bytes() == (
        SOURCE / "lightning" / "fp8monitor.yaml"
    ).read_bytes()


def _te_requests(config: dict) -> list[tuple[str, str]]:
    """(tensor, stat) pairs the stat features of a TE debug config ask for."""
    pairs = []
    for section in config.values():
        assert section["enabled"] is True and "layers" in section
        for feature, spec in section["transformer_engine"].items():
            assert feature in ("LogFp8TensorStats", "LogTensorStats"), feature
            assert spec["enabled"] is True
            groups = spec.get("tensors_struct") or [{"tensor": t, **spec} for t in spec["tensors"]]
            for g in groups:
                assert isinstance(g.get("freq", 1), int) and g.get("freq", 1) >= 1
                pairs.extend((g["tensor"], s) for s in g["stats"])
    return pairs


@pytest.mark.parametrize("name", sorted(p.name for p in (SOURCE / "te_debug").glob("*.yaml")))
def test_te_debug_configs_feed_the_bridge(name):
    pytest.importorskip("nvdlfw_inspect")
    from fp8track.trackers.nvdlfw import parse_te_stat_name

    config = yaml.safe_load((SOURCE / "te_debug" / name).read_text())
    pairs = _te_requests(config)
    assert pairs
    for tensor, stat in pairs:
        assert tensor in ("activation", "gradient", "weight")
        # TE emits f"{layer_name}_{tensor}_{stat}"; the bridge must take every one of them apart
        parsed = parse_te_stat_name(f"model.layers.0.self_attention.proj_{tensor}_{stat}")
        assert parsed is not None, stat
        assert (parsed.layer, parsed.tensor) == ("model.layers.0.self_attention.proj", tensor)
        assert "%" not in parsed.stat


@pytest.mark.slow
def test_the_wheel_carries_every_integration_file(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, timeout=300)
    [wheel] = tmp_path.glob("fp8track-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in _walk(SOURCE):
        assert f"fp8track/integrations/{rel}" in names, rel
