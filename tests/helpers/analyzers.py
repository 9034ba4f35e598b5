"""A base for the step analyzers tests plug into a monitor: no state, nothing at close."""

from __future__ import annotations


class StatelessAnalyzer:
    """The :class:`fp8track.monitoring.capture_config.StepAnalyzer` methods other than ``observe``."""

    def close(self, last_step):
        return []

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
