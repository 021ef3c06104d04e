// Two processes exchanging B bytes each way (the all-gather of 2 ranks on one
// node), three ways, to see what a shared-memory collective pays per byte:
//   window  copy-in / copy-out through a shared slot pair of S bytes per
//           process (what meshtrain's shared_memory algorithms do: every byte
//           is copied twice, once by its owner into its slot, once by the
//           peer out of it; chunks of S, double-buffered)
//   cma     one copy: each process reads the peer's buffer straight into its
//           own with process_vm_readv (Linux cross-memory attach, what Open
//           MPI's vader/sm BTL uses for large messages: "single_copy_mechanism
//           cma"), in chunks of S
//   memcpy  one process copying B bytes once (the reference: the memory
//           system's copy rate on one core)
// The measurement behind docs/comm.md "Why shared memory is slower where it
// is". Not part of the build:
//   gcc -O2 -std=gnu11 bench/tools/copy_paths.c -o copy_paths && ./copy_paths [MAX_BYTES]
// (MAX_BYTES: the largest B, default 64 MiB; on a loaded machine the small
// chunks of the large sizes take minutes).
// Prints one JSON line per (mode, B, S): GB/s = B / t (bytes delivered to each
// process per second), t the median of the repetitions, each result checked
// (every byte of the peer's pattern arrives).
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

typedef struct {
  _Alignas(64) atomic_long published[2];  // per process: chunks written into its slots
  _Alignas(64) atomic_long consumed[2];   // per process: the peer's chunks it copied out
  _Alignas(64) atomic_long round[2];      // barrier
  _Alignas(64) atomic_long pid[2];
  _Alignas(64) atomic_long src[2];  // address of each process's source buffer
} Ctl;

static Ctl* ctl;
static char* slots;  // [process][2][S]

static void spin_until(atomic_long* a, long v) {
  int k = 0;
  while (atomic_load_explicit(a, memory_order_acquire) < v) {
    if (++k > 1000) sched_yield();
  }
}

static long barrier_round[2];
static void barrier(int me) {
  long r = ++barrier_round[me];
  atomic_store_explicit(&ctl->round[me], r, memory_order_release);
  spin_until(&ctl->round[1 - me], r);
}

// One exchange of B bytes each way; returns seconds.
static double exchange(int me, const char* mode, char* src, char* dst, size_t B, size_t S,
                       long* pub, long* con) {
  const int peer = 1 - me;
  barrier(me);
  const double t0 = now();
  const size_t chunks = (B + S - 1) / S;
  if (strcmp(mode, "window") == 0) {
    char* mine = slots + (size_t)me * 2 * S;
    char* theirs = slots + (size_t)peer * 2 * S;
    size_t wrote = 0, read = 0;
    // Interleave: write my chunk k when the peer has consumed k-2, read the
    // peer's chunk k when published, until both are done.
    while (read < chunks || wrote < chunks) {
      if (wrote < chunks &&
          (long)atomic_load_explicit(&ctl->consumed[peer], memory_order_acquire) >=
              *pub + (long)wrote - 1) {
        const size_t off = wrote * S, n = B - off < S ? B - off : S;
        memcpy(mine + ((size_t)*pub + wrote) % 2 * S, src + off, n);
        atomic_store_explicit(&ctl->published[me], *pub + (long)wrote + 1, memory_order_release);
        ++wrote;
        continue;
      }
      if (read < chunks &&
          (long)atomic_load_explicit(&ctl->published[peer], memory_order_acquire) >=
              *con + (long)read + 1) {
        const size_t off = read * S, n = B - off < S ? B - off : S;
        memcpy(dst + off, theirs + ((size_t)*con + read) % 2 * S, n);
        atomic_store_explicit(&ctl->consumed[me], *con + (long)read + 1, memory_order_release);
        ++read;
        continue;
      }
      sched_yield();
    }
    *pub += (long)chunks;
    *con += (long)chunks;
  } else {  // cma
    const pid_t p = (pid_t)atomic_load(&ctl->pid[peer]);
    char* remote = (char*)atomic_load(&ctl->src[peer]);
    for (size_t off = 0; off < B; off += S) {
      const size_t n = B - off < S ? B - off : S;
      struct iovec l = {dst + off, n}, r = {remote + off, n};
      if (process_vm_readv(p, &l, 1, &r, 1, 0) != (ssize_t)n) {
        perror("process_vm_readv");
        exit(1);
      }
    }
  }
  barrier(me);  // the peer is done reading my buffer
  return now() - t0;
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  const size_t sizes[] = {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  const size_t slot_sizes[] = {64 << 10, 512 << 10, 4 << 20};
  const size_t maxB = 64 << 20, maxS = 4 << 20;
  ctl = mmap(NULL, sizeof(Ctl), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  slots = mmap(NULL, 2 * 2 * maxS, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(ctl, 0, sizeof(Ctl));
  memset(slots, 0, 2 * 2 * maxS);
  const pid_t child = fork();
  const int me = child == 0 ? 1 : 0;
  char* src = malloc(maxB);
  char* dst = malloc(maxB);
  for (size_t i = 0; i < maxB; ++i) src[i] = (char)(i * 7 + me * 13);
  memset(dst, 0, maxB);
  atomic_store(&ctl->pid[me], (long)getpid());
  atomic_store(&ctl->src[me], (long)(uintptr_t)src);
  barrier(me);
  long pub = 0, con = 0;
  char host[64] = {0};
  FILE* f = popen("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2", "r");
  if (f) {
    if (fgets(host, sizeof host, f)) host[strcspn(host, "\n")] = 0;
    pclose(f);
  }
  const char* modes[] = {"window", "cma"};
  const size_t limit = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : maxB;
  for (size_t bi = 0; bi < sizeof sizes / sizeof *sizes; ++bi) {
    const size_t B = sizes[bi];
    if (B > limit) break;
    const int reps = B >= (16 << 20) ? 5 : 15;
    for (size_t mi = 0; mi < 2; ++mi) {
      for (size_t si = 0; si < sizeof slot_sizes / sizeof *slot_sizes; ++si) {
        const size_t S = slot_sizes[si];
        double t[32];
        exchange(me, modes[mi], src, dst, B, S, &pub, &con);  // warm-up
        for (int r = 0; r < reps; ++r) t[r] = exchange(me, modes[mi], src, dst, B, S, &pub, &con);
        for (size_t i = 0; i < B; ++i) {
          if (dst[i] != (char)(i * 7 + (1 - me) * 13)) {
            fprintf(stderr, "%s B=%zu S=%zu: byte %zu wrong\n", modes[mi], B, S, i);
            return 1;
          }
        }
        qsort(t, (size_t)reps, sizeof *t, cmp);
        if (me == 0) {
          printf("{\"name\": \"copy_paths_%s\", \"bytes\": %zu, \"chunk_bytes\": %zu, \"unit\": "
                 "\"GB/s\", \"value\": %.2f, \"best\": %.2f, \"cpu\": \"%s\"}\n",
                 modes[mi], B, S, B / t[reps / 2] / 1e9, B / t[0] / 1e9, host + 1);
          fflush(stdout);
        }
      }
    }
    if (me == 0) {
      double t[32];
      for (int r = 0; r < reps; ++r) {
        const double t0 = now();
        memcpy(dst, src, B);
        t[r] = now() - t0;
      }
      qsort(t, (size_t)reps, sizeof *t, cmp);
      printf("{\"name\": \"copy_paths_memcpy\", \"bytes\": %zu, \"unit\": \"GB/s\", \"value\": "
             "%.2f, \"best\": %.2f, \"cpu\": \"%s\"}\n",
             B, B / t[reps / 2] / 1e9, B / t[0] / 1e9, host + 1);
      fflush(stdout);
    }
  }
  if (child != 0) waitpid(child, NULL, 0);
  return 0;
}
