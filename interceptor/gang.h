/*
 * Which gang this process belongs to (docs/interceptor.md, "Gangs"): the processes of one
 * multi-GPU job on this node, which the scheduler grants their devices together. Found from
 * what launchers already put in the environment, or set with NVSHARE_GANG. Pure: it reads the
 * environment array it is given (no getenv, no I/O), so that tests call it with any they like.
 */
#ifndef NVSHARE_GANG_H
#define NVSHARE_GANG_H

#include <stddef.h>
#include <stdint.h>

#define NVS_GANG_NAME_MAX 127
#define NVS_GANG_SOURCE_MAX 200

struct nvs_gang {
    char name[NVS_GANG_NAME_MAX + 1]; /* "": no gang */
    uint64_t size;                    /* ranks on this node; 0 when name is "" */
    char source[NVS_GANG_SOURCE_MAX]; /* where name and size came from, or why there is none */
    int malformed;                    /* NVSHARE_GANG did not parse: source says so (a warning) */
};

/* The gang of a process whose environment is `env` (NULL-terminated "KEY=value" strings, as
 * environ). Never fails: no gang is an answer too. */
void nvs_gang_discover(char *const *env, struct nvs_gang *out);

#endif
