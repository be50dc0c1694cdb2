# Install rules, the exported package (find_package(hddp)) and a build-tree export.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(HDDP_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/hddp")

if(TARGET hddp_emu)
  install(TARGETS hddp_emu EXPORT hddpTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(TARGETS hddp EXPORT hddpTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/hddp" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES "${PROJECT_BINARY_DIR}/include/hddp/version.h"
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/hddp)

install(EXPORT hddpTargets NAMESPACE hddp:: DESTINATION ${HDDP_INSTALL_CMAKEDIR})
export(EXPORT hddpTargets NAMESPACE hddp:: FILE "${PROJECT_BINARY_DIR}/hddpTargets.cmake")

configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/hddpConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/hddpConfig.cmake"
                              INSTALL_DESTINATION ${HDDP_INSTALL_CMAKEDIR})
write_basic_package_version_file("${PROJECT_BINARY_DIR}/hddpConfigVersion.cmake"
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES "${PROJECT_BINARY_DIR}/hddpConfig.cmake" "${PROJECT_BINARY_DIR}/hddpConfigVersion.cmake"
        DESTINATION ${HDDP_INSTALL_CMAKEDIR})
