"""Kubernetes device plugin that advertises `nvshare.com/gpu`.

Each physical GPU found through NVML is advertised as N virtual devices; a container that is
given one gets the nvshare interceptor, the scheduler's client socket directory and its GPU
injected (see k8s/README.md and docs/kubernetes.md).
"""
