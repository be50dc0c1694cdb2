# The layering check: a file of a layer includes headers of its own layer and of the
# layers below it, never above; private headers (src/<layer>/*.h) stay inside their
# layer; public headers include only public ones; tools, examples and benchmarks use
# only the public API.
#
#   cmake -DSOURCE_DIR=<repo> [-DLAYERS_DOC=<file>] -P cmake/check_layers.cmake
#
# The order is the table of layers in LAYERS_DOC (default SOURCE_DIR/docs/architecture.md;
# first row: the lowest layer), so the document and the check cannot disagree. Prints every violation
# as "<file>:<line> includes <header>: <why>" and fails when there is one.
cmake_minimum_required(VERSION 3.20)
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "check_layers.cmake needs -DSOURCE_DIR=<repository root>")
endif()

# Private headers of core that the layers above share (the library's own internals:
# the gradient capture used by DDP and checkpointing, LibTorch version shims).
set(SHARED_PRIVATE_HEADERS core/gradient_capture.h core/torch_compat.h)

# ---- the order, from the architecture document -----------------------------------------
if(NOT LAYERS_DOC)
  set(LAYERS_DOC "${SOURCE_DIR}/docs/architecture.md")
endif()
file(STRINGS "${LAYERS_DOC}" doc_lines)
set(LAYERS "")
set(in_table FALSE)
foreach(line IN LISTS doc_lines)
  if(line MATCHES "^\\| layer \\|")
    set(in_table TRUE)
  elseif(in_table)
    if(line MATCHES "^\\| ([a-z_]+) \\|")
      list(APPEND LAYERS "${CMAKE_MATCH_1}")
    elseif(NOT line MATCHES "^\\| ---")
      break()
    endif()
  endif()
endforeach()
list(LENGTH LAYERS layer_count)
if(layer_count LESS 2)
  message(FATAL_ERROR "no table of layers ('| layer | ...') in ${LAYERS_DOC}")
endif()

set(violations "")
macro(violation file line header why)
  file(RELATIVE_PATH _rel "${SOURCE_DIR}" "${file}")
  list(APPEND violations "${_rel}:${line} includes ${header}: ${why}")
endmacro()

# The quoted includes of `file`, as "line|header" entries.
function(quoted_includes file out)
  file(STRINGS "${file}" lines)
  set(result "")
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]+\"([^\"]+)\"")
      list(APPEND result "${n}|${CMAKE_MATCH_1}")
    endif()
  endforeach()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

# ---- the library ------------------------------------------------------------------------
foreach(layer IN LISTS LAYERS)
  list(FIND LAYERS "${layer}" rank)
  file(GLOB_RECURSE public_files "${SOURCE_DIR}/include/hddp/${layer}/*.h")
  file(GLOB_RECURSE private_files "${SOURCE_DIR}/src/${layer}/*.h" "${SOURCE_DIR}/src/${layer}/*.cpp")
  foreach(file IN LISTS public_files private_files)
    set(is_public FALSE)
    if(file MATCHES "/include/hddp/")
      set(is_public TRUE)
    endif()
    quoted_includes("${file}" includes)
    foreach(entry IN LISTS includes)
      string(REGEX MATCH "^([0-9]+)\\|(.*)$" _ "${entry}")
      set(line "${CMAKE_MATCH_1}")
      set(header "${CMAKE_MATCH_2}")
      if(header MATCHES "^hddp/([a-z_]+)/")
        set(target "${CMAKE_MATCH_1}")
        set(private FALSE)
      elseif(header MATCHES "^([a-z_]+)/")
        set(target "${CMAKE_MATCH_1}")
        set(private TRUE)
      else()
        continue()
      endif()
      list(FIND LAYERS "${target}" target_rank)
      if(target_rank LESS 0)
        continue()  # not a layer (hddp/version.h, third-party folders)
      endif()
      if(target_rank GREATER rank)
        violation("${file}" "${line}" "${header}"
                  "layer '${layer}' must not include layer '${target}', which is above it")
      endif()
      if(private AND is_public)
        violation("${file}" "${line}" "${header}"
                  "a public header must include only public headers (hddp/...)")
      elseif(private AND NOT target STREQUAL layer AND NOT header IN_LIST SHARED_PRIVATE_HEADERS)
        violation("${file}" "${line}" "${header}"
                  "'${header}' is private to layer '${target}': use its public API")
      endif()
    endforeach()
  endforeach()
endforeach()

# ---- programs outside the library: the public API only ----------------------------------
foreach(dir tools examples bench)
  file(GLOB_RECURSE files "${SOURCE_DIR}/${dir}/*.h" "${SOURCE_DIR}/${dir}/*.cpp")
  foreach(file IN LISTS files)
    quoted_includes("${file}" includes)
    foreach(entry IN LISTS includes)
      string(REGEX MATCH "^([0-9]+)\\|(.*)$" _ "${entry}")
      set(line "${CMAKE_MATCH_1}")
      set(header "${CMAKE_MATCH_2}")
      if(NOT header MATCHES "^hddp/" AND header MATCHES "^([a-z_]+)/")
        list(FIND LAYERS "${CMAKE_MATCH_1}" target_rank)
        if(target_rank GREATER_EQUAL 0)
          violation("${file}" "${line}" "${header}"
                    "programs outside the library use its public headers (hddp/...) only")
        endif()
      endif()
    endforeach()
  endforeach()
endforeach()

list(LENGTH violations count)
if(count GREATER 0)
  string(REPLACE ";" "\n  " text "${violations}")
  message(FATAL_ERROR "layering: ${count} include(s) break the layer order "
                      "(docs/architecture.md: ${LAYERS}):\n  ${text}")
endif()
message(STATUS "layering: every include follows the layer order ${LAYERS}")
