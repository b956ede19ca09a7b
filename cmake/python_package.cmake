# The keel Python package's extension, keel._native (src/keel/bindings/, nanobind), and the package
# laid out in build/python/keel/ (python/keel/*.py + the extension + the keel command) so that the
# tests import the build tree directly. `pip install .` (pyproject.toml, scikit-build-core) runs
# this same build and installs the same files into the wheel.
# (The layers are compiled position independent for it: CMakeLists.txt.)

find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(COMMAND ${Python_EXECUTABLE} -m nanobind --cmake_dir OUTPUT_VARIABLE nanobind_ROOT
                OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE nanobind_found)
if(NOT nanobind_found EQUAL 0)
  message(FATAL_ERROR "KEEL_PYTHON_PACKAGE: ${Python_EXECUTABLE} has no nanobind (pip install nanobind, or use "
                      "scripts/python-env.sh's environment)")
endif()
# The interpreter's own nanobind at every configure (pip's isolated build environments come and go).
unset(nanobind_DIR CACHE)
find_package(nanobind CONFIG REQUIRED)

file(GLOB KEEL_PYTHON_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/keel/bindings/*.cpp)
nanobind_add_module(keel_native NB_STATIC ${KEEL_PYTHON_SOURCES})
set_target_properties(keel_native PROPERTIES OUTPUT_NAME _native LIBRARY_OUTPUT_DIRECTORY
                                             ${CMAKE_BINARY_DIR}/python/keel)
keel_top_app(keel_native bindings)  # as the CLI: every room, kernels through its public seam only

# The pure-Python modules and the keel command beside the extension, refreshed at every build.
add_custom_target(keel_python_files ALL
  COMMAND ${CMAKE_COMMAND} -E copy_directory ${CMAKE_SOURCE_DIR}/python/keel ${CMAKE_BINARY_DIR}/python/keel
  COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/python/keel/_bin
  COMMAND ${CMAKE_COMMAND} -E create_symlink $<TARGET_FILE:keel_cli> ${CMAKE_BINARY_DIR}/python/keel/_bin/keel
  COMMENT "keel Python package: build/python/keel")
add_dependencies(keel_python_files keel_native keel_cli)

if(SKBUILD)  # pip install . / a wheel: the extension and the keel command inside the package
  install(TARGETS keel_native LIBRARY DESTINATION keel)
  install(TARGETS keel_cli RUNTIME DESTINATION keel/_bin)
endif()
