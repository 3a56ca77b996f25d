/* Configuration of the simulated GPUs, shared by the simulated driver, NVML and simapp. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_devices.h"

int sim_parse_size(const char *text, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    /* strtoull accepts a minus sign (after blanks) and negates: "-1" would be the largest value. */
    if (errno || end == text || strchr(text, '-'))
        return -1;
    unsigned shift = 0;
    switch (*end) {
    case '\0': break;
    case 'K': shift = 10; end++; break;
    case 'M': shift = 20; end++; break;
    case 'G': shift = 30; end++; break;
    default: return -1;
    }
    if (*end != '\0' || value > (SIZE_MAX >> shift))
        return -1;
    *out = (size_t)value << shift;
    return 0;
}

int sim_read_config(const char *program, int *devices, size_t *memory)
{
    const char *count_text = getenv("SIMCUDA_DEVICES");
    const char *memory_text = getenv("SIMCUDA_MEMORY");
    *devices = 1;
    *memory = (size_t)16 << 30;
    if (count_text) {
        char *end;
        errno = 0;
        long value = strtol(count_text, &end, 10);
        if (errno || end == count_text || *end || value < 0 || value > SIM_MAX_DEVICES) {
            fprintf(stderr, "%s: SIMCUDA_DEVICES=%s is not a number from 0 to %d\n", program, count_text,
                    SIM_MAX_DEVICES);
            return -1;
        }
        *devices = (int)value;
    }
    if (memory_text && (sim_parse_size(memory_text, memory) != 0 || *memory == 0)) {
        fprintf(stderr, "%s: SIMCUDA_MEMORY=%s is not a byte count (K, M, G suffixes)\n", program, memory_text);
        return -1;
    }
    return 0;
}
