#pragma once
/// Compiler portability macros shared by host (.hpp) and device (.cuh) code.

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVSIFT_HOST_DEVICE __host__ __device__
#define KVSIFT_DEVICE __device__
#else
#define KVSIFT_HOST_DEVICE
#define KVSIFT_DEVICE
#endif

#define KVSIFT_VERSION_MAJOR 0
#define KVSIFT_VERSION_MINOR 1
#define KVSIFT_VERSION_PATCH 0
