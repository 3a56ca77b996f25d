/*
 * The simulated GPUs as every program of this directory sees them: their identity, and their
 * number and memory from SIMCUDA_DEVICES and SIMCUDA_MEMORY. The simulated driver and the
 * simulated NVML each compile sim_devices.c in, so the two libraries cannot disagree about which
 * devices exist; simapp uses the same byte-count syntax for its step arguments.
 */
#ifndef SIM_DEVICES_H
#define SIM_DEVICES_H

#include <stddef.h>

#define SIM_MAX_DEVICES 64
#define SIM_DEVICE_NAME "nvshare simulated GPU"
#define SIM_UUID_FORMAT "GPU-5151ad00-0000-4000-8000-%012x"

/* Shared between the sources of one library without becoming part of its ABI. */
#define SIM_INTERNAL __attribute__((visibility("hidden")))

/* "16G", "512M", "1024": a byte count with an optional K, M or G suffix (powers of 1024).
 * Returns -1, leaving *out alone, for anything else, including values that do not fit. */
SIM_INTERNAL int sim_parse_size(const char *text, size_t *out);

/* SIMCUDA_DEVICES (0 to SIM_MAX_DEVICES, default 1) and SIMCUDA_MEMORY (bytes per device, more
 * than 0, default 16G). A value that does not parse (an empty one included) is reported on
 * stderr, prefixed with `program`, and makes it return -1. */
SIM_INTERNAL int sim_read_config(const char *program, int *devices, size_t *memory);

#endif
