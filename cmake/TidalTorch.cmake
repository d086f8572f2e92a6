# tidal_find_torch(): find the libtorch that the project's Python environment has, and the
# interpreter that goes with it (one torch for C++ and Python).
#
# The interpreter: TIDAL_PYTHON when given (or Python3_EXECUTABLE), else the first that imports
# torch of $TIDAL_VENV/bin/python, <source>/.venv/bin/python (scripts/setup.sh makes it),
# python3 on PATH and /usr/bin/python3. Its torch.utils.cmake_prefix_path is appended to
# CMAKE_PREFIX_PATH, then find_package(Torch) runs as usual (a CMAKE_PREFIX_PATH or Torch_DIR
# given by hand still wins). Sets TIDAL_PYTHON, Python3_EXECUTABLE, TIDAL_TORCH_CMAKE_PREFIX and
# Torch_FOUND; a torch older than TIDAL_TORCH_MIN_VERSION is refused with the reason.
set(TIDAL_TORCH_MIN_VERSION 2.9 CACHE STRING "The oldest torch tidal's torch layers build against")

function(_tidal_python_imports_torch python out)
  execute_process(COMMAND "${python}" -c
                  "import torch, torch.utils; print(torch.__version__); print(torch.utils.cmake_prefix_path)"
                  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_rc EQUAL 0)
    string(REPLACE "\n" ";" _out "${_out}")
    set(${out} "${_out}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

macro(tidal_find_torch)
  set(Torch_FOUND FALSE)
  if(NOT TIDAL_PYTHON AND Python3_EXECUTABLE)
    set(TIDAL_PYTHON "${Python3_EXECUTABLE}" CACHE FILEPATH "The Python whose torch tidal uses")
  endif()
  set(_tidal_torch_info "")
  if(TIDAL_PYTHON)
    _tidal_python_imports_torch("${TIDAL_PYTHON}" _tidal_torch_info)
    if(NOT _tidal_torch_info)
      message(WARNING "tidal: TIDAL_PYTHON=${TIDAL_PYTHON} cannot import torch")
    endif()
  else()
    find_program(_tidal_path_python python3 NO_CACHE)
    foreach(_candidate "$ENV{TIDAL_VENV}/bin/python" "${PROJECT_SOURCE_DIR}/.venv/bin/python"
                       ${_tidal_path_python} /usr/bin/python3)
      if(EXISTS "${_candidate}" AND NOT IS_DIRECTORY "${_candidate}")
        _tidal_python_imports_torch("${_candidate}" _tidal_torch_info)
        if(_tidal_torch_info)
          set(TIDAL_PYTHON "${_candidate}" CACHE FILEPATH "The Python whose torch tidal uses")
          break()
        endif()
      endif()
    endforeach()
  endif()
  if(_tidal_torch_info)
    list(GET _tidal_torch_info 0 _tidal_torch_version)
    list(GET _tidal_torch_info 1 TIDAL_TORCH_CMAKE_PREFIX)
    list(APPEND CMAKE_PREFIX_PATH "${TIDAL_TORCH_CMAKE_PREFIX}")
    set(Python3_EXECUTABLE "${TIDAL_PYTHON}" CACHE FILEPATH "Python with torch")
    set(Python_EXECUTABLE "${TIDAL_PYTHON}")   # the one Caffe2's config looks for
    # The wheel's Caffe2 config looks for the CUDA toolkit itself where torch has CUDA. tidal
    # compiles no CUDA kernels, so the architectures it would detect (and warn about) are moot.
    unset(CMAKE_CUDA_ARCHITECTURES)
    unset(CMAKE_CUDA_ARCHITECTURES CACHE)
    if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
      set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
    endif()
    find_package(Torch QUIET)
    if(Torch_FOUND)
      string(REGEX MATCH "^[0-9]+\\.[0-9]+(\\.[0-9]+)?" _tidal_torch_version "${_tidal_torch_version}")
      if(_tidal_torch_version VERSION_LESS TIDAL_TORCH_MIN_VERSION)
        message(FATAL_ERROR "tidal: ${TIDAL_PYTHON} has torch ${_tidal_torch_version}; tidal's torch "
                            "layers need torch >= ${TIDAL_TORCH_MIN_VERSION}. Run scripts/setup.sh "
                            "(torch 2.11.0 in .venv), or configure with -DTIDAL_WITH_TORCH=OFF.")
      endif()
      set(TIDAL_TORCH_VERSION "${_tidal_torch_version}")
      # A PyPI wheel's CUDA libraries live beside torch (site-packages/nvidia/*/lib), and torch's
      # own libraries find them through their RUNPATH. The linker must find the same ones (not
      # an older NCCL of the system's CUDA toolkit that lacks symbols a newer torch needs), and
      # tidal's CUDA backend uses the wheel's CUDA runtime, so one libcudart is in the process.
      file(GLOB TIDAL_TORCH_NVIDIA_LIBDIRS LIST_DIRECTORIES true
           "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
      find_library(TIDAL_TORCH_CUDART NAMES libcudart.so.13 libcudart.so.12 cudart
                   PATHS ${TIDAL_TORCH_NVIDIA_LIBDIRS} NO_DEFAULT_PATH)
    endif()
  else()
    find_package(Torch QUIET)   # a libtorch given by CMAKE_PREFIX_PATH or Torch_DIR
    set(TIDAL_TORCH_VERSION "unknown (no Python with torch)")
  endif()
endmacro()
