"""fp8track's capture feature in nvdlfw_inspect's generic ``base`` namespace (any framework calls
``debug_api.inspect_tensor(layer_name=, tensor_name=, tensor=, quantizer=, iteration=)``)."""

from nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper
from nvdlfw_inspect.registry import Registry

from fp8track.monitoring.te_capture import make_feature_class

Registry.register_feature(namespace="base")(make_feature_class(GenericConfigAPIMapper))
