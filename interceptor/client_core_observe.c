/*
 * What the shell tells the client core between events, and what it reads back (client_core.h):
 * the devices, what it observed of them (recorded only, level-triggered: acted on at the next
 * event, so that the core needs no clock) and the read-only views.
 */
#include <stdio.h>
#include <string.h>

#include "client_core_internal.h"

/* A device the shell added (every entry point that names one by index checks it). */
int valid_device(const struct nvs_core *c, int device) {
    return device >= 0 && device < NVS_CORE_MAX_DEVICES && c->devices[device].known;
}

int nvs_core_add_device(struct nvs_core *c, int device, const char *uuid, const char *name, uint64_t total) {
    if (device < 0 || device >= NVS_CORE_MAX_DEVICES || uuid == NULL || strlen(uuid) > NVS_DEVICE_ID_MAX) return -1;
    struct nvs_core_device *d = &c->devices[device];
    if (d->known) {
        if (strcmp(d->uuid, uuid) != 0) return -1;
        /* A program that names its device's size later (nvshare_py.client's announce): DEVICE again. */
        if (name != NULL && (total != d->total || strcmp(name, d->name) != 0)) {
            snprintf(d->name, sizeof d->name, "%s", name);
            d->total = total;
            d->announced = 0;
        }
        return 0;
    }
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    snprintf(d->name, sizeof d->name, "%s", name ? name : "");
    d->total = total;
    d->known = 1;
    if (device >= c->n_devices) c->n_devices = device + 1;
    if (c->registered) apply_limit(c, d);
    return 0;
}

void nvs_core_use_device(struct nvs_core *c, int device) {
    if (valid_device(c, device)) c->devices[device].used = 1;
}

void nvs_core_observe(struct nvs_core *c, int device, int waiters, int captures, uint64_t entered, uint64_t bytes) {
    if (!valid_device(c, device)) return;
    struct nvs_core_device *d = &c->devices[device];
    d->waiters = waiters;
    d->captures = captures;
    d->entered = entered;
    d->bytes = bytes;
}

void nvs_core_observe_admission(struct nvs_core *c, int device, uint64_t wanted) {
    if (valid_device(c, device)) c->devices[device].admit_wanted = wanted;
}

void nvs_core_observe_collectives(struct nvs_core *c, int device, uint64_t launched) {
    if (valid_device(c, device)) c->devices[device].collectives = launched;
}

void nvs_core_observe_residency(struct nvs_core *c, int device, uint64_t converted, uint64_t swapped) {
    if (!valid_device(c, device)) return;
    c->devices[device].converted = converted;
    c->devices[device].swapped = swapped;
}

void nvs_core_observe_swap(struct nvs_core *c, const struct nvs_core_swap *swap) { c->swap = *swap; }

/* --- views ----------------------------------------------------------------------------------*/

enum nvs_lock_state nvs_core_state(const struct nvs_core *c, int device) {
    return valid_device(c, device) ? c->devices[device].state : NVS_IDLE;
}

int nvs_core_gate(const struct nvs_core *c, int device) {
    return valid_device(c, device) ? c->devices[device].gate_open : 0;
}

int nvs_core_registered(const struct nvs_core *c) { return c->registered; }

double nvs_core_lease_until(const struct nvs_core *c) { return c->registered ? c->lease_until : 0; }

uint64_t nvs_core_admitted(const struct nvs_core *c, int device) {
    return valid_device(c, device) ? c->devices[device].admitted : NVS_CORE_UNADMITTED;
}

int nvs_core_any_waiters(const struct nvs_core *c) {
    for (int i = 0; i < c->n_devices; i++)
        if (c->devices[i].waiters > 0) return 1;
    return 0;
}
