/*
 * Gang discovery (gang.h). The rule, in order (docs/interceptor.md, "Gangs"):
 *   1. NVSHARE_GANG=name:size says it; NVSHARE_GANG=none says there is none;
 *   2. torch.distributed's variables (torchrun, DeepSpeed, Lightning, a hand-written
 *      MASTER_ADDR/MASTER_PORT/WORLD_SIZE for torch.multiprocessing.spawn);
 *   3. Open MPI's (mpirun);
 *   4. Slurm's, in a task of an srun step.
 * The name must be the same in every rank of one job and differ between jobs running at once:
 * it is built from what the launcher makes unique per job (the rendezvous master's address and
 * port, the MPI job's namespace, Slurm's job and step ids). The size is the number of ranks on
 * this node: each node's scheduler grants its own ranks together. One rank is no gang.
 */
#include "gang.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const char *env_get(char *const *env, const char *key) {
    size_t n = strlen(key);
    for (char *const *e = env; e != NULL && *e != NULL; e++)
        if (strncmp(*e, key, n) == 0 && (*e)[n] == '=') return *e + n + 1;
    return NULL;
}

static const char *env_text(char *const *env, const char *key) {
    const char *value = env_get(env, key);
    return value != NULL && value[0] != '\0' ? value : NULL;
}

/* A count of ranks: decimal, 1 .. 1<<20 (nothing else is a rank count). 0: not one. */
static uint64_t parse_count(const char *text, const char **end) {
    uint64_t n = 0;
    const char *p = text;
    while (p != NULL && *p >= '0' && *p <= '9' && n <= (1u << 20)) n = n * 10 + (uint64_t)(*p++ - '0');
    if (end != NULL) *end = p;
    if (p == text || n == 0 || n > (1u << 20) || (end == NULL && *p != '\0')) return 0;
    return n;
}

static uint64_t env_count(char *const *env, const char *key) { return parse_count(env_text(env, key), NULL); }

/* Slurm's per-node task counts ("2(x3),1": two tasks on each of three nodes, then one) at the
 * node index `node`. 0: not said. */
static uint64_t slurm_tasks_on_node(const char *list, uint64_t node) {
    const char *p = list;
    while (p != NULL && *p != '\0') {
        uint64_t tasks = parse_count(p, &p), repeat = 1;
        if (tasks == 0) return 0;
        if (strncmp(p, "(x", 2) == 0) {
            repeat = parse_count(p + 2, &p);
            if (repeat == 0 || *p != ')') return 0;
            p++;
        }
        if (node < repeat) return tasks;
        node -= repeat;
        if (*p == ',') p++;
        else if (*p != '\0') return 0;
    }
    return 0;
}

/* Ranks on this node as the other launchers' variables say, for torch.distributed launched by
 * one of them (torchrun under Slurm, or by hand from SLURM_* / OMPI_* values). 0: not said. */
static uint64_t local_ranks_from_launchers(char *const *env, const char **which) {
    uint64_t n = env_count(env, "OMPI_COMM_WORLD_LOCAL_SIZE");
    if (n > 0) {
        *which = "OMPI_COMM_WORLD_LOCAL_SIZE";
        return n;
    }
    const char *node_text = env_text(env, "SLURM_NODEID"); /* this node's index in the step */
    uint64_t node = node_text != NULL && strcmp(node_text, "0") != 0 ? parse_count(node_text, NULL) : 0;
    if (node_text != NULL && (node > 0 || strcmp(node_text, "0") == 0)) {
        static const char *const lists[] = {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"};
        for (int i = 0; i < 2; i++) {
            n = slurm_tasks_on_node(env_text(env, lists[i]), node);
            if (n > 0) {
                *which = lists[i];
                return n;
            }
        }
    }
    n = env_count(env, "SLURM_NTASKS_PER_NODE");
    if (n > 0) *which = "SLURM_NTASKS_PER_NODE";
    return n;
}

/* `name` is what snprintf wrote into a buffer of `cap` bytes (`written`: its return value). */
static void set_gang(struct nvs_gang *g, uint64_t size, const char *source, const char *name, int written) {
    if (size < 2) {
        snprintf(g->source, sizeof g->source, "%s: one rank on this node, no gang", source);
        return;
    }
    if (written < 0 || (size_t)written > NVS_GANG_NAME_MAX) { /* cut, two jobs' names could be equal */
        snprintf(g->source, sizeof g->source, "%s: the job's name is longer than %d bytes, no gang", source,
                 NVS_GANG_NAME_MAX);
        return;
    }
    snprintf(g->name, sizeof g->name, "%s", name);
    g->size = size;
    snprintf(g->source, sizeof g->source, "%s", source);
}

/* NVSHARE_GANG: 1 when it decided (a gang, or none), 0 when discovery goes on. */
static int from_setting(const char *value, struct nvs_gang *g) {
    if (value == NULL) return 0;
    if (strcasecmp(value, "none") == 0 || strcasecmp(value, "off") == 0 || strcmp(value, "0") == 0) {
        snprintf(g->source, sizeof g->source, "NVSHARE_GANG=%s: no gang", value);
        return 1;
    }
    const char *colon = strrchr(value, ':');
    uint64_t size = colon != NULL ? parse_count(colon + 1, NULL) : 0;
    size_t length = colon != NULL ? (size_t)(colon - value) : 0;
    if (size == 0 || length == 0 || length > NVS_GANG_NAME_MAX) {
        g->malformed = 1;
        return 0;
    }
    char name[NVS_GANG_NAME_MAX + 1];
    memcpy(name, value, length);
    name[length] = '\0';
    set_gang(g, size, "NVSHARE_GANG", name, (int)length);
    return 1;
}

static int from_torch(char *const *env, struct nvs_gang *g) {
    const char *addr = env_text(env, "MASTER_ADDR"), *port = env_text(env, "MASTER_PORT");
    uint64_t world = env_count(env, "WORLD_SIZE");
    if (addr == NULL || port == NULL || world == 0) return 0;
    const char *which = "LOCAL_WORLD_SIZE";
    uint64_t local = env_count(env, which); /* torchrun */
    if (local == 0) local = env_count(env, which = "LOCAL_SIZE"); /* DeepSpeed's launcher */
    if (local == 0) local = local_ranks_from_launchers(env, &which);
    if (local == 0) { /* nothing says how many are local (torch.multiprocessing.spawn): one node */
        local = world;
        which = "WORLD_SIZE, assumed on one node";
    }
    char source[NVS_GANG_SOURCE_MAX];
    snprintf(source, sizeof source, "torch.distributed (MASTER_ADDR:MASTER_PORT, %s)", which);
    /* torchrun's run id tells apart jobs that reuse a master address and port one after the
     * other (an elastic restart is the same job); "none" is its default for static launches. */
    const char *run = env_text(env, "TORCHELASTIC_RUN_ID");
    if (run == NULL || strcmp(run, "none") == 0) run = "";
    char name[NVS_GANG_NAME_MAX + 1];
    int written = snprintf(name, sizeof name, "torch:%s:%s%s%s", addr, port, run[0] ? ":" : "", run);
    set_gang(g, local, source, name, written);
    return 1;
}

static int from_open_mpi(char *const *env, struct nvs_gang *g) {
    uint64_t local = env_count(env, "OMPI_COMM_WORLD_LOCAL_SIZE");
    if (local == 0) return 0;
    /* The job's id: PMIx's namespace (Open MPI 5), else the ess job id (Open MPI 4). */
    const char *job = env_text(env, "PMIX_NAMESPACE");
    if (job == NULL) job = env_text(env, "OMPI_MCA_ess_base_jobid");
    if (job == NULL) {
        snprintf(g->source, sizeof g->source,
                 "Open MPI: no job id (PMIX_NAMESPACE, OMPI_MCA_ess_base_jobid), no gang; set NVSHARE_GANG");
        return 1;
    }
    char name[NVS_GANG_NAME_MAX + 1];
    int written = snprintf(name, sizeof name, "ompi:%s", job);
    set_gang(g, local, "Open MPI (its job id, OMPI_COMM_WORLD_LOCAL_SIZE)", name, written);
    return 1;
}

static int from_slurm(char *const *env, struct nvs_gang *g) {
    const char *job = env_text(env, "SLURM_JOB_ID"), *step = env_text(env, "SLURM_STEP_ID");
    if (job == NULL || step == NULL || env_text(env, "SLURM_LOCALID") == NULL) return 0; /* no srun task */
    const char *which = "";
    uint64_t local = local_ranks_from_launchers(env, &which);
    if (local == 0) {
        snprintf(g->source, sizeof g->source, "Slurm: no tasks-per-node count, no gang; set NVSHARE_GANG");
        return 1;
    }
    char source[NVS_GANG_SOURCE_MAX];
    snprintf(source, sizeof source, "Slurm (SLURM_JOB_ID.SLURM_STEP_ID, %s)", which);
    char name[NVS_GANG_NAME_MAX + 1];
    int written = snprintf(name, sizeof name, "slurm:%s.%s", job, step);
    set_gang(g, local, source, name, written);
    return 1;
}

void nvs_gang_discover(char *const *env, struct nvs_gang *out) {
    memset(out, 0, sizeof *out);
    if (from_setting(env_text(env, "NVSHARE_GANG"), out)) return;
    int malformed = out->malformed;
    if (!from_torch(env, out) && !from_open_mpi(env, out) && !from_slurm(env, out))
        snprintf(out->source, sizeof out->source, "no launcher's variables, no gang");
    out->malformed = malformed;
}
