# Install rules and the CMake package `tidal` (find_package(tidal)): the headers, the libraries
# (tidal::core, and tidal::torch where built), the CLI, tidalConfig.cmake with its version file
# and exported targets, and tidal.pc for the torch-free core.
include(CMakePackageConfigHelpers)
set(TIDAL_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/tidal CACHE STRING
    "Where tidalConfig.cmake is installed, relative to the prefix")

# The headers; without torch, not those of the torch layers (they need the libtorch targets).
if(TIDAL_HAVE_TORCH)
  install(DIRECTORY include/tidal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
else()
  install(DIRECTORY include/tidal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          PATTERN "torch" EXCLUDE PATTERN "models" EXCLUDE)
endif()

# One export set per component: find_package(tidal COMPONENTS core) never looks for Torch.
install(TARGETS tidal_core EXPORT tidalCoreTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(EXPORT tidalCoreTargets NAMESPACE tidal:: DESTINATION ${TIDAL_INSTALL_CMAKEDIR})
if(TIDAL_HAVE_TORCH)
  install(TARGETS tidal_torch EXPORT tidalTorchTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT tidalTorchTargets NAMESPACE tidal:: DESTINATION ${TIDAL_INSTALL_CMAKEDIR})
endif()
if(TARGET tidal_cli)
  install(TARGETS tidal_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
if(TARGET tidal_torch_cli)
  install(TARGETS tidal_torch_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# What tidalConfig.cmake needs to know of this build: the optional parts compiled in decide the
# private dependencies of the static libraries that a consumer's link needs.
set(TIDAL_PACKAGE_HAVE_TORCH ${TIDAL_HAVE_TORCH})
set(TIDAL_PACKAGE_HAVE_IO_URING ${TIDAL_HAVE_IO_URING})
set(TIDAL_PACKAGE_HAVE_CUDA ${TIDAL_HAVE_CUDA})
configure_package_config_file(cmake/tidalConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/tidalConfig.cmake
                              INSTALL_DESTINATION ${TIDAL_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tidalConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tidalConfig.cmake
              ${PROJECT_BINARY_DIR}/tidalConfigVersion.cmake
        DESTINATION ${TIDAL_INSTALL_CMAKEDIR})
if(TIDAL_HAVE_TORCH)
  install(FILES cmake/TidalTorch.cmake DESTINATION ${TIDAL_INSTALL_CMAKEDIR})
endif()

# tidal.pc: the torch-free core for builds without CMake (`pkg-config --static --libs tidal`).
set(TIDAL_PC_REQUIRES_PRIVATE "libxxhash")
set(TIDAL_PC_CFLAGS "")
if(TIDAL_HAVE_IO_URING)
  string(APPEND TIDAL_PC_REQUIRES_PRIVATE " liburing")
  string(APPEND TIDAL_PC_CFLAGS " -DTIDAL_WITH_IO_URING=1")
endif()
set(TIDAL_PC_LIBS_PRIVATE "-pthread -ldl")
if(TIDAL_HAVE_CUDA)
  string(APPEND TIDAL_PC_CFLAGS " -DTIDAL_WITH_CUDA=1")
  # The CUDA backend's static objects call the CUDA runtime.
  string(APPEND TIDAL_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart")
endif()
# Relocatable: the prefix is found from the .pc file's own place.
file(RELATIVE_PATH TIDAL_PC_TO_PREFIX /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(cmake/tidal.pc.in ${PROJECT_BINARY_DIR}/tidal.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/tidal.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
