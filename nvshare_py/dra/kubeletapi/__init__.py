"""The kubelet's APIs a DRA driver speaks: the DRA plugin service (v1, and v1beta1 for the
kubelets that prefer it) and plugin registration (v1). Generated stubs (`*_pb2`, `*_pb2_grpc`)
from the protos beside them, and the constants both sides agree on."""

# What the driver lists in PluginInfo.supported_versions, most preferred first: the kubelet
# takes the first one it knows (k8s.io/kubelet/pkg/apis/dra/v1.DRAPluginService, ...).
DRA_V1_SERVICE = "v1.DRAPlugin"
DRA_V1BETA1_SERVICE = "v1beta1.DRAPlugin"
SUPPORTED_SERVICES = (DRA_V1_SERVICE, DRA_V1BETA1_SERVICE)
# PluginInfo.type of a DRA driver.
PLUGIN_TYPE = "DRAPlugin"
# Where a kubelet (with its default --root-dir) looks for registration sockets, and the
# directory under which each driver keeps its own socket and state.
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
