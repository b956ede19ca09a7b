/* LD_PRELOAD shim for tests/integration/fault_injection_test.py: makes writes under one directory
 * fail the way a full or failing disk does, without needing a mount.
 *
 *   KEEL_FAULT_DIR    path prefix of the files affected (absolute)
 *   KEEL_FAULT_BYTES  bytes that may be written there (by this process) before faults begin
 *   KEEL_FAULT_OP     "write": write()/pwrite() fail once the budget is spent (a partial write
 *                     first, as a real full disk gives); "fsync": writes succeed but fsync() and
 *                     fdatasync() fail once the budget is spent (writeback errors)
 *                     "slow": nothing fails, but every fsync()/fdatasync() of such a file first
 *                     sleeps KEEL_FAULT_SLEEP_S seconds (a slow disk)
 *                     "capacity": the directory is a disk of KEEL_FAULT_BYTES bytes: a write fails
 *                     (after a partial one) when the files under it would exceed that size;
 *                     deleting files there makes room again
 *   KEEL_FAULT_ERRNO  ENOSPC (default) or EIO
 *
 * Files are tracked from open()/openat()/creat() by path, and forgotten on close(). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_FDS 65536
static atomic_char tracked[MAX_FDS];
static atomic_llong written;
static const char* fault_dir;
static size_t fault_dir_len;
static long long budget = -1;
static int fault_on_fsync;
static int fault_errno = ENOSPC;
static double slow_sync_s;
static int capacity_mode;
static pthread_mutex_t usage_lock = PTHREAD_MUTEX_INITIALIZER;
static long long usage_total;

static void init(void) {
  static int done;
  if (done) return;
  done = 1;
  fault_dir = getenv("KEEL_FAULT_DIR");
  fault_dir_len = fault_dir ? strlen(fault_dir) : 0;
  const char* b = getenv("KEEL_FAULT_BYTES");
  budget = b ? atoll(b) : -1;
  const char* op = getenv("KEEL_FAULT_OP");
  fault_on_fsync = op && strcmp(op, "fsync") == 0;
  capacity_mode = op && strcmp(op, "capacity") == 0;
  if (op && strcmp(op, "slow") == 0) {
    const char* sleep_s = getenv("KEEL_FAULT_SLEEP_S");
    slow_sync_s = sleep_s ? atof(sleep_s) : 1.0;
    budget = -1; /* writes always succeed */
  }
  const char* e = getenv("KEEL_FAULT_ERRNO");
  if (e && strcmp(e, "EIO") == 0) fault_errno = EIO;
}

static int under_dir(int dirfd, const char* path) {
  init();
  if (!fault_dir || fault_dir_len == 0 || !path) return 0;
  if (path[0] == '/') return strncmp(path, fault_dir, fault_dir_len) == 0;
  char cwd[4096];
  if (dirfd != AT_FDCWD || !getcwd(cwd, sizeof cwd)) return 0;
  size_t n = strlen(cwd);
  if (n >= fault_dir_len) return strncmp(cwd, fault_dir, fault_dir_len) == 0;
  return strncmp(cwd, fault_dir, n) == 0 && fault_dir[n] == '/' &&
         strncmp(path, fault_dir + n + 1, fault_dir_len - n - 1) == 0;
}

static int track(int fd, int yes) {
  if (fd >= 0 && fd < MAX_FDS) atomic_store(&tracked[fd], (char)yes);
  return fd;
}

static int is_tracked(int fd) { return fd >= 0 && fd < MAX_FDS && atomic_load(&tracked[fd]); }

#define REAL(name)                   \
  static __typeof__(&name) real_##name; \
  if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

static int mode_arg(int flags, va_list ap) { return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, int) : 0; }

int open(const char* path, int flags, ...) {
  REAL(open);
  va_list ap;
  va_start(ap, flags);
  int mode = mode_arg(flags, ap);
  va_end(ap);
  return track(real_open(path, flags, mode), under_dir(AT_FDCWD, path));
}
int open64(const char* path, int flags, ...) {
  REAL(open64);
  va_list ap;
  va_start(ap, flags);
  int mode = mode_arg(flags, ap);
  va_end(ap);
  return track(real_open64(path, flags, mode), under_dir(AT_FDCWD, path));
}
int openat(int dirfd, const char* path, int flags, ...) {
  REAL(openat);
  va_list ap;
  va_start(ap, flags);
  int mode = mode_arg(flags, ap);
  va_end(ap);
  return track(real_openat(dirfd, path, flags, mode), under_dir(dirfd, path));
}
int openat64(int dirfd, const char* path, int flags, ...) {
  REAL(openat64);
  va_list ap;
  va_start(ap, flags);
  int mode = mode_arg(flags, ap);
  va_end(ap);
  return track(real_openat64(dirfd, path, flags, mode), under_dir(dirfd, path));
}
int creat(const char* path, mode_t mode) { return open(path, O_CREAT | O_WRONLY | O_TRUNC, mode); }
int creat64(const char* path, mode_t mode) { return open(path, O_CREAT | O_WRONLY | O_TRUNC, mode); }

int close(int fd) {
  REAL(close);
  track(fd, 0);
  return real_close(fd);
}

static int add_file_size(const char* path, const struct stat* st, int type, struct FTW* ftw) {
  (void)path, (void)ftw;
  if (type == FTW_F) usage_total += (long long)st->st_size;
  return 0;
}

/* Capacity mode: what the disk has left, from the sizes of the files under the directory now. */
static ssize_t room_for(size_t count) {
  pthread_mutex_lock(&usage_lock);
  usage_total = 0;
  nftw(fault_dir, add_file_size, 16, FTW_PHYS);
  long long left = budget - usage_total;
  pthread_mutex_unlock(&usage_lock);
  if (left <= 0) return 0;
  return (size_t)left < count ? (ssize_t)left : (ssize_t)count;
}

/* How many of `count` bytes may be written now: all of them, fewer (a partial write), or none. */
static ssize_t allowed(int fd, size_t count) {
  if (capacity_mode && is_tracked(fd) && budget >= 0) return room_for(count);
  if (!is_tracked(fd) || budget < 0 || fault_on_fsync) return (ssize_t)count;
  long long before = atomic_fetch_add(&written, (long long)count);
  if (before + (long long)count <= budget) return (ssize_t)count;
  if (before < budget) {
    atomic_fetch_sub(&written, before + (long long)count - budget);
    return (ssize_t)(budget - before);
  }
  atomic_fetch_sub(&written, (long long)count);
  return 0;
}

static void count_written(int fd, ssize_t n) {
  if (fault_on_fsync && is_tracked(fd) && n > 0) atomic_fetch_add(&written, n);
}

ssize_t write(int fd, const void* buf, size_t count) {
  REAL(write);
  ssize_t n = allowed(fd, count);
  if (count > 0 && n == 0) {
    errno = fault_errno;
    return -1;
  }
  ssize_t r = real_write(fd, buf, (size_t)n);
  count_written(fd, r);
  return r;
}

ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset) {
  REAL(pwrite);
  ssize_t n = allowed(fd, count);
  if (count > 0 && n == 0) {
    errno = fault_errno;
    return -1;
  }
  ssize_t r = real_pwrite(fd, buf, (size_t)n, offset);
  count_written(fd, r);
  return r;
}

ssize_t pwrite64(int fd, const void* buf, size_t count, off_t offset) { return pwrite(fd, buf, count, offset); }

ssize_t writev(int fd, const struct iovec* iov, int iovcnt) {
  REAL(writev);
  if (!is_tracked(fd) || budget < 0) return real_writev(fd, iov, iovcnt);
  /* Rare in keel (stdio does not come through here): write the pieces one by one. */
  ssize_t total = 0;
  for (int i = 0; i < iovcnt; ++i) {
    ssize_t n = write(fd, iov[i].iov_base, iov[i].iov_len);
    if (n < 0) return total > 0 ? total : -1;
    total += n;
    if ((size_t)n < iov[i].iov_len) break;
  }
  return total;
}

static int sync_fails(int fd) {
  init();
  if (slow_sync_s > 0 && is_tracked(fd)) {
    struct timespec t = {(time_t)slow_sync_s, (long)((slow_sync_s - (double)(time_t)slow_sync_s) * 1e9)};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
  }
  return fault_on_fsync && is_tracked(fd) && budget >= 0 && atomic_load(&written) > budget;
}

int fsync(int fd) {
  REAL(fsync);
  if (sync_fails(fd)) {
    errno = fault_errno;
    return -1;
  }
  return real_fsync(fd);
}

int fdatasync(int fd) {
  REAL(fdatasync);
  if (sync_fails(fd)) {
    errno = fault_errno;
    return -1;
  }
  return real_fdatasync(fd);
}
