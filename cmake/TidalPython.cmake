# tidal_find_python(): resolve TIDAL_BUILD_PYTHON (AUTO|ON|OFF) into TIDAL_HAVE_PYTHON, with
# the interpreter, pybind11 and libtorch_python the module needs.
#
# The interpreter is the one whose torch this build links (TIDAL_PYTHON, chosen by
# tidal_find_torch in TidalTorch.cmake: by default the project's .venv that scripts/setup.sh
# makes). pybind11 comes from the same environment (`python -m pybind11 --cmakedir`).
macro(tidal_find_python)
  set(_tidal_py_reason "")
  if(NOT TIDAL_PYTHON)
    string(CONCAT _tidal_py_reason "no Python with torch (run scripts/setup.sh, or give "
           "-DTIDAL_PYTHON=<a python with torch>)")
  else()
    # FindPython (pybind11's python_add_library comes from it), on the same interpreter.
    set(Python_EXECUTABLE "${TIDAL_PYTHON}")
    set(Python3_EXECUTABLE "${TIDAL_PYTHON}")
    find_package(Python COMPONENTS Interpreter Development.Module QUIET)
    if(NOT Python_Development.Module_FOUND)
      set(_tidal_py_reason "no Python headers for ${TIDAL_PYTHON} (install python3-dev)")
    endif()
  endif()
  if(NOT _tidal_py_reason)
    execute_process(COMMAND "${TIDAL_PYTHON}" -m pybind11 --cmakedir RESULT_VARIABLE _rc
                    OUTPUT_VARIABLE _tidal_pybind11_dir ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_rc EQUAL 0 AND NOT pybind11_DIR)
      set(pybind11_DIR "${_tidal_pybind11_dir}" CACHE PATH "pybind11's CMake package")
    endif()
    set(PYBIND11_FINDPYTHON ON)
    find_package(pybind11 CONFIG QUIET)
    if(NOT pybind11_FOUND)
      set(_tidal_py_reason "pybind11 not found for ${TIDAL_PYTHON} (run scripts/setup.sh)")
    endif()
  endif()
  if(NOT _tidal_py_reason)
    execute_process(
      COMMAND "${TIDAL_PYTHON}" -c "import os, torch; print(os.path.dirname(torch.__file__))"
      OUTPUT_VARIABLE _tidal_torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE)
    find_library(TIDAL_TORCH_PYTHON_LIBRARY torch_python HINTS "${_tidal_torch_dir}/lib"
                 NO_DEFAULT_PATH)
    if(NOT TIDAL_TORCH_PYTHON_LIBRARY)
      set(_tidal_py_reason "libtorch_python not found in ${_tidal_torch_dir}/lib")
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
        COMMAND "${TIDAL_PYTHON}" -c
                "import sysconfig; print(sysconfig.get_path('platlib', vars={'platbase': '.', 'base': '.'}))"
        OUTPUT_VARIABLE TIDAL_PYTHON_INSTALL_DIR OUTPUT_STRIP_TRAILING_WHITESPACE)
    endif()
  endif()
endmacro()
