# ctest script: every kernel of the ABI (ubnext_<algo>_<dtype>, docs/ARCHITECTURE.md) is
# compiled into the library. The C API binds them weakly so that a partial tree still builds;
# this is where a missing one fails.
#   cmake -DNM=<nm> -DLIB=<libubnext.so> -P check_kernels.cmake
execute_process(COMMAND "${NM}" --defined-only "${LIB}" OUTPUT_VARIABLE nm_out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_kernels: ${NM} failed on ${LIB}")
endif()
set(missing "")
foreach(algo lamport nvls_oneshot nvls_twoshot nvls_lamport twoshot)
  foreach(dt bf16 fp16 fp32)
    if(NOT nm_out MATCHES " [Tt] ubnext_${algo}_${dt}\n")
      list(APPEND missing ubnext_${algo}_${dt})
    endif()
  endforeach()
endforeach()
foreach(name allgather_u8 reduce_scatter_bf16 reduce_scatter_fp16 reduce_scatter_fp32 quantize_fp8_bf16
             quantize_fp8_fp16 quantize_fp8_fp32)
  if(NOT nm_out MATCHES " [Tt] ubnext_${name}\n")
    list(APPEND missing ubnext_${name})
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "check_kernels: kernels not compiled into ${LIB}: ${missing}\n"
                      "(csrc/kernels/*.cu must define them as extern \"C\" __global__)")
endif()
message(STATUS "check_kernels: all 22 kernels present")
