"""Tensor dumps (public reader): load a dump written after an event and recompute its statistics.

    >>> from fp8track import dumps
    >>> for path in dumps.list_dumps(run_dir):          # doctest: +SKIP
    ...     d = dumps.load_dump(path)                   # torch.load(weights_only=True)
    ...     print(d.step, d.layer, dumps.recompute_stats(d)["activation"]["mse"])

Format and bounds: :mod:`fp8track.monitoring.dumps`.
"""

from fp8track.monitoring.dumps import DUMP_DIR, LayerDump, list_dumps, load_dump, recompute_stats

__all__ = ["DUMP_DIR", "LayerDump", "list_dumps", "load_dump", "recompute_stats"]
