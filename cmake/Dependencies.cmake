# Every third-party library meshtrain uses comes from Debian's packages
# (scripts/setup installs them). One place finds them all.
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(MPI REQUIRED COMPONENTS CXX)
find_package(dnnl REQUIRED)
find_package(OpenBLAS CONFIG REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(tomlplusplus REQUIRED)
find_package(CLI11 REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(ZLIB REQUIRED)
if(MT_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(MT_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# OpenBLAS's CMake config exports variables, not a target; wrap it in one.
if(NOT TARGET mt::openblas)
  add_library(mt::openblas INTERFACE IMPORTED)
  set_target_properties(mt::openblas PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${OpenBLAS_INCLUDE_DIRS}"
    INTERFACE_LINK_LIBRARIES "${OpenBLAS_LIBRARIES}")
endif()
