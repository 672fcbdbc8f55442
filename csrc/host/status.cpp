#include "status.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace ubnext {

namespace {
// Fixed storage: recording an error must not allocate or fail.
thread_local char g_last_error[512];
}  // namespace

ubnext_status_t fail(ubnext_status_t status, const char* fmt, ...) {
  int prefix = std::snprintf(g_last_error, sizeof g_last_error, "%s: ", ubnext_status_string(status));
  if (prefix < 0 || static_cast<size_t>(prefix) >= sizeof g_last_error) prefix = 0;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_last_error + prefix, sizeof g_last_error - prefix, fmt, ap);
  va_end(ap);
  return status;
}

void clear_error() { g_last_error[0] = '\0'; }

ubnext_status_t read_versioned(const void* user, size_t size_of_ours, size_t min_size, void* out,
                               const char* type_name) {
  if (user == nullptr) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "%s is NULL", type_name);
  size_t size;
  std::memcpy(&size, user, sizeof size);
  if (size < min_size) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "%s.struct_size is %zu, expected %zu: initialise it with the _INIT macro", type_name, size,
                size_of_ours);
  }
  const unsigned char* bytes = static_cast<const unsigned char*>(user);
  for (size_t i = size_of_ours; i < size; ++i) {
    if (bytes[i] != 0) {
      return fail(UBNEXT_STATUS_UNSUPPORTED,
                  "%s has fields newer than this library (byte %zu of %zu is set); "
                  "upgrade libubnext",
                  type_name, i, size);
    }
  }
  std::memcpy(out, user, size < size_of_ours ? size : size_of_ours);
  return UBNEXT_STATUS_SUCCESS;
}

}  // namespace ubnext

extern "C" {

const char* ubnext_status_string(ubnext_status_t status) {
  switch (status) {
    case UBNEXT_STATUS_SUCCESS: return "UBNEXT_STATUS_SUCCESS";
    case UBNEXT_STATUS_INVALID_ARGUMENT: return "UBNEXT_STATUS_INVALID_ARGUMENT";
    case UBNEXT_STATUS_NO_DEVICE: return "UBNEXT_STATUS_NO_DEVICE";
    case UBNEXT_STATUS_CUDA_ERROR: return "UBNEXT_STATUS_CUDA_ERROR";
    case UBNEXT_STATUS_TIMEOUT: return "UBNEXT_STATUS_TIMEOUT";
    case UBNEXT_STATUS_UNSUPPORTED: return "UBNEXT_STATUS_UNSUPPORTED";
    case UBNEXT_STATUS_NO_ROOM: return "UBNEXT_STATUS_NO_ROOM";
    case UBNEXT_STATUS_INTERNAL: return "UBNEXT_STATUS_INTERNAL";
    case UBNEXT_STATUS_PEER_LEFT: return "UBNEXT_STATUS_PEER_LEFT";
  }
  return "UBNEXT_STATUS_<unknown>";
}

const char* ubnext_get_last_error_string(void) { return ubnext::g_last_error; }

void ubnext_get_version(int* major, int* minor, int* patch) {
  if (major) *major = UBNEXT_VERSION_MAJOR;
  if (minor) *minor = UBNEXT_VERSION_MINOR;
  if (patch) *patch = UBNEXT_VERSION_PATCH;
}

}  // extern "C"
