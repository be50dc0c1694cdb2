# HDDP_SANITIZE=ON: every target of this build (libhddp, the tools, the tests, the
# examples and benchmarks) compiled and linked with AddressSanitizer and
# UndefinedBehaviorSanitizer. scripts/sanitize.sh configures build-asan/ this way and
# runs the fast tests there; see docs/development.md, "Sanitizers".
#
# LibTorch is not instrumented (it is the wheel's prebuilt libraries), so one check is
# left out: -fno-sanitize=vptr. UBSan's vptr check follows the typeinfo of every
# polymorphic object hddp calls or casts, LibTorch's (modules, autograd nodes, optimizer
# states) made and destroyed by code the sanitizer never saw. A small LibTorch program
# (modules, Adam, dynamic_pointer_cast, an archive) ran clean with it; the suite has not
# yet (a trial build was stopped on 2026-12-07): drop the flag here to try it. The rest
# of -fsanitize=undefined stays, and ends the program at the first report
# (-fno-sanitize-recover=undefined), as the fuzz targets do.
#
# The runtime options (ASAN_OPTIONS, UBSAN_OPTIONS, the suppressions of LibTorch's own
# reports) are set by scripts/sanitize.sh, not here: they are needed at run time by every
# process a test starts, not at build time.
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "HDDP_SANITIZE=ON is set up for clang (found ${CMAKE_CXX_COMPILER_ID}): "
                      "configure a fresh build folder with CC=clang CXX=clang++, as scripts/sanitize.sh does.")
endif()
set(HDDP_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize=vptr
    -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
add_compile_options(${HDDP_SANITIZE_FLAGS})
add_link_options(-fsanitize=address,undefined)
message(STATUS "hddp: AddressSanitizer and UndefinedBehaviorSanitizer on (${HDDP_SANITIZE_FLAGS})")
