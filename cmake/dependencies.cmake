# Dependencies. scripts/setup.sh installs the Debian packages and stages into .deps/ what a
# machine without them (the GPU machine) needs: oneDNN, GoogleTest's sources and the cuDNN
# frontend headers. Prefer what is staged, so that a build here and there link the same.
find_package(Threads REQUIRED)
find_package(ZLIB REQUIRED)
find_package(JPEG REQUIRED)
find_package(PNG REQUIRED)
find_package(yaml-cpp REQUIRED)
# OpenMP: the CPU backend's own loops run on the same GNU OpenMP pool as oneDNN's primitives.
find_package(OpenMP REQUIRED COMPONENTS CXX)

# oneDNN 2.6 (Debian's libdnnl-dev); staged copy first.
find_path(KILN_DNNL_INCLUDE oneapi/dnnl/dnnl.hpp HINTS ${KILN_DEPS_DIR}/dnnl/include NO_DEFAULT_PATH)
find_path(KILN_DNNL_INCLUDE oneapi/dnnl/dnnl.hpp)
find_library(KILN_DNNL_LIB NAMES dnnl libdnnl.so.2 HINTS ${KILN_DEPS_DIR}/dnnl/lib NO_DEFAULT_PATH)
find_library(KILN_DNNL_LIB NAMES dnnl)
if(NOT KILN_DNNL_INCLUDE OR NOT KILN_DNNL_LIB)
  message(FATAL_ERROR "oneDNN not found: run scripts/setup.sh (it installs libdnnl-dev and stages it into .deps/dnnl)")
endif()
add_library(kiln_dnnl INTERFACE)
target_include_directories(kiln_dnnl SYSTEM INTERFACE ${KILN_DNNL_INCLUDE})
target_link_libraries(kiln_dnnl INTERFACE ${KILN_DNNL_LIB})
message(STATUS "kiln: oneDNN ${KILN_DNNL_LIB}")

# CUDA backend.
set(KILN_WITH_CUDA OFF)
if(NOT KILN_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  find_path(KILN_CUDNN_FRONTEND_INCLUDE cudnn_frontend.h HINTS ${KILN_DEPS_DIR}/cudnn-frontend/include NO_DEFAULT_PATH)
  if(CMAKE_CUDA_COMPILER AND KILN_CUDNN_FRONTEND_INCLUDE)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # Hopper (H100/H200)
    endif()
    enable_language(CUDA)
    # CMake before 3.26 knows no C++20 flag for nvcc (which has taken -std=c++20 since 12.0).
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    find_package(CUDAToolkit REQUIRED)
    find_library(KILN_CUDNN_LIB cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
    find_path(KILN_CUDNN_INCLUDE cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
    if(KILN_CUDNN_LIB AND KILN_CUDNN_INCLUDE)
      add_library(kiln_cudnn INTERFACE)
      target_include_directories(kiln_cudnn SYSTEM INTERFACE ${KILN_CUDNN_INCLUDE})
      target_link_libraries(kiln_cudnn INTERFACE ${KILN_CUDNN_LIB})
      set(KILN_WITH_CUDA ON)
    endif()
  endif()
  if(KILN_CUDA STREQUAL "AUTO" AND CMAKE_CUDA_COMPILER AND NOT KILN_WITH_CUDA)
    message(WARNING "kiln: a CUDA compiler is here, but the CUDA backend is not built: it needs cuDNN "
                    "and the cuDNN frontend headers in ${KILN_DEPS_DIR}/cudnn-frontend (bash "
                    "scripts/setup.sh stages them; then configure, or pip install ., again)")
  endif()
  if(KILN_CUDA STREQUAL "ON" AND NOT KILN_WITH_CUDA)
    message(FATAL_ERROR "KILN_CUDA=ON but the CUDA toolkit, cuDNN or the cuDNN frontend headers "
                        "(.deps/cudnn-frontend, staged by scripts/setup.sh) were not found")
  endif()
endif()
message(STATUS "kiln: CUDA backend ${KILN_WITH_CUDA}")

# nvJPEG (GPU JPEG decode, issue 16): the toolkit's where it has one (the GPU machine's CUDA 13.0
# does, so it links and runs with its own), else the pinned wheel's header and library that
# scripts/setup.sh stages in .deps/nvjpeg. Without either, the CUDA backend builds without its
# JPEG decoder (Backend::decodes_jpeg says why) and images are decoded on the host.
set(KILN_WITH_NVJPEG OFF)
if(KILN_WITH_CUDA)
  find_path(KILN_NVJPEG_TOOLKIT_INCLUDE nvjpeg.h HINTS ${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
  add_library(kiln_nvjpeg INTERFACE)
  if(TARGET CUDA::nvjpeg AND KILN_NVJPEG_TOOLKIT_INCLUDE)
    target_link_libraries(kiln_nvjpeg INTERFACE CUDA::nvjpeg)
    set(KILN_WITH_NVJPEG ON)
    message(STATUS "kiln: nvJPEG from the CUDA toolkit (${CUDAToolkit_LIBRARY_DIR})")
  else()
    find_path(KILN_NVJPEG_INCLUDE nvjpeg.h HINTS ${KILN_DEPS_DIR}/nvjpeg/include NO_DEFAULT_PATH)
    find_library(KILN_NVJPEG_LIB nvjpeg HINTS ${KILN_DEPS_DIR}/nvjpeg/lib NO_DEFAULT_PATH)
    if(KILN_NVJPEG_INCLUDE AND KILN_NVJPEG_LIB)
      target_include_directories(kiln_nvjpeg SYSTEM INTERFACE ${KILN_NVJPEG_INCLUDE})
      target_link_libraries(kiln_nvjpeg INTERFACE ${KILN_NVJPEG_LIB})
      # An installed kiln (and its users' link) finds the staged library where it lies.
      get_filename_component(KILN_NVJPEG_LIB_DIR ${KILN_NVJPEG_LIB} DIRECTORY)
      set(KILN_WITH_NVJPEG ON)
      message(STATUS "kiln: nvJPEG from ${KILN_NVJPEG_LIB} (staged by scripts/setup.sh)")
    else()
      message(STATUS "kiln: nvJPEG not found (neither in the CUDA toolkit nor in .deps/nvjpeg, which "
                     "scripts/setup.sh stages): the CUDA backend decodes no JPEGs")
    endif()
  endif()
  if(KILN_WITH_NVJPEG)
    target_compile_definitions(kiln_nvjpeg INTERFACE KILN_HAVE_NVJPEG=1)
  endif()
endif()

# Data parallel (S27): MPI starts the processes (mpirun, srun) and carries the CPU
# collectives; NCCL the GPU ones. Both optional: without MPI kiln runs one process and says
# so when asked for more; without NCCL the CUDA backend trains on one GPU only.
add_library(kiln_dist INTERFACE)
set(MPI_CXX_SKIP_MPICXX ON)  # the C API only, not the deprecated C++ bindings
find_package(MPI COMPONENTS CXX QUIET)
if(MPI_CXX_FOUND)
  target_link_libraries(kiln_dist INTERFACE MPI::MPI_CXX)
  target_compile_definitions(kiln_dist INTERFACE KILN_HAVE_MPI=1)
  message(STATUS "kiln: MPI ${MPI_CXX_VERSION} (${MPIEXEC_EXECUTABLE})")
else()
  message(STATUS "kiln: MPI not found: data-parallel training is off (install libopenmpi-dev and "
                 "openmpi-bin, as scripts/setup.sh does, and configure again)")
endif()
if(KILN_WITH_CUDA)
  find_path(KILN_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT}/include)
  find_library(KILN_NCCL_LIB nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib
               ${CUDAToolkit_LIBRARY_ROOT}/lib64)
  if(KILN_NCCL_INCLUDE AND KILN_NCCL_LIB)
    target_include_directories(kiln_dist SYSTEM INTERFACE ${KILN_NCCL_INCLUDE})
    target_link_libraries(kiln_dist INTERFACE ${KILN_NCCL_LIB})
    target_compile_definitions(kiln_dist INTERFACE KILN_HAVE_NCCL=1)
    message(STATUS "kiln: NCCL ${KILN_NCCL_LIB}")
  else()
    message(STATUS "kiln: NCCL not found: the CUDA backend trains on one GPU per run")
  endif()
endif()

# GoogleTest: the system's libraries where present, else the sources staged in .deps.
if(KILN_BUILD_TESTS)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    if(EXISTS ${KILN_DEPS_DIR}/googletest/CMakeLists.txt)
      set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
      set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
      add_subdirectory(${KILN_DEPS_DIR}/googletest ${CMAKE_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
      add_library(GTest::gtest ALIAS gtest)
      add_library(GTest::gtest_main ALIAS gtest_main)
    else()
      message(FATAL_ERROR "GoogleTest not found: run scripts/setup.sh")
    endif()
  endif()
endif()
