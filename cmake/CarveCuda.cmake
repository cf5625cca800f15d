# Finds the CUDA toolkit (nvcc, cuBLAS, NCCL) for the CUDA target and enables
# the CUDA language. Sets CARVE_CUDA_FOUND, and CARVE_CUDA_WHY when it is off.
# Included once, from the top-level CMakeLists.txt (the language must be
# enabled at the top for every directory to compile .cu files), and from the
# runtime's own when it is built alone.
if(DEFINED CARVE_CUDA_FOUND)
  return()
endif()
option(CARVE_CUDA "Build the CUDA target when a CUDA toolkit with cuBLAS and NCCL is found" ON)
set(CARVE_CUDA_ARCHITECTURES "80;90" CACHE STRING
    "GPU architectures (sm_XX numbers) the CUDA runtime and generated programs are built for")
set(CARVE_CUDA_FOUND OFF)
set(CARVE_CUDA_WHY "")
if(CARVE_CUDA)
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES ${CARVE_CUDA_ARCHITECTURES})
    enable_language(CUDA)
    find_package(CUDAToolkit)
    find_path(CARVE_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(CARVE_NCCL nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
    # cuDNN 9's backend graph API (attention_cudnn.cpp). Without it the CUDA
    # target still builds: attention_*_cudnn then run carve's own kernels.
    find_path(CARVE_CUDNN_INCLUDE cudnn_graph.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(CARVE_CUDNN cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib)
    if(NOT CUDAToolkit_FOUND OR NOT TARGET CUDA::cublas OR NOT TARGET CUDA::cublasLt)
      set(CARVE_CUDA_WHY "the CUDA toolkit has no cuBLAS")
    elseif(NOT CARVE_NCCL_INCLUDE OR NOT CARVE_NCCL)
      set(CARVE_CUDA_WHY "NCCL (nccl.h, libnccl) was not found")
    else()
      set(CARVE_CUDA_FOUND ON)
    endif()
  else()
    set(CARVE_CUDA_WHY "no nvcc on PATH or in /usr/local/cuda/bin")
  endif()
else()
  set(CARVE_CUDA_WHY "CARVE_CUDA=OFF")
endif()

