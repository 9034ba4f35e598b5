"""fp8track's capture feature in Transformer Engine's debug namespace (loaded by nvdlfw_inspect
from ``feature_dirs``; see :mod:`fp8track.monitoring.te_capture`)."""

from nvdlfw_inspect.registry import Registry
from transformer_engine.debug.features.api import TEConfigAPIMapper

from fp8track.monitoring.te_capture import make_feature_class

Registry.register_feature(namespace="transformer_engine")(make_feature_class(TEConfigAPIMapper))
