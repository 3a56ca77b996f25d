"""Kubernetes Dynamic Resource Allocation (resource.k8s.io/v1, Kubernetes 1.34 and later): the
nvshare DRA driver, `nvshare-dra-driver`, a kubelet plugin that publishes the node's GPUs as
ResourceSlices and prepares the ResourceClaims given them (a CDI spec that puts the container
under nvshare; the claim's weight, priority and memory limit in the scheduler). See
docs/kubernetes.md ("Dynamic Resource Allocation") and k8s/dra/.
"""
