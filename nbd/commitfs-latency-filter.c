/* nbdkit-commitfs-latency-filter: a block device with a volatile write cache and a
 * latency/throughput model, for `commitfs bench --device emulated:PROFILE`.
 *
 * Written against the public nbdkit filter API (nbdkit-filter.h, API v2 as shipped
 * by Debian's nbdkit-plugin-dev); no nbdkit code is copied. Built by
 * nbd/build.sh. Usage:
 *
 *   nbdkit -U SOCK --filter=./nbdkit-commitfs-latency-filter.so memory 1G \
 *          profile=sata-ssd stats=/dev/shm/x.stats [lat-flush=1500 ...]
 *
 * Model (every time in microseconds; a profile sets defaults, keys override):
 *   write  = throttle(iops, bw) + lat-write                  (lands in the cache)
 *   FUA    = write + lat-fua + bytes / destage-bw            (bypasses the cache)
 *   flush  = lat-flush + dirty bytes since last flush / destage-bw (serialised)
 *   read   = throttle(iops, bw) + lat-read
 *   trim/zero are counted and throttled like writes.
 * throttle(): one global token bucket: each request reserves 1/iops seconds and
 * bytes/bw seconds of the device's time line and waits for its slot, so IOPS and
 * bandwidth caps hold across all connections (nbdfuse opens several).
 *
 * Counters live in a shared file (stats=PATH, mmap'd, little-endian u64 fields;
 * layout `struct shared` below, mirrored in crates/cli/src/bench/emu.rs) so the
 * benchmark reads them while the device runs: they are the device's own counts,
 * never the file system's. With trace=N the file also holds a ring of the last N
 * requests (time, op, offset, length) for classifying writes by disk region.
 * The model in force is read from the same file at every request, so a client
 * may change it while the device runs (the tests do).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define NBDKIT_API_VERSION 2
#include <nbdkit-filter.h>

#define SHARED_MAGIC 0x31534d4c43544643ULL /* "CFTCLMS1" */
#define HEADER_BYTES 4096

enum { OP_READ = 1, OP_WRITE = 2, OP_FLUSH = 3, OP_TRIM = 4, OP_ZERO = 5 };
enum { TF_FUA = 1 };

/* Shared file layout; every field is a little-endian u64 (x86-64 host order). */
struct shared {
  uint64_t magic;
  uint64_t version;          /* 1 */
  _Atomic uint64_t reads, read_bytes;
  _Atomic uint64_t writes, write_bytes, fua_writes;
  _Atomic uint64_t flushes;
  _Atomic uint64_t trims, trim_bytes, zeroes, zero_bytes;
  _Atomic uint64_t delay_ns;   /* total injected delay (all requests) */
  _Atomic uint64_t flush_ns;   /* total time spent in flush (incl. waiting) */
  _Atomic uint64_t trace_next; /* requests recorded so far (ring index) */
  uint64_t trace_cap;          /* ring capacity in records (0 = no trace) */
  /* the model in force, for the report */
  uint64_t lat_write_us, lat_read_us, lat_flush_us, lat_fua_us;
  uint64_t iops, bw_bps, destage_bps;
};

struct trace_rec {
  uint64_t t_ns;   /* CLOCK_MONOTONIC */
  uint64_t offset;
  uint32_t count;
  uint8_t op, flags;
  uint8_t pad[10];
};

static struct {
  const char *profile;
  int64_t lat_write, lat_read, lat_flush, lat_fua; /* -1 = from profile */
  int64_t iops, bw_mbps, destage_mbps;
  char *stats_path;
  uint64_t trace_cap;
} cfg = { NULL, -1, -1, -1, -1, -1, -1, -1, NULL, 0 };

static struct shared *sh;
static struct trace_rec *ring;
static size_t map_len;

static pthread_mutex_t bucket_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t bucket_ns;           /* the device's time line */
static pthread_mutex_t flush_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t dirty_bytes; /* written since the last flush */
static __thread int slack_set;

#define MODEL(f) __atomic_load_n (&sh->f, __ATOMIC_RELAXED)

static uint64_t
now_ns (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t) ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}

static void
sleep_until (uint64_t t)
{
  struct timespec ts;
  if (!slack_set) {
    /* Default 50 us timer slack would swamp the NVMe profile. */
    prctl (PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    slack_set = 1;
  }
  ts.tv_sec = t / 1000000000ULL;
  ts.tv_nsec = t % 1000000000ULL;
  while (clock_nanosleep (CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
    ;
}

struct profile {
  const char *name;
  int64_t lat_write, lat_read, lat_flush, lat_fua, iops, bw_mbps, destage_mbps;
};

/* Documented in crates/cli/src/bench/emu.rs (PROFILES) and the report. */
static const struct profile profiles[] = {
  /*  name        write read  flush   fua   iops    MB/s  destage MB/s */
  { "none",         0,    0,     0,    0,      0,     0,     0 },
  { "nvme",        20,   60,   250,   40, 400000,  2500,  2000 },
  { "sata-ssd",    60,  120,  1500, 1000,  80000,   500,   400 },
  { "cloud",      400,  600,   100,    0,  15000,   150,     0 },
};

static int
latency_config (nbdkit_next_config *next, nbdkit_backend *nxdata,
                const char *key, const char *value)
{
  int64_t *dst = NULL;
  if (strcmp (key, "profile") == 0) { cfg.profile = value; return 0; }
  if (strcmp (key, "stats") == 0) {
    cfg.stats_path = nbdkit_absolute_path (value);
    return cfg.stats_path ? 0 : -1;
  }
  if (strcmp (key, "trace") == 0)
    return nbdkit_parse_uint64_t ("trace", value, &cfg.trace_cap);
  if (strcmp (key, "lat-write") == 0) dst = &cfg.lat_write;
  else if (strcmp (key, "lat-read") == 0) dst = &cfg.lat_read;
  else if (strcmp (key, "lat-flush") == 0) dst = &cfg.lat_flush;
  else if (strcmp (key, "lat-fua") == 0) dst = &cfg.lat_fua;
  else if (strcmp (key, "iops") == 0) dst = &cfg.iops;
  else if (strcmp (key, "bw") == 0) dst = &cfg.bw_mbps;
  else if (strcmp (key, "destage-bw") == 0) dst = &cfg.destage_mbps;
  if (dst) {
    if (nbdkit_parse_int64_t (key, value, dst) == -1) return -1;
    if (*dst < 0) { nbdkit_error ("%s must be >= 0", key); return -1; }
    return 0;
  }
  return next (nxdata, key, value);
}

static int
latency_config_complete (nbdkit_next_config_complete *next,
                         nbdkit_backend *nxdata)
{
  const struct profile *p = &profiles[0];
  size_t i;
  if (cfg.profile) {
    for (i = 0; i < sizeof profiles / sizeof profiles[0]; i++)
      if (strcmp (profiles[i].name, cfg.profile) == 0) { p = &profiles[i]; break; }
    if (i == sizeof profiles / sizeof profiles[0]) {
      nbdkit_error ("unknown profile %s (none, nvme, sata-ssd, cloud)", cfg.profile);
      return -1;
    }
  }
#define DEF(f) if (cfg.f < 0) cfg.f = p->f
  DEF (lat_write); DEF (lat_read); DEF (lat_flush); DEF (lat_fua);
  DEF (iops); DEF (bw_mbps); DEF (destage_mbps);
#undef DEF
  if (!cfg.stats_path) {
    nbdkit_error ("stats=PATH is required");
    return -1;
  }
  return next (nxdata);
}

/* Map the shared file in get_ready (before forking to the background is fine:
 * the mapping is MAP_SHARED and survives fork). */
static int
latency_get_ready (int thread_model)
{
  int fd;
  map_len = HEADER_BYTES + cfg.trace_cap * sizeof (struct trace_rec);
  fd = open (cfg.stats_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd == -1) { nbdkit_error ("open %s: %m", cfg.stats_path); return -1; }
  if (ftruncate (fd, map_len) == -1) {
    nbdkit_error ("ftruncate %s: %m", cfg.stats_path); close (fd); return -1;
  }
  sh = mmap (NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close (fd);
  if (sh == MAP_FAILED) { nbdkit_error ("mmap: %m"); sh = NULL; return -1; }
  memset (sh, 0, sizeof *sh);
  sh->version = 1;
  sh->trace_cap = cfg.trace_cap;
  sh->lat_write_us = cfg.lat_write; sh->lat_read_us = cfg.lat_read;
  sh->lat_flush_us = cfg.lat_flush; sh->lat_fua_us = cfg.lat_fua;
  sh->iops = cfg.iops; sh->bw_bps = cfg.bw_mbps * 1000000;
  sh->destage_bps = cfg.destage_mbps * 1000000;
  ring = cfg.trace_cap ? (struct trace_rec *) ((char *) sh + HEADER_BYTES) : NULL;
  __atomic_store_n (&sh->magic, SHARED_MAGIC, __ATOMIC_RELEASE);
  return 0;
}

static void
latency_unload (void)
{
  if (sh) munmap (sh, map_len);
  free (cfg.stats_path);
}

static void
trace (uint8_t op, uint64_t offset, uint32_t count, uint8_t flags)
{
  uint64_t i;
  struct trace_rec *r;
  if (!ring) return;
  i = atomic_fetch_add (&sh->trace_next, 1);
  r = &ring[i % cfg.trace_cap];
  r->t_ns = now_ns ();
  r->offset = offset;
  r->count = count;
  r->op = op;
  r->flags = flags;
}

/* Reserve this request's slot on the device's time line (IOPS and bandwidth
 * caps) and return when it may complete: slot end + fixed latency. */
static uint64_t
throttle (uint64_t t0, uint64_t bytes, uint64_t lat_us)
{
  uint64_t cost = 0, start, iops = MODEL (iops), bw = MODEL (bw_bps);
  if (iops > 0) cost += 1000000000ULL / iops;
  if (bw > 0) cost += bytes * 1000000000ULL / bw; /* ns */
  if (cost == 0) return t0 + lat_us * 1000;
  pthread_mutex_lock (&bucket_lock);
  start = bucket_ns > t0 ? bucket_ns : t0;
  bucket_ns = start + cost;
  pthread_mutex_unlock (&bucket_lock);
  return start + cost + lat_us * 1000;
}

static uint64_t
destage_ns (uint64_t bytes)
{
  uint64_t d = MODEL (destage_bps);
  return d > 0 ? bytes * 1000000000ULL / d : 0;
}

static void
finish (uint64_t t0, uint64_t deadline)
{
  uint64_t t = now_ns ();
  if (deadline > t) sleep_until (deadline);
  atomic_fetch_add (&sh->delay_ns, deadline > t0 ? deadline - t0 : 0);
}

static int
latency_pread (nbdkit_next *next, void *handle, void *buf, uint32_t count,
               uint64_t offset, uint32_t flags, int *err)
{
  uint64_t t0 = now_ns ();
  int r = next->pread (next, buf, count, offset, flags, err);
  if (r == -1) return r;
  atomic_fetch_add (&sh->reads, 1);
  atomic_fetch_add (&sh->read_bytes, count);
  trace (OP_READ, offset, count, 0);
  finish (t0, throttle (t0, count, MODEL (lat_read_us)));
  return r;
}

static int
latency_pwrite (nbdkit_next *next, void *handle, const void *buf,
                uint32_t count, uint64_t offset, uint32_t flags, int *err)
{
  uint64_t t0 = now_ns (), deadline;
  int fua = (flags & NBDKIT_FLAG_FUA) != 0;
  int r = next->pwrite (next, buf, count, offset, flags, err);
  if (r == -1) return r;
  atomic_fetch_add (&sh->writes, 1);
  atomic_fetch_add (&sh->write_bytes, count);
  trace (OP_WRITE, offset, count, fua ? TF_FUA : 0);
  deadline = throttle (t0, count, MODEL (lat_write_us));
  if (fua) {
    atomic_fetch_add (&sh->fua_writes, 1);
    deadline += MODEL (lat_fua_us) * 1000 + destage_ns (count);
  } else
    atomic_fetch_add (&dirty_bytes, count);
  finish (t0, deadline);
  return r;
}

static int
latency_flush (nbdkit_next *next, void *handle, uint32_t flags, int *err)
{
  uint64_t t0 = now_ns (), start, dirty;
  int r;
  /* A device handles one cache flush at a time. */
  pthread_mutex_lock (&flush_lock);
  start = now_ns ();
  r = next->flush (next, flags, err);
  if (r != -1) {
    dirty = atomic_exchange (&dirty_bytes, 0);
    atomic_fetch_add (&sh->flushes, 1);
    trace (OP_FLUSH, 0, 0, 0);
    finish (start, start + MODEL (lat_flush_us) * 1000 + destage_ns (dirty));
  }
  pthread_mutex_unlock (&flush_lock);
  atomic_fetch_add (&sh->flush_ns, now_ns () - t0);
  return r;
}

static int
latency_trim (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
              uint32_t flags, int *err)
{
  uint64_t t0 = now_ns ();
  int r = next->trim (next, count, offset, flags, err);
  if (r == -1) return r;
  atomic_fetch_add (&sh->trims, 1);
  atomic_fetch_add (&sh->trim_bytes, count);
  trace (OP_TRIM, offset, count, 0);
  finish (t0, throttle (t0, 0, MODEL (lat_write_us)));
  return r;
}

static int
latency_zero (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
              uint32_t flags, int *err)
{
  uint64_t t0 = now_ns ();
  int r = next->zero (next, count, offset, flags, err);
  if (r == -1) return r;
  atomic_fetch_add (&sh->zeroes, 1);
  atomic_fetch_add (&sh->zero_bytes, count);
  trace (OP_ZERO, offset, count, (flags & NBDKIT_FLAG_FUA) ? TF_FUA : 0);
  finish (t0, throttle (t0, count, MODEL (lat_write_us)));
  return r;
}

static struct nbdkit_filter filter = {
  .name = "commitfs-latency",
  .longname = "commitfs device latency model",
  .config = latency_config,
  .config_complete = latency_config_complete,
  .config_help =
    "profile=none|nvme|sata-ssd|cloud  latency/throughput defaults\n"
    "stats=PATH            shared counter file (required)\n"
    "trace=N               keep the last N requests in PATH\n"
    "lat-write=US lat-read=US lat-flush=US lat-fua=US\n"
    "iops=N bw=MB/s destage-bw=MB/s (0 = unlimited)",
  .get_ready = latency_get_ready,
  .unload = latency_unload,
  .pread = latency_pread,
  .pwrite = latency_pwrite,
  .flush = latency_flush,
  .trim = latency_trim,
  .zero = latency_zero,
};

NBDKIT_REGISTER_FILTER (filter)
