/* What libubnext.so does on its own, without the Python package.
 *
 * The collectives run on a communicator descriptor: a symmetric pool mapped on every rank (peer
 * mappings, multicast address, zeroed sync region, Lamport buffers, host-visible error word).
 * The library validates and launches on one but never creates one; ubnext's Python pool
 * (ubnext/pool/) does, or a host program of your own that follows <ubnext/desc.cuh>. So this
 * example stops short of a collective and shows what needs no pool: the version, whether a GPU
 * is usable, and the argument checks that every call makes before it touches CUDA.
 *
 * Exit status: 0 with a usable GPU, 2 without one (UBNEXT_STATUS_NO_DEVICE), 1 on any other
 * outcome. A machine without a GPU is reported as such, never passed off as success.
 *
 * Build: see CMakeLists.txt next to this file (find_package(ubnext CONFIG), ubnext::ubnext). */
#include <stdio.h>

#include <ubnext.h>
#include <ubnext/desc.cuh>

int main(void) {
  int major = 0, minor = 0, patch = 0, count = -1;
  ubnext_status_t devices, st;
  ubnext_launch_t launch = UBNEXT_LAUNCH_INIT;

  /* The loaded library can be a later patch release than the header this was compiled with. */
  ubnext_get_version(&major, &minor, &patch);
  printf("libubnext %d.%d.%d (built against header %d.%d.%d)\n", major, minor, patch,
         UBNEXT_VERSION_MAJOR, UBNEXT_VERSION_MINOR, UBNEXT_VERSION_PATCH);
  /* A host that builds its own pool fills this struct; the magic pins the layout version. */
  printf("communicator descriptor: %u bytes, magic 0x%llx, up to %d ranks\n",
         (unsigned)sizeof(ubnext_comm_desc), UBNEXT_DESC_MAGIC, UBNEXT_MAX_RANKS);

  devices = ubnext_device_count(&count);
  printf("ubnext_device_count: %s, %d device(s)\n", ubnext_status_string(devices), count);
  if (devices != UBNEXT_STATUS_SUCCESS) printf("  %s\n", ubnext_get_last_error_string());

  /* Validation comes before any CUDA call, so this answers alike with and without a GPU, and a
   * launch without a descriptor is exactly a collective called without a pool. */
  st = ubnext_allreduce(&launch, UBNEXT_ALGO_LAMPORT, UBNEXT_DTYPE_BF16, NULL, NULL, 1);
  printf("ubnext_allreduce without a descriptor: %s\n  %s\n", ubnext_status_string(st),
         ubnext_get_last_error_string());
  if (st != UBNEXT_STATUS_INVALID_ARGUMENT) {
    fprintf(stderr, "device_info: expected UBNEXT_STATUS_INVALID_ARGUMENT\n");
    return 1;
  }

  if (devices == UBNEXT_STATUS_NO_DEVICE) {
    printf("no usable GPU: the collectives cannot run on this machine\n");
    return 2;
  }
  return devices == UBNEXT_STATUS_SUCCESS && count > 0 ? 0 : 1;
}
