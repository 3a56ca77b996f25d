/*
 * NVSHARE_* settings, read once from the environment on first use (docs/interceptor.md lists
 * them). A malformed value is reported on stderr as a warning and its default used: the library
 * must never stop the host program, and the program goes on working. NVSHARE_MEMORY_LIMIT is
 * the exception (load_memory_limits says why).
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client_core.h"
#include "config.h"
#include "log.h"

/* Written once by nvs_config_load, inside its pthread_once (see config.h). */
struct nvs_config nvs_config;

static int is_directory(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return 0;
    close(fd);
    return 1;
}

/* Whether something listens on the Unix socket `path` (a connect, closed at once; the
 * scheduler's ROUTER ignores a peer that never speaks). */
static int socket_answers(const char *path) {
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof address.sun_path) return 0;
    memcpy(address.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    int connected = connect(fd, (struct sockaddr *)&address, sizeof address) == 0;
    close(fd);
    return connected;
}

/* The socket directory rule of nvshare_py/paths.py (SocketPaths.resolve), so that every user's
 * programs reach the same scheduler without configuration: $NVSHARE_SOCKET_DIR; else the system
 * directory ($NVSHARE_SYSTEM_SOCKET_DIR, default /var/run/nvshare) for root or whenever a
 * scheduler serves there; else this user's $XDG_RUNTIME_DIR/nvshare or /tmp/nvshare-<uid>. */
static void socket_dir(char *out, size_t cap) {
    const char *dir = getenv("NVSHARE_SOCKET_DIR");
    const char *system_dir = getenv("NVSHARE_SYSTEM_SOCKET_DIR");
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    if (system_dir == NULL || system_dir[0] == '\0') system_dir = "/var/run/nvshare";
    char system_socket[256];
    snprintf(system_socket, sizeof system_socket, "%s/client/scheduler.sock", system_dir);
    if (dir != NULL && dir[0] != '\0')
        snprintf(out, cap, "%s", dir);
    else if (geteuid() == 0 || socket_answers(system_socket))
        snprintf(out, cap, "%s", system_dir);
    else if (runtime != NULL && runtime[0] != '\0' && is_directory(runtime))
        snprintf(out, cap, "%s/nvshare", runtime);
    else
        snprintf(out, cap, "/tmp/nvshare-%u", (unsigned)geteuid());
}

/* 1/0 for on/off words, -1 for anything else. */
static int parse_switch(const char *value) {
    static const char *const on[] = {"1", "true", "yes", "on"};
    static const char *const off[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < sizeof on / sizeof on[0]; i++) {
        if (strcasecmp(value, on[i]) == 0) return 1;
        if (strcasecmp(value, off[i]) == 0) return 0;
    }
    return -1;
}

static void copy_env(const char *name, char *out, size_t cap) {
    const char *value = getenv(name);
    snprintf(out, cap, "%s", value != NULL ? value : "");
}

/* --- NVSHARE_MEMORY_LIMIT ----------------------------------------------------------------- */

/* Bytes from '8G', '512M', '1.5GiB', '1048576': the grammar of nvsharectl's sizes (nvshare_py/sizes.py
 * parse_size; the interceptor cannot call Python, hence this C twin), binary units, a fraction rounded down to whole bytes, more than 0 and at most
 * 2^63-1), so one spelling works on both sides; tests/test_memory_limit.py holds them to the
 * same answers. Returns -1 for anything else. */
static int parse_size(const char *text, size_t len, uint64_t *out) {
    static const char units[] = "kmgtp";
    size_t i = 0;
    while (i < len && text[i] == ' ') i++;
    unsigned __int128 whole = 0, fraction = 0, scale = 1;
    size_t digits = 0;
    for (; i < len && text[i] >= '0' && text[i] <= '9'; i++, digits++) {
        whole = whole * 10 + (unsigned)(text[i] - '0');
        if (whole > INT64_MAX) return -1;
    }
    if (digits == 0) return -1;
    if (i < len && text[i] == '.') {
        size_t fraction_digits = 0;
        for (i++; i < len && text[i] >= '0' && text[i] <= '9'; i++, fraction_digits++) {
            if (fraction_digits == 18) return -1; /* finer than any unit can tell apart */
            fraction = fraction * 10 + (unsigned)(text[i] - '0');
            scale *= 10;
        }
        if (fraction_digits == 0) return -1;
    }
    while (i < len && text[i] == ' ') i++;
    unsigned __int128 unit = 1;
    if (i < len) {
        const char *u = strchr(units, text[i] | 0x20);
        if (u != NULL && text[i] != '\0') {
            unit = (unsigned __int128)1 << (10 * (u - units + 1));
            i++;
        }
    }
    /* an optional "B" or "iB" */
    if (i < len && (text[i] | 0x20) == 'i') i++;
    if (i < len && (text[i] | 0x20) == 'b') i++;
    else if (i > 0 && (text[i - 1] | 0x20) == 'i') return -1;
    while (i < len && text[i] == ' ') i++;
    if (i != len) return -1;
    unsigned __int128 bytes = whole * unit + fraction * unit / scale;
    if (bytes == 0 || bytes > INT64_MAX) return -1;
    *out = (uint64_t)bytes;
    return 0;
}

/* One entry of NVSHARE_MEMORY_LIMIT: SIZE (every device), ORDINAL=SIZE or UUID=SIZE. */
static int parse_limit_rule(const char *text, size_t len, struct nvs_memory_limit_rule *rule) {
    while (len > 0 && *text == ' ') text++, len--; /* "8G, 1=4G" reads as written */
    const char *equals = memchr(text, '=', len);
    rule->ordinal = -1;
    rule->uuid[0] = '\0';
    if (equals == NULL) return parse_size(text, len, &rule->bytes);
    size_t key_len = (size_t)(equals - text);
    if (key_len == 0) return -1;
    if (strncmp(text, "GPU-", 4) == 0 || strncmp(text, "MIG-", 4) == 0) {
        if (key_len <= 4 || key_len > NVS_DEVICE_ID_MAX) return -1;
        memcpy(rule->uuid, text, key_len);
        rule->uuid[key_len] = '\0';
    } else {
        int ordinal = 0;
        for (size_t i = 0; i < key_len; i++) {
            if (text[i] < '0' || text[i] > '9' || ordinal >= NVS_CORE_MAX_DEVICES) return -1;
            ordinal = ordinal * 10 + (text[i] - '0');
        }
        if (ordinal >= NVS_CORE_MAX_DEVICES) return -1;
        rule->ordinal = ordinal;
    }
    return parse_size(equals + 1, len - key_len - 1, &rule->bytes);
}

/* A malformed limit is not ignored: an operator who set a limit must not get an unlimited
 * process. It becomes a limit of 0 bytes on every device, so every allocation is refused, each
 * refusal naming the setting (limits.c), and the program runs on to report the error its own way. */
static void load_memory_limits(void) {
    nvs_config.n_memory_limits = 0;
    nvs_config.memory_limit_invalid = 0;
    const char *value = getenv("NVSHARE_MEMORY_LIMIT");
    if (value == NULL || value[0] == '\0') return;
    for (const char *entry = value;;) {
        const char *comma = strchr(entry, ',');
        size_t len = comma != NULL ? (size_t)(comma - entry) : strlen(entry);
        struct nvs_memory_limit_rule *rule = &nvs_config.memory_limits[nvs_config.n_memory_limits];
        if (nvs_config.n_memory_limits == NVS_MAX_LIMIT_RULES || parse_limit_rule(entry, len, rule) != 0) {
            nvs_error("NVSHARE_MEMORY_LIMIT=%s: '%.*s' is not SIZE, ORDINAL=SIZE or GPU-UUID=SIZE (sizes "
                      "like 8G, 512M, 1.5GiB or bytes; entries separated by commas); every allocation is "
                      "refused until it is corrected",
                      value, (int)len, entry);
            nvs_config.memory_limit_invalid = 1;
            nvs_config.n_memory_limits = 0;
            return;
        }
        nvs_config.n_memory_limits++;
        if (comma == NULL) break;
        entry = comma + 1;
    }
}

/*
 * The only work done at load time, before main(): JAX reads XLA_PYTHON_CLIENT_ALLOCATOR from the
 * environment that Python copies at start-up, so later is too late. XLA's default allocator
 * (JAX 0.11) builds device memory with cuMemCreate/cuMemMap, which cannot be made managed
 * (measured on an H200); its cuda_async allocator uses cuMemAllocFromPoolAsync, which nvshare
 * converts. A value the user set wins, and NVSHARE_MANAGED=0 (no conversion) leaves it alone.
 */
__attribute__((constructor)) static void prefer_convertible_allocators(void) {
    const char *managed = getenv("NVSHARE_MANAGED");
    if (managed != NULL && parse_switch(managed) == 0) return;
    setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async", 0);
}

static void read_environment(void) {
    const char *value;

    value = getenv("NVSHARE_LOG");
    if (value != NULL && value[0] != '\0') {
        static const char *const levels[] = {"error", "warn", "info", "debug"};
        int level = -1;
        for (int i = 0; i < 4; i++)
            if (strcasecmp(value, levels[i]) == 0) level = i;
        if (strcasecmp(value, "warning") == 0) level = NVS_LOG_WARN;
        if (level < 0)
            nvs_warn("NVSHARE_LOG=%s is not one of error, warn, info, debug; using warn", value);
        else
            nvs_log_level = level;
    }

    char dir[200];
    socket_dir(dir, sizeof dir);
    snprintf(nvs_config.socket_path, sizeof nvs_config.socket_path, "%s/client/scheduler.sock",
             dir);
    if (strlen(nvs_config.socket_path) > 107)
        nvs_error("the scheduler socket path %s is longer than the 107 bytes a Unix socket "
                  "allows; set NVSHARE_SOCKET_DIR to a shorter directory",
                  nvs_config.socket_path);
    nvs_info("scheduler socket: %s", nvs_config.socket_path);

    nvs_config.fail_open = 0;
    value = getenv("NVSHARE_FAIL_MODE");
    if (value != NULL && value[0] != '\0') {
        if (strcasecmp(value, "open") == 0)
            nvs_config.fail_open = 1;
        else if (strcasecmp(value, "closed") != 0)
            nvs_warn("NVSHARE_FAIL_MODE=%s is not 'open' or 'closed'; using closed", value);
    }

    nvs_config.idle_release_ms = -1;
    value = getenv("NVSHARE_IDLE_RELEASE_MS");
    if (value != NULL && value[0] != '\0') {
        char *end;
        long ms = strtol(value, &end, 10);
        if (*end != '\0' || ms < 0 || ms > 86400000L)
            nvs_warn("NVSHARE_IDLE_RELEASE_MS=%s is not a number of milliseconds (0 disables "
                      "early release); using the scheduler's idle window",
                      value);
        else
            nvs_config.idle_release_ms = ms;
    }

    nvs_config.managed = 1;
    value = getenv("NVSHARE_MANAGED");
    if (value != NULL && value[0] != '\0') {
        int on = parse_switch(value);
        if (on < 0)
            nvs_warn("NVSHARE_MANAGED=%s is not 1 or 0; converting allocations (1)", value);
        else
            nvs_config.managed = on;
    }

    nvs_config.predrain = 1;
    value = getenv("NVSHARE_PREDRAIN");
    if (value != NULL && value[0] != '\0') {
        int on = parse_switch(value);
        if (on < 0)
            nvs_warn("NVSHARE_PREDRAIN=%s is not 1 or 0; draining ahead of contended quanta (1)", value);
        else
            nvs_config.predrain = on;
    }

    nvs_config.advise = 0;
    value = getenv("NVSHARE_ADVISE");
    if (value != NULL && value[0] != '\0') {
        int on = parse_switch(value);
        if (on < 0)
            nvs_warn("NVSHARE_ADVISE=%s is not 1 or 0; giving no advice (0)", value);
        else
            nvs_config.advise = on;
    }

    nvs_config.pool = 1;
    value = getenv("NVSHARE_POOL");
    if (value != NULL && value[0] != '\0') {
        int on = parse_switch(value);
        if (on < 0)
            nvs_warn("NVSHARE_POOL=%s is not 1 or 0; swapping through the shared pool (1)", value);
        else
            nvs_config.pool = on;
    }
    value = getenv("NVSHARE_POOL_DIR");
    if (value == NULL || value[0] == '\0') value = "/dev/shm";
    if (value[0] != '/' || strlen(value) >= sizeof nvs_config.pool_dir - 32) {
        nvs_warn("NVSHARE_POOL_DIR=%s is not an absolute path shorter than %zu bytes; using /dev/shm", value,
                 sizeof nvs_config.pool_dir - 32);
        value = "/dev/shm";
    }
    snprintf(nvs_config.pool_dir, sizeof nvs_config.pool_dir, "%s", value);
    /* Segments are mapped at huge-page boundaries and handed out in the area's 64 KiB pages. */
    nvs_config.pool_segment = (uint64_t)512 << 20;
    value = getenv("NVSHARE_POOL_SEGMENT");
    if (value != NULL && value[0] != '\0') {
        uint64_t bytes;
        if (parse_size(value, strlen(value), &bytes) != 0 || bytes % ((uint64_t)2 << 20) != 0 ||
            bytes > ((uint64_t)4 << 30))
            nvs_warn("NVSHARE_POOL_SEGMENT=%s is not a multiple of 2 MiB up to 4 GiB; using 512M", value);
        else
            nvs_config.pool_segment = bytes;
    }

    nvs_config.pinning_grace_ms = 250;
    value = getenv("NVSHARE_PINNING_GRACE_MS");
    if (value != NULL && value[0] != '\0') {
        char *end;
        long ms = strtol(value, &end, 10);
        if (*end != '\0' || ms < 0 || ms > 86400000L)
            nvs_warn("NVSHARE_PINNING_GRACE_MS=%s is not a number of milliseconds; using 250", value);
        else
            nvs_config.pinning_grace_ms = ms;
    }

    nvs_config.vmm_hide = 0;
    nvs_config.vmm_swap = 1;
    value = getenv("NVSHARE_VMM");
    if (value != NULL && value[0] != '\0') {
        if (strcasecmp(value, "hide") == 0)
            nvs_config.vmm_hide = 1; /* and what is made all the same (PyTorch does not ask) swaps */
        else if (strcasecmp(value, "allow") == 0)
            nvs_config.vmm_swap = 0;
        else if (strcasecmp(value, "swap") != 0)
            nvs_warn("NVSHARE_VMM=%s is not 'swap', 'allow' or 'hide'; using swap", value);
    }

    load_memory_limits();

    copy_env("NVSHARE_POD_NAME", nvs_config.pod, sizeof nvs_config.pod);
    copy_env("NVSHARE_POD_NAMESPACE", nvs_config.pod_namespace, sizeof nvs_config.pod_namespace);
    copy_env("NVSHARE_PROGRAM", nvs_config.program, sizeof nvs_config.program);
    /* NCCL's kernels: ncclKernel_* before NCCL 2.19, ncclDevKernel_* since (mangled: the words
     * are found anywhere in the name). */
    snprintf(nvs_config.collectives, sizeof nvs_config.collectives, "%s",
             getenv("NVSHARE_COLLECTIVES") != NULL ? getenv("NVSHARE_COLLECTIVES") : "ncclKernel,ncclDevKernel");
}

static pthread_once_t config_once = PTHREAD_ONCE_INIT;

void nvs_config_load(void) { pthread_once(&config_once, read_environment); }
