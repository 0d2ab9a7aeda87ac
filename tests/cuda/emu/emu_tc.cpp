/* The CUDA backend's tensor-core GEMM, compiled for the CPU emulation. */
#include "qm_cuda_tc.cu"
