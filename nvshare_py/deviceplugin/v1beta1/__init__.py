"""The kubelet device-plugin API v1beta1: generated stubs (api_pb2, api_pb2_grpc) and the
constants both sides of the API agree on."""

API_VERSION = "v1beta1"
DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_DEVICE_ID_LENGTH = 63
