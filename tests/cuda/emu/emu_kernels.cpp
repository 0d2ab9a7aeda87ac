/* The CUDA backend's kernels, compiled for the CPU emulation. */
#include "qm_cuda_kernels.cu"
