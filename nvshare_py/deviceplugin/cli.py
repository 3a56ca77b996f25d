"""`nvshare-device-plugin`: serve nvshare.com/gpu to the kubelet, or install libnvshare.so on
the node. Every flag can also be set through the environment variable named in --help.

Exit status: 2 for a usage error (a flag's or variable's value, as every nvshare tool), 1 when
it cannot serve (no NVML, no kubelet, ...)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from nvshare_py import library
from nvshare_py.clikit import APP_SETTINGS, LOG_LEVELS, VERSION_OPTION, missing_extra, one_of, setup_logging
from nvshare_py.paths import ENV_SOCKET_DIR, SocketPaths

from . import config as defaults
from .config import AllocationPolicy, CdiNames, ConfigError, PluginConfig, Preload, parse_container_env, parse_xids
from .injection import replace_file
from .nvml import NvmlUnavailable
from .v1beta1 import DEFAULT_DEVICE_PLUGIN_DIR

app = typer.Typer(**APP_SETTINGS, no_args_is_help=True,
                  help="Kubernetes device plugin for nvshare: shares each GPU among several containers.")


@app.callback()
def options(version: bool = VERSION_OPTION) -> None:
    """Kubernetes device plugin for nvshare: shares each GPU among several containers."""


def _server():
    """The gRPC side (.server), imported when a command needs it, so that --help works and a
    missing `k8s` extra (grpcio, protobuf) is one line that says how to install it."""
    try:
        from . import server
    except ImportError as missing:
        typer.echo(missing_extra("nvshare-device-plugin", "k8s", missing.name or "grpcio"), err=True)
        raise typer.Exit(1) from None
    return server

LIBRARY_NAME = "libnvshare.so"
log = logging.getLogger("nvshare_py.deviceplugin")


@app.command("serve")
def serve_command(
    resource_name: Annotated[str, typer.Option(envvar="NVSHARE_DP_RESOURCE_NAME",
                                               help="Extended resource to advertise.")] = defaults.DEFAULT_RESOURCE_NAME,
    replicas: Annotated[int, typer.Option(envvar="NVSHARE_DP_REPLICAS",
                                          help="Virtual devices per physical GPU (containers that may share it).")] = defaults.DEFAULT_REPLICAS,
    device_plugin_dir: Annotated[Path, typer.Option(envvar="NVSHARE_DP_DIR",
                                                    help="The kubelet's device-plugin directory (holds kubelet.sock).")] = Path(DEFAULT_DEVICE_PLUGIN_DIR),
    endpoint: Annotated[str, typer.Option(envvar="NVSHARE_DP_ENDPOINT",
                                          help="File name of this plugin's socket in that directory.")] = defaults.DEFAULT_ENDPOINT,
    socket_dir: Annotated[Optional[Path], typer.Option(envvar=ENV_SOCKET_DIR, show_default="/var/run/nvshare for root",
                                                       help="The nvshare scheduler's socket directory on the node; "
                                                            "its client/ subdirectory is mounted into containers.")] = None,
    library: Annotated[Path, typer.Option(envvar="NVSHARE_DP_LIBRARY",
                                          help="libnvshare.so on the node.")] = defaults.DEFAULT_LIBRARY,
    container_library: Annotated[Path, typer.Option(envvar="NVSHARE_DP_CONTAINER_LIBRARY",
                                                    help="Where containers see libnvshare.so.")] = defaults.DEFAULT_CONTAINER_LIBRARY,
    preload: Annotated[Preload, typer.Option(envvar="NVSHARE_DP_PRELOAD",
                                             help="env: set LD_PRELOAD; file: mount an /etc/ld.so.preload "
                                                  "that the plugin writes on the node.")] = Preload.ENV,
    preload_file: Annotated[Path, typer.Option(envvar="NVSHARE_DP_PRELOAD_FILE",
                                               help="Node path of the ld.so.preload written for --preload=file.")] = defaults.DEFAULT_PRELOAD_FILE,
    allocation: Annotated[AllocationPolicy, typer.Option(envvar="NVSHARE_DP_ALLOCATION",
                                                         help="spread: suggest the least shared GPU; "
                                                              "pack: fill one GPU before the next.")] = AllocationPolicy.SPREAD,
    container_env: Annotated[Optional[list[str]], typer.Option(envvar="NVSHARE_DP_CONTAINER_ENV",
                                                               help="NAME=VALUE set in every container, e.g. "
                                                                    "NVSHARE_FAIL_MODE=closed (repeatable; the variable "
                                                                    "takes a space-separated list).")] = None,
    health_interval: Annotated[float, typer.Option(envvar="NVSHARE_DP_HEALTH_INTERVAL",
                                                   help="Seconds between GPU health checks.")] = 2.0,
    ignored_xids: Annotated[str, typer.Option(envvar="NVSHARE_DP_IGNORED_XIDS",
                                              help="Xids that leave a GPU healthy (application faults).")] =
        ",".join(str(xid) for xid in sorted(defaults.DEFAULT_IGNORED_XIDS)),
    kubelet_watch_interval: Annotated[float, typer.Option(envvar="NVSHARE_DP_KUBELET_WATCH_INTERVAL",
                                                          help="Seconds between checks for a kubelet restart.")] = 1.0,
    device_specs: Annotated[bool, typer.Option(envvar="NVSHARE_DP_DEVICE_SPECS",
                                               help="Pass the GPUs' device nodes (and nvidiactl, nvidia-uvm) to "
                                                    "the runtime as device specs, those present in --device-dir.")] = True,
    device_dir: Annotated[Path, typer.Option(envvar="NVSHARE_DP_DEVICE_DIR",
                                             help="Where the plugin finds the device nodes (the host's /dev, or the "
                                                  "copy the NVIDIA runtime gives its container).")] = Path("/dev"),
    cdi: Annotated[CdiNames, typer.Option(envvar="NVSHARE_DP_CDI",
                                          help="Also name the GPUs as CDI devices in Allocate: off, uuid "
                                               "(<kind>=GPU-...) or index (<kind>=0), matching the node's CDI spec.")] = CdiNames.OFF,
    cdi_kind: Annotated[str, typer.Option(envvar="NVSHARE_DP_CDI_KIND",
                                          help="CDI kind of the GPUs in the node's CDI spec.")] = defaults.DEFAULT_CDI_KIND,
    pod_settings: Annotated[bool, typer.Option(envvar="NVSHARE_DP_POD_SETTINGS",
                                               help="Apply the nvshare.com/weight, /priority and /memory-limit "
                                                    "annotations of this node's pods through the scheduler's "
                                                    "control socket (needs the API server and NODE_NAME).")] = True,
    node_name: Annotated[str, typer.Option(envvar="NODE_NAME",
                                           help="This node's name (the downward API's spec.nodeName).")] = "",
    log_level: Annotated[str, typer.Option(envvar="NVSHARE_DP_LOG_LEVEL", metavar="|".join(LOG_LEVELS),
                                           parser=one_of(LOG_LEVELS, "a log level"), help="Log verbosity.")] = "info",
) -> None:
    """Advertise every GPU as REPLICAS devices and inject nvshare into the containers given one."""
    server = _server()
    setup_logging(log_level)
    try:
        config = PluginConfig(
            resource_name=resource_name, replicas=replicas, device_plugin_dir=device_plugin_dir.absolute(),
            endpoint=endpoint, socket_paths=SocketPaths.resolve(socket_dir), library=library,
            container_library=container_library, preload=preload, preload_file=preload_file,
            allocation=allocation, container_env=parse_container_env(container_env or []),
            health_interval=health_interval, ignored_xids=parse_xids(ignored_xids),
            kubelet_watch_interval=kubelet_watch_interval, device_specs=device_specs,
            device_dir=device_dir, cdi=cdi, cdi_kind=cdi_kind, pod_settings=pod_settings, node_name=node_name)
    except ConfigError as error:  # a value given on the command line or in the environment
        raise typer.BadParameter(str(error)) from None
    try:
        asyncio.run(server.serve(config))
    except (NvmlUnavailable, server.PluginError) as error:
        log.error("%s", error)
        raise typer.Exit(1) from None


@app.command("install-library")
def install_library_command(
    target_dir: Annotated[Path, typer.Option("--to", envvar="NVSHARE_DP_LIBRARY_DIR",
                                             help="Node directory to put libnvshare.so in.")] = defaults.DEFAULT_LIBRARY.parent,
    source: Annotated[Optional[Path], typer.Option("--from", help="The library to install.",
                                                   show_default="the one in this package")] = None,
) -> None:
    """Copy libnvshare.so onto the node (an atomic replace: running containers keep theirs)."""
    _server()  # the command belongs to the k8s extra: without it, say so as `serve` does
    install_library(target_dir, source)


def install_library(target_dir: Path, source: Path | None) -> None:
    """`install-library` of both nvshare-device-plugin and nvshare-dra-driver."""
    setup_logging("info")
    if source is None:
        try:
            source = library.path()
        except library.LibraryNotFound as missing:
            log.error("%s", missing)
            raise typer.Exit(1) from None
    if not source.is_file():
        log.error("%s does not exist", source)
        raise typer.Exit(1)
    target = target_dir / LIBRARY_NAME
    try:
        replace_file(target, source.read_bytes(), 0o755)
    except OSError as error:
        log.error("cannot install %s as %s: %s", source, target, error.strerror or error)
        raise typer.Exit(1) from None
    log.info("installed %s as %s", source, target)


def main() -> None:
    app(prog_name="nvshare-device-plugin")
