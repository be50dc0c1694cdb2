# The layering check: a file of a layer includes headers of its own layer and of the
# layers its row of the table says it may use, never others; private headers
# (src/<layer>/*.h) stay inside their layer; public headers include only public ones;
# programs (tools/, examples/, bench/) use only the public API and do not reach into each
# other's files: what several of them share lives in models/ (the example models),
# cli/ (the command-line checks) or protocol/ (the launch protocol).
#
#   cmake -DSOURCE_DIR=<repo> [-DLAYERS_DOC=<file>] -P cmake/check_layers.cmake
#
# The rules are the table of layers in LAYERS_DOC (default SOURCE_DIR/docs/architecture.md):
# each row "| layer | may use | ... |", first row the lowest layer; "may use" lists layers
# of earlier rows ("-" for none), so the layers form a DAG whose siblings stay siblings.
# The document and the check cannot disagree. Prints every violation as
# "<file>:<line> includes <header>: <why>" and fails when there is one.
cmake_minimum_required(VERSION 3.20)
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "check_layers.cmake needs -DSOURCE_DIR=<repository root>")
endif()
get_filename_component(SOURCE_DIR "${SOURCE_DIR}" ABSOLUTE)

# Private headers that the layers above share (the library's own internals: the
# gradient capture used by DDP and checkpointing, LibTorch version shims).
set(SHARED_PRIVATE_HEADERS core/gradient_capture.h core/torch_compat.h)

# ---- the rules, from the architecture document ------------------------------------------
if(NOT LAYERS_DOC)
  set(LAYERS_DOC "${SOURCE_DIR}/docs/architecture.md")
endif()
file(STRINGS "${LAYERS_DOC}" doc_lines)
set(LAYERS "")
set(in_table FALSE)
foreach(line IN LISTS doc_lines)
  if(line MATCHES "^\\| layer \\| may use \\|")
    set(in_table TRUE)
  elseif(in_table)
    if(line MATCHES "^\\| ([a-z_]+) \\| ([a-z_, -]+) \\|")
      set(layer "${CMAKE_MATCH_1}")
      string(REPLACE "," ";" uses "${CMAKE_MATCH_2}")
      set(MAY_USE_${layer} "")
      foreach(used IN LISTS uses)
        string(STRIP "${used}" used)
        if(used STREQUAL "-" OR used STREQUAL "")
          continue()
        endif()
        list(FIND LAYERS "${used}" used_rank)
        if(used_rank LESS 0)
          message(FATAL_ERROR "${LAYERS_DOC}: layer '${layer}' may use '${used}', which is not "
                              "a layer of an earlier row (the layers must form a DAG)")
        endif()
        list(APPEND MAY_USE_${layer} "${used}")
      endforeach()
      list(APPEND LAYERS "${layer}")
    elseif(line MATCHES "^\\| ---")
    elseif(line MATCHES "^\\|")
      message(FATAL_ERROR "${LAYERS_DOC}: a row of the table of layers does not read "
                          "'| layer | may use | ...' (lower-case names, commas, '-' for none): "
                          "${line}")
    else()
      break()
    endif()
  endif()
endforeach()
list(LENGTH LAYERS layer_count)
if(layer_count LESS 2)
  message(FATAL_ERROR "no table of layers ('| layer | may use | ...') in ${LAYERS_DOC}")
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
      elseif(NOT target STREQUAL layer AND NOT target IN_LIST MAY_USE_${layer})
        string(REPLACE ";" ", " allowed "${MAY_USE_${layer}}")
        violation("${file}" "${line}" "${header}"
                  "layer '${layer}' must not include layer '${target}', which it may not use "
                  "(docs/architecture.md: '${layer}' may use: ${allowed})")
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

# ---- programs outside the library: the public API only, and no other program's files ----
# A program group (each tool under tools/, the examples, the benchmarks) includes its own
# files, the shared homes and the library's public headers; a header found only in
# another group's folder is that program's own. The examples share examples/common, the
# benchmarks bench/'s own files, so each of those folders is one group.
set(SHARED_HOMES models cli protocol)
set(PROGRAM_GROUPS "")
file(GLOB tool_dirs LIST_DIRECTORIES true "${SOURCE_DIR}/tools/*")
foreach(dir IN LISTS tool_dirs)
  if(IS_DIRECTORY "${dir}")
    get_filename_component(tool "${dir}" NAME)
    list(APPEND PROGRAM_GROUPS "tools/${tool}")
  endif()
endforeach()
list(APPEND PROGRAM_GROUPS examples bench)
foreach(group IN LISTS PROGRAM_GROUPS)
  file(GLOB_RECURSE files "${SOURCE_DIR}/${group}/*.h" "${SOURCE_DIR}/${group}/*.cpp")
  foreach(file IN LISTS files)
    quoted_includes("${file}" includes)
    get_filename_component(file_dir "${file}" DIRECTORY)
    foreach(entry IN LISTS includes)
      string(REGEX MATCH "^([0-9]+)\\|(.*)$" _ "${entry}")
      set(line "${CMAKE_MATCH_1}")
      set(header "${CMAKE_MATCH_2}")
      if(header MATCHES "^hddp/" OR header MATCHES "^hddp_protocol/")
        continue()
      endif()
      if(header MATCHES "^([a-z_]+)/")
        list(FIND LAYERS "${CMAKE_MATCH_1}" target_rank)
        if(target_rank GREATER_EQUAL 0)
          violation("${file}" "${line}" "${header}"
                    "programs outside the library use its public headers (hddp/...) only")
          continue()
        endif()
      endif()
      if(EXISTS "${file_dir}/${header}")
        # Next to the including file, or reached by a relative path: where it really is.
        get_filename_component(real "${file_dir}/${header}" REALPATH)
        set(inside FALSE)
        foreach(home IN ITEMS ${group} ${SHARED_HOMES})
          get_filename_component(home_real "${SOURCE_DIR}/${home}" REALPATH)
          string(FIND "${real}" "${home_real}/" at)
          if(at EQUAL 0)
            set(inside TRUE)
          endif()
        endforeach()
        if(NOT inside)
          file(RELATIVE_PATH real_rel "${SOURCE_DIR}" "${real}")
          violation("${file}" "${line}" "${header}"
                    "'${real_rel}' is outside this program's folders: programs use the "
                    "library's public headers and what models/, cli/ or protocol/ share")
        endif()
        continue()
      endif()
      set(found_in_group FALSE)
      set(found_in_home FALSE)
      set(found_elsewhere "")
      get_filename_component(name "${header}" NAME)
      foreach(other IN LISTS PROGRAM_GROUPS SHARED_HOMES)
        file(GLOB_RECURSE hits "${SOURCE_DIR}/${other}/${name}")
        foreach(hit IN LISTS hits)
          if(hit MATCHES "/${header}$")
            if(other STREQUAL group)
              set(found_in_group TRUE)
            elseif(other IN_LIST SHARED_HOMES)
              set(found_in_home TRUE)
            else()
              file(RELATIVE_PATH hit_rel "${SOURCE_DIR}" "${hit}")
              set(found_elsewhere "${hit_rel}")
            endif()
          endif()
        endforeach()
      endforeach()
      if(NOT found_in_group AND NOT found_in_home AND found_elsewhere)
        violation("${file}" "${line}" "${header}"
                  "'${found_elsewhere}' is another program's file: programs do not reach into "
                  "each other (share it through models/, cli/ or protocol/)")
      endif()
    endforeach()
  endforeach()
endforeach()

list(LENGTH violations count)
if(count GREATER 0)
  string(REPLACE ";" "\n  " text "${violations}")
  message(FATAL_ERROR "layering: ${count} include(s) break the layering rules "
                      "(docs/architecture.md: ${LAYERS}):\n  ${text}")
endif()
message(STATUS "layering: every include follows the layers' rules (${LAYERS}) and no program "
               "reaches into another")
