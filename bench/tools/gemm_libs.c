// Single-thread SGEMM GFLOP/s of one BLAS library (dlopen'ed by path) or of
// oneDNN's dnnl_sgemm, on the shipped models' training-step shapes and 2048^3:
// the measurement behind docs/engines.md (which engines are worth having).
// Not part of the build (it loads libraries meshtrain does not depend on):
//   gcc -O2 gemm_libs.c -o gemm_libs -ldl -ldnnl -lm
//   export OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 BLIS_NUM_THREADS=1 OMP_NUM_THREADS=1
//   ./gemm_libs LABEL /path/to/libX.so     (or: ./gemm_libs LABEL onednn)
// Prints one JSON line per shape and one for all model shapes together.
// Time: the calling thread's CPU time (all these libraries run one-thread
// GEMMs in the caller), best of reps after a warm-up call; each result is
// checked against a plain double-precision loop on a sample of elements.
#include <dlfcn.h>
#include <math.h>
#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                        float, float*, int);
enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
static sgemm_t cblas;
static int use_dnnl;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void gemm(int ta, int tb, int m, int n, int k, const float* a, const float* b, float* c) {
  int lda = ta ? m : k, ldb = tb ? k : n;
  if (use_dnnl)
    dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, n);
  else
    cblas(RowMajor, ta ? Trans : NoTrans, tb ? Trans : NoTrans, m, n, k, 1.0f, a, lda, b, ldb, 0.0f,
          c, n);
}

struct Case {
  const char* name;
  int ta, tb, m, n, k;
};

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  if (strcmp(argv[2], "onednn") == 0) {
    use_dnnl = 1;
  } else {
    void* h = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    cblas = (sgemm_t)dlsym(h, "cblas_sgemm");
    if (!cblas) {
      fprintf(stderr, "no cblas_sgemm in %s\n", argv[2]);
      return 1;
    }
    const char* (*core)(void) = (const char* (*)(void))dlsym(h, "openblas_get_corename");
    if (core) fprintf(stderr, "%s: openblas core %s\n", argv[1], core());
  }
  // MLP (batch 128, 784-512-512-10): forward, dW (A^T), dX (B^T).
  // GPT (batch 16 x seq 128 = 2048 tokens, d 256, MLP 1024): qkv, out proj,
  // fc1, fc2 forward and their dW / dX; then the big square.
  static const struct Case cases[] = {
      {"mlp_fwd_128x512x784", 0, 0, 128, 512, 784},
      {"mlp_fwd_128x512x512", 0, 0, 128, 512, 512},
      {"mlp_dW_784x512x128", 1, 0, 784, 512, 128},
      {"mlp_dX_128x784x512", 0, 1, 128, 784, 512},
      {"gpt_qkv_2048x768x256", 0, 0, 2048, 768, 256},
      {"gpt_fc1_2048x1024x256", 0, 0, 2048, 1024, 256},
      {"gpt_fc2_2048x256x1024", 0, 0, 2048, 256, 1024},
      {"gpt_dW_256x1024x2048", 1, 0, 256, 1024, 2048},
      {"gpt_dX_2048x256x1024", 0, 1, 2048, 256, 1024},
      {"square_2048", 0, 0, 2048, 2048, 2048},
  };
  double total_flops = 0, total_s = 0;
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ++ci) {
    const struct Case* c = &cases[ci];
    size_t na = (size_t)c->m * c->k, nb = (size_t)c->k * c->n, nc = (size_t)c->m * c->n;
    float *a = malloc(na * 4), *b = malloc(nb * 4), *out = malloc(nc * 4);
    unsigned x = 12345;
    for (size_t i = 0; i < na; ++i) a[i] = ((x = x * 1103515245u + 12345u) >> 9) * 0x1p-23f - 0.5f;
    for (size_t i = 0; i < nb; ++i) b[i] = ((x = x * 1103515245u + 12345u) >> 9) * 0x1p-23f - 0.5f;
    gemm(c->ta, c->tb, c->m, c->n, c->k, a, b, out);
    double flops = 2.0 * c->m * c->n * c->k;
    int reps = flops > 5e9 ? 5 : (int)(3e9 / flops) + 5;
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      double t0 = now();
      gemm(c->ta, c->tb, c->m, c->n, c->k, a, b, out);
      double t = now() - t0;
      if (t < best) best = t;
    }
    double maxerr = 0;
    for (int s = 0; s < 64; ++s) {
      int i = (s * 7919) % c->m, j = (s * 104729) % c->n;
      double want = 0;
      for (int l = 0; l < c->k; ++l) {
        double av = c->ta ? a[(size_t)l * c->m + i] : a[(size_t)i * c->k + l];
        double bv = c->tb ? b[(size_t)j * c->k + l] : b[(size_t)l * c->n + j];
        want += av * bv;
      }
      double e = fabs(want - out[(size_t)i * c->n + j]);
      if (e > maxerr) maxerr = e;
    }
    int ok = maxerr <= 1e-5 * c->k;
    printf(
        "{\"lib\": \"%s\", \"case\": \"%s\", \"gflops\": %.1f, \"ok\": %s, \"max_abs_err\": "
        "%.2g}\n",
        argv[1], c->name, flops / best * 1e-9, ok ? "true" : "false", maxerr);
    if (ci + 1 < sizeof cases / sizeof cases[0]) {
      total_flops += flops;
      total_s += best;
    }
    free(a);
    free(b);
    free(out);
  }
  printf("{\"lib\": \"%s\", \"case\": \"model_shapes_all\", \"gflops\": %.1f}\n", argv[1],
         total_flops / total_s * 1e-9);
  return 0;
}
