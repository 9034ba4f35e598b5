"""fp8track.MonitorConfig: one object for capture settings and detector thresholds, from Python,
a dict or YAML; unknown keys rejected; the thresholds reach the analyzers."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fp8track
from fp8track.analysis.divergence import DivergenceConfig
from fp8track.analysis.drift import DriftConfig
from fp8track.analysis.spikes import SpikeConfig
from fp8track.errors import ConfigError
from fp8track.monitoring.monitor import CaptureConfig

from helpers.models import mlp

YAML = """
every_n_steps: 5
tensors: [activation, gradient]
whatif: [current]
spikes:
  z_threshold: 9.0
  window: 64
  warmup: 32
divergence:
  rise_threshold: 0.1
drift:
  consecutive: 5
whatif_history_len: null
"""


def test_yaml_dict_and_python_build_the_same_config(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text(YAML)
    from_yaml = fp8track.MonitorConfig.load(path)
    expected = fp8track.MonitorConfig(
        every_n_steps=5,
        tensors=("activation", "gradient"),
        whatif=("current",),
        spikes=SpikeConfig(z_threshold=9.0, window=64, warmup=32),
        divergence=DivergenceConfig(rise_threshold=0.1),
        drift=DriftConfig(consecutive=5),
        whatif_history_len=None,
    )
    assert from_yaml == expected
    assert fp8track.MonitorConfig.load(str(path)) == expected
    assert fp8track.MonitorConfig.from_dict(expected.to_dict()) == expected  # round trip through plain data
    assert isinstance(from_yaml, CaptureConfig)  # the core monitor takes it as is
    assert from_yaml.samples(10) and not from_yaml.samples(11)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"every_n_step": 5},
            r"unknown MonitorConfig key 'every_n_step'; valid values are: .*'every_n_steps'",
        ),
        ({"spikes": {"z": 3}}, r"unknown SpikeConfig key 'z'; valid values are: .*'z_threshold'"),
        (
            {"drift": {"threshold": 2}},
            r"unknown DriftConfig key 'threshold'; valid values are: 'consecutive', 'threshold_log2'",
        ),
        ({"every_n_steps": True}, r"every_n_steps must be an integer >= 1, got True"),
        ({"spikes": {"window": 0}}, r"window"),
        ({"whatif_history_len": 0}, r"whatif_history_len must be an integer >= 1, got 0"),
        ({"spikes": 3}, r"spikes must be a SpikeConfig or a mapping, got 3"),
    ],
)
def test_bad_keys_and_values_are_rejected_naming_the_valid_ones(data, message):
    with pytest.raises(ConfigError, match=message):
        fp8track.MonitorConfig.from_dict(data)


def test_unknown_keywords_from_python_are_the_same_config_error():
    """``MonitorConfig(every_n_step=10)`` was Python's TypeError, which names no valid keyword."""
    from fp8track.analysis.diagnose import DiagnosisConfig
    from fp8track.analysis.spike_events import SpikeConfig

    for cls, bad, valid in ((fp8track.MonitorConfig, "every_n_step", "every_n_steps"),
                            (SpikeConfig, "z", "z_threshold"), (DiagnosisConfig, "noise", "noise_k")):
        with pytest.raises(ConfigError, match=rf"unknown {cls.__name__} keyword '{bad}'; valid .*'{valid}'"):
            cls(**{bad: 1})
    c = fp8track.MonitorConfig(every_n_steps=5)  # known keywords, replace and copies as before
    assert (c.every_n_steps, c.replace(every_n_steps=3).every_n_steps) == (5, 3)
    assert copy.deepcopy(c) == c == pickle.loads(pickle.dumps(c))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        fp8track.MonitorConfig.load(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping, got list"):
        fp8track.MonitorConfig.load(tmp_path / "list.yaml")
    with pytest.raises(
        ConfigError, match="config must be a MonitorConfig, a mapping or a YAML path, got int"
    ):
        fp8track.MonitorConfig.load(3)


def test_the_thresholds_reach_the_analyzers(tmp_path):
    (tmp_path / "monitor.yaml").write_text(YAML)
    mon = fp8track.Monitor(mlp(8, 8, 2), tmp_path / "monitor.yaml", log_dir=tmp_path)
    loss_analyzer, drift_analyzer = mon.analyzers
    assert loss_analyzer.spikes.config == SpikeConfig(z_threshold=9.0, window=64, warmup=32)
    assert loss_analyzer.divergence.config == DivergenceConfig(rise_threshold=0.1)
    assert drift_analyzer.recipe.config == drift_analyzer.whatif_tracker.config == DriftConfig(consecutive=5)
    assert drift_analyzer.whatif is None  # whatif_history_len: null switches the what-if scaler off
    assert mon.config.tensors == ("activation", "gradient")


def test_readme_plain_loop_snippet(tmp_path):
    model = mlp(8, 8, 2)
    monitor = fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=2), log_dir=tmp_path).attach()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        monitor.step(loss=loss)
        opt.zero_grad()
        losses.append(loss.item())
    monitor.close()
    summary = monitor.summary()
    assert summary["last_step"] == 2 and summary["final_loss"] == pytest.approx(losses[-1], rel=1e-6)
    assert [e.kind for e in monitor.events] == ["run_end"]
    assert {w["layer"] for w in summary["worst_layers"]} == {"0", "2"}


def test_fp8monitor_keywords_override_the_config(tmp_path):
    (tmp_path / "monitor.yaml").write_text(YAML)
    cb = fp8track.FP8Monitor(every_n_steps=3, on_spike="stop", config=str(tmp_path / "monitor.yaml"))
    assert cb.config.every_n_steps == 3 and cb.config.spikes.action == "stop" and cb.on_spike == "stop"
    assert cb.config.spikes.z_threshold == 9.0  # the rest comes from the file
    assert fp8track.FP8Monitor(config={"spikes": {"action": "checkpoint"}}).on_spike == "checkpoint"
    assert fp8track.FP8Monitor().config == fp8track.MonitorConfig()
    with pytest.raises(
        ConfigError, match="unknown on_spike action 'kill'; valid values are: 'log', 'stop', 'checkpoint'"
    ):
        fp8track.FP8Monitor(on_spike="kill")
    with pytest.raises(ConfigError, match="every_n_steps must be an integer >= 1, got 0"):
        fp8track.FP8Monitor(every_n_steps=0)


def test_public_surface_keeps_internals_in_their_modules():
    for name in ("FP8Monitor", "Monitor", "MonitorConfig", "apply_fp8", "Recipe", "load_baseline",
                 "make_trackers", "quant_stats", "RunReader"):
        assert name in fp8track.__all__ and getattr(fp8track, name) is not None
    for internal in ("set_compile", "partial_stats", "merge_partials", "all_reduce_partials", "finalize"):
        assert internal not in fp8track.__all__
        assert not hasattr(fp8track, internal)
    from fp8track.numerics.stats import set_compile  # still reachable where it lives

    assert callable(set_compile)
