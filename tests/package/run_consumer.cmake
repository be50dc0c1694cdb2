# ctest script: install hddp to a temporary prefix, build examples/consumer against it
# with find_package(hddp), run it. Inputs: HDDP_BUILD_DIR, CONSUMER_SOURCE_DIR, WORK_DIR,
# TORCH_PREFIX, GENERATOR.
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}")
  endif()
endfunction()

run("${CMAKE_COMMAND}" --install "${HDDP_BUILD_DIR}" --prefix "${prefix}")
# Installed executables run from the prefix, without LD_LIBRARY_PATH (their RPATH finds
# libhddp and LibTorch).
unset(ENV{LD_LIBRARY_PATH})
foreach(tool hddp-probe train_resnet train_unet)
  if(EXISTS "${prefix}/bin/${tool}")
    run("${prefix}/bin/${tool}" --help)
  elseif(tool STREQUAL "hddp-probe")
    message(FATAL_ERROR "hddp-probe was not installed into ${prefix}/bin")
  endif()
endforeach()
run("${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix};${TORCH_PREFIX}" -DCMAKE_BUILD_TYPE=Release)
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer")
message(STATUS "consumer built with find_package(hddp) from ${prefix} and ran")
