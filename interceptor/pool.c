/*
 * The swap pool (issue 29; docs/interceptor.md, "Swapping"): pinned host memory that the
 * processes of one user share for swapping, so that the node's pinned memory follows what is
 * out instead of growing with tenants times their areas, and any process can move all of its
 * memory at the link's speed while the pool has room. The scheduler sizes it (POOL bytes=N, the
 * same N to every process of the user); a private area (area.c, PREPARE) is what a process that
 * cannot use the pool swaps through.
 *
 * Where: the directory $NVSHARE_POOL_DIR/nvshare-pool-<euid> (default /dev/shm, shared memory;
 * in Kubernetes every pod has a /dev/shm of its own, so a pod's processes share one pool). It
 * is made 0700 and refused (a warning, then the private area) when it is a symbolic link, not
 * ours, open to group or others, not on tmpfs or hugetlbfs, or holds a file that is not ours.
 *
 * What: files segment-<k> of NVSHARE_POOL_SEGMENT bytes (512 MiB), mapped MAP_SHARED (advised
 * MADV_HUGEPAGE and MADV_DONTFORK) and registered PORTABLE by each member's pinner thread, ahead
 * of need: the segments it makes, and free ones others made while those free here could not take
 * all that it could be asked to move out (choose_locked says why no more). Each member makes the
 * pages present and mapped from several threads before it registers them (populate.c; the maker
 * makes them, the others map them): registering holds the driver, and a process's copies wait
 * meanwhile. On an H200, copies into registered segments
 * ran at 18.9 GB/s (/dev/shm) and 7.6 GB/s (a tmpfs mounted huge=always) beside a thread that
 * fallocated and registered more, at 45.9 and 44.8 GB/s beside one that made them present first
 * (52.5 alone); registering absent pages cost 0.40-0.49 s per GiB (0.21), present ones 0.04-0.11
 * (0.02-0.03) (benchmarks/results/pool-pinning-h200-2026-11-28*.json). Huge pages make the pool
 * grow two to three times as fast: docs/interceptor.md, "The pool", says how to give it some.
 * And MAP_NAME, the shared state: a robust process-shared mutex over the segment table (state,
 * owner, file, which members have it registered) and the member table (what each member's
 * scheduler wants).
 *
 * Who owns what: a whole segment belongs to one member at a time. Inside it, area.c hands out
 * pages as in its own chunks: claiming a free segment registered here replaces pinning a chunk
 * (instant, so it happens on a swap's path), and a segment that is wholly free again goes back
 * to the pool at once, for any member to evict into (one that has not registered it registers it
 * first). A swap-out that finds no free segment registered here (the pinner takes no step while
 * the worker moves memory: worker.c) does on its path what the pinner would have done next: joins
 * the pool, or registers a free segment another member made (0.06-0.19 s per 512 MiB on an H200),
 * rather than move the rest the driver's slow way. Segments are not zeroed between members: they
 * are one user's (one pod's) processes.
 *
 * Membership and liveness: member slot k is held by an OFD lock on byte LOCKS_AT + k of the
 * map file (one per open file description, so a fork child's copy of the descriptor, closed at
 * once, does not keep it; OFD locks work across the pid namespaces of a pod's containers, pids
 * do not). Another member tests it with F_OFD_GETLK: unlocked means the holder is gone, crashed
 * or exited, and what it owned is free again (reaping). A program that closed our descriptor
 * behind our back would look gone too.
 *
 * Size: the pool holds the largest size its live members were told (in segments, rounded up):
 * any member's pinner makes the missing segments (one maker per segment, O_CREAT|O_EXCL), and
 * when it falls, free segments beyond it retire: each member unregisters and unmaps them, and
 * the last one to let go removes the file. The last member to leave removes the whole pool
 * (atexit); a pool whose members are all gone (they crashed) is removed by the next process
 * that joins it, which starts it anew.
 *
 * Locks and threads: the shared mutex guards the shared state and this process's table of
 * mappings (`mapped`); it is taken with none of nvs_mu, area_mu or mem_mu held (nvs_ctx_mu may
 * be read-held, by the pinner, and vmm_mu, by a VMM handle's free, which gives its pages back
 * through area.c), no lock is taken under it, and it is held for table scans and F_OFD_GETLK
 * only (no CUDA call, no file written or removed, no log line). INIT_LOCK (an OFD lock: joining,
 * and the last member's removal) is taken before it, never after. The pinner thread joins,
 * registers, makes and unregisters segments (a context current, nvs_ctx_mu read-held); the
 * worker claims (and registers what it claims unregistered, its job's context current) and any
 * thread releases (through area.c); the client thread only stores the scheduler's size.
 *
 * Over 600 lines: the shared state's rules (who may change which field, in which state, and
 * what a crash leaves) are kept in one place.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "config.h"
#include "loader.h"
#include "log.h"
#include "pool.h"
#include "populate.h"

#define POOL_MAGIC 0x6e76732d706f6f6cull /* "nvs-pool" */
#define MAP_NAME "pool-1.map"            /* the layout's version is in the name */
#define MAX_SEGMENTS 4096
#define MAX_MEMBERS 64 /* a bit each in a segment's `registered` */
#define NONE (-1)
/* How often the pinner looks at the other members' liveness (and so at the pool's size). */
#define LOOK_SECONDS 1.0

enum segment_state {
    ABSENT = 0, /* no file (a name free to make) */
    CREATING,   /* its maker (owner) makes the file present and registers it */
    READY,      /* in use by its owner, or free (owner NONE) */
    RETIRING,   /* beyond the pool's size: members let go of it; the last one (owner, while it
                 * removes the file) makes it ABSENT */
};

struct shared_segment {
    uint32_t state;
    int32_t owner;       /* see enum segment_state */
    uint64_t ino;        /* READY, RETIRING: the file's inode (a mapping is of this file) */
    uint64_t registered; /* bit k: member k has it mapped and registered */
};

struct shared_member {
    uint32_t joined;  /* the slot is someone's; its OFD lock says whether they live */
    uint32_t leaving; /* it exits (or swaps by itself now): no longer counted as staying */
    uint64_t want;    /* bytes its scheduler last asked for (POOL) */
};

/* The map file. Every field is consistent on its own: a member that dies holding the mutex
 * leaves nothing the next holder cannot use, and reaping repairs what it left half-done. */
struct shared {
    uint64_t magic; /* written last by the member that initialises the map */
    uint64_t segment_bytes;
    pthread_mutex_t mu;       /* robust, process-shared: guards everything below */
    _Atomic uint64_t changes; /* bumped at every change: read without the mutex, a hint to look */
    struct shared_member members[MAX_MEMBERS];
    struct shared_segment segments[MAX_SEGMENTS];
};

/* The member locks lie beyond the data: byte LOCKS_AT + k is slot k's, INIT_LOCK guards joining
 * and the removal of the pool. */
#define LOCKS_AT ((off_t)((sizeof(struct shared) + 4095) / 4096 * 4096))
#define INIT_LOCK (LOCKS_AT + MAX_MEMBERS)

/* This process's side. Written by the pinner while it joins (or by a swap job's claim, while the
 * pinner takes no step), before `joined` is published; constant afterwards (a fork child resets
 * them). */
static struct shared *shared;
static int dir_fd = -1, map_fd = -1;
static int self = NONE;
static size_t segment_bytes;
static char where[256]; /* the directory, for messages */
/* Under the shared mutex: this process's mappings of the segments (host NULL: none). */
static struct {
    char *host;
    uint64_t ino;
} mapped[MAX_SEGMENTS];
/* Any thread. wanted: the scheduler's POOL (the client thread); needed: what this process could
 * be asked to move out at once (swap.c, before each pinner step); need_cap: of that, what it may
 * be asked to move out soon (POOL need=, the client thread); joined: a member, claims may go
 * on (the pinner sets it, leaving clears it); refused: this process swaps through its own area
 * from now on (set once, by whoever found why, and said once); free_bytes: written under the
 * shared mutex. */
static _Atomic uint64_t wanted, needed, need_cap = UINT64_MAX;
static _Atomic int joined, refused;
static _Atomic uint64_t free_bytes;
/* The pinner's own: the want last written to our slot, the `changes` it last found nothing to
 * do at, when it looks at the members next, and the pool's size at which a segment could not
 * be made (no retry until the size changes). */
static uint64_t published = UINT64_MAX;
static uint64_t seen;
static double next_look;
static uint64_t growth_failed_at;
static uint64_t capped_said = UINT64_MAX; /* the need= at which the pinner last said it stops registering */

void nvs_pool_want(uint64_t bytes) { atomic_store(&wanted, bytes); }
void nvs_pool_need(uint64_t bytes) { atomic_store(&needed, bytes); }
void nvs_pool_need_at_most(uint64_t bytes) { atomic_store(&need_cap, bytes); }
int nvs_pool_joined(void) { return atomic_load(&joined); }
uint64_t nvs_pool_free_bytes(void) { return atomic_load(&free_bytes); }

static void segment_name(int k, char *out, size_t cap) { snprintf(out, cap, "segment-%d", k); }

/* fstat. On x86-64 as the system call: glibc's fstat is a symbol of its own only since 2.33
 * (glibc_compat.h), and the kernel's struct stat is glibc's there. */
#if defined(__x86_64__)
static int file_status(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }
#else
static int file_status(int fd, struct stat *st) { return fstat(fd, st); }
#endif

/* --- the shared state (under its mutex) ----------------------------------------------------*/

static int member_alive(int k) {
    struct flock probe = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = LOCKS_AT + k, .l_len = 1};
    if (fcntl(map_fd, F_OFD_GETLK, &probe) != 0) return 1; /* cannot tell: it stays */
    return probe.l_type != F_UNLCK;
}

/* A member's slot is forgotten: what it owned is free, what it made half is retired, what it had
 * registered it has no longer. */
static void forget_member_locked(int k) {
    for (int i = 0; i < MAX_SEGMENTS; i++) {
        struct shared_segment *s = &shared->segments[i];
        s->registered &= ~(1ULL << k);
        if (s->owner != k) continue;
        if (s->state == CREATING) s->state = RETIRING;
        s->owner = NONE;
    }
    shared->members[k] = (struct shared_member){0};
}

/* Members that are gone (their lock is free) are forgotten; how many. */
static int reap_locked(void) {
    int gone = 0;
    for (int k = 0; k < MAX_MEMBERS; k++) {
        if (k == self || !shared->members[k].joined || member_alive(k)) continue;
        forget_member_locked(k);
        gone++;
    }
    /* A maker that died between its last two writes leaves a segment CREATING without one. */
    for (int i = 0; i < MAX_SEGMENTS; i++)
        if (shared->segments[i].state == CREATING && shared->segments[i].owner == NONE)
            shared->segments[i].state = RETIRING;
    return gone;
}

static int lock_shared(void) {
    int r = pthread_mutex_lock(&shared->mu);
    if (r == EOWNERDEAD) { /* a member died holding it: see struct shared */
        pthread_mutex_consistent(&shared->mu);
        reap_locked();
        r = 0;
    }
    if (r != 0 && !atomic_exchange(&refused, 1)) {
        atomic_store(&joined, 0);
        nvs_warn("the swap pool at %s cannot be locked any more (%s): this process swaps through an area of its own "
                 "from now on, as the scheduler's PREPARE says",
                 where, strerror(r));
    }
    return r;
}

static void unlock_shared(void) { pthread_mutex_unlock(&shared->mu); }

static void changed_locked(void) { atomic_fetch_add(&shared->changes, 1); }

/* Whether segment i is registered here (and so usable here). */
static int usable_here_locked(int i) {
    const struct shared_segment *s = &shared->segments[i];
    return s->state == READY && mapped[i].host != NULL && mapped[i].ino == s->ino;
}

static uint64_t free_here_locked(void) {
    uint64_t free_segments = 0;
    for (int i = 0; i < MAX_SEGMENTS; i++) free_segments += usable_here_locked(i) && shared->segments[i].owner == NONE;
    return free_segments * segment_bytes;
}

static void refresh_locked(void) { atomic_store(&free_bytes, free_here_locked()); }

/* The pool's size in segments: the largest size a member that stays was told, and one segment
 * more for each such member. A segment is one member's at a time, so each member's part ends in
 * a segment it fills only in part; the scheduler, which counts bytes, does not know the segment
 * size. None while nobody wants any. */
static uint64_t target_locked(void) {
    uint64_t want = 0, staying = 0;
    for (int k = 0; k < MAX_MEMBERS; k++) {
        if (!shared->members[k].joined || shared->members[k].leaving) continue;
        staying++;
        if (shared->members[k].want > want) want = shared->members[k].want;
    }
    uint64_t segments = want > 0 ? (want + segment_bytes - 1) / segment_bytes + staying : 0;
    return segments < MAX_SEGMENTS ? segments : MAX_SEGMENTS;
}

static int others_stay_locked(void) {
    for (int k = 0; k < MAX_MEMBERS; k++)
        if (k != self && shared->members[k].joined && !shared->members[k].leaving && member_alive(k)) return 1;
    return 0;
}

/* --- files and pinning (no lock held) ------------------------------------------------------*/

static char *map_segment(int fd) {
    char *host = mmap(NULL, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (host == MAP_FAILED) return NULL;
    madvise(host, segment_bytes, MADV_HUGEPAGE); /* advice: shmem may back it with huge pages */
    if (madvise(host, segment_bytes, MADV_DONTFORK) != 0) { /* a child must not get pinned pages */
        munmap(host, segment_bytes);
        return NULL;
    }
    return host;
}

static CUresult register_segment(char *host) {
    if (nvs_real.cuMemHostRegister_v2 == NULL) return CUDA_ERROR_NOT_FOUND;
    return nvs_real.cuMemHostRegister_v2(host, segment_bytes, CU_MEMHOSTREGISTER_PORTABLE);
}

/* Unregisters and unmaps a segment of ours (a context current). */
static void unpin_segment(int k, char *host) {
    CUresult r = nvs_real.cuMemHostUnregister != NULL ? nvs_real.cuMemHostUnregister(host) : CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) {
        munmap(host, segment_bytes);
        return;
    }
    /* Unmapped while the driver takes it for pinned, the addresses could be handed to another
     * mapping: kept, and said. */
    nvs_warn("unregistering segment-%d of the swap pool at %s failed (%s, %d): it stays mapped and pinned here", k,
             where, nvs_real_error_name(r), r);
}

/* Removes every segment file of the directory (the pool is being removed or started anew). */
static int remove_segment_files(void) {
    int removed = 0, fd = dup(dir_fd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (dir == NULL) {
        if (fd >= 0) close(fd);
        return 0;
    }
    rewinddir(dir); /* the descriptor's offset is shared with dir_fd's */
    for (struct dirent *entry; (entry = readdir(dir)) != NULL;)
        if (strncmp(entry->d_name, "segment-", 8) == 0 && unlinkat(dir_fd, entry->d_name, 0) == 0) removed++;
    closedir(dir);
    return removed;
}

/* --- joining -------------------------------------------------------------------------------*/

/* The pool's directory, made if missing, opened and checked: 0, or -1 with the reason. */
static int open_directory(char *why, size_t cap) {
    snprintf(where, sizeof where, "%s/nvshare-pool-%u", nvs_config.pool_dir, (unsigned)geteuid());
    if (mkdir(where, 0700) != 0 && errno != EEXIST) {
        snprintf(why, cap, "it cannot be made: %s", strerror(errno));
        return -1;
    }
    dir_fd = open(where, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    struct statfs fs;
    if (dir_fd < 0) {
        int error = errno, link = open(where, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        int symbolic = link >= 0 && file_status(link, &st) == 0 && S_ISLNK(st.st_mode);
        if (link >= 0) close(link);
        snprintf(why, cap, "%s", symbolic ? "it is a symbolic link" : strerror(error));
    } else if (file_status(dir_fd, &st) != 0 || fstatfs(dir_fd, &fs) != 0) {
        snprintf(why, cap, "it cannot be examined: %s", strerror(errno));
    } else if (st.st_uid != geteuid()) {
        snprintf(why, cap, "it belongs to uid %u", (unsigned)st.st_uid);
    } else if ((st.st_mode & 077) != 0) {
        snprintf(why, cap, "it is open to group or others (mode %03o)", (unsigned)(st.st_mode & 0777));
    } else if (fs.f_type != TMPFS_MAGIC && fs.f_type != HUGETLBFS_MAGIC) {
        snprintf(why, cap, "it is not on shared memory (tmpfs or hugetlbfs)");
    } else if (fs.f_type == HUGETLBFS_MAGIC && nvs_config.pool_segment % (uint64_t)fs.f_bsize != 0) {
        snprintf(why, cap, "its huge pages (%ld bytes) do not divide a segment", (long)fs.f_bsize);
    } else {
        /* Every file in it must be ours: nobody else may put in what we map and pin. */
        int fd = dup(dir_fd);
        DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
        why[0] = '\0';
        if (dir != NULL) rewinddir(dir);
        for (struct dirent *entry; dir != NULL && why[0] == '\0' && (entry = readdir(dir)) != NULL;) {
            if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0) continue;
            int file = openat(dir_fd, entry->d_name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            struct stat fst;
            if (file >= 0 && file_status(file, &fst) == 0 && (fst.st_uid != geteuid() || !S_ISREG(fst.st_mode)))
                snprintf(why, cap, "it holds %.64s, which is %s", entry->d_name,
                         fst.st_uid != geteuid() ? "not ours" : "not a regular file");
            if (file >= 0) close(file);
        }
        if (dir != NULL) closedir(dir);
        else if (fd >= 0) close(fd);
        if (why[0] == '\0') return 0;
    }
    if (dir_fd >= 0) close(dir_fd);
    dir_fd = -1;
    return -1;
}

static int ofd_lock(int fd, short type, off_t at, off_t length, int wait) {
    struct flock lock = {.l_type = type, .l_whence = SEEK_SET, .l_start = at, .l_len = length};
    return fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &lock);
}

/* Under INIT_LOCK, with nobody in the pool: the map (re)made from nothing, and what a pool whose
 * members are all gone left is removed (how many segments, in *removed). */
static int initialise(char *why, size_t cap, int *removed) {
    *removed = remove_segment_files();
    shared->magic = 0;
    memset(&shared->members, 0, sizeof shared->members);
    memset(&shared->segments, 0, sizeof shared->segments);
    for (int i = 0; i < MAX_SEGMENTS; i++) shared->segments[i].owner = NONE;
    atomic_store(&shared->changes, 0);
    shared->segment_bytes = nvs_config.pool_segment;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    int r = pthread_mutex_init(&shared->mu, &attr);
    pthread_mutexattr_destroy(&attr);
    if (r != 0) {
        snprintf(why, cap, "its lock cannot be made: %s", strerror(r));
        return -1;
    }
    shared->magic = POOL_MAGIC;
    return 0;
}

/* Under INIT_LOCK, the map mapped: a member slot, the map made anew first when nobody is in the
 * pool (`alone`; what that removed in *removed); 0, or -1 with the reason. */
static int take_slot(int alone, char *why, size_t cap, int *removed) {
    if (!alone && shared->magic != POOL_MAGIC) {
        snprintf(why, cap, "%s was made by another nvshare", MAP_NAME);
        return -1;
    }
    if (alone && initialise(why, cap, removed) != 0) return -1;
    madvise(shared, (size_t)LOCKS_AT, MADV_DONTFORK);
    for (int k = 0; k < MAX_MEMBERS && self == NONE; k++)
        if (ofd_lock(map_fd, F_WRLCK, LOCKS_AT + k, 1, 0) == 0) self = k;
    if (self != NONE) return 0;
    snprintf(why, cap, "it has %d members already", MAX_MEMBERS);
    return -1;
}

/* Opens (or makes) the map and takes a member slot: 0; -1 with the reason; 1 when the map was
 * removed meanwhile (its last member left): try again. A pool nobody was in any more was started
 * anew: the segments it had, in *removed. */
static int attach(char *why, size_t cap, int *removed) {
    map_fd = openat(dir_fd, MAP_NAME, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (map_fd < 0) {
        snprintf(why, cap, "%s cannot be opened: %s", MAP_NAME, strerror(errno));
        return errno == ENOENT ? 1 : -1; /* the directory itself was removed */
    }
    if (ofd_lock(map_fd, F_WRLCK, INIT_LOCK, 1, 1) != 0) {
        snprintf(why, cap, "open file description locks do not work there: %s", strerror(errno));
        return -1;
    }
    int r = -1;
    struct stat st;
    struct flock anyone = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = LOCKS_AT, .l_len = MAX_MEMBERS};
    if (file_status(map_fd, &st) != 0 || st.st_uid != geteuid()) {
        snprintf(why, cap, "%s is not ours", MAP_NAME);
    } else if (st.st_nlink == 0) {
        r = 1;
    } else if (st.st_size != LOCKS_AT && ftruncate(map_fd, LOCKS_AT) != 0) {
        snprintf(why, cap, "%s cannot be sized: %s", MAP_NAME, strerror(errno));
    } else if ((shared = mmap(NULL, (size_t)LOCKS_AT, PROT_READ | PROT_WRITE, MAP_SHARED, map_fd, 0)) == MAP_FAILED) {
        shared = NULL;
        snprintf(why, cap, "%s cannot be mapped: %s", MAP_NAME, strerror(errno));
    } else if (fcntl(map_fd, F_OFD_GETLK, &anyone) != 0) {
        snprintf(why, cap, "open file description locks do not work there: %s", strerror(errno));
    } else {
        r = take_slot(anyone.l_type == F_UNLCK, why, cap, removed);
    }
    ofd_lock(map_fd, F_UNLCK, INIT_LOCK, 1, 0);
    if (r != 0) {
        if (shared != NULL) munmap(shared, (size_t)LOCKS_AT);
        shared = NULL;
        close(map_fd);
        map_fd = -1;
    }
    return r;
}

/* Gives the pool up for good: this process swaps through its own area (PREPARE) from now on. */
static void refuse(const char *why) {
    if (atomic_exchange(&refused, 1)) return;
    nvs_warn("the swap pool at %s is not used (%s): this process swaps through an area of its own, as the scheduler's "
             "PREPARE says",
             where, why);
}

static int join(void) {
    char why[200] = "";
    if (open_directory(why, sizeof why) != 0) {
        refuse(why);
        return 0;
    }
    int r = 1, removed = 0;
    for (int attempt = 0; attempt < 3 && r == 1; attempt++) r = attach(why, sizeof why, &removed);
    if (r != 0) {
        close(dir_fd);
        dir_fd = -1;
        refuse(why);
        return 0;
    }
    if (lock_shared() != 0) return 0;
    reap_locked();
    forget_member_locked(self); /* a slot's previous holder may have left things behind */
    shared->members[self] = (struct shared_member){.joined = 1, .want = atomic_load(&wanted)};
    published = shared->members[self].want;
    segment_bytes = shared->segment_bytes;
    int ready = 0, others = 0;
    for (int i = 0; i < MAX_SEGMENTS; i++) ready += shared->segments[i].state == READY;
    for (int k = 0; k < MAX_MEMBERS; k++) others += k != self && shared->members[k].joined;
    changed_locked();
    unlock_shared();
    atomic_store(&joined, 1);
    if (removed > 0)
        nvs_info("the swap pool at %s had no member left (they crashed): removed its %d segments and started it anew",
                 where, removed);
    nvs_info("joined the swap pool at %s: %llu bytes wanted, %d segments of %zu bytes ready, other members: %d", where,
             (unsigned long long)published, ready, segment_bytes, others);
    return 1;
}

/* Leaves the pool: claims stop, this member no longer counts for the pool's size or as one that
 * stays. Its slot is held until the process ends, so what it still owns (moved-out memory) stays
 * its own; `unpin` (a context current): the segments it does not own are let go of now. The last
 * member to leave removes the pool. */
static void leave(int unpin) {
    if (!atomic_exchange(&joined, 0) || lock_shared() != 0) return;
    shared->members[self].leaving = 1;
    shared->members[self].want = 0;
    int n = 0;
    static struct { /* static: one leave per process (joined), and 64 KiB off the pinner's stack */
        int index;
        char *host;
    } let_go[MAX_SEGMENTS];
    for (int i = 0; unpin && i < MAX_SEGMENTS; i++) {
        if (mapped[i].host == NULL || (shared->segments[i].owner == self && shared->segments[i].state == READY)) continue;
        if (mapped[i].ino == shared->segments[i].ino) shared->segments[i].registered &= ~(1ULL << self);
        let_go[n].index = i;
        let_go[n++].host = mapped[i].host;
        mapped[i].host = NULL;
    }
    refresh_locked();
    changed_locked();
    int last = !others_stay_locked();
    unlock_shared();
    for (int i = 0; i < n; i++) unpin_segment(let_go[i].index, let_go[i].host);
    if (!last) return;
    /* Under INIT_LOCK nobody joins meanwhile; one who joined since is seen and keeps it. */
    ofd_lock(map_fd, F_WRLCK, INIT_LOCK, 1, 1);
    int locked = lock_shared() == 0;
    last = locked && !others_stay_locked();
    if (locked) unlock_shared();
    int removed = last ? remove_segment_files() : 0;
    if (last) unlinkat(dir_fd, MAP_NAME, 0);
    ofd_lock(map_fd, F_UNLCK, INIT_LOCK, 1, 0);
    if (last && rmdir(where) != 0 && errno != ENOTEMPTY && errno != ENOENT)
        nvs_debug("swap pool: %s stays (%s)", where, strerror(errno));
    if (last) nvs_debug("swap pool: the last member left %s: removed it and its %d segments", where, removed);
}

void nvs_pool_leave(void) { leave(0); }

/* --- the pinner's steps --------------------------------------------------------------------*/

enum action_kind {
    NOTHING,
    UNMAP,   /* unregister and unmap a segment that retired or was replaced */
    UNLINK,  /* remove a retired segment's file: nobody maps it any more */
    RETIRED, /* (done) a free segment beyond the pool's size retires */
    REVIVED, /* (done) a retiring segment is wanted again */
    REGISTER,
    CREATE,
};

struct action {
    enum action_kind kind;
    int index;
    char *host;   /* UNMAP */
    uint64_t ino; /* REGISTER: the file the table names */
    uint64_t target;
    int capped; /* NOTHING: a free segment another member made is left unregistered for need= */
};

/* A free READY segment this process has not mapped yet (a file that could not be mapped here is
 * not tried again). */
static int unregistered_locked(void) {
    struct shared_segment *segments = shared->segments;
    for (int i = 0; i < MAX_SEGMENTS; i++)
        if (segments[i].state == READY && mapped[i].host == NULL && mapped[i].ino != segments[i].ino &&
            segments[i].owner == NONE)
            return i;
    return NONE;
}

/* The pinner's next thing to do, most urgent first: let go of what retired, remove what nobody
 * maps, shrink, grow, register a free segment another member made while the free ones registered
 * here could not take all that this process could be asked to move out (`needed`), or as much of it
 * as the scheduler says it may be asked to move out soon (`need_cap`: a tenant late in eviction
 * order, asked every second, registered segments freed by cold tenants while it served, and its
 * requests waited for the registrations). A member registers no more than that, and no segment
 * another member holds (of no use here until it is free): on an H200 a registration took 0.05-0.2 s
 * per 512 MiB and held up every other CUDA call of its process meanwhile, and when six tenants of
 * 12 GiB loaded at once each member registered every segment of a pool of 36 GiB in turn, about 70
 * of them, for the 24 its own memory would fill, while the first requests to the tenants waited for
 * room. While the pool grows, every member makes segments, and what it makes (registered by it
 * alone) is what it moves its memory into: each segment is registered once. A swap-out that finds
 * too few free segments registered here registers more on its path (nvs_pool_claim), which is why
 * growth no longer waits for registrations: before a swap-out could, a segment freed while its
 * member made a new one was not registered when its eviction needed it, and the eviction took the
 * driver's slow path (a CI run under load). Cheap changes are made here. */
static void choose_locked(struct action *a) {
    struct shared_segment *segments = shared->segments;
    uint64_t bit = 1ULL << self, live = 0;
    a->target = target_locked();
    for (int i = 0; i < MAX_SEGMENTS; i++) {
        live += segments[i].state == READY || segments[i].state == CREATING;
        if (mapped[i].host == NULL || usable_here_locked(i)) continue;
        if (mapped[i].ino == segments[i].ino) segments[i].registered &= ~bit;
        *a = (struct action){.kind = UNMAP, .index = i, .host = mapped[i].host};
        mapped[i].host = NULL;
        mapped[i].ino = 0;
        return;
    }
    for (int i = 0; i < MAX_SEGMENTS; i++) {
        if (segments[i].state != RETIRING || segments[i].registered != 0 || segments[i].owner != NONE) continue;
        segments[i].owner = self;
        *a = (struct action){.kind = UNLINK, .index = i};
        return;
    }
    for (int i = MAX_SEGMENTS - 1; live > a->target && i >= 0; i--) {
        if (segments[i].state != READY || segments[i].owner != NONE) continue;
        segments[i].state = RETIRING;
        *a = (struct action){.kind = RETIRED, .index = i, .target = a->target};
        return;
    }
    for (int i = 0; live < a->target && a->target != growth_failed_at && i < MAX_SEGMENTS; i++) {
        if (segments[i].state != RETIRING || segments[i].owner != NONE) continue;
        segments[i].state = READY;
        *a = (struct action){.kind = REVIVED, .index = i, .target = a->target};
        return;
    }
    for (int i = 0; live < a->target && a->target != growth_failed_at && i < MAX_SEGMENTS; i++) {
        if (segments[i].state != ABSENT) continue;
        segments[i].state = CREATING;
        segments[i].owner = self;
        *a = (struct action){.kind = CREATE, .index = i, .target = a->target};
        return;
    }
    uint64_t free_here = free_here_locked();
    int k = free_here < atomic_load(&needed) ? unregistered_locked() : NONE;
    if (k != NONE && free_here >= atomic_load(&need_cap))
        a->capped = 1; /* it would register k, but the scheduler's need= says no */
    else if (k != NONE)
        *a = (struct action){.kind = REGISTER, .index = k, .ino = segments[k].ino, .target = a->target};
}

/* A segment registered here, in the table (if it is still what the table names: else let go). */
static void keep_registered(int k, char *host, uint64_t ino) {
    int kept = 0;
    if (lock_shared() == 0) {
        struct shared_segment *s = &shared->segments[k];
        kept = atomic_load(&joined) && s->state == READY && s->ino == ino;
        if (kept) {
            mapped[k].host = host;
            mapped[k].ino = ino;
            s->registered |= 1ULL << self;
            refresh_locked();
            changed_locked();
        }
        unlock_shared();
    }
    if (!kept) unpin_segment(k, host);
}

/* Registering failed: the driver will not pin the pool's memory here. */
static void registering_failed(int k, CUresult r) {
    char why[160];
    snprintf(why, sizeof why, "registering segment-%d failed: %s, %d", k, nvs_real_error_name(r), r);
    refuse(why);
    leave(1);
}

/* Segment `index`'s file mapped here, if it is the file the table names (`ino`); else NULL. */
static char *map_named(int index, uint64_t ino) {
    char name[32];
    segment_name(index, name, sizeof name);
    int fd = openat(dir_fd, name, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    char *host = NULL;
    if (fd >= 0 && file_status(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
        (uint64_t)st.st_size == segment_bytes && (uint64_t)st.st_ino == ino)
        host = map_segment(fd);
    if (fd >= 0) close(fd);
    return host;
}

static void register_existing(const struct action *a) {
    char name[32];
    segment_name(a->index, name, sizeof name);
    double since = nvs_now();
    char *host = map_named(a->index, a->ino);
    if (host == NULL) {
        /* Not the file the table names (removed behind the pool's back, or replaced): retired,
         * so that it is made anew. */
        if (lock_shared() == 0) {
            struct shared_segment *s = &shared->segments[a->index];
            if (s->state == READY && s->ino == a->ino && s->owner == NONE) s->state = RETIRING;
            mapped[a->index].ino = a->ino; /* if it is in use, it stays what it is: not tried again */
            changed_locked();
            unlock_shared();
        }
        nvs_debug("swap pool: %s is not the file the pool names: retired", name);
        return;
    }
    /* Mapped here first (the pages exist: its maker made them), as its maker does: advice, where
     * it fails registering maps them. */
    nvs_populate(host, segment_bytes);
    CUresult r = register_segment(host);
    if (r != CUDA_SUCCESS) {
        munmap(host, segment_bytes);
        registering_failed(a->index, r);
        return;
    }
    keep_registered(a->index, host, a->ino);
    nvs_debug("swap pool: registered %s (%zu bytes) in %.3f s", name, segment_bytes, nvs_now() - since);
}

/* A new segment's pages, present before they are registered (populate.c); where the kernel has
 * no MADV_POPULATE_WRITE (before 5.14), fallocate makes them present and registering maps them.
 * 0, or why not (an errno). */
static int make_present(int fd, char *host) {
    int error = nvs_populate(host, segment_bytes);
    if (error == EINVAL) error = fallocate(fd, 0, 0, (off_t)segment_bytes) == 0 ? 0 : errno;
    return error;
}

/* Makes segment a->index: the file, present, mapped and registered here; then READY for all. */
static void create(const struct action *a) {
    char name[32], why[160] = "";
    segment_name(a->index, name, sizeof name);
    double since = nvs_now(), present = 0;
    int error = 0;
    int fd = openat(dir_fd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST && unlinkat(dir_fd, name, 0) == 0) /* not in the table: a stray */
        fd = openat(dir_fd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    struct stat st;
    char *host = NULL;
    if (fd < 0)
        snprintf(why, sizeof why, "it cannot be made: %s", strerror(errno));
    else if (ftruncate(fd, (off_t)segment_bytes) != 0 || file_status(fd, &st) != 0 || (host = map_segment(fd)) == NULL)
        snprintf(why, sizeof why, "it cannot be mapped: %s", strerror(errno));
    else if ((error = make_present(fd, host)) != 0) {
        snprintf(why, sizeof why, "its %zu bytes cannot be had: %s", segment_bytes,
                 error == EFAULT ? "shared memory is full" : strerror(error));
        munmap(host, segment_bytes);
        host = NULL;
    }
    if (fd >= 0) close(fd);
    present = nvs_now() - since;
    CUresult r = host != NULL ? register_segment(host) : CUDA_SUCCESS;
    int ok = 0, left = 0;
    if (host == NULL) unlinkat(dir_fd, name, 0);
    if (lock_shared() == 0) {
        struct shared_segment *s = &shared->segments[a->index];
        int ours = s->state == CREATING && s->owner == self;
        if (ours && host != NULL) { /* the file is good, whether or not this process could register it */
            s->ino = (uint64_t)st.st_ino;
            ok = r == CUDA_SUCCESS && atomic_load(&joined);
            if (ok) {
                s->registered |= 1ULL << self;
                mapped[a->index].host = host;
                mapped[a->index].ino = s->ino;
            }
            s->state = READY;
            s->owner = NONE;
        } else if (ours) {
            s->state = ABSENT;
            s->owner = NONE;
        }
        for (int i = 0; i < MAX_SEGMENTS; i++)
            left += shared->segments[i].state == READY || shared->segments[i].state == CREATING;
        refresh_locked();
        changed_locked();
        unlock_shared();
    }
    if (host != NULL && r != CUDA_SUCCESS) {
        munmap(host, segment_bytes);
        registering_failed(a->index, r);
    } else if (host != NULL && !ok) {
        unpin_segment(a->index, host);
    } else if (host == NULL && left == 0) {
        snprintf(why + strlen(why), sizeof why - strlen(why), "; not a single segment fits");
        refuse(why);
        leave(1);
    } else if (host == NULL) {
        growth_failed_at = a->target;
        nvs_warn("the swap pool at %s cannot grow to %llu bytes: %s %s; what does not fit in its %d segments moves "
                 "the slow way (cuMemPrefetchAsync)",
                 where, (unsigned long long)(a->target * segment_bytes), name, why, left);
    } else {
        nvs_debug("swap pool: made %s (%zu bytes present in %.3f s, registered in %.3f s)", name, segment_bytes,
                  present, nvs_now() - since - present);
    }
}

static void perform(const struct action *a) {
    char name[32];
    segment_name(a->index, name, sizeof name);
    switch (a->kind) {
    case UNMAP:
        unpin_segment(a->index, a->host);
        nvs_debug("swap pool: let go of %s (retired or replaced)", name);
        break;
    case UNLINK:
        unlinkat(dir_fd, name, 0);
        if (lock_shared() == 0) {
            struct shared_segment *s = &shared->segments[a->index];
            if (s->state == RETIRING && s->owner == self) *s = (struct shared_segment){.state = ABSENT, .owner = NONE};
            changed_locked();
            unlock_shared();
        }
        nvs_debug("swap pool: removed %s", name);
        break;
    case RETIRED:
    case REVIVED:
        nvs_debug("swap pool: %s %s (the pool's size is %llu bytes)", name, a->kind == RETIRED ? "retires" : "is wanted again",
                  (unsigned long long)(a->target * segment_bytes));
        break;
    case REGISTER:
        register_existing(a);
        break;
    case CREATE:
        create(a);
        break;
    default:
        break;
    }
}

int nvs_pool_due(void) {
    if (!nvs_config.pool || atomic_load(&refused)) return 0;
    if (!atomic_load(&joined)) return atomic_load(&wanted) > 0;
    return atomic_load(&wanted) != published || atomic_load(&shared->changes) != seen || nvs_now() >= next_look;
}

int nvs_pool_step(void) {
    if (!nvs_pool_due()) return 0;
    if (!atomic_load(&joined)) return join();
    uint64_t want = atomic_load(&wanted), figure = atomic_load(&free_bytes);
    double now = nvs_now();
    if (lock_shared() != 0) return 0;
    int gone = 0;
    if (now >= next_look) {
        gone = reap_locked();
        next_look = now + LOOK_SECONDS;
    }
    int resized = want != published;
    shared->members[self].want = want;
    published = want;
    struct action a = {.kind = NOTHING};
    choose_locked(&a);
    if (gone || resized || a.kind != NOTHING) changed_locked();
    refresh_locked();
    int changed = gone || resized || a.kind != NOTHING || atomic_load(&free_bytes) != figure;
    if (!changed) seen = atomic_load(&shared->changes);
    unlock_shared();
    if (gone) nvs_debug("swap pool: %d members are gone; what they held is free again", gone);
    if (resized) nvs_debug("swap pool: %llu bytes wanted", (unsigned long long)want);
    uint64_t cap = atomic_load(&need_cap);
    if (a.capped && cap != capped_said)
        nvs_debug("swap pool: registers no more segments others made: the scheduler says this process may be asked "
                  "to move out %llu bytes soon, and %llu are free here",
                  (unsigned long long)cap, (unsigned long long)atomic_load(&free_bytes));
    capped_said = a.capped ? cap : UINT64_MAX;
    perform(&a);
    return changed;
}

/* --- claims (the swap area) ----------------------------------------------------------------*/

static int free_segment_locked(void) {
    for (int i = 0; i < MAX_SEGMENTS; i++)
        if (usable_here_locked(i) && shared->segments[i].owner == NONE) return i;
    return NONE;
}

/* A free segment that is not registered here, claimed while the caller registers it
 * (register_claimed). */
static int claim_unregistered_locked(uint64_t *ino) {
    int k = unregistered_locked();
    if (k != NONE) {
        shared->segments[k].owner = self;
        *ino = shared->segments[k].ino;
        changed_locked();
    }
    return k;
}

/* Registers segment k, claimed by claim_unregistered_locked, on the swap job's path: 0 and *out
 * when it is ours to use, else -1 (given back). Its mapping's pages are not made present first,
 * as the pinner's are (populate.c): the job's own calls wait for the registration either way, and
 * registering present pages this way took 0.15-0.21 s per GiB on one thread on an H200, against
 * 0.22-0.63 s for mapping them from four threads first (pool-pinning-h200-2026-11-28*.json). */
static int register_claimed(int k, uint64_t ino, struct nvs_pool_segment *out) {
    double since = nvs_now();
    char *host = map_named(k, ino);
    CUresult r = host != NULL ? register_segment(host) : CUDA_ERROR_INVALID_VALUE;
    int kept = 0;
    if (lock_shared() == 0) {
        struct shared_segment *s = &shared->segments[k];
        kept = r == CUDA_SUCCESS && atomic_load(&joined) && s->state == READY && s->ino == ino && s->owner == self;
        if (kept) {
            mapped[k].host = host;
            mapped[k].ino = ino;
            s->registered |= 1ULL << self;
            *out = (struct nvs_pool_segment){.host = host, .bytes = segment_bytes, .index = k};
        } else {
            if (s->owner == self && s->ino == ino) s->owner = NONE;
            mapped[k].ino = ino; /* not tried again here (the pinner retires or replaces it) */
        }
        refresh_locked();
        changed_locked();
        unlock_shared();
    }
    if (!kept && host != NULL && r == CUDA_SUCCESS) unpin_segment(k, host);
    else if (!kept && host != NULL) munmap(host, segment_bytes);
    if (kept)
        nvs_debug("swap pool: registered and claimed segment-%d on a swap's path in %.3f s", k, nvs_now() - since);
    else
        nvs_debug("swap pool: segment-%d could not be registered on a swap's path (%d)", k, r);
    return kept ? 0 : -1;
}

/* A free segment registered here, claimed. Else, on the swap's path (the pinner takes no step
 * meanwhile: worker.c), what the pinner would have done next for it: join the pool (told POOL
 * since), or register a free segment another member made. The pool does not grow on the path:
 * making a segment's pages cost 0.15-0.5 s per 512 MiB on an H200 beside five members doing the
 * same, slower than the driver's prefetch to the host the rest then takes. */
int nvs_pool_claim(struct nvs_pool_segment *out) {
    if (!atomic_load(&joined) && !(nvs_pool_due() && join())) return -1; /* told POOL: join first */
    if (!atomic_load(&joined) || lock_shared() != 0) return -1;
    int k = atomic_load(&joined) ? free_segment_locked() : NONE;
    if (k == NONE && atomic_load(&joined) && reap_locked() > 0) k = free_segment_locked(); /* one may have died */
    uint64_t ino = 0;
    int unregistered = k == NONE && atomic_load(&joined) ? claim_unregistered_locked(&ino) : NONE;
    if (k != NONE) {
        shared->segments[k].owner = self;
        *out = (struct nvs_pool_segment){.host = mapped[k].host, .bytes = segment_bytes, .index = k};
        refresh_locked();
        changed_locked();
    }
    unlock_shared();
    if (unregistered != NONE) return register_claimed(unregistered, ino, out);
    if (k != NONE) nvs_debug("swap pool: claimed segment-%d", k);
    return k != NONE ? 0 : -1;
}

void nvs_pool_release(int index) {
    if (shared == NULL || index < 0 || index >= MAX_SEGMENTS || lock_shared() != 0) return;
    if (shared->segments[index].owner == self) shared->segments[index].owner = NONE;
    refresh_locked();
    changed_locked();
    unlock_shared();
    nvs_debug("swap pool: released segment-%d", index);
}

void nvs_pool_reset_after_fork(void) {
    /* The child has neither the map nor the segments (MADV_DONTFORK). Closing its copies of the
     * descriptors leaves the parent's member lock held (it belongs to the open file description,
     * which the parent still has). */
    if (dir_fd >= 0) close(dir_fd);
    if (map_fd >= 0) close(map_fd);
    dir_fd = map_fd = -1;
    shared = NULL;
    self = NONE;
    memset(mapped, 0, sizeof mapped);
    atomic_store(&wanted, 0);
    atomic_store(&joined, 0);
    atomic_store(&refused, 0);
    atomic_store(&free_bytes, 0);
    atomic_store(&need_cap, UINT64_MAX);
    published = UINT64_MAX;
    seen = 0;
    next_look = 0;
    growth_failed_at = 0;
    capped_said = UINT64_MAX;
}
