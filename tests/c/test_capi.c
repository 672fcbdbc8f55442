/* C API contract test, linked against libubnext.so. Runs on machines with and without a GPU
 * (UBNEXT_TEST_EXPECT_GPU says which outcome is right). Calls that would launch a kernel are
 * only made where no GPU can be found: their pointers are fake, so a real launch would fault. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "desc.cuh"
#include "ubnext.h"

static int g_failures = 0;

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                      \
    }                                                                    \
  } while (0)

/* Status equals `want` and the last-error text mentions `needle` (and, on failure, is
 * prefixed with the status name so that a log line alone identifies the class of error). */
static void expect_status(int line, ubnext_status_t got, ubnext_status_t want,
                          const char* needle) {
  const char* text = ubnext_get_last_error_string();
  if (got != want) {
    fprintf(stderr, "test_capi.c:%d: got %s, want %s (last error: \"%s\")\n", line,
            ubnext_status_string(got), ubnext_status_string(want), text);
    ++g_failures;
    return;
  }
  if (want == UBNEXT_STATUS_SUCCESS) {
    if (text[0] != '\0') {
      fprintf(stderr, "test_capi.c:%d: success left last error \"%s\"\n", line, text);
      ++g_failures;
    }
    return;
  }
  if (strncmp(text, ubnext_status_string(want), strlen(ubnext_status_string(want))) != 0 ||
      (needle != NULL && strstr(text, needle) == NULL)) {
    fprintf(stderr, "test_capi.c:%d: last error \"%s\" lacks \"%s\"\n", line, text,
            needle ? needle : ubnext_status_string(want));
    ++g_failures;
  }
}
#define EXPECT(call, want, needle) expect_status(__LINE__, (call), (want), (needle))

/* ---- fixture: a plausible 2-rank descriptor whose pool lives at fake addresses ---------- */

#define POOL0 0x7f0000000000ull
#define POOL1 0x7f1000000000ull
#define DATA_OFF (1ull << 20)
#define POOL_BYTES (64ull << 20)
#define SLOT_BYTES (1ull << 20)

static ubnext_comm_desc g_desc;
static uint32_t g_err_word[UBNEXT_ERR_WORDS];
static ubnext_launch_t g_launch;
static ubnext_rmsnorm_args_t g_args;
static void* g_arena; /* start of rank 0's data arena */

static void reset_fixture(void) {
  ubnext_launch_t launch = UBNEXT_LAUNCH_INIT;
  ubnext_rmsnorm_args_t args = UBNEXT_RMSNORM_ARGS_INIT;
  memset(&g_desc, 0, sizeof g_desc);
  memset(g_err_word, 0, sizeof g_err_word);
  g_desc.magic = UBNEXT_DESC_MAGIC;
  g_desc.rank = 0;
  g_desc.nranks = 2;
  g_desc.timeout_ns = 5000000000ull;
  g_desc.err_ptr = (unsigned long long)(uintptr_t)g_err_word;
  g_desc.mc_base = 0x7f2000000000ull;
  g_desc.sync_off = UBNEXT_DESC_BYTES;
  g_desc.lamport_off = UBNEXT_DESC_BYTES + UBNEXT_SYNC_BYTES;
  g_desc.lamport_slot_bytes = SLOT_BYTES;
  g_desc.data_off = DATA_OFF;
  g_desc.pool_bytes = POOL_BYTES;
  g_desc.peer_base[0] = POOL0;
  g_desc.peer_base[1] = POOL1;
  g_arena = (void*)(uintptr_t)(POOL0 + DATA_OFF);

  launch.desc = (const struct ubnext_comm_desc*)(uintptr_t)POOL0;
  launch.host_desc = &g_desc;
  g_launch = launch;

  args.in = g_arena;
  args.out = (char*)g_arena + 0x10000;
  args.residual = (char*)g_arena + 0x20000;
  args.residual_out = (char*)g_arena + 0x20000; /* aliasing residual is allowed */
  args.weight = (char*)g_arena + 0x30000;
  args.count = 4 * 4096;
  args.hidden = 4096;
  g_args = args;
}

static ubnext_status_t allreduce(ubnext_algo_t algo, ubnext_dtype_t dt, const void* in,
                                 void* out, size_t count) {
  return ubnext_allreduce(&g_launch, algo, dt, in, out, count);
}
static ubnext_status_t fused(ubnext_algo_t algo) {
  return ubnext_allreduce_add_rmsnorm(&g_launch, algo, UBNEXT_DTYPE_BF16, &g_args);
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_version(void) {
  int major = -1, minor = -1, patch = -1;
  ubnext_get_version(&major, &minor, &patch);
  CHECK(major == UBNEXT_VERSION_MAJOR && minor == UBNEXT_VERSION_MINOR &&
        patch == UBNEXT_VERSION_PATCH);
  /* The header and CMake's project(VERSION) must not drift apart. */
  CHECK(major == UBNEXT_EXPECT_MAJOR && minor == UBNEXT_EXPECT_MINOR &&
        patch == UBNEXT_EXPECT_PATCH);
  ubnext_get_version(NULL, NULL, NULL);
  CHECK(UBNEXT_VERSION == UBNEXT_VERSION_CODE(major, minor, patch));
}

static void test_status_strings(void) {
  int i, j;
  const char* unknown = ubnext_status_string((ubnext_status_t)UBNEXT_STATUS_COUNT);
  CHECK(unknown != NULL && unknown[0] != '\0');
  for (i = 0; i < UBNEXT_STATUS_COUNT; ++i) {
    const char* s = ubnext_status_string((ubnext_status_t)i);
    CHECK(s != NULL && strncmp(s, "UBNEXT_STATUS_", 14) == 0 && s[14] != '\0');
    CHECK(strcmp(s, unknown) != 0); /* every code below COUNT is a real one */
    for (j = 0; j < i; ++j) CHECK(strcmp(s, ubnext_status_string((ubnext_status_t)j)) != 0);
  }
  CHECK(strcmp(ubnext_status_string(UBNEXT_STATUS_TIMEOUT), "UBNEXT_STATUS_TIMEOUT") == 0);
  CHECK(strcmp(ubnext_status_string((ubnext_status_t)-1), unknown) == 0);
}

static void test_enums(void) {
  CHECK(ubnext_dtype_size(UBNEXT_DTYPE_BF16) == 2);
  CHECK(ubnext_dtype_size(UBNEXT_DTYPE_FP16) == 2);
  CHECK(ubnext_dtype_size(UBNEXT_DTYPE_FP32) == 4);
  CHECK(ubnext_dtype_size(UBNEXT_DTYPE_FP8_E4M3) == 1);
  CHECK(ubnext_dtype_size((ubnext_dtype_t)42) == 0);
  CHECK(strcmp(ubnext_algo_string(UBNEXT_ALGO_LAMPORT), "lamport") == 0);
  CHECK(strcmp(ubnext_algo_string(UBNEXT_ALGO_NVLS_ONESHOT), "nvls_oneshot") == 0);
  CHECK(strcmp(ubnext_algo_string(UBNEXT_ALGO_NVLS_TWOSHOT), "nvls_twoshot") == 0);
  CHECK(strcmp(ubnext_algo_string(UBNEXT_ALGO_NVLS_LAMPORT), "nvls_lamport") == 0);
  CHECK(strcmp(ubnext_algo_string(UBNEXT_ALGO_TWOSHOT), "twoshot") == 0);
  CHECK(strcmp(ubnext_algo_string((ubnext_algo_t)9), "unknown") == 0);
}

/* Returns 1 if a GPU is usable. */
static int test_device_count(void) {
  const char* expect = getenv("UBNEXT_TEST_EXPECT_GPU");
  int n = -1;
  ubnext_status_t st;
  EXPECT(ubnext_device_count(NULL), UBNEXT_STATUS_INVALID_ARGUMENT, "count");
  st = ubnext_device_count(&n);
  if (st == UBNEXT_STATUS_NO_DEVICE) {
    CHECK(n == 0);
    CHECK(ubnext_get_last_error_string()[0] != '\0');
    /* The runtime remembers a failed initialisation; asking again must not hang or crash. */
    EXPECT(ubnext_device_count(&n), UBNEXT_STATUS_NO_DEVICE, NULL);
  } else {
    EXPECT(st, UBNEXT_STATUS_SUCCESS, NULL);
    CHECK(n > 0);
  }
  if (expect != NULL && strcmp(expect, st == UBNEXT_STATUS_SUCCESS ? "1" : "0") != 0) {
    fprintf(stderr, "device count: %s (%d devices, \"%s\") but UBNEXT_TEST_EXPECT_GPU=%s\n",
            ubnext_status_string(st), n, ubnext_get_last_error_string(), expect);
    ++g_failures;
  }
  printf("device count: %s, %d device(s)\n", ubnext_status_string(st), n);
  return st == UBNEXT_STATUS_SUCCESS;
}

static void test_allreduce_arguments(void) {
  const ubnext_status_t INV = UBNEXT_STATUS_INVALID_ARGUMENT;
  char* outside = (char*)(uintptr_t)(POOL1 + DATA_OFF); /* another rank's arena */
  char* a;

  reset_fixture();
  a = (char*)g_arena;
  EXPECT(ubnext_allreduce(NULL, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "ubnext_launch_t is NULL");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, NULL, a, 64), INV, "in is NULL");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, NULL, 64), INV, "out is NULL");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a + 2, a + 4096, 64), INV,
         "16-byte aligned");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 0), INV, "count 0");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, (size_t)1 << 31), INV,
         "outside 1..");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, SIZE_MAX), INV,
         "outside 1..");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_FP8_E4M3, a, a + 4096, 64), INV,
         "output format only");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, (ubnext_dtype_t)7, a, a + 4096, 64), INV,
         "dtype 7");
  EXPECT(allreduce((ubnext_algo_t)5, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV, "algo 5");
  EXPECT(allreduce((ubnext_algo_t)-1, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV, "algo -1");

  /* Placement rules of each algorithm. out == in is allowed where the kernel overwrites in
   * (two-shot) or never reads in after writing out (lamport); a partial overlap never is. */
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 16, 64), INV, "overlaps");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a + 16, a, 64), INV, "overlaps");
  EXPECT(allreduce(UBNEXT_ALGO_TWOSHOT, UBNEXT_DTYPE_BF16, a, a + 16, 64), INV, "overlaps");
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_TWOSHOT, UBNEXT_DTYPE_BF16, a + 16, a, 64), INV,
         "overlaps");
  /* Odd counts: the overlap is judged on count elements, not on whole 16-byte vectors. */
  EXPECT(allreduce(UBNEXT_ALGO_TWOSHOT, UBNEXT_DTYPE_BF16, a, a + 16, 9), INV, "overlaps");
  /* nvls_oneshot and nvls_lamport leave in unmodified: peers read it during the call. */
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_ONESHOT, UBNEXT_DTYPE_BF16, a, a, 64), INV,
         "out must not be in");
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_LAMPORT, UBNEXT_DTYPE_BF16, a, a, 64), INV,
         "out must not be in");
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_ONESHOT, UBNEXT_DTYPE_BF16, a, a + 16, 64), INV,
         "overlaps");
  EXPECT(allreduce(UBNEXT_ALGO_TWOSHOT, UBNEXT_DTYPE_BF16, outside, outside, 64), INV,
         "data arena");
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_ONESHOT, UBNEXT_DTYPE_BF16, a - 4096, a, 64), INV,
         "data arena");
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_LAMPORT, UBNEXT_DTYPE_BF16, outside, a, 64), INV,
         "data arena");
  /* Straddling the end of the pool is as bad as lying outside it. */
  EXPECT(allreduce(UBNEXT_ALGO_TWOSHOT, UBNEXT_DTYPE_FP32, a + POOL_BYTES - DATA_OFF - 16,
                   a + POOL_BYTES - DATA_OFF - 16, 8),
         INV, "data arena");
  /* A partial last vector is read whole: its 16 bytes must lie in the arena too. */
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_TWOSHOT, UBNEXT_DTYPE_BF16, a + POOL_BYTES - DATA_OFF - 16,
                   a, 9),
         INV, "data arena");
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_FP32, a, a + SLOT_BYTES * 2,
                   SLOT_BYTES / 4 + 4),
         UBNEXT_STATUS_NO_ROOM, "Lamport slot");
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_LAMPORT, UBNEXT_DTYPE_FP32, a, a + SLOT_BYTES * 2,
                   SLOT_BYTES / 4 + 4),
         UBNEXT_STATUS_NO_ROOM, "Lamport slot");
  /* ... and the Lamport slot: 1000 bytes of bf16 move as 1008 bytes of vectors. */
  g_desc.lamport_slot_bytes = 1000;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + SLOT_BYTES, 500),
         UBNEXT_STATUS_NO_ROOM, "1008 as 16-byte vectors");
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_LAMPORT, UBNEXT_DTYPE_BF16, a, a + SLOT_BYTES, 500),
         UBNEXT_STATUS_NO_ROOM, "Lamport slot");
  reset_fixture();

  /* Multicast algorithms on a communicator without multicast. */
  g_desc.mc_base = 0;
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_TWOSHOT, UBNEXT_DTYPE_BF16, a, a, 64),
         UBNEXT_STATUS_UNSUPPORTED, "multicast");
  g_launch.flags = UBNEXT_LAUNCH_LAMPORT_MULTICAST;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64),
         UBNEXT_STATUS_UNSUPPORTED, "multicast");
  reset_fixture();
  g_launch.flags = UBNEXT_LAUNCH_LAMPORT_MULTICAST;
  EXPECT(allreduce(UBNEXT_ALGO_TWOSHOT, UBNEXT_DTYPE_BF16, a, a, 64), INV,
         "UBNEXT_ALGO_LAMPORT only");
  g_launch.flags = 0x80;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "flags bits 0x80");
}

static void test_launch_struct(void) {
  const ubnext_status_t INV = UBNEXT_STATUS_INVALID_ARGUMENT;
  char* a;
  /* A caller built against a newer header: a longer struct whose extra field we do not know. */
  struct {
    ubnext_launch_t launch;
    uint64_t newer_field;
  } longer;

  reset_fixture();
  a = (char*)g_arena;
  g_launch.struct_size = 0;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "struct_size is 0");
  g_launch.struct_size = sizeof(ubnext_launch_t) - 1;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "struct_size");
  reset_fixture();
  memset(&longer, 0, sizeof longer);
  longer.launch = g_launch;
  longer.launch.struct_size = sizeof longer;
  longer.newer_field = 1;
  EXPECT(ubnext_allreduce(&longer.launch, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096,
                          64),
         UBNEXT_STATUS_UNSUPPORTED, "newer than this library");

  reset_fixture();
  g_launch.desc = NULL;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV, "desc");
  reset_fixture();
  g_launch.host_desc = NULL;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "host_desc is NULL");
  reset_fixture();
  g_launch.grid = UBNEXT_MAX_BLOCKS + 1;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "UBNEXT_MAX_BLOCKS");
  reset_fixture();
  g_launch.block = 100;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "multiple of 32");
  g_launch.block = 2048;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "multiple of 32");

  /* The host descriptor is checked before it is trusted. */
  reset_fixture();
  g_desc.magic = 0x1234;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV, "magic");
  reset_fixture();
  g_desc.rank = 2;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "rank 2 of 2");
  reset_fixture();
  g_desc.nranks = UBNEXT_MAX_RANKS + 1;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV, "ranks");
  reset_fixture();
  g_desc.peer_base[1] = 0;
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV,
         "peer_base[1]");
  reset_fixture();
  g_desc.lamport_off = UBNEXT_DESC_BYTES + 65536; /* the v1 layout: Lamport buffers in the call headers */
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, a + 4096, 64), INV, "inside the 81920-byte sync region");
}

static void test_rmsnorm_arguments(void) {
  const ubnext_status_t INV = UBNEXT_STATUS_INVALID_ARGUMENT;
  float* fake_scale;

  reset_fixture();
  fake_scale = (float*)((char*)g_arena + 0x40000);
  EXPECT(ubnext_allreduce_add_rmsnorm(&g_launch, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, NULL),
         INV, "ubnext_rmsnorm_args_t is NULL");
  EXPECT(ubnext_allreduce_add_rmsnorm(NULL, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, &g_args),
         INV, "ubnext_launch_t is NULL");
  g_args.struct_size = 8;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "ubnext_rmsnorm_args_t.struct_size is 8");
  reset_fixture();
  EXPECT(ubnext_allreduce_add_rmsnorm(&g_launch, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_FP8_E4M3,
                                      &g_args),
         INV, "output format only");

  reset_fixture();
  g_args.residual = NULL;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "residual is NULL");
  reset_fixture();
  g_args.residual_out = NULL;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "residual_out is NULL");
  reset_fixture();
  g_args.weight = (char*)g_args.weight + 8;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "weight");
  reset_fixture();
  g_args.in = NULL;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "in is NULL");
  reset_fixture();
  g_args.hidden = 0;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "hidden 0");
  reset_fixture();
  g_args.hidden = 3000; /* does not divide count */
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "whole tokens");
  reset_fixture();
  g_args.hidden = 4; /* 8 bytes of bf16 per row */
  g_args.count = 64;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "hidden 4 x 2 bytes");
  reset_fixture();
  g_args.eps = -1.0f;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "eps");
  reset_fixture();
  g_args.count = (size_t)1 << 32;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "outside 1..");

  /* FP8 mode and its pointers must agree. */
  reset_fixture();
  g_args.scale_inv = fake_scale;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "fp8 = NONE");
  reset_fixture();
  g_args.fp8 = UBNEXT_FP8_STATIC;
  g_args.scale_inv = fake_scale;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "scale (FP8_STATIC) is NULL");
  g_args.scale = fake_scale;
  g_args.scale_inv = NULL;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "scale_inv (FP8_STATIC) is NULL");
  reset_fixture();
  g_args.fp8 = UBNEXT_FP8_PER_TOKEN;
  g_args.scale = fake_scale;
  g_args.scale_inv = fake_scale;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "FP8_PER_TOKEN");
  g_args.scale = NULL;
  g_args.scale_inv = NULL;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "scale_inv (FP8_PER_TOKEN) is NULL");
  reset_fixture();
  g_args.fp8 = (ubnext_fp8_scaling_t)3;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "fp8 3");
  reset_fixture();
  g_args.fp8 = UBNEXT_FP8_PER_TOKEN;
  g_args.scale_inv = fake_scale;
  g_args.out = (void*)g_args.in;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "in place");
  EXPECT(fused(UBNEXT_ALGO_TWOSHOT), INV, "in place");

  /* FP8 output partly over in is as bad as exactly on it. */
  reset_fixture();
  g_args.fp8 = UBNEXT_FP8_PER_TOKEN;
  g_args.scale_inv = fake_scale;
  g_args.out = (char*)g_args.in + 16;
  EXPECT(fused(UBNEXT_ALGO_NVLS_TWOSHOT), INV, "out overlaps in");

  /* Placement: `in` where the algorithm needs it; the outputs anywhere (see
   * test_no_device_launches), but no written buffer over another one. */
  reset_fixture();
  EXPECT(fused(UBNEXT_ALGO_NVLS_ONESHOT), UBNEXT_STATUS_UNSUPPORTED, "switch's order");
  g_args.in = (char*)(uintptr_t)(POOL1 + DATA_OFF);
  EXPECT(fused(UBNEXT_ALGO_TWOSHOT), INV, "needs in in the symmetric pool");
  EXPECT(fused(UBNEXT_ALGO_NVLS_LAMPORT), INV, "needs in in the symmetric pool");
  reset_fixture();
  g_args.out = (char*)g_args.in + 16;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "overlaps");
  reset_fixture();
  g_args.out = (void*)g_args.in; /* nvls_lamport leaves in unmodified: never out == in */
  EXPECT(fused(UBNEXT_ALGO_NVLS_LAMPORT), INV, "out must not be in");
  reset_fixture();
  g_args.residual_out = (void*)g_args.in;
  EXPECT(fused(UBNEXT_ALGO_TWOSHOT), INV, "in overlaps residual_out");
  reset_fixture();
  g_args.residual = (char*)g_args.in + 0x100;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "in overlaps residual");
  reset_fixture();
  g_args.residual_out = (char*)g_args.out + 16;
  EXPECT(fused(UBNEXT_ALGO_NVLS_TWOSHOT), INV, "out overlaps residual_out");
  reset_fixture();
  g_args.residual_out = (char*)g_args.residual + 16; /* aliasing is fine, a shift is not */
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "residual_out overlaps residual");
  reset_fixture();
  g_args.weight = g_args.out;
  EXPECT(fused(UBNEXT_ALGO_NVLS_LAMPORT), INV, "out overlaps weight");
  reset_fixture();
  g_args.weight = g_args.residual; /* fine when only read, but residual_out aliases residual */
  EXPECT(fused(UBNEXT_ALGO_TWOSHOT), INV, "residual_out overlaps weight");
  reset_fixture();
  g_args.fp8 = UBNEXT_FP8_PER_TOKEN; /* 4 tokens: 16 bytes of scales */
  g_args.scale_inv = (float*)((char*)g_args.weight + 8192 - 8);
  EXPECT(fused(UBNEXT_ALGO_TWOSHOT), INV, "scale_inv overlaps weight");
  reset_fixture();
  g_args.fp8 = UBNEXT_FP8_STATIC;
  g_args.scale = fake_scale;
  g_args.scale_inv = fake_scale;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), INV, "scale_inv overlaps scale");

  /* The message checks are shared with ubnext_allreduce. */
  reset_fixture();
  g_desc.lamport_slot_bytes = 1024;
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), UBNEXT_STATUS_NO_ROOM, "Lamport slot");
}

/* What a failing kernel leaves in the error word: code, op, the detecting rank and the peer. */
static void post_kernel_error(uint32_t code, uint32_t op, uint32_t rank, uint32_t peer) {
  g_err_word[0] = code;
  g_err_word[1] = op;
  g_err_word[2] = rank;
  g_err_word[3] = peer;
}

static void test_kernel_error(void) {
  reset_fixture();
  EXPECT(ubnext_take_kernel_error(NULL), UBNEXT_STATUS_INVALID_ARGUMENT, "NULL");
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_SUCCESS, NULL);

  post_kernel_error(UBNEXT_ERR_TIMEOUT, UBNEXT_OP_NVLS_TWOSHOT, 1, 3);
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_TIMEOUT,
         "nvls_twoshot timed out on rank 1 waiting for peer 3");
  CHECK(g_err_word[0] == 0 && g_err_word[1] == 0 && g_err_word[2] == 0 && g_err_word[3] == 0);
  /* Taken means cleared: the next check is clean. */
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_SUCCESS, NULL);

  post_kernel_error(UBNEXT_ERR_MISMATCH, UBNEXT_OP_TWOSHOT, 0, 2);
  g_err_word[4] = UBNEXT_HDR_IN_OFFSET;
  g_err_word[5] = 0x300;
  g_err_word[6] = 0x100;
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_INVALID_ARGUMENT,
         "twoshot: ranks made different calls: rank 0 has in offset (16-byte units) 768 but rank 2 has 256");
  CHECK(g_err_word[0] == 0 && g_err_word[4] == 0 && g_err_word[5] == 0 && g_err_word[6] == 0);

  /* A fused call's eps (issue 40 W3): the words are fp32 bits, read as the values the callers passed. */
  post_kernel_error(UBNEXT_ERR_MISMATCH, UBNEXT_OP_LAMPORT, 1, 0);
  g_err_word[4] = UBNEXT_HDR_EPS;
  g_err_word[5] = 0x358637bdu; /* 1e-6f */
  g_err_word[6] = 0x3727c5acu; /* 1e-5f */
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_INVALID_ARGUMENT,
         "lamport: ranks made different calls: rank 1 has eps 1e-06 but rank 0 has eps 1e-05");

  /* A rank that stopped because a peer aborted the communicator reports the peer's failure. */
  post_kernel_error(UBNEXT_ERR_TIMEOUT, UBNEXT_OP_LAMPORT, 2, 1);
  g_err_word[7] = 1;
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_TIMEOUT,
         "communicator aborted: lamport timed out on rank 2 waiting for peer 1");
  CHECK(g_err_word[0] == 0 && g_err_word[7] == 0);

  /* A peer that left: its own status, naming the rank and the peer. */
  post_kernel_error(UBNEXT_ERR_PEER_LEFT, UBNEXT_OP_TWOSHOT, 0, 3);
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_PEER_LEFT,
         "twoshot: rank 0 stopped waiting for peer 3, which has left");
  CHECK(g_err_word[0] == 0 && g_err_word[3] == 0);

  g_err_word[0] = 9;
  g_err_word[1] = UBNEXT_OP_LAMPORT;
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_INTERNAL, "unknown code 9");
  CHECK(g_err_word[0] == 0);

  g_desc.err_ptr = 0;
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_INVALID_ARGUMENT, "err_ptr");
  reset_fixture();
  g_desc.magic = 0;
  EXPECT(ubnext_take_kernel_error(&g_desc), UBNEXT_STATUS_INVALID_ARGUMENT, "magic");
}

/* Requests that pass validation; without a GPU each must end in NO_DEVICE, not a crash. */
static void test_no_device_launches(void) {
  const ubnext_status_t NODEV = UBNEXT_STATUS_NO_DEVICE;
  /* Device memory outside the pool (fake address: nothing is launched). */
  char* elsewhere = (char*)(uintptr_t)0x7e0000000000ull;
  char* arena_end = (char*)(uintptr_t)(POOL0 + POOL_BYTES);
  static const size_t odd_counts[] = {1, 3, 5, 7, 9, 4095, 4097};
  char* a;
  int algo;
  size_t i;
  reset_fixture();
  a = (char*)g_arena;
  for (algo = 0; algo <= UBNEXT_ALGO_TWOSHOT; ++algo) {
    const ubnext_algo_t al = (ubnext_algo_t)algo;
    const int out_may_be_in = algo == UBNEXT_ALGO_LAMPORT || algo == UBNEXT_ALGO_NVLS_TWOSHOT ||
                              algo == UBNEXT_ALGO_TWOSHOT;
    reset_fixture();
    /* Plain: out anywhere, for every algorithm (two-shot copies the result out of in). */
    EXPECT(allreduce(al, UBNEXT_DTYPE_BF16, a, a + 8192, 4096), NODEV, NULL);
    EXPECT(allreduce(al, UBNEXT_DTYPE_FP16, a, elsewhere, 4096), NODEV, NULL);
    if (out_may_be_in) EXPECT(allreduce(al, UBNEXT_DTYPE_FP32, a, a, 4096), NODEV, NULL);
    /* Any count: no "multiple of 16 bytes" rule for plain calls. */
    for (i = 0; i < sizeof odd_counts / sizeof odd_counts[0]; ++i) {
      EXPECT(allreduce(al, UBNEXT_DTYPE_BF16, a, elsewhere, odd_counts[i]), NODEV, NULL);
      EXPECT(allreduce(al, UBNEXT_DTYPE_FP32, a, elsewhere, odd_counts[i]), NODEV, NULL);
      if (out_may_be_in) {
        EXPECT(allreduce(al, UBNEXT_DTYPE_FP16, a, a, odd_counts[i]), NODEV, NULL);
      }
    }
    /* Out right after an odd-sized in (16-byte aligned) does not overlap it. */
    EXPECT(allreduce(al, UBNEXT_DTYPE_BF16, a, a + 16, 7), NODEV, NULL);
    /* A partial last vector at the very end of the arena: its 16 bytes still lie inside. */
    EXPECT(allreduce(al, UBNEXT_DTYPE_BF16, arena_end - 16, elsewhere, 5), NODEV, NULL);

    if (algo == UBNEXT_ALGO_NVLS_ONESHOT) continue; /* never fused (UNSUPPORTED, tested above) */
    EXPECT(fused(al), NODEV, NULL);
    /* Fused: out and residual_out need not be in the pool (the norm runs on every rank after
     * the exchange), nor residual, weight, scale or scale_inv. */
    g_args.out = elsewhere;
    g_args.residual = elsewhere + 0x100000;
    g_args.residual_out = elsewhere + 0x200000;
    g_args.weight = elsewhere + 0x300000;
    EXPECT(fused(al), NODEV, NULL);
    g_args.residual_out = (void*)g_args.residual; /* may alias residual */
    EXPECT(fused(al), NODEV, NULL);
    g_args.residual_out = elsewhere + 0x200000;
    g_args.weight = g_args.residual; /* read-only buffers may overlap each other */
    EXPECT(fused(al), NODEV, NULL);
    g_args.fp8 = UBNEXT_FP8_STATIC;
    g_args.scale = (const float*)(elsewhere + 0x400000);
    g_args.scale_inv = (float*)(elsewhere + 0x400010);
    EXPECT(fused(al), NODEV, NULL);
    g_args.fp8 = UBNEXT_FP8_PER_TOKEN;
    g_args.scale = NULL;
    EXPECT(fused(al), NODEV, NULL);
    g_args.out = (char*)g_args.in + 0x8000; /* e4m3 out right after in: no overlap */
    EXPECT(fused(al), NODEV, NULL);
    /* Dtype output in place, where the algorithm allows out == in. */
    reset_fixture();
    g_args.out = (void*)g_args.in;
    if (out_may_be_in) EXPECT(fused(al), NODEV, NULL);
  }
  reset_fixture();
  /* A message that fills the Lamport slot after its 16-byte call header fits; 16 bytes more do not. */
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, elsewhere, SLOT_BYTES / 2 - 8), NODEV,
         NULL);
  EXPECT(allreduce(UBNEXT_ALGO_NVLS_LAMPORT, UBNEXT_DTYPE_FP32, a, elsewhere, SLOT_BYTES / 4 - 4),
         NODEV, NULL);
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, elsewhere, SLOT_BYTES / 2),
         UBNEXT_STATUS_NO_ROOM, "the 16-byte call header do not fit");
  g_launch.flags = UBNEXT_LAUNCH_LAMPORT_MULTICAST;
  g_launch.grid = 7;
  g_launch.block = 128;
  g_args.fp8 = UBNEXT_FP8_STATIC;
  g_args.scale = (const float*)((char*)g_arena + 0x40000);
  g_args.scale_inv = (float*)((char*)g_arena + 0x40010);
  EXPECT(fused(UBNEXT_ALGO_LAMPORT), NODEV, NULL);
  /* A longer struct whose extra bytes are zero is accepted. */
  {
    struct {
      ubnext_launch_t launch;
      uint64_t newer_field;
    } longer;
    memset(&longer, 0, sizeof longer);
    longer.launch = g_launch;
    longer.launch.struct_size = sizeof longer;
    EXPECT(ubnext_allreduce(&longer.launch, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_FP32, a,
                            a + 8192, 64),
           NODEV, NULL);
  }
}

static void* other_thread(void* arg) {
  /* The last error is per thread: a failure on the main thread is not visible here. */
  *(int*)arg = ubnext_get_last_error_string()[0] == '\0';
  return NULL;
}

static void test_last_error_is_thread_local(void) {
  pthread_t t;
  int clean = 0;
  reset_fixture();
  EXPECT(ubnext_allreduce(NULL, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, NULL, NULL, 0),
         UBNEXT_STATUS_INVALID_ARGUMENT, NULL);
  CHECK(pthread_create(&t, NULL, other_thread, &clean) == 0);
  CHECK(pthread_join(t, NULL) == 0);
  CHECK(clean);
  CHECK(ubnext_get_last_error_string()[0] != '\0');
}

/* The FSDP collectives and the FP8 cast: what each refuses, naming it; valid requests end in
 * NO_DEVICE without a GPU. */
static void test_fsdp_entries(int gpu) {
  const ubnext_status_t INV = UBNEXT_STATUS_INVALID_ARGUMENT;
  char* elsewhere = (char*)(uintptr_t)0x7e0000000000ull;
  char* a;
  float* s = (float*)(elsewhere + 0x100000);
  reset_fixture();
  a = (char*)g_arena;
  /* all-gather: out in the arena, bytes a multiple of 4, in this rank's slice or outside out */
  EXPECT(ubnext_allgather(&g_launch, elsewhere, elsewhere + 0x10000, 256), INV, "symmetric pool");
  EXPECT(ubnext_allgather(&g_launch, elsewhere, a, 6), INV, "multiple of 4");
  EXPECT(ubnext_allgather(&g_launch, elsewhere, a, 0), INV, "bytes");
  EXPECT(ubnext_allgather(&g_launch, a + 256, a, 256), INV, "slice");
  EXPECT(ubnext_allgather(&g_launch, elsewhere + 2, a, 256), INV, "aligned");
  g_launch.flags = UBNEXT_LAUNCH_LAMPORT_MULTICAST;
  EXPECT(ubnext_allgather(&g_launch, elsewhere, a, 256), INV, "flags");
  g_launch.flags = 0;
  /* reduce-scatter: in in the arena, whole 16-byte vectors, finite factor, out not over in */
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_BF16, elsewhere, elsewhere + 0x10000, 64, 1.0f), INV,
         "symmetric pool");
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_BF16, a, elsewhere, 5, 1.0f), INV, "16 bytes");
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_FP8_E4M3, a, elsewhere, 64, 1.0f), INV, "dtype");
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_FP32, a, elsewhere, 64, 1.0f / 0.0f), INV, "finite");
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_FP32, a, a + 128, 64, 1.0f), INV, "overlaps");
  /* quantisation: rows of whole vectors, the scale that the scaling needs */
  EXPECT(ubnext_quantize_fp8(NULL, UBNEXT_DTYPE_BF16, UBNEXT_FP8_PER_TOKEN, elsewhere, a, 64, 12, NULL, s), INV,
         "hidden");
  EXPECT(ubnext_quantize_fp8(NULL, UBNEXT_DTYPE_BF16, UBNEXT_FP8_STATIC, elsewhere, a, 64, 64, NULL, s), INV,
         "scale");
  EXPECT(ubnext_quantize_fp8(NULL, UBNEXT_DTYPE_BF16, UBNEXT_FP8_PER_TOKEN, elsewhere, a, 64, 64, s, s + 4), INV,
         "NULL");
  EXPECT(ubnext_quantize_fp8(NULL, UBNEXT_DTYPE_BF16, UBNEXT_FP8_NONE, elsewhere, a, 64, 64, NULL, s), INV,
         "scaling");
  EXPECT(ubnext_quantize_fp8(NULL, UBNEXT_DTYPE_FP32, UBNEXT_FP8_PER_TOKEN, elsewhere, elsewhere + 8, 64, 64,
                             NULL, s), INV, "overlap");
  /* plain stream order instead of programmatic dependent launch: the one flag these two take */
  g_launch.flags = UBNEXT_LAUNCH_NO_PDL | UBNEXT_LAUNCH_LAMPORT_MULTICAST;
  EXPECT(ubnext_allgather(&g_launch, elsewhere, a, 256), INV, "UBNEXT_LAUNCH_NO_PDL");
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_BF16, a, elsewhere, 64, 0.5f), INV, "UBNEXT_LAUNCH_NO_PDL");
  g_launch.flags = 0;
  if (gpu) return; /* tests/gpu launches for real */
  g_launch.flags = UBNEXT_LAUNCH_NO_PDL;
  EXPECT(ubnext_allgather(&g_launch, elsewhere, a, 256), UBNEXT_STATUS_NO_DEVICE, NULL);
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_BF16, a, elsewhere, 64, 0.5f), UBNEXT_STATUS_NO_DEVICE, NULL);
  EXPECT(allreduce(UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, a, elsewhere, 4096), UBNEXT_STATUS_NO_DEVICE, NULL);
  g_launch.flags = 0;
  EXPECT(ubnext_allgather(&g_launch, elsewhere, a, 256), UBNEXT_STATUS_NO_DEVICE, NULL);
  EXPECT(ubnext_allgather(&g_launch, a, a, 12), UBNEXT_STATUS_NO_DEVICE, NULL); /* rank 0's own slice */
  EXPECT(ubnext_reduce_scatter(&g_launch, UBNEXT_DTYPE_BF16, a, elsewhere, 64, 0.5f), UBNEXT_STATUS_NO_DEVICE, NULL);
  EXPECT(ubnext_quantize_fp8(NULL, UBNEXT_DTYPE_BF16, UBNEXT_FP8_PER_TOKEN, elsewhere, a, 64, 8, NULL, s),
         UBNEXT_STATUS_NO_DEVICE, NULL);
  EXPECT(ubnext_quantize_fp8(NULL, UBNEXT_DTYPE_FP32, UBNEXT_FP8_STATIC, elsewhere, a, 64, 64, s, s + 4),
         UBNEXT_STATUS_NO_DEVICE, NULL);
}

int main(void) {
  int gpu;
  test_version();
  test_status_strings();
  test_enums();
  gpu = test_device_count();
  test_allreduce_arguments();
  test_launch_struct();
  test_rmsnorm_arguments();
  test_kernel_error();
  test_last_error_is_thread_local();
  test_fsdp_entries(gpu);
  if (!gpu) {
    test_no_device_launches();
  } else {
    printf("GPU present: launches with fake pointers skipped (tests/gpu launches for real)\n");
  }
  if (g_failures) {
    fprintf(stderr, "test_capi: %d check(s) failed\n", g_failures);
    return 1;
  }
  printf("test_capi: all checks passed\n");
  return 0;
}
