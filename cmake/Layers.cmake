# Compile flags shared by every meshtrain target, and mt_add_layer(): one
# directory of design.md's layer table = one static library that links only the
# layers below it, so a wrong-way include fails to link.
add_library(mt_flags INTERFACE)
target_compile_options(mt_flags INTERFACE -Wall -Wextra -Wpedantic -Wshadow
  -Wnon-virtual-dtor -Wno-unused-parameter -fno-math-errno)
if(MT_WERROR)
  target_compile_options(mt_flags INTERFACE -Werror)
endif()
if(MT_NATIVE)
  target_compile_options(mt_flags INTERFACE -march=native)
endif()
if(MT_SANITIZE)
  target_compile_options(mt_flags INTERFACE -fsanitize=address,undefined
    -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  target_link_options(mt_flags INTERFACE -fsanitize=address,undefined)
endif()

# mt_add_layer(NAME DIRS <dirs...> DEPS <targets...>)
# Sources are the .cpp files directly in each listed directory.
function(mt_add_layer name)
  cmake_parse_arguments(L "" "" "DIRS;DEPS" ${ARGN})
  set(srcs)
  foreach(d IN LISTS L_DIRS)
    file(GLOB s CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/${d}/*.cpp")
    list(APPEND srcs ${s})
  endforeach()
  if(NOT srcs)  # a layer that is headers only so far
    add_library(meshtrain_${name} INTERFACE)
    target_include_directories(meshtrain_${name} INTERFACE ${PROJECT_SOURCE_DIR}/src)
    target_link_libraries(meshtrain_${name} INTERFACE ${L_DEPS})
    return()
  endif()
  add_library(meshtrain_${name} STATIC ${srcs})
  target_include_directories(meshtrain_${name} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(meshtrain_${name} PUBLIC ${L_DEPS} PRIVATE mt_flags)
endfunction()

# mt_add_test(NAME SOURCES <files...> DEPS <targets...> [LABELS <labels...>])
# A GoogleTest binary registered with CTest as one test per binary.
function(mt_add_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_DEPS} GTest::gtest GTest::gtest_main mt_flags)
  # Shared test helpers: #include "common/temp_dir.h".
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  target_compile_definitions(${name} PRIVATE
    MT_SOURCE_DIR="${PROJECT_SOURCE_DIR}" MT_BINARY_DIR="${PROJECT_BINARY_DIR}")
  add_test(NAME ${name} COMMAND ${name})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT})
  if(T_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}")
  endif()
  # "core" tests also run under ASan/UBSan (scripts/test builds them alone).
  if("core" IN_LIST T_LABELS)
    if(NOT TARGET mt_core_tests)
      add_custom_target(mt_core_tests)
    endif()
    add_dependencies(mt_core_tests ${name})
  endif()
endfunction()

# mt_add_mpi_test(NAME SOURCES <files...> DEPS <targets...> RANKS <n...>
#                 [LABELS <labels...>] [TIMEOUT s])
# A GoogleTest binary with its own main (it initialises MPI) run under
# mpirun once per rank count, as NAME_np<n>, shared-memory BTL only; label
# "mpi" is added.
function(mt_add_mpi_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;DEPS;LABELS;RANKS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_DEPS} GTest::gtest mt_flags)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  foreach(np IN LISTS T_RANKS)
    add_test(NAME ${name}_np${np}
      COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe --bind-to none
        --mca btl self,vader -np ${np} $<TARGET_FILE:${name}>)
    set_tests_properties(${name}_np${np} PROPERTIES LABELS "mpi;${T_LABELS}"
      TIMEOUT ${T_TIMEOUT}
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
  endforeach()
endfunction()
