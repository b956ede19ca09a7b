# The layers are enforced by the build (cmake/layers.cmake): compiled in the model layer's view of
# the source tree, a file may include the model's own headers and the public ones below it
# (kernels' seam, core), and an include of a layer above (train/) or of a backend's private header
# (kernels/gemm.h, kernels/cpu/...) fails to compile; so does the reference backend's include of
# the CPU backend's. Run as
#   cmake -DCXX=... -DLAYERS=build/layers -DWORK=dir -P layer_include_test.cmake
foreach(var CXX LAYERS WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "layer_include_test: -D${var}=... is required")
  endif()
endforeach()
file(MAKE_DIRECTORY ${WORK})

# compiles `include` from the `layer` view; sets ok (TRUE/FALSE) and output in the caller.
function(probe layer include)
  set(source ${WORK}/probe_${layer}.cpp)
  file(WRITE ${source} "#include \"${include}\"\nint main() { return 0; }\n")
  execute_process(COMMAND ${CXX} -std=c++20 -fsyntax-only -I ${LAYERS}/${layer} ${source}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    set(ok TRUE PARENT_SCOPE)
  else()
    set(ok FALSE PARENT_SCOPE)
  endif()
  set(output "${out}" PARENT_SCOPE)
endfunction()

set(failures 0)
# Allowed: the layer's own room and the public headers below it. (Controls: without them a
# broken view would make every refusal below pass.) kernels_reference is the reference backend's
# own view inside kernels/ (cmake/layers.cmake): the seam, the host-memory base, its folder, core.
foreach(case "model|keel/model/decoder.h" "model|keel/kernels/backend.h" "model|keel/core/memory_plan.h"
             "model|keel/formats/safetensors.h" "kernels_reference|keel/kernels/reference/attention.h"
             "kernels_reference|keel/kernels/host_memory.h" "kernels_reference|keel/kernels/shapes.h"
             "kernels_reference|keel/core/dtype.h" "report|keel/plan/training_plan.h"
             "plan|keel/recipe/recipe.h")
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 layer)
  list(GET parts 1 allowed)
  probe(${layer} ${allowed})
  if(NOT ok)
    message(SEND_ERROR "${layer} layer: #include \"${allowed}\" should compile:\n${output}")
    math(EXPR failures "${failures} + 1")
  endif()
endforeach()
# Refused: upward, sideways and private includes, each for the reason that the file is not there.
foreach(case "model|keel/train/trainer.h" "model|keel/recipe/recipe.h" "model|keel/kernels/gemm.h"
             "model|keel/kernels/cpu/vector_ops.h" "kernels|keel/model/decoder.h"
             "distributed|keel/model/params.h" "train|keel/cluster/topology.h" "train|keel/kernels/attention.h"
             "formats|keel/model/config.h" "formats|keel/kernels/backend.h" "data|keel/formats/safetensors.h"
             # the plan is built below the report that prints it
             "plan|keel/report/memory_report.h" "recipe|keel/plan/training_plan.h"
             # the reference backend, independent of the CPU backend's kernels and their headers
             "kernels_reference|keel/kernels/cpu/vector_ops.h" "kernels_reference|keel/kernels/cpu/cpu_backend.h"
             "kernels_reference|keel/kernels/rmsnorm.h" "kernels_reference|keel/kernels/cached_attention.h"
             "kernels_reference|keel/kernels/gemm.h" "kernels_reference|keel/kernels/attention.h")
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 layer)
  list(GET parts 1 include)
  probe(${layer} ${include})
  if(ok)
    message(SEND_ERROR "${layer} layer: #include \"${include}\" compiled; the layers must refuse it")
    math(EXPR failures "${failures} + 1")
  elseif(NOT output MATCHES "No such file")
    message(SEND_ERROR "${layer} layer: #include \"${include}\" failed for another reason than a missing file:\n${output}")
    math(EXPR failures "${failures} + 1")
  else()
    message(STATUS "refused as it should be: ${layer} -> ${include}")
  endif()
endforeach()
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} layer check(s) failed")
endif()
