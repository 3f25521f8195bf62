// KILN_HD marks a function compiled for host and device under nvcc (__host__ __device__),
// and for the host alone by the host compiler: code that both backends run.
#pragma once

#if defined(__CUDACC__)
#define KILN_HD __host__ __device__
#else
#define KILN_HD
#endif
