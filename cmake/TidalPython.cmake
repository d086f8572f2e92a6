# tidal_find_python(): resolve TIDAL_BUILD_PYTHON (AUTO|ON|OFF) into TIDAL_HAVE_PYTHON, with
# the interpreter, pybind11 and libtorch_python the module needs.
#
# The interpreter is the one that imports torch: Python3_EXECUTABLE when given, else the first of
# `python3` on PATH and /usr/bin/python3 that can (a pyenv or venv python3 without torch is
# skipped). Its torch must be the libtorch this build links (Debian: python3-torch and
# libtorch-dev; pip wheels: configure with -DCMAKE_PREFIX_PATH=<torch.utils.cmake_prefix_path>).
macro(tidal_find_python)
  set(_tidal_py_reason "")
  if(NOT Python3_EXECUTABLE)
    find_program(_tidal_path_python python3 NO_CACHE)
    foreach(_candidate ${_tidal_path_python} /usr/bin/python3)
      if(EXISTS "${_candidate}")
        execute_process(COMMAND "${_candidate}" -c "import torch" RESULT_VARIABLE _rc
                        OUTPUT_QUIET ERROR_QUIET)
        if(_rc EQUAL 0)
          set(Python3_EXECUTABLE "${_candidate}" CACHE FILEPATH "Python with torch")
          break()
        endif()
      endif()
    endforeach()
  endif()
  if(Python3_EXECUTABLE)
    execute_process(COMMAND "${Python3_EXECUTABLE}" -c "import torch" RESULT_VARIABLE _rc
                    OUTPUT_QUIET ERROR_QUIET)
    if(NOT _rc EQUAL 0)
      string(CONCAT _tidal_py_reason "${Python3_EXECUTABLE} cannot import torch (install "
             "python3-torch, or give -DPython3_EXECUTABLE=<a python with torch>)")
    endif()
  endif()
  if(NOT Python3_EXECUTABLE)
    set(_tidal_py_reason "no python3 that can import torch (install python3-torch)")
  elseif(NOT _tidal_py_reason)
    find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
    if(NOT Python3_Development.Module_FOUND)
      set(_tidal_py_reason "no Python headers for ${Python3_EXECUTABLE} (install python3-dev)")
    endif()
  endif()
  if(NOT _tidal_py_reason)
    set(PYBIND11_FINDPYTHON ON)
    find_package(pybind11 CONFIG QUIET)
    if(NOT pybind11_FOUND)
      set(_tidal_py_reason "pybind11 not found (install pybind11-dev)")
    endif()
  endif()
  if(NOT _tidal_py_reason)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c "import os, torch; print(os.path.dirname(torch.__file__))"
      OUTPUT_VARIABLE _tidal_torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE)
    find_library(TIDAL_TORCH_PYTHON_LIBRARY torch_python
                 HINTS "${_tidal_torch_dir}/lib" "${TORCH_INSTALL_PREFIX}/lib")
    if(NOT TIDAL_TORCH_PYTHON_LIBRARY)
      set(_tidal_py_reason "libtorch_python not found next to ${_tidal_torch_dir}")
    endif()
  endif()
  if(_tidal_py_reason)
    if(TIDAL_BUILD_PYTHON STREQUAL "ON")
      message(FATAL_ERROR "TIDAL_BUILD_PYTHON=ON but ${_tidal_py_reason}; or configure with "
                          "-DTIDAL_BUILD_PYTHON=OFF")
    endif()
    message(STATUS "tidal: no Python module: ${_tidal_py_reason}")
  else()
    set(TIDAL_HAVE_PYTHON ON)
    if(NOT TIDAL_PYTHON_INSTALL_DIR)
      execute_process(
        COMMAND "${Python3_EXECUTABLE}" -c
                "import sysconfig; print(sysconfig.get_path('platlib', vars={'platbase': '.', 'base': '.'}))"
        OUTPUT_VARIABLE TIDAL_PYTHON_INSTALL_DIR OUTPUT_STRIP_TRAILING_WHITESPACE)
    endif()
  endif()
endmacro()
