# Finds LibTorch and the rest. LibTorch comes from the `torch` wheel (see
# scripts/setup.sh); when CMAKE_PREFIX_PATH does not lead to it, ask a Python that has
# torch for torch.utils.cmake_prefix_path.
set(HDDP_PYTHON "" CACHE FILEPATH "Python with the torch wheel (default: /opt/hddp-venv/bin/python, else python3).")

find_package(Torch QUIET)
if(NOT Torch_FOUND)
  set(_hddp_py "${HDDP_PYTHON}")
  if(NOT _hddp_py)
    if(EXISTS "/opt/hddp-venv/bin/python")
      set(_hddp_py "/opt/hddp-venv/bin/python")
    else()
      find_program(_hddp_py NAMES python3 python)
    endif()
  endif()
  if(_hddp_py)
    execute_process(COMMAND "${_hddp_py}" -c "import torch; print(torch.utils.cmake_prefix_path)"
                    OUTPUT_VARIABLE _hddp_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE _hddp_rc ERROR_QUIET)
    if(_hddp_rc EQUAL 0 AND _hddp_torch_prefix)
      list(APPEND CMAKE_PREFIX_PATH "${_hddp_torch_prefix}")
    endif()
  endif()
  find_package(Torch REQUIRED)
endif()
message(STATUS "hddp: LibTorch ${Torch_VERSION} from ${Torch_DIR}")
get_filename_component(HDDP_TORCH_ROOT "${Torch_DIR}/../../.." ABSOLUTE)   # .../site-packages/torch
get_filename_component(HDDP_TORCH_SITE "${HDDP_TORCH_ROOT}/.." ABSOLUTE)  # .../site-packages

# CUDA sources: built when the Torch found has CUDA (AUTO), forced with ON.
if(HDDP_WITH_CUDA STREQUAL "AUTO")
  if(CAFFE2_USE_CUDA AND TARGET torch_cuda)
    set(HDDP_CUDA_ENABLED ON)
  else()
    set(HDDP_CUDA_ENABLED OFF)
  endif()
elseif(HDDP_WITH_CUDA)
  if(NOT (CAFFE2_USE_CUDA AND TARGET torch_cuda))
    message(FATAL_ERROR "HDDP_WITH_CUDA=ON but the LibTorch found (${Torch_DIR}) has no CUDA. "
                        "Point CMAKE_PREFIX_PATH at a CUDA build of torch or use -DHDDP_WITH_CUDA=AUTO.")
  endif()
  set(HDDP_CUDA_ENABLED ON)
else()
  set(HDDP_CUDA_ENABLED OFF)
endif()

# NCCL header: the one of the NCCL that LibTorch loads (the nvidia-nccl wheel), else
# the CUDA toolkit's.
if(HDDP_CUDA_ENABLED)
  find_path(HDDP_NCCL_INCLUDE_DIR nccl.h
            HINTS "${HDDP_TORCH_SITE}/nvidia/nccl/include" "${CUDAToolkit_INCLUDE_DIRS}"
            NO_DEFAULT_PATH)
  find_path(HDDP_NCCL_INCLUDE_DIR nccl.h)
  if(NOT HDDP_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "nccl.h not found (looked in ${HDDP_TORCH_SITE}/nvidia/nccl/include and the CUDA toolkit). "
                        "Install the nvidia-nccl wheel that matches torch, or use -DHDDP_WITH_CUDA=OFF.")
  endif()
endif()

# spdlog (only the logging TU sees it; it never meets LibTorch's bundled fmt).
if(HDDP_DEVICE_DEPS)
  if(NOT EXISTS "${HDDP_DEVICE_DEPS}/include/spdlog")
    message(FATAL_ERROR "HDDP_DEVICE_DEPS=${HDDP_DEVICE_DEPS} has no include/spdlog: run shared/tools/device-pack.sh first.")
  endif()
  add_library(hddp_dep_headers INTERFACE)
  target_include_directories(hddp_dep_headers SYSTEM INTERFACE "${HDDP_DEVICE_DEPS}/include")
  add_library(hddp_dep_spdlog INTERFACE)
  target_link_libraries(hddp_dep_spdlog INTERFACE hddp_dep_headers)
  target_compile_definitions(hddp_dep_spdlog INTERFACE SPDLOG_HEADER_ONLY FMT_HEADER_ONLY)
  set(HDDP_SPDLOG_TARGET hddp_dep_spdlog)
  set(HDDP_CLI11_TARGET hddp_dep_headers)
else()
  find_package(spdlog REQUIRED)
  set(HDDP_SPDLOG_TARGET spdlog::spdlog)
  find_package(CLI11 QUIET CONFIG)
  if(TARGET CLI11::CLI11)
    set(HDDP_CLI11_TARGET CLI11::CLI11)
  else()
    find_path(HDDP_CLI11_INCLUDE CLI/CLI.hpp REQUIRED)
    add_library(hddp_dep_cli11 INTERFACE)
    target_include_directories(hddp_dep_cli11 SYSTEM INTERFACE "${HDDP_CLI11_INCLUDE}")
    set(HDDP_CLI11_TARGET hddp_dep_cli11)
  endif()
endif()
# Our readable range checks for CLI11 (cli/cli_checks.h), for tools, examples and bench.
add_library(hddp_cli INTERFACE)
target_include_directories(hddp_cli INTERFACE "${PROJECT_SOURCE_DIR}/cli")
target_link_libraries(hddp_cli INTERFACE ${HDDP_CLI11_TARGET})
set(HDDP_CLI11_TARGET hddp_cli)

# nlohmann-json (metrics, timeline) and stb (GIF, BMP, TGA decoding): header-only, private to
# libhddp. zlib reads .gz datasets; without it, gzip files are refused with a message.
if(HDDP_DEVICE_DEPS)
  set(HDDP_JSON_TARGET hddp_dep_headers)
  set(HDDP_STB_TARGET hddp_dep_headers)
else()
  find_package(nlohmann_json REQUIRED)
  set(HDDP_JSON_TARGET nlohmann_json::nlohmann_json)
  find_path(HDDP_STB_INCLUDE stb/stb_image.h)
  if(NOT HDDP_STB_INCLUDE)
    message(FATAL_ERROR "stb/stb_image.h not found: apt-get install libstb-dev (scripts/setup.sh does)")
  endif()
  add_library(hddp_dep_stb INTERFACE)
  target_include_directories(hddp_dep_stb SYSTEM INTERFACE "${HDDP_STB_INCLUDE}")
  set(HDDP_STB_TARGET hddp_dep_stb)
endif()
find_package(ZLIB QUIET)
# libpng and libjpeg-turbo decode PNG and JPEG (src/data/image_png.cpp, image_jpeg.cpp;
# private to libhddp). Required, except on a GPU machine without package access
# (HDDP_DEVICE_DEPS), where PNG and JPEG fall back to stb_image
# (src/data/image_png_jpeg_stb.cpp).
find_package(PNG QUIET)
find_package(JPEG QUIET)
if(PNG_FOUND AND JPEG_FOUND)
  set(HDDP_IMAGE_CODECS ON)
elseif(HDDP_DEVICE_DEPS)
  set(HDDP_IMAGE_CODECS OFF)
  message(WARNING "libpng or libjpeg not found: PNG and JPEG are decoded by stb_image, which "
                  "has open faults on crafted files (docs/development.md, \"Fuzzing\"). "
                  "On Debian: apt-get install libpng-dev libjpeg62-turbo-dev")
else()
  message(FATAL_ERROR "libpng or libjpeg not found (PNG: ${PNG_FOUND}, JPEG: ${JPEG_FOUND}): "
                      "apt-get install libpng-dev libjpeg62-turbo-dev (scripts/setup.sh does)")
endif()
# protobuf-lite and protoc (TensorBoard's event files, private to libhddp). Without them
# hddp still builds and a TensorBoard folder is refused with what to install.
find_package(Protobuf QUIET)
if(Protobuf_FOUND AND Protobuf_PROTOC_EXECUTABLE AND TARGET protobuf::libprotobuf-lite)
  set(HDDP_TENSORBOARD_ENABLED ON)
else()
  set(HDDP_TENSORBOARD_ENABLED OFF)
  message(WARNING "protobuf not found: hddp will not write TensorBoard event files "
                  "(apt-get install libprotobuf-dev protobuf-compiler)")
endif()

if(HDDP_BUILD_TESTS)
  if(HDDP_DEVICE_DEPS AND EXISTS "${HDDP_DEVICE_DEPS}/googletest/CMakeLists.txt")
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory("${HDDP_DEVICE_DEPS}/googletest" "${CMAKE_BINARY_DIR}/_deps/googletest" EXCLUDE_FROM_ALL)
    add_library(GTest::gtest ALIAS gtest)
    add_library(GTest::gtest_main ALIAS gtest_main)
  else()
    find_package(GTest REQUIRED)
  endif()
endif()

# Precompiled header shared by the Torch-heavy targets.
set(HDDP_PCH_HEADERS <torch/torch.h>)
function(hddp_use_torch_pch target)
  if(NOT HDDP_USE_PCH)
    return()
  endif()
  if(TARGET hddp_pch)
    target_precompile_headers(${target} REUSE_FROM hddp_pch)
  else()
    target_precompile_headers(${target} PRIVATE ${HDDP_PCH_HEADERS})
  endif()
  if(CMAKE_CXX_COMPILER_LAUNCHER MATCHES "ccache" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${target} PRIVATE -fpch-preprocess)
  endif()
endfunction()
