/* A stand-in libcuda.so.1 for machines without a GPU: every entry point is a no-op that returns
 * CUDA_SUCCESS with fake handles, and a launch records what it was given. With it on
 * LD_LIBRARY_PATH, cuda.bindings and cuda.core load and run their real code up to the driver call,
 * so that ubnext's launch path (ubnext/runtime/_cuda.py) is executed and its host time measured without a
 * GPU (tests/unit/test_stub_driver.py, python -m ubnext.bench --host --launch driver). What the driver
 * tells about a kernel (its parameters, registers, occupancy) comes from globals a test sets, for
 * ubnext.kernels.kernel_report.
 *
 * Build: tests/stub_driver/__init__.py (gcc -O2 -shared -fPIC -o libcuda.so.1 stub_libcuda.c -ldl).
 * STUB_TRACE=1 prints every cuGetProcAddress lookup and every stub call to stderr.
 *
 * It reports one sm_90 device. NVRTC looks for the driver too and crashes on the stub: a process
 * that loads the stub finds its kernels compiled already (python -m ubnext.kernels build --arch sm_90).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;

#define FAKE_CTX ((CUcontext)0xC7C7C000ull)
#define FAKE_LIB ((void *)0x11B11B000ull)
#define FAKE_MOD ((void *)0x30D30D000ull)
#define FAKE_KERNEL ((void *)0x4E4E4E000ull)
#define FAKE_FUNC ((void *)0xF00F00000ull)
#define FAKE_STREAM ((void *)0x5A5A5A000ull)
#define FAKE_EVENT ((void *)0xE0E0E0000ull)

static int trace_on = -1;
static int tracing(void) {
    if (trace_on < 0) trace_on = getenv("STUB_TRACE") != NULL;
    return trace_on;
}
/* Every entry point's call, counted, and the last STUB_CALL_LOG names in call order (a ring indexed by
 * the count), so that a test pins which driver calls one launch makes (tests/unit/test_stub_driver.py).
 * Not atomic: a test that reads them makes its calls from one thread at a time. */
#define STUB_CALL_LOG 64
unsigned long long stub_call_count = 0;
const char *stub_call_names[STUB_CALL_LOG];
#define T()                                                                      \
    do {                                                                         \
        stub_call_names[stub_call_count++ % STUB_CALL_LOG] = __func__;           \
        if (tracing()) fprintf(stderr, "[stub] %s\n", __func__);                 \
    } while (0)

/* What the last launch was given, read by the tests through ctypes. The driver cannot know how many
 * parameters a kernel takes (the cubin says so); the test sets stub_param_sizes[i] to the byte size
 * of parameter i (0 ends the list), and each launch copies that many bytes of each parameter (at most
 * 256: the descriptor by value), so the values outlive the caller's parameter buffer: parameters of up
 * to 8 bytes into stub_last_args[i] too. */
unsigned long long stub_launch_count = 0;
/* cuDeviceGetAttribute(&v, STUB_ATTRIBUTE_LAUNCH_COUNT, dev): how many launches the stub has seen,
 * for a process that reads it through cuda.bindings (python -m ubnext.bench --host --launch driver) */
#define STUB_ATTRIBUTE_LAUNCH_COUNT 0x5754
void *stub_last_func = NULL;
void *stub_last_stream = NULL;
void *stub_last_ctx = NULL; /* the context current on the launching thread */
unsigned stub_last_grid = 0, stub_last_block = 0;
unsigned stub_param_sizes[16];
unsigned long long stub_last_args[16];
unsigned char stub_last_param_bytes[16][256];
/* cuLaunchKernelEx's attributes: how many, and each one's id and the first 32 bits of its value
 * (CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value union) */
unsigned stub_last_nattrs = 0;
int stub_last_attr_ids[8];
int stub_last_attr_values[8];

static __thread CUcontext ctx_stack[64];
static __thread int ctx_depth = 0; /* ctx_stack[ctx_depth-1] is current */

static void record_launch(void *f, void *stream, unsigned grid, unsigned block, void **params) {
    stub_launch_count++;
    stub_last_func = f;
    stub_last_stream = stream;
    stub_last_ctx = ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
    stub_last_grid = grid;
    stub_last_block = block;
    for (int i = 0; i < 16; i++) {
        unsigned size = stub_param_sizes[i] < 256 ? stub_param_sizes[i] : 256;
        stub_last_args[i] = 0;
        memset(stub_last_param_bytes[i], 0, 256);
        if (!size || !params) continue;
        memcpy(stub_last_param_bytes[i], params[i], size);
        if (size <= 8) memcpy(&stub_last_args[i], params[i], size);
    }
}

#define API __attribute__((visibility("default")))


/* What a test may change, from the environment of the process that loads the stub:
 * STUB_INIT_ERROR=<CUresult>  what cuInit returns (100: CUDA_ERROR_NO_DEVICE, a driver without a GPU)
 * STUB_DEVICE_COUNT=<n>       what cuDeviceGetCount reports (default 1)
 * STUB_COMPUTE_CAPABILITY=M.m the device's compute capability (default 9.0)
 * STUB_PARAM_SIZES=a,b,...    every kernel's parameter sizes (stub_param_sizes, below), read by cuInit: for a
 *                             process that cannot set them through ctypes before it asks (a whole program) */
static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}
static CUresult init_error = 0; /* cuInit's, returned again by every call that needs it, as the driver does */

extern unsigned stub_param_sizes[16];
extern int stub_occupancy;
API CUresult cuInit(unsigned int f) {
    (void)f; T();
    init_error = env_int("STUB_INIT_ERROR", 0);
    stub_occupancy = env_int("STUB_OCCUPANCY", stub_occupancy); /* a whole program's answer, as STUB_PARAM_SIZES */
    const char *sizes = getenv("STUB_PARAM_SIZES");
    for (int i = 0; sizes && *sizes && i < 16; i++) {
        char *end;
        stub_param_sizes[i] = (unsigned)strtoul(sizes, &end, 10);
        sizes = *end == ',' ? end + 1 : NULL;
    }
    return init_error;
}
API CUresult cuDriverGetVersion(int *v) { T(); *v = 13000; return 0; }
API CUresult cuDeviceGetCount(int *n) {
    T();
    if (init_error) return init_error;
    *n = env_int("STUB_DEVICE_COUNT", 1);
    return 0;
}
API CUresult cuDeviceGet(CUdevice *d, int ordinal) { T(); *d = ordinal; return 0; }
API CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    (void)d; T(); snprintf(name, len, "Stub GPU"); return 0;
}
API CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice d) {
    (void)d; T();
    switch (attrib) {
    case 75: *v = env_int("STUB_COMPUTE_CAPABILITY", 9); break;  /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
    case 76: { const char *cc = getenv("STUB_COMPUTE_CAPABILITY"); /* ..._MINOR: after the dot */
               *v = cc && strchr(cc, '.') ? atoi(strchr(cc, '.') + 1) : 0; break; }
    case 91: *v = 0; break;   /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: no, see cuMemHostRegister */
    case 16: *v = 132; break; /* multiprocessor count */
    case 1: *v = 1024; break; /* max threads per block */
    case STUB_ATTRIBUTE_LAUNCH_COUNT: *v = (int)(stub_launch_count & 0x7fffffff); break;
    default: *v = 1; break;
    }
    return 0;
}
API CUresult cuDeviceGetUuid_v2(void *uuid, CUdevice d) { (void)d; T(); memset(uuid, 0xab, 16); return 0; }
API CUresult cuDeviceGetUuid(void *uuid, CUdevice d) { return cuDeviceGetUuid_v2(uuid, d); }
API CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { (void)d; T(); *b = (size_t)80 << 30; return 0; }
API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; T(); *c = FAKE_CTX; return 0; }
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; T(); return 0; }
API CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned *flags, int *active) {
    (void)d; T(); *flags = 0; *active = 1; return 0;
}

API CUresult cuCtxGetCurrent(CUcontext *c) { T(); *c = ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; return 0; }
API CUresult cuCtxSetCurrent(CUcontext c) {
    T();
    if (ctx_depth == 0) { if (c) ctx_stack[ctx_depth++] = c; }
    else if (c) ctx_stack[ctx_depth - 1] = c;
    else ctx_depth--;
    return 0;
}
unsigned long long stub_push_count = 0; /* context pushes, to tell a launch that switched contexts */
API CUresult cuCtxPushCurrent_v2(CUcontext c) {
    T();
    stub_push_count++;
    if (ctx_depth < 64) ctx_stack[ctx_depth++] = c;
    return 0;
}
API CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    T();
    CUcontext top = ctx_depth ? ctx_stack[--ctx_depth] : NULL;
    if (c) *c = top;
    return 0;
}
API CUresult cuCtxPushCurrent(CUcontext c) { return cuCtxPushCurrent_v2(c); }
API CUresult cuCtxPopCurrent(CUcontext *c) { return cuCtxPopCurrent_v2(c); }
API CUresult cuCtxGetDevice(CUdevice *d) { T(); *d = 0; return 0; }
API CUresult cuCtxGetDevice_v2(CUdevice *d, CUcontext c) { (void)c; T(); *d = 0; return 0; }
API CUresult cuCtxSynchronize(void) { T(); return 0; }
API CUresult cuCtxGetId(CUcontext c, unsigned long long *id) { (void)c; T(); *id = 1; return 0; }
API CUresult cuCtxGetApiVersion(CUcontext c, unsigned *v) { (void)c; T(); *v = 13000; return 0; }

void *stub_last_load_ctx = NULL; /* the context current when a cubin was last loaded */
#define CURRENT_CTX (ctx_depth ? ctx_stack[ctx_depth - 1] : NULL)

API CUresult cuLibraryLoadData(void **lib, const void *code, void *jo, void *jov, unsigned nj,
                               void *lo, void *lov, unsigned nl) {
    (void)code; (void)jo; (void)jov; (void)nj; (void)lo; (void)lov; (void)nl; T();
    stub_last_load_ctx = CURRENT_CTX;
    *lib = FAKE_LIB; return 0;
}
API CUresult cuLibraryLoadFromFile(void **lib, const char *f, void *jo, void *jov, unsigned nj,
                                   void *lo, void *lov, unsigned nl) {
    (void)f; (void)jo; (void)jov; (void)nj; (void)lo; (void)lov; (void)nl; T();
    *lib = FAKE_LIB; return 0;
}
API CUresult cuLibraryUnload(void *lib) { (void)lib; T(); return 0; }
/* Kernels by name: cuLibraryGetKernel gives each name its own handle (FAKE_KERNEL + 16 * its index in
 * kernel_names), and cuKernelGetFunction the function of the same index (FAKE_FUNC + 16 * index), so that
 * the stub can answer one kernel differently from the others (stub_odd_kernel). */
#define MAX_KERNELS 128
static char kernel_names[MAX_KERNELS][128];
static int n_kernels = 0;
static int func_loaded[MAX_KERNELS];
static int kernel_index(const void *handle, const void *base) {
    uintptr_t delta = (uintptr_t)handle - (uintptr_t)base;
    return delta % 16 == 0 && delta / 16 < (uintptr_t)n_kernels ? (int)(delta / 16) : -1;
}
API CUresult cuLibraryGetKernel(void **k, void *lib, const char *name) {
    (void)lib; T();
    int i = 0;
    while (i < n_kernels && strcmp(kernel_names[i], name)) i++;
    if (i == n_kernels) {
        if (n_kernels == MAX_KERNELS) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
        snprintf(kernel_names[n_kernels++], sizeof kernel_names[0], "%s", name);
    }
    *k = (char *)FAKE_KERNEL + 16 * i;
    return 0;
}
API CUresult cuLibraryGetModule(void **m, void *lib) { (void)lib; T(); *m = FAKE_MOD; return 0; }

/* What the tests read and set through ctypes about loading and inspecting kernels:
 * stub_func_load_count      cuFuncLoad calls; cuFuncIsLoaded answers LOADED for a function loaded so
 * stub_last_function_ctx    the context current at the last cuKernelGetFunction (whose function it gives)
 * stub_num_regs, stub_local_bytes  cuFuncGetAttribute's NUM_REGS and LOCAL_SIZE_BYTES for every kernel
 * stub_occupancy            cuOccupancyMaxActiveBlocksPerMultiprocessor's answer for every kernel;
 *                           stub_last_occupancy_block the block size it was last asked about
 * stub_param_sizes          (above) every kernel's parameters for cuKernelGetParamInfo too
 * stub_odd_kernel           one kernel's name: it gets stub_odd_param_sizes (when its first entry is not
 *                           0) and stub_odd_occupancy (when not negative) instead */
unsigned long long stub_func_load_count = 0;
void *stub_last_function_ctx = NULL;
int stub_num_regs = 32;
int stub_local_bytes = 0;
int stub_occupancy = 8;
int stub_last_occupancy_block = 0;
char stub_odd_kernel[128];
unsigned stub_odd_param_sizes[16];
int stub_odd_occupancy = -1;

static int is_odd(int index) { return index >= 0 && stub_odd_kernel[0] && !strcmp(kernel_names[index], stub_odd_kernel); }

API CUresult cuKernelGetFunction(void **f, void *k) {
    T();
    int i = kernel_index(k, FAKE_KERNEL);
    stub_last_function_ctx = CURRENT_CTX;
    *f = (char *)FAKE_FUNC + 16 * (i < 0 ? 0 : i);
    return 0;
}
API CUresult cuFuncLoad(void *f) {
    T();
    int i = kernel_index(f, FAKE_FUNC);
    stub_func_load_count++;
    if (i >= 0) func_loaded[i] = 1;
    return 0;
}
API CUresult cuFuncIsLoaded(int *state, void *f) {
    T();
    int i = kernel_index(f, FAKE_FUNC);
    *state = i >= 0 && func_loaded[i]; /* CU_FUNCTION_LOADING_STATE_LOADED 1, UNLOADED 0 */
    return 0;
}
/* Each parameter at its natural alignment (8 at most), as the compiler lays them out; past the last one
 * CUDA_ERROR_INVALID_VALUE, as the driver answers. */
API CUresult cuKernelGetParamInfo(void *k, size_t index, size_t *offset, size_t *size) {
    T();
    const unsigned *sizes = is_odd(kernel_index(k, FAKE_KERNEL)) && stub_odd_param_sizes[0] ? stub_odd_param_sizes
                                                                                              : stub_param_sizes;
    size_t at = 0;
    for (size_t i = 0; i < 16 && sizes[i]; i++) {
        size_t align = sizes[i] >= 8 ? 8 : sizes[i];
        at = (at + align - 1) / align * align;
        if (i == index) {
            if (offset) *offset = at;
            if (size) *size = sizes[i];
            return 0;
        }
        at += sizes[i];
    }
    return 1; /* CUDA_ERROR_INVALID_VALUE */
}
API CUresult cuKernelGetLibrary(void **l, void *k) { (void)k; T(); *l = FAKE_LIB; return 0; }
API CUresult cuKernelGetAttribute(int *v, int a, void *k, CUdevice d) { (void)a; (void)k; (void)d; T(); *v = 0; return 0; }
API CUresult cuKernelGetName(const char **n, void *k) {
    T();
    int i = kernel_index(k, FAKE_KERNEL);
    *n = i >= 0 ? kernel_names[i] : "k";
    return 0;
}
API CUresult cuModuleLoadData(void **m, const void *img) {
    (void)img; T(); stub_last_load_ctx = CURRENT_CTX; *m = FAKE_MOD; return 0;
}
API CUresult cuModuleLoadDataEx(void **m, const void *img, unsigned n, void *o, void *ov) {
    (void)img; (void)n; (void)o; (void)ov; T(); stub_last_load_ctx = CURRENT_CTX; *m = FAKE_MOD; return 0;
}
API CUresult cuModuleGetFunction(void **f, void *m, const char *name) { (void)m; (void)name; T(); *f = FAKE_FUNC; return 0; }
API CUresult cuModuleUnload(void *m) { (void)m; T(); return 0; }
API CUresult cuFuncGetAttribute(int *v, int a, void *f) {
    (void)f; T();
    switch (a) {
    case 4: *v = stub_num_regs; break;    /* CU_FUNC_ATTRIBUTE_NUM_REGS */
    case 3: *v = stub_local_bytes; break; /* CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES */
    default: *v = 0; break;
    }
    return 0;
}
API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, void *f, int block, size_t dynamic_smem) {
    (void)dynamic_smem; T();
    stub_last_occupancy_block = block;
    *blocks = is_odd(kernel_index(f, FAKE_FUNC)) && stub_odd_occupancy >= 0 ? stub_odd_occupancy : stub_occupancy;
    return 0;
}

/* cuOccupancyMaxActiveClusters: stub_max_clusters for every kernel; stub_last_cluster_asked the cluster size
 * (the launch config's cluster-dimension attribute, 0 without one) it was last asked about */
typedef struct { unsigned gx, gy, gz, bx, by, bz, shmem; void *hStream; void *attrs; unsigned nattrs; } OccCfg;
typedef struct { int id; char pad[4]; union { char bytes[64]; unsigned u[3]; } value; } OccAttr;
int stub_max_clusters = 16;
int stub_last_cluster_asked = 0;
API CUresult cuOccupancyMaxActiveClusters(int *n, void *f, const OccCfg *cfg) {
    (void)f; T();
    stub_last_cluster_asked = 0;
    for (unsigned i = 0; i < cfg->nattrs; i++) {
        const OccAttr *a = (const OccAttr *)cfg->attrs + i;
        if (a->id == 4) stub_last_cluster_asked = (int)a->value.u[0]; /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION */
    }
    *n = stub_max_clusters;
    return 0;
}

API CUresult cuStreamGetCtx(void *s, CUcontext *c) { (void)s; T(); *c = FAKE_CTX; return 0; }
API CUresult cuStreamGetCtx_v2(void *s, CUcontext *c, void **gc) { (void)s; T(); *c = FAKE_CTX; if (gc) *gc = NULL; return 0; }
API CUresult cuStreamGetDevice(void *s, CUdevice *d) { (void)s; T(); *d = 0; return 0; }
API CUresult cuStreamGetFlags(void *s, unsigned *f) { (void)s; T(); *f = 0; return 0; }
API CUresult cuStreamGetPriority(void *s, int *p) { (void)s; T(); *p = 0; return 0; }
API CUresult cuStreamGetId(void *s, unsigned long long *id) { (void)s; T(); *id = 7; return 0; }
API CUresult cuStreamCreate(void **s, unsigned f) { (void)f; T(); *s = FAKE_STREAM; return 0; }
API CUresult cuStreamCreateWithPriority(void **s, unsigned f, int p) { (void)f; (void)p; T(); *s = FAKE_STREAM; return 0; }
API CUresult cuStreamDestroy_v2(void *s) { (void)s; T(); return 0; }
API CUresult cuStreamSynchronize(void *s) { (void)s; T(); return 0; }
API CUresult cuStreamQuery(void *s) { (void)s; T(); return 0; }
API CUresult cuStreamIsCapturing(void *s, int *st) { (void)s; T(); *st = 0; return 0; }
API CUresult cuEventCreate(void **e, unsigned f) { (void)f; T(); *e = FAKE_EVENT; return 0; }
API CUresult cuEventDestroy_v2(void *e) { (void)e; T(); return 0; }
API CUresult cuEventRecord(void *e, void *s) { (void)e; (void)s; T(); return 0; }

/* What the launches return: a test sets it (through ctypes) to see a launch error reach ubnext's caller.
 * A failed launch records nothing, as the driver runs nothing. */
CUresult stub_launch_result = 0;
API CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, void *stream, void **params, void **extra) {
    (void)gy; (void)gz; (void)by; (void)bz; (void)shmem; (void)extra; T();
    if (stub_launch_result) return stub_launch_result;
    record_launch(f, stream, gx, bx, params);
    stub_last_nattrs = 0;
    return 0;
}
typedef struct { unsigned gx, gy, gz, bx, by, bz, shmem; void *hStream; void *attrs; unsigned nattrs; } LaunchCfg;
typedef struct { int id; char pad[4]; union { char bytes[64]; int i; } value; } LaunchAttr;
API CUresult cuLaunchKernelEx(const LaunchCfg *cfg, void *f, void **params, void **extra) {
    (void)extra; T();
    if (stub_launch_result) return stub_launch_result;
    record_launch(f, cfg->hStream, cfg->gx, cfg->bx, params);
    stub_last_nattrs = cfg->nattrs;
    for (unsigned i = 0; i < cfg->nattrs && i < 8; i++) {
        const LaunchAttr *a = (const LaunchAttr *)cfg->attrs + i;
        stub_last_attr_ids[i] = a->id;
        stub_last_attr_values[i] = a->value.i;
    }
    return 0;
}

/* Page-locked host memory (cuMemHostAlloc, cuMemHostRegister, as torch's pin_memory uses them) and
 * its device pointer. The stub models a device that cannot use the host pointer for registered
 * memory (attribute 91 is 0): the device pointer is the host pointer plus HOST_DEVPTR_OFFSET, so a
 * caller that assumes they are equal is caught. cuMemHostGetDevicePointer takes flags 0 only and
 * refuses memory that is not page-locked (CUDA_ERROR_INVALID_VALUE), as documented. */
#define HOST_DEVPTR_OFFSET 0x100000000000ull
static struct { uintptr_t base; size_t size; } pinned[64];
static int n_pinned = 0;
API CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned flags) {
    (void)flags; T();
    if (n_pinned == 64) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    pinned[n_pinned].base = (uintptr_t)p;
    pinned[n_pinned++].size = size;
    return 0;
}
API CUresult cuMemHostUnregister(void *p) {
    T();
    for (int i = 0; i < n_pinned; i++)
        if (pinned[i].base == (uintptr_t)p) { pinned[i] = pinned[--n_pinned]; return 0; }
    return 713; /* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
}
API CUresult cuMemHostGetDevicePointer_v2(unsigned long long *dptr, void *p, unsigned flags) {
    T();
    if (flags) return 1; /* CUDA_ERROR_INVALID_VALUE */
    for (int i = 0; i < n_pinned; i++)
        if ((uintptr_t)p - pinned[i].base < pinned[i].size) { *dptr = (uintptr_t)p + HOST_DEVPTR_OFFSET; return 0; }
    return 1;
}

API CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "stub error"; return 0; }
API CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "STUB_ERROR"; return 0; }

/* Any symbol not implemented above resolves to this: returns success, writes nothing. */
static CUresult generic_noop(void) { if (tracing()) fprintf(stderr, "[stub] generic_noop called\n"); return 0; }

static void *self_handle(void) {
    static void *h = NULL;
    if (!h) {
        Dl_info info;
        dladdr((void *)&cuInit, &info);
        h = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    }
    return h;
}

/* cuGetProcAddress: the real driver maps a base name ("cuCtxPushCurrent") to its newest ABI
 * version for cudaVersion; we try the exact name, then name_v4.._v2, then the generic no-op. */
API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, unsigned long long flags,
                                 int *symbolStatus) {
    char buf[256];
    void *h = self_handle();
    void *p = NULL;
    (void)flags;
    p = dlsym(h, symbol); /* exact name first: cuCtxGetDevice_v2/cuStreamGetCtx_v2 differ in ABI */
    for (int v = 4; v >= 2 && !p; v--) {
        snprintf(buf, sizeof buf, "%s_v%d", symbol, v);
        p = dlsym(h, buf);
    }
    if (tracing()) fprintf(stderr, "[stub] cuGetProcAddress(%s, ver=%d) -> %s\n", symbol, cudaVersion,
                           p ? "impl" : "generic_noop");
    if (!p) p = (void *)&generic_noop;
    *pfn = p;
    if (symbolStatus) *symbolStatus = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
    return 0;
}
API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
