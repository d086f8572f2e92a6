# tidal_find_optional(NAME): resolve TIDAL_WITH_<NAME> (AUTO|ON|OFF) into TIDAL_HAVE_<NAME>.
macro(tidal_find_optional name)
  set(_want "${TIDAL_WITH_${name}}")
  set(TIDAL_HAVE_${name} OFF)
  if(NOT _want STREQUAL "OFF")
    if("${name}" STREQUAL "IO_URING")
      pkg_check_modules(TIDAL_URING QUIET IMPORTED_TARGET liburing)
      set(_found ${TIDAL_URING_FOUND})
    elseif("${name}" STREQUAL "CUDA")
      find_package(CUDAToolkit QUIET)
      set(_found ${CUDAToolkit_FOUND})
    elseif("${name}" STREQUAL "TORCH")
      include(TidalTorch)
      tidal_find_torch()
      set(_found ${Torch_FOUND})
    endif()
    if(_found)
      set(TIDAL_HAVE_${name} ON)
    elseif(_want STREQUAL "ON")
      message(FATAL_ERROR "TIDAL_WITH_${name}=ON but it was not found; install it "
                          "(scripts/setup.sh) or configure with -DTIDAL_WITH_${name}=OFF")
    endif()
  endif()
endmacro()

# tidal_enable_cuda(TARGET): the one place CUDA is wired in. The CUDA backend uses the runtime
# API only (no kernels), so plain C++ sources linked with cudart suffice; cuFile is dlopen'ed.
function(tidal_enable_cuda target)
  target_compile_definitions(${target} PUBLIC TIDAL_WITH_CUDA=1)
  # The CUDA runtime torch's wheel ships, where there is one (TidalTorch.cmake): one libcudart
  # in a process that also loads torch; else the toolkit's.
  if(TIDAL_TORCH_CUDART)
    target_link_libraries(${target} PRIVATE ${TIDAL_TORCH_CUDART})
    target_include_directories(${target} PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  else()
    target_link_libraries(${target} PRIVATE CUDA::cudart)
  endif()
  # cufile.h comes from the nvidia-cufile package on GPU machines; without it our own
  # declarations of the few symbols we use (src/io/cuda/cufile_shim.hpp) are used.
  find_path(TIDAL_CUFILE_INCLUDE cufile.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV CUFILE_INCLUDE)
  if(TIDAL_CUFILE_INCLUDE)
    target_include_directories(${target} PRIVATE ${TIDAL_CUFILE_INCLUDE})
    target_compile_definitions(${target} PRIVATE TIDAL_HAVE_CUFILE_H=1)
  endif()
endfunction()

# tidal_add_test_suite(NAME DIR LABELS...): one GoogleTest executable per layer.
# The torch-free layers' suites link tidal::core alone, the torch layer's tidal::tidal.
function(tidal_add_test_suite name dir)
  file(GLOB _src CONFIGURE_DEPENDS ${dir}/*.cpp)
  if(NOT _src)
    return()
  endif()
  add_executable(${name} ${_src})
  if("torch" IN_LIST ARGN)
    target_link_libraries(${name} PRIVATE tidal::tidal GTest::gtest GTest::gtest_main)
  else()
    target_link_libraries(${name} PRIVATE tidal::core GTest::gtest GTest::gtest_main)
  endif()
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  gtest_discover_tests(${name} PROPERTIES LABELS "${ARGN}" DISCOVERY_TIMEOUT 60
                       TEST_PREFIX "${name}.")
endfunction()
