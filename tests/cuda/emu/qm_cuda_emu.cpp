/* qm_cuda_emu.cpp - the CPU emulation behind test_cuda_emu: a fiber
 * scheduler for kernel launches and a fake of the CUDA runtime calls the
 * backend makes (device memory is host memory, copies are memcpy, streams
 * and events are tokens: everything completes at once).
 *
 * The fake keeps an exact byte count of "device" allocations against a
 * 4 GiB device, so out-of-memory paths run too. Single-threaded use only
 * (the tests drive one backend from one thread). */
#include "qm_cuda_emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <map>
#include <memory>
#include <vector>

thread_local dim3 threadIdx, blockIdx, blockDim;

/* Fibers switch with a few instructions (x86-64: callee-saved registers and
 * the stack pointer); swapcontext would make two system calls per switch,
 * and a warp reduction switches every thread ten times per row. */
#if defined(__x86_64__)
extern "C" void qm_emu_switch(void **save_sp, void *load_sp);
asm(".text\n"
    ".globl qm_emu_switch\n"
    ".type qm_emu_switch,@function\n"
    "qm_emu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size qm_emu_switch, .-qm_emu_switch\n");
#define QM_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace
{

constexpr size_t kStackBytes = 256 * 1024;

enum FiberState { RUNNABLE, WAITING, DONE };

struct Fiber {
#ifdef QM_EMU_ASM_SWITCH
    void *sp = nullptr;
#else
    ucontext_t ctx;
#endif
    std::unique_ptr<char[]> stack; /* kept across launches, freed at exit */
    FiberState state = DONE;
};

#ifdef QM_EMU_ASM_SWITCH
void *g_sched_sp;
#else
ucontext_t g_sched;
#endif
std::vector<Fiber> g_fibers;
std::vector<double> g_xfer; /* one value per thread: float and double shuffles */
unsigned g_current;
const std::function<void()> *g_body;

void to_scheduler(unsigned me)
{
#ifdef QM_EMU_ASM_SWITCH
    qm_emu_switch(&g_fibers[me].sp, g_sched_sp);
#else
    swapcontext(&g_fibers[me].ctx, &g_sched);
#endif
}

void to_fiber(unsigned i)
{
#ifdef QM_EMU_ASM_SWITCH
    qm_emu_switch(&g_sched_sp, g_fibers[i].sp);
#else
    swapcontext(&g_sched, &g_fibers[i].ctx);
#endif
}

void fiber_main()
{
    unsigned me = g_current;
    (*g_body)();
    g_fibers[me].state = DONE;
    to_scheduler(me); /* never resumed */
    abort();
}

void run_block(unsigned n)
{
    if (g_fibers.size() < n) g_fibers.resize(n);
    g_xfer.assign(n, 0.0);
    for (unsigned i = 0; i < n; i++) {
        Fiber &f = g_fibers[i];
        if (!f.stack) f.stack.reset(new char[kStackBytes]);
#ifdef QM_EMU_ASM_SWITCH
        /* A frame that "returns" into fiber_main with the stack aligned as
         * after a call: six zeroed registers, the entry, a dummy return. */
        uintptr_t *sp = reinterpret_cast<uintptr_t *>(
            (reinterpret_cast<uintptr_t>(f.stack.get()) + kStackBytes) &
            ~static_cast<uintptr_t>(15));
        *--sp = 0;
        *--sp = reinterpret_cast<uintptr_t>(&fiber_main);
        for (int r = 0; r < 6; r++)
            *--sp = 0;
        f.sp = sp;
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.get();
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
#endif
        f.state = RUNNABLE;
    }
    for (;;) {
        /* Run every runnable fiber until it waits at a barrier or ends. */
        for (unsigned i = 0; i < n; i++) {
            if (g_fibers[i].state != RUNNABLE) continue;
            g_current = i;
            threadIdx = dim3(i, 0, 0);
            to_fiber(i);
        }
        /* Every live fiber has arrived: release the barrier. */
        bool waiting = false;
        for (unsigned i = 0; i < n; i++) {
            if (g_fibers[i].state == WAITING) {
                g_fibers[i].state = RUNNABLE;
                waiting = true;
            }
        }
        if (!waiting) break;
    }
}

cudaError_t g_last = cudaSuccess;
const size_t kDeviceBytes = (size_t)4 << 30;
size_t g_allocated;
std::map<void *, size_t> g_device_allocs;

cudaError_t fail(cudaError_t e)
{
    g_last = e;
    return e;
}

} /* namespace */

void qm_emu_launch(dim3 grid, dim3 block, const std::function<void()> &fn)
{
    g_body = &fn;
    unsigned n = block.x * block.y * block.z;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = dim3(x, y, z);
                blockDim = block;
                run_block(n);
            }
    g_body = nullptr;
}

void qm_emu_barrier(void)
{
    unsigned me = g_current;
    g_fibers[me].state = WAITING;
    to_scheduler(me);
    threadIdx = dim3(me, 0, 0);
}

double qm_emu_exchange(double v, unsigned src_lane)
{
    unsigned me = g_current;
    g_xfer[me] = v;
    qm_emu_barrier();
    double r = g_xfer[(me & ~31u) | src_lane];
    qm_emu_barrier();
    return r;
}

float qm_emu_half_to_float(unsigned short h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) {
                mant <<= 1;
                exp--;
            }
            u = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    return __uint_as_float(u);
}

unsigned short qm_emu_float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu, mant = x & 0x7fffffu;
    if (exp == 0xffu) return (unsigned short)(sign | 0x7c00u | (mant ? 0x200u : 0u));
    const int e = (int)exp - 127 + 15;
    if (e >= 31) return (unsigned short)(sign | 0x7c00u);
    if (e <= 0) { /* subnormal or zero in f16 */
        if (e < -10) return (unsigned short)sign;
        const uint32_t m = mant | 0x800000u, shift = (uint32_t)(14 - e);
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (unsigned short)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* a carry may reach inf: right */
    return (unsigned short)(sign | h);
}

/* ---- the runtime calls the backend and its tests make ---- */

extern "C" {

cudaError_t cudaGetDeviceCount(int *count)
{
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    if (device != 0) return fail(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "qmoe CUDA emulator (CPU)");
    prop->totalGlobalMem = kDeviceBytes;
    prop->major = 9; /* as an H100/H200: the tensor-core path runs (emulated) */
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    (void)attr;
    (void)device;
    *value = 1;
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags)
{
    (void)flags;
    *stream = reinterpret_cast<cudaStream_t>(new char);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    delete reinterpret_cast<char *>(stream);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
    (void)stream;
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
    (void)flags;
    *event = reinterpret_cast<cudaEvent_t>(new char);
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event)
{
    delete reinterpret_cast<char *>(event);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
    (void)stream;
    return event ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
    return event ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaMalloc(void **ptr, size_t size)
{
    *ptr = nullptr;
    if (size > kDeviceBytes - g_allocated) return fail(cudaErrorMemoryAllocation);
    void *p = nullptr;
    if (posix_memalign(&p, 256, size ? size : 1) != 0) return fail(cudaErrorMemoryAllocation);
    g_device_allocs[p] = size;
    g_allocated += size;
    *ptr = p;
    return cudaSuccess;
}

cudaError_t cudaFree(void *ptr)
{
    if (!ptr) return cudaSuccess;
    auto it = g_device_allocs.find(ptr);
    if (it == g_device_allocs.end()) return fail(cudaErrorInvalidDevicePointer);
    g_allocated -= it->second;
    g_device_allocs.erase(it);
    free(ptr);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **ptr, size_t size)
{
    if (posix_memalign(ptr, 4096, size ? size : 1) != 0) return fail(cudaErrorMemoryAllocation);
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *ptr)
{
    free(ptr);
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
    (void)flags;
    return ptr && size ? cudaSuccess : fail(cudaErrorInvalidValue);
}

cudaError_t cudaHostUnregister(void *ptr)
{
    return ptr ? cudaSuccess : fail(cudaErrorInvalidValue);
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total)
{
    *free_bytes = kDeviceBytes - g_allocated;
    *total = kDeviceBytes;
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream)
{
    (void)kind;
    (void)stream;
    if (count && (!dst || !src)) return fail(cudaErrorInvalidValue);
    memcpy(dst, src, count);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    return cudaMemcpyAsync(dst, src, count, kind, nullptr);
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

const char *cudaGetErrorString(cudaError_t error)
{
    switch (error) {
    case cudaSuccess:
        return "no error";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInvalidValue:
        return "invalid argument";
    default:
        return "emulated CUDA error";
    }
}

const char *cudaGetErrorName(cudaError_t error)
{
    switch (error) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    default:
        return "cudaErrorEmulated";
    }
}

} /* extern "C" */
