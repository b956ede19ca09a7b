# The layers of keel, one static library per room of src/keel/, each compiled against a view of
# the source tree that holds its own room and the public headers of the rooms below it, nothing
# else: an include of a room above (or of a backend's private kernels header) is "No such file"
# at compile time, not a review comment. tests/layers/layer_include_test.cmake checks that it is.
#
# A view is build/layers/<room>/keel/ with a symlink per visible room; kernels/ shows only its
# public seam (kernels_public_headers): the backends behind it are kernels' own business.

set(KEEL_SOURCE_ROOT ${CMAKE_SOURCE_DIR}/src/keel)
set(KEEL_KERNELS_PUBLIC_HEADERS backend.h bf16_widening.h shapes.h)
# The reference backend is built apart from the rest of kernels/, in a view without the CPU
# backend's kernels (cpu/ and their headers), so that a change to a CPU kernel cannot change the
# yardstick it is measured against: it sees the public seam, the host-memory base both backends
# share, its own folder and core.
set(KEEL_KERNELS_SEPARATE_BACKENDS reference)
set(KEEL_KERNELS_BACKEND_SHARED_HEADERS host_memory.h)

# Makes `view`/<room> show what layers above may include of `room`.
function(keel_view_room view room)
  if(room STREQUAL "kernels")
    file(MAKE_DIRECTORY ${view}/kernels)
    foreach(header ${KEEL_KERNELS_PUBLIC_HEADERS})
      file(CREATE_LINK ${KEEL_SOURCE_ROOT}/kernels/${header} ${view}/kernels/${header} SYMBOLIC)
    endforeach()
  else()
    file(CREATE_LINK ${KEEL_SOURCE_ROOT}/${room} ${view}/${room} SYMBOLIC)
  endif()
endfunction()

# keel_kernels_backend(NAME): keel_kernels_NAME from src/keel/kernels/NAME/**.cpp, compiled in the
# view build/layers/kernels_NAME/ described at KEEL_KERNELS_SEPARATE_BACKENDS.
function(keel_kernels_backend name)
  set(root ${CMAKE_BINARY_DIR}/layers/kernels_${name})
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root}/keel)
  keel_view_room(${root}/keel kernels)
  foreach(header ${KEEL_KERNELS_BACKEND_SHARED_HEADERS})
    file(CREATE_LINK ${KEEL_SOURCE_ROOT}/kernels/${header} ${root}/keel/kernels/${header} SYMBOLIC)
  endforeach()
  file(CREATE_LINK ${KEEL_SOURCE_ROOT}/kernels/${name} ${root}/keel/kernels/${name} SYMBOLIC)
  keel_view_room(${root}/keel core)
  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${KEEL_SOURCE_ROOT}/kernels/${name}/*.cpp)
  add_library(keel_kernels_${name} STATIC ${sources})
  target_include_directories(keel_kernels_${name} PRIVATE ${root})
  target_link_libraries(keel_kernels_${name} PUBLIC keel_core)
endfunction()

# keel_layer(ROOM [BELOW room...] [PUBLIC_LINK target...] [PRIVATE_LINK target...])
# Defines keel_ROOM from src/keel/ROOM/**.cpp, linking keel_<below> for every room BELOW it.
function(keel_layer room)
  cmake_parse_arguments(L "" "" "BELOW;PUBLIC_LINK;PRIVATE_LINK" ${ARGN})
  set(root ${CMAKE_BINARY_DIR}/layers/${room})
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root}/keel)
  file(CREATE_LINK ${KEEL_SOURCE_ROOT}/${room} ${root}/keel/${room} SYMBOLIC)
  set(below_targets "")
  foreach(below ${L_BELOW})
    keel_view_room(${root}/keel ${below})
    list(APPEND below_targets keel_${below})
  endforeach()
  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${KEEL_SOURCE_ROOT}/${room}/*.cpp)
  if(room STREQUAL "kernels")  # the backends built apart, each its own library that kernels links
    foreach(backend ${KEEL_KERNELS_SEPARATE_BACKENDS})
      list(FILTER sources EXCLUDE REGEX "/kernels/${backend}/")
      keel_kernels_backend(${backend})
      list(APPEND below_targets keel_kernels_${backend})
    endforeach()
  endif()
  add_library(keel_${room} STATIC ${sources})
  target_include_directories(keel_${room} PRIVATE ${root})
  target_link_libraries(keel_${room} PUBLIC ${below_targets} ${L_PUBLIC_LINK} PRIVATE ${L_PRIVATE_LINK})
endfunction()

# keel_top_app(TARGET ROOM): TARGET (the CLI, the Python extension) is an app on top of every layer:
# it sees its own room and every other one, kernels through its public seam only, and links them all.
function(keel_top_app target room)
  set(view ${CMAKE_BINARY_DIR}/layers/${room})
  file(REMOVE_RECURSE ${view})
  file(MAKE_DIRECTORY ${view}/keel)
  foreach(r ${room} train checkpoint report plan recipe cluster distributed data model formats kernels core)
    keel_view_room(${view}/keel ${r})
  endforeach()
  target_include_directories(${target} PRIVATE ${view})
  target_link_libraries(${target} PRIVATE keel_train keel_cluster keel_checkpoint keel_report keel_plan keel_recipe
                        keel_distributed keel_data keel_model keel_formats keel_kernels keel_core)
endfunction()
