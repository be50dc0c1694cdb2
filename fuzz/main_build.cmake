# HDDP_BUILD_FUZZ=ON in the main build (top-level CMakeLists.txt): fuzz/ is configured as a
# project of its own, with clang, into <build>/fuzz, against this build's libhddp (which
# stays built by the main compiler, uninstrumented), and each target runs under
# `ctest -L fuzz` for HDDP_FUZZ_SECONDS through scripts/fuzz.sh --no-build.
include(ExternalProject)
find_program(HDDP_FUZZ_CC NAMES clang clang-14)
find_program(HDDP_FUZZ_CXX NAMES clang++ clang++-14)
if(NOT HDDP_FUZZ_CC OR NOT HDDP_FUZZ_CXX)
  message(FATAL_ERROR "HDDP_BUILD_FUZZ needs clang and clang++ (libFuzzer ships with them: "
                      "apt-get install clang).")
endif()
if(NOT BUILD_SHARED_LIBS)
  message(FATAL_ERROR "HDDP_BUILD_FUZZ links the fuzz targets against libhddp.so: "
                      "configure with BUILD_SHARED_LIBS=ON (the default).")
endif()
set(HDDP_FUZZ_SECONDS 30 CACHE STRING "Seconds each fuzz target runs under ctest -L fuzz.")
ExternalProject_Add(hddp_fuzz
  SOURCE_DIR "${PROJECT_SOURCE_DIR}/fuzz"
  BINARY_DIR "${PROJECT_BINARY_DIR}/fuzz"
  CMAKE_ARGS -DCMAKE_C_COMPILER=${HDDP_FUZZ_CC} -DCMAKE_CXX_COMPILER=${HDDP_FUZZ_CXX}
             -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHDDP_LIBRARY=$<TARGET_FILE:hddp>
             -DTorch_DIR=${Torch_DIR} -DHDDP_FUZZ_SECONDS=${HDDP_FUZZ_SECONDS}
  INSTALL_COMMAND ""
  BUILD_ALWAYS ON
  DEPENDS hddp)

enable_testing()
include("${PROJECT_SOURCE_DIR}/fuzz/targets.cmake")
foreach(target IN LISTS HDDP_FUZZ_TARGETS)
  string(REGEX REPLACE "^fuzz_" "fuzz." test "${target}")  # fuzz.state_dict_pt, ...
  add_test(NAME ${test}
           COMMAND "${PROJECT_SOURCE_DIR}/scripts/fuzz.sh" --no-build
                   --build-dir "${PROJECT_BINARY_DIR}/fuzz" --only ${target} ${HDDP_FUZZ_SECONDS})
  set_tests_properties(${test} PROPERTIES LABELS fuzz TIMEOUT 600)
endforeach()
