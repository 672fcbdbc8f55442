# ctest script: what a C user of an installed ubnext does, end to end. Installs the build into a
# scratch prefix, configures examples/c as a separate project that finds it with
# find_package(ubnext CONFIG) alone, builds it (compile with the imported include dirs, link
# ubnext::ubnext), runs it and checks what it reports against the machine.
#   cmake -DBUILD=<ubnext build dir> -DEXAMPLE=<examples/c> -DWORK=<scratch dir>
#         -DGENERATOR=<generator> -DMAKE_PROGRAM=<make program> -DC_COMPILER=<cc>
#         -DLIBDIR=<CMAKE_INSTALL_LIBDIR> -DINCLUDEDIR=<CMAKE_INSTALL_INCLUDEDIR>
#         -DVERSION=<project version> -DEXPECT_GPU=<0|1> -P check_package.cmake
foreach(var BUILD EXAMPLE WORK GENERATOR C_COMPILER LIBDIR INCLUDEDIR VERSION EXPECT_GPU)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_package: ${var} not set")
  endif()
endforeach()

set(prefix "${WORK}/prefix")
set(consumer "${WORK}/example")
# A leftover install or consumer cache from an earlier run could let a broken config pass.
file(REMOVE_RECURSE "${WORK}")

function(run step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "check_package: ${step} failed (${rc}):\n  ${command}\n${out}")
  endif()
endfunction()

run("install into ${prefix}" "${CMAKE_COMMAND}" --install "${BUILD}" --prefix "${prefix}")

set(configure "${CMAKE_COMMAND}" -S "${EXAMPLE}" -B "${consumer}" -G "${GENERATOR}"
    "-DCMAKE_C_COMPILER=${C_COMPILER}" -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
    # strict here rather than in the example, whose users pick their own flags (the headers come
    # in as -isystem, so header_c99 and header_cxx are what hold them to -pedantic)
    "-DCMAKE_C_FLAGS=-Wall -Wextra -Werror -pedantic")
if(MAKE_PROGRAM)
  list(APPEND configure "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
run("find_package(ubnext CONFIG) in examples/c" ${configure})

# The package found must be the one just installed, not one elsewhere on the system.
file(STRINGS "${consumer}/CMakeCache.txt" found REGEX "^ubnext_DIR:")
string(REGEX REPLACE "^ubnext_DIR:[A-Z]+=" "" found "${found}")
file(REAL_PATH "${prefix}/${LIBDIR}/cmake/ubnext" want)
if(found STREQUAL "" OR NOT EXISTS "${found}")
  message(FATAL_ERROR "check_package: examples/c did not record ubnext_DIR")
endif()
file(REAL_PATH "${found}" found)
if(NOT found STREQUAL want)
  message(FATAL_ERROR "check_package: examples/c found ubnext in ${found}, not in ${want}")
endif()

# The include path must come from the imported target: a header that happens to sit on the
# compiler's default path would otherwise hide a target without INTERFACE_INCLUDE_DIRECTORIES.
file(READ "${consumer}/compile_commands.json" commands)
string(FIND "${commands}" "-isystem ${prefix}/${INCLUDEDIR}" at_isystem)
string(FIND "${commands}" "-I${prefix}/${INCLUDEDIR}" at_i)
if(at_isystem EQUAL -1 AND at_i EQUAL -1)
  message(FATAL_ERROR "check_package: ubnext::ubnext did not put ${prefix}/${INCLUDEDIR} on the "
                      "compile line of device_info.c:\n${commands}")
endif()

run("build examples/c (compile and link against ubnext::ubnext)"
    "${CMAKE_COMMAND}" --build "${consumer}")

execute_process(COMMAND "${consumer}/device_info" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
message(STATUS "device_info exited ${rc}:\n${out}${err}")
set(problems "")
if(NOT out MATCHES "libubnext ${VERSION} \\(built against header ${VERSION}\\)")
  list(APPEND problems "version line is not 'libubnext ${VERSION} (built against header ${VERSION})'")
endif()
if(NOT out MATCHES "ubnext_allreduce without a descriptor: UBNEXT_STATUS_INVALID_ARGUMENT\n  UBNEXT_STATUS_INVALID_ARGUMENT: ubnext_launch_t.desc")
  list(APPEND problems "the descriptor-less allreduce was not rejected as INVALID_ARGUMENT naming desc")
endif()
# As the capi test: the outcome this machine must give, so that both cannot pass.
if(EXPECT_GPU)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "ubnext_device_count: UBNEXT_STATUS_SUCCESS, [1-9]")
    list(APPEND problems "UBNEXT_TEST_EXPECT_GPU=1 wants exit 0 and UBNEXT_STATUS_SUCCESS with devices")
  endif()
else()
  if(NOT rc EQUAL 2 OR NOT out MATCHES "ubnext_device_count: UBNEXT_STATUS_NO_DEVICE, 0 device\\(s\\)\n  UBNEXT_STATUS_NO_DEVICE: ")
    list(APPEND problems "UBNEXT_TEST_EXPECT_GPU=0 wants exit 2 and UBNEXT_STATUS_NO_DEVICE with its reason")
  endif()
endif()
if(problems)
  list(JOIN problems "\n  " problems)
  message(FATAL_ERROR "check_package: device_info (exit ${rc}):\n  ${problems}")
endif()
message(STATUS "check_package: installed ${prefix}, found by find_package, examples/c built and ran")
