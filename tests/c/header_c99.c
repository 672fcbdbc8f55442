/* Compiled, never run: include/ubnext.h must be clean strict C99 and C++, the descriptor
 * header must combine with its forward declaration, and the INIT macros must name every field
 * (-Wmissing-field-initializers). */
#include "ubnext.h"
#include "desc.cuh"
#include "ubnext.h" /* include guard */

int ubnext_header_check(void* stream);

int ubnext_header_check(void* stream) {
  ubnext_launch_t launch = UBNEXT_LAUNCH_INIT;
  ubnext_rmsnorm_args_t args = UBNEXT_RMSNORM_ARGS_INIT;
  ubnext_comm_desc desc;
  ubnext_status_t st;
  desc.magic = UBNEXT_DESC_MAGIC;
  launch.host_desc = &desc;
  launch.desc = &desc;
  launch.stream = stream;
  launch.flags = UBNEXT_LAUNCH_LAMPORT_MULTICAST;
  args.fp8 = UBNEXT_FP8_PER_TOKEN;
  st = ubnext_allreduce_add_rmsnorm(&launch, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, &args);
  if (st == UBNEXT_STATUS_SUCCESS)
    st = ubnext_allreduce(&launch, UBNEXT_ALGO_TWOSHOT, UBNEXT_DTYPE_FP32, args.in, args.out, 8);
  if (st == UBNEXT_STATUS_SUCCESS) st = ubnext_take_kernel_error(&desc);
  return (int)st + (int)ubnext_dtype_size(UBNEXT_DTYPE_FP8_E4M3) +
         (UBNEXT_VERSION >= UBNEXT_VERSION_CODE(0, 1, 0));
}
