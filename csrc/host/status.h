// Internal: status helpers shared by the C API implementation files.
#pragma once

#include "ubnext.h"

namespace ubnext {

// Records a printf-style detail for ubnext_get_last_error_string() and returns `status`, so
// that a failing check reads `return fail(UBNEXT_STATUS_..., "...", ...);`.
ubnext_status_t fail(ubnext_status_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Empties the last-error text: every entry point returning a status calls it first, so the text
// always belongs to the most recent call.
void clear_error();

// Reads a caller struct that starts with `size_t struct_size` into `*out`, which holds the
// defaults. Shorter than `min_size`: the caller was built against no release of this API.
// Longer than ours: accepted only if the fields we do not know are zero, because a non-zero
// one asks for behaviour this library cannot give.
ubnext_status_t read_versioned(const void* user, size_t size_of_ours, size_t min_size, void* out,
                               const char* type_name);

template <class T>
ubnext_status_t read_versioned(const T* user, T* out, const char* type_name) {
  // Version 1 is the first release: every field of it is required.
  return read_versioned(user, sizeof(T), sizeof(T), out, type_name);
}

}  // namespace ubnext
