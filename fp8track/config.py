"""The frontends' one configuration object: what the monitor captures and when, plus the
thresholds of the spike, divergence and drift detectors. Loadable from Python, a dict or a YAML
file, and typed so that LightningCLI (jsonargparse) can set every field."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.analysis.divergence import DivergenceConfig
from fp8track.analysis.drift import DriftConfig
from fp8track.analysis.spikes import SpikeConfig
from fp8track.errors import ConfigError, check_int, dataclass_from_dict, read_yaml_mapping
from fp8track.monitoring.capture_config import CaptureConfig

DEFAULT_LOG_DIR = "fp8track-runs"
"""The one default parent of run directories, relative to the working directory, for every
frontend: the plain monitor, the Lightning callback (under ``trainer.default_root_dir``, which is
the working directory unless set), the Hugging Face callback, the examples and the demo."""

_NESTED: dict[str, type] = {"spikes": SpikeConfig, "divergence": DivergenceConfig, "drift": DriftConfig}


@dataclass(frozen=True)
class MonitorConfig(CaptureConfig):
    """Everything :class:`fp8track.Monitor` and :class:`fp8track.FP8Monitor` take besides the model,
    the layer selection, the trackers, the control run and the output folder. Validated at
    construction (:class:`fp8track.errors.ConfigError` names the bad value and the valid ones).

    Attributes (beyond the capture fields of
    :class:`fp8track.monitoring.monitor.CaptureConfig`: ``every_n_steps``, ``steps``, ``tensors``,
    ``scalar_stats``, ``whatif``, ``per_layer_scalars``, ``shadow_format``, ``track_grad_norm``,
    the TE-style windows ``start_step`` / ``end_step`` / ``start_end_list``, the bursts
    ``burst_steps`` / ``burst_layers`` / ``burst_on``, the dumps ``max_dumps`` / ``max_dump_bytes``,
    the guard ``on_nonfinite`` / ``on_divergence`` and ``fp8_share_warn_below``; docs/monitoring.md):
        run_name: the name stored in the run metadata.
        spikes: :class:`fp8track.analysis.spikes.SpikeConfig` (window, z thresholds, recovery;
            ``action`` is what the Lightning callback does when a spike opens).
        divergence: :class:`fp8track.analysis.divergence.DivergenceConfig`.
        drift: :class:`fp8track.analysis.drift.DriftConfig`.
        classify_window: a spike counts as shared with the control when the control spiked within
            this many steps of it.
        whatif_history_len: amax history of the what-if delayed scaler that the drift analyzer
            runs on every sampled tensor; ``None`` switches it off.

    Example:
        >>> cfg = MonitorConfig.from_dict({"every_n_steps": 5, "spikes": {"z_threshold": 8}})
        >>> cfg.every_n_steps, cfg.spikes.z_threshold, cfg.drift.threshold_log2
        (5, 8, 1.0)
    """

    run_name: str = "fp8track"
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    classify_window: int = 50
    whatif_history_len: int | None = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a plain dict from Python code is read like YAML
                object.__setattr__(self, name, cls.from_dict(value))
            elif not isinstance(value, cls):
                raise ConfigError(f"{name} must be a {cls.__name__} or a mapping, got {value!r}")
        if not isinstance(self.run_name, str) or not self.run_name:
            raise ConfigError(f"run_name must be a non-empty string, got {self.run_name!r}")
        check_int("classify_window", self.classify_window, 0)
        if self.whatif_history_len is not None:
            check_int("whatif_history_len", self.whatif_history_len, 1)

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MonitorConfig:
        """Build from a mapping (lists for tuples, nested mappings for ``spikes``, ``divergence``,
        ``drift``). An unknown key, at any level, is a :class:`ConfigError` naming the valid ones."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a monitor config must be a mapping, got {type(data).__name__}")
        return dataclass_from_dict(cls, data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> MonitorConfig:
        """Read a YAML file (``yaml.safe_load``, UTF-8) holding the mapping :meth:`from_dict` takes.
        A missing, unreadable, non-UTF-8, malformed or unsafe file is a :class:`ConfigError`."""
        return cls.from_dict(read_yaml_mapping(path, "monitor config file"))

    @classmethod
    def load(cls, spec: MonitorConfig | Mapping[str, Any] | str | Path | None) -> MonitorConfig:
        """Accept a :class:`MonitorConfig`, a mapping, a YAML path, or ``None`` (the defaults)."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, CaptureConfig):  # the core's config: keep its capture fields
            return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(CaptureConfig)})
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        if isinstance(spec, (str, Path)):
            return cls.from_yaml(spec)
        raise ConfigError(
            f"config must be a MonitorConfig, a mapping or a YAML path, got {type(spec).__name__}"
        )

    def replace(self, **changes: Any) -> MonitorConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (nested configs as dicts); ``MonitorConfig.from_dict(c.to_dict()) == c``."""
        return dataclasses.asdict(self)


__all__ = ["MonitorConfig", "DEFAULT_LOG_DIR"]
