"""`nvshare-dra-driver`: serve the node's GPUs to the kubelet through Dynamic Resource
Allocation, or install libnvshare.so on the node. Every flag can also be set through the
environment variable named in --help.

Exit status: 2 for a usage error (a flag's or variable's value, as every nvshare tool), 1 when
it cannot serve (no NVML, no API server, a damaged checkpoint, a kubelet that refuses it)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from nvshare_py.clikit import APP_SETTINGS, LOG_LEVELS, VERSION_OPTION, missing_extra, one_of, setup_logging
from nvshare_py.deviceplugin import injection as defaults
from nvshare_py.deviceplugin.cli import install_library
from nvshare_py.deviceplugin.config import DEFAULT_CDI_KIND, CdiNames
from nvshare_py.deviceplugin.injection import ConfigError, Injection, Preload, parse_container_env
from nvshare_py.deviceplugin.nvml import NvmlUnavailable
from nvshare_py.paths import ENV_SOCKET_DIR, SocketPaths

from .cdi import DEFAULT_CDI_DIR
from .config import DEFAULT_DRIVER_NAME, DEFAULT_SHARES, DriverConfig, SharingChoice
from .kubeletapi import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR

app = typer.Typer(**APP_SETTINGS, no_args_is_help=True,
                  help="Kubernetes DRA driver for nvshare: shares each GPU among ResourceClaims.")
log = logging.getLogger("nvshare_py.dra")


@app.callback()
def options(version: bool = VERSION_OPTION) -> None:
    """Kubernetes DRA driver for nvshare: shares each GPU among ResourceClaims."""


def _server():
    """The gRPC and HTTP side, imported when a command needs it (the `k8s` extra: grpcio,
    protobuf, httpx), so that --help works and a missing extra is one line saying so."""
    try:
        from . import server
    except ImportError as missing:
        typer.echo(missing_extra("nvshare-dra-driver", "k8s", missing.name or "grpcio"), err=True)
        raise typer.Exit(1) from None
    return server


def _api_server(url: str, credentials: Optional[Path]):
    """The API server named on the command line, else the cluster's (in a pod)."""
    from nvshare_py.deviceplugin.kubeapi import ApiServer  # after _server(): httpx is there

    if url:
        directory = credentials or Path("/var/run/secrets/kubernetes.io/serviceaccount")
        return ApiServer(url.rstrip("/"), directory / "token", directory / "ca.crt")
    found = ApiServer.in_cluster() if credentials is None else ApiServer.in_cluster(service_account_dir=credentials)
    if found is None:
        raise ConfigError("no API server: not in a Kubernetes cluster (no KUBERNETES_SERVICE_HOST) and no --api-server")
    return found


@app.command("serve")
def serve_command(
    driver_name: Annotated[str, typer.Option(envvar="NVSHARE_DRA_DRIVER_NAME",
                                             help="The DRA driver's name (ResourceSlices, DeviceClasses, CDI kind).")] = DEFAULT_DRIVER_NAME,
    node_name: Annotated[str, typer.Option(envvar="NODE_NAME",
                                           help="This node's name (the downward API's spec.nodeName).")] = "",
    registry_dir: Annotated[Path, typer.Option(envvar="NVSHARE_DRA_REGISTRY_DIR",
                                               help="The kubelet's plugin registry directory.")] = Path(DEFAULT_REGISTRY_DIR),
    plugins_dir: Annotated[Path, typer.Option(envvar="NVSHARE_DRA_PLUGINS_DIR",
                                              help="The kubelet's plugins directory; the driver keeps its socket and "
                                                   "checkpoint in <dir>/<driver name>.")] = Path(DEFAULT_PLUGINS_DIR),
    cdi_dir: Annotated[Path, typer.Option(envvar="NVSHARE_DRA_CDI_DIR",
                                          help="Where the container runtime reads CDI specs.")] = DEFAULT_CDI_DIR,
    sharing: Annotated[SharingChoice, typer.Option(envvar="NVSHARE_DRA_SHARING",
                                                   help="capacity: one device per GPU that many claims share "
                                                        "(DRAConsumableCapacity); replicas: SHARES devices per GPU; "
                                                        "auto: capacity where the cluster keeps its fields.")] = SharingChoice.AUTO,
    shares: Annotated[int, typer.Option(envvar="NVSHARE_DRA_SHARES",
                                        help="Claims that may share one GPU.")] = DEFAULT_SHARES,
    memory_oversubscription: Annotated[float, typer.Option(envvar="NVSHARE_DRA_MEMORY_OVERSUBSCRIPTION",
                                                           help="The memory the claims of one GPU may ask for together, "
                                                                "as a multiple of its card's (capacity sharing).")] = 1.0,
    socket_dir: Annotated[Optional[Path], typer.Option(envvar=ENV_SOCKET_DIR, show_default="/var/run/nvshare for root",
                                                       help="The nvshare scheduler's socket directory on the node; "
                                                            "its client/ subdirectory goes into containers.")] = None,
    library: Annotated[Path, typer.Option(envvar="NVSHARE_DRA_LIBRARY",
                                          help="libnvshare.so on the node.")] = defaults.DEFAULT_LIBRARY,
    container_library: Annotated[Path, typer.Option(envvar="NVSHARE_DRA_CONTAINER_LIBRARY",
                                                    help="Where containers see libnvshare.so.")] = defaults.DEFAULT_CONTAINER_LIBRARY,
    preload: Annotated[Preload, typer.Option(envvar="NVSHARE_DRA_PRELOAD",
                                             help="env: set LD_PRELOAD; file: mount an /etc/ld.so.preload "
                                                  "that the driver writes on the node.")] = Preload.ENV,
    preload_file: Annotated[Path, typer.Option(envvar="NVSHARE_DRA_PRELOAD_FILE",
                                               help="Node path of the ld.so.preload written for --preload=file.")] = defaults.DEFAULT_PRELOAD_FILE,
    container_env: Annotated[Optional[list[str]], typer.Option(envvar="NVSHARE_DRA_CONTAINER_ENV",
                                                               help="NAME=VALUE set in every container (repeatable; the "
                                                                    "variable takes a space-separated list).")] = None,
    device_specs: Annotated[bool, typer.Option(envvar="NVSHARE_DRA_DEVICE_NODES",
                                               help="Give containers the GPUs' device nodes (and nvidiactl, "
                                                    "nvidia-uvm), those present in --device-dir.")] = True,
    device_dir: Annotated[Path, typer.Option(envvar="NVSHARE_DRA_DEVICE_DIR",
                                             help="Where the driver finds the device nodes.")] = Path("/dev"),
    nvidia_cdi: Annotated[CdiNames, typer.Option(envvar="NVSHARE_DRA_NVIDIA_CDI",
                                                 help="Also give containers the node's NVIDIA CDI device of each GPU: "
                                                      "off, uuid (<kind>=GPU-...) or index (<kind>=0).")] = CdiNames.OFF,
    nvidia_cdi_kind: Annotated[str, typer.Option(envvar="NVSHARE_DRA_NVIDIA_CDI_KIND",
                                                 help="CDI kind of the GPUs in the node's NVIDIA CDI spec.")] = DEFAULT_CDI_KIND,
    pod_settings: Annotated[bool, typer.Option(envvar="NVSHARE_DRA_POD_SETTINGS",
                                               help="Give the pods that use a claim its weight, priority and memory "
                                                    "limit, and its GPUs the mode it asks for, through the "
                                                    "scheduler's control socket.")] = True,
    api_server: Annotated[str, typer.Option(envvar="NVSHARE_DRA_API_SERVER", show_default="the cluster's",
                                            help="The API server's URL; in a pod, the cluster's is found.")] = "",
    api_credentials: Annotated[Optional[Path], typer.Option(envvar="NVSHARE_DRA_API_CREDENTIALS",
                                                            show_default="the pod's service account",
                                                            help="A directory with the bearer token (token) and the "
                                                                 "API server's CA (ca.crt).")] = None,
    slice_interval: Annotated[float, typer.Option(envvar="NVSHARE_DRA_SLICE_INTERVAL",
                                                  help="Seconds between checks of the node's ResourceSlices.")] = 30.0,
    watch_interval: Annotated[float, typer.Option(envvar="NVSHARE_DRA_WATCH_INTERVAL",
                                                  help="Seconds between checks of the driver's sockets.")] = 1.0,
    log_level: Annotated[str, typer.Option(envvar="NVSHARE_DRA_LOG_LEVEL", metavar="|".join(LOG_LEVELS),
                                           parser=one_of(LOG_LEVELS, "a log level"), help="Log verbosity.")] = "info",
) -> None:
    """Publish the node's GPUs as ResourceSlices and prepare the claims given them."""
    server = _server()
    setup_logging(log_level)
    if log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per request to the API server
    try:
        config = DriverConfig(
            node_name=node_name, api=_api_server(api_server, api_credentials), driver_name=driver_name,
            registry_dir=registry_dir.absolute(), plugins_dir=plugins_dir.absolute(), cdi_dir=cdi_dir.absolute(),
            injection=Injection(socket_paths=SocketPaths.resolve(socket_dir), library=library,
                                container_library=container_library, preload=preload, preload_file=preload_file,
                                container_env=parse_container_env(container_env or []), device_specs=device_specs,
                                device_dir=device_dir),
            sharing=sharing, shares=shares, memory_oversubscription=memory_oversubscription, nvidia_cdi=nvidia_cdi,
            nvidia_cdi_kind=nvidia_cdi_kind, pod_settings=pod_settings, slice_interval=slice_interval,
            watch_interval=watch_interval)
    except ConfigError as error:  # a value given on the command line or in the environment
        raise typer.BadParameter(str(error)) from None
    try:
        asyncio.run(server.serve(config))
    except (NvmlUnavailable, server.DriverError) as error:
        log.error("%s", error)
        raise typer.Exit(1) from None


@app.command("install-library")
def install_library_command(
    target_dir: Annotated[Path, typer.Option("--to", envvar="NVSHARE_DRA_LIBRARY_DIR",
                                             help="Node directory to put libnvshare.so in.")] = defaults.DEFAULT_LIBRARY.parent,
    source: Annotated[Optional[Path], typer.Option("--from", help="The library to install.",
                                                   show_default="the one in this package")] = None,
) -> None:
    """Copy libnvshare.so onto the node (an atomic replace: running containers keep theirs)."""
    _server()  # the command belongs to the k8s extra, as `serve` does
    install_library(target_dir, source)


def main() -> None:
    app(prog_name="nvshare-dra-driver")
