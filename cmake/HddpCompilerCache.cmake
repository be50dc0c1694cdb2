# ccache as compiler launcher. The sloppiness settings let ccache reuse objects built
# with a precompiled header (gcc needs -fpch-preprocess for that, added per target).
if(HDDP_USE_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(HDDP_CCACHE_PROGRAM ccache)
  if(HDDP_CCACHE_PROGRAM)
    set(CMAKE_CXX_COMPILER_LAUNCHER
        "${CMAKE_COMMAND};-E;env;CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime;${HDDP_CCACHE_PROGRAM}")
    set(CMAKE_C_COMPILER_LAUNCHER "${HDDP_CCACHE_PROGRAM}")
    message(STATUS "hddp: using ccache (${HDDP_CCACHE_PROGRAM})")
  endif()
endif()
