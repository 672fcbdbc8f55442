# ctest script: the library's dynamic symbol table must hold exactly the functions that
# include/ubnext.h declares with UBNEXT_API, so nothing internal (kernel stubs, cudart, C++
# runtime) leaks and nothing declared is missing.
#   cmake -DNM=<nm> -DLIB=<libubnext.so> -DHEADER=<ubnext.h> -P check_exports.cmake
foreach(var NM LIB HEADER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_exports: ${var} not set")
  endif()
endforeach()

file(READ "${HEADER}" header)
string(REGEX MATCHALL "UBNEXT_API[^;(]*[ *](ubnext_[A-Za-z0-9_]+)[ \n]*\\(" decls "${header}")
set(declared "")
foreach(decl IN LISTS decls)
  string(REGEX MATCH "ubnext_[A-Za-z0-9_]+[ \n]*\\($" name "${decl}")
  string(REGEX REPLACE "[ \n]*\\($" "" name "${name}")
  list(APPEND declared "${name}")
endforeach()
list(SORT declared)
list(LENGTH declared n_declared)
if(n_declared EQUAL 0)
  message(FATAL_ERROR "check_exports: found no UBNEXT_API declarations in ${HEADER}")
endif()

execute_process(COMMAND "${NM}" -D --defined-only "${LIB}"
                OUTPUT_VARIABLE nm_out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_exports: ${NM} -D failed on ${LIB}")
endif()
string(REPLACE "\n" ";" lines "${nm_out}")
set(exported "")
foreach(line IN LISTS lines)
  # "<addr> <type> <name>[@@version]"; type A marks version nodes, not symbols.
  if(line MATCHES "^[0-9a-fA-F]* +([A-Za-z]) +([^@ ]+)")
    if(NOT CMAKE_MATCH_1 STREQUAL "A")
      list(APPEND exported "${CMAKE_MATCH_2}")
    endif()
  endif()
endforeach()
list(SORT exported)

set(extra ${exported})
list(REMOVE_ITEM extra ${declared})
set(missing ${declared})
if(exported)
  list(REMOVE_ITEM missing ${exported})
endif()
if(extra OR missing)
  message(FATAL_ERROR "check_exports: exported symbols differ from include/ubnext.h\n"
                      "  exported but not declared: ${extra}\n"
                      "  declared but not exported: ${missing}")
endif()
message(STATUS "check_exports: ${n_declared} symbols, exactly the declared API: ${exported}")
