// emu_runtime.h: the fiber runtime of gpt2np's CUDA emulator (included by cuda_emu.h; one copy is
// compiled into every emulated module, so all state below is per module). It DEFINES its globals:
// include it in exactly one translation unit (emulator.py compiles each module as one).
//
// Every CUDA thread of a block is a fiber: a 64 KiB stack (with a guard page below it) and a
// saved stack pointer. A block runs on the calling OS thread: the fibers run round-robin in
// schedule order ("forward": thread 0, 1, ...; "reverse": last thread first) and each one runs
// until it blocks at a block barrier or a warp collective, or returns. The last arriver of a
// barrier/collective releases the others; every fiber then yields, so each phase between two
// barriers again runs in schedule order. When no fiber can run but some have not returned, the
// block is deadlocked (a barrier or warp collective reached by only part of its threads): the
// launch stops with an error naming the kernel, block and thread, instead of hanging.
//
// Context switch: hand-written x86-64 assembly (callee-saved registers + stack pointer, ~a few
// ns); on other architectures the portable but slower ucontext (swapcontext) is used.
// Faults inside a kernel (SIGSEGV, SIGBUS, SIGFPE, SIGILL) and fiber stack overflow are caught
// while a launch runs and turned into the same kind of error: the handler runs on an alternate
// signal stack and switches straight back to the scheduler, abandoning the faulting fiber, so the
// process (and later launches) go on. For SIGSEGV/SIGBUS it also records the faulting address and
// whether it was a read or a write (gpt2np_emu_last_fault), which emulator.py maps to the device
// buffer whose guard page was hit.
#pragma once

#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <sys/ucontext.h>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <pthread.h>
// x86-64 switches contexts with the assembly below; elsewhere (or with -DGPT2NP_EMU_UCONTEXT,
// which the tests use to keep this path working) with ucontext.
#if defined(__x86_64__) && !defined(GPT2NP_EMU_UCONTEXT)
#define EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace __emu {

constexpr unsigned kStackBytes = 64 * 1024;      // per CUDA thread
constexpr unsigned kGuardBytes = 4096;           // PROT_NONE page below each stack
constexpr unsigned kMaxThreads = 1024;           // per block
constexpr unsigned kMaxDynSmem = 232448;         // 227 KiB, as an H100's opt-in maximum
constexpr unsigned kValueBytes = 16;             // largest value a warp shuffle moves

enum : uint8_t { RUNNABLE = 0, BLOCKED = 1, EXITED = 2 };
enum : uint8_t { WAIT_NONE = 0, WAIT_BLOCK = 1, WAIT_WARP = 2 };

// Warp collectives. Lanes meeting in one collective must name the same kind, mask and width.
enum : uint8_t {
    OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_ALL, OP_ANY, OP_BALLOT, OP_SYNCWARP,
    OP_REDUCE_ADD_I, OP_REDUCE_ADD_U, OP_REDUCE_MIN_I, OP_REDUCE_MIN_U, OP_REDUCE_MAX_I,
    OP_REDUCE_MAX_U, OP_REDUCE_AND, OP_REDUCE_OR, OP_REDUCE_XOR, OP_MATCH_ANY, OP_MATCH_ALL,
    OP_WMMA_LOAD, OP_WMMA_STORE, OP_WMMA_MMA,
    OP_COUNT
};
static const char* const kOpNames[OP_COUNT] = {
    "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__all_sync",
    "__any_sync", "__ballot_sync", "__syncwarp", "__reduce_add_sync", "__reduce_add_sync",
    "__reduce_min_sync", "__reduce_min_sync", "__reduce_max_sync", "__reduce_max_sync",
    "__reduce_and_sync", "__reduce_or_sync", "__reduce_xor_sync", "__match_any_sync",
    "__match_all_sync", "wmma::load_matrix_sync", "wmma::store_matrix_sync", "wmma::mma_sync"};

// Block barriers: __syncthreads and its predicate-reducing variants.
enum : uint8_t { BAR_SYNC, BAR_COUNT, BAR_AND, BAR_OR };
static const char* const kBarNames[4] = {"__syncthreads", "__syncthreads_count",
                                         "__syncthreads_and", "__syncthreads_or"};

struct Fiber {
    void* sp;               // saved stack pointer (x86-64 switch)
    uint3 tid;              // threadIdx
    unsigned linear;        // x + y*bx + z*bx*by: warp = linear / 32, lane = linear % 32
    unsigned pos;           // position in schedule order
    uint8_t state;          // RUNNABLE, BLOCKED or EXITED
    uint8_t wait;           // what a BLOCKED fiber waits at
    uint8_t kind;           // its barrier flavour or warp collective
    unsigned mask;          // its warp collective's mask (existing lanes only)
    int arg;                // shuffle lane/delta/xor mask, or a predicate
    alignas(16) unsigned char in[kValueBytes];   // value handed to a collective
    alignas(16) unsigned char out[kValueBytes];  // value it receives
#if !defined(EMU_ASM_SWITCH)
    ucontext_t uc;
#endif
};

struct WarpOp {              // a warp collective some lanes have reached
    unsigned mask;           // lanes taking part (existing lanes only)
    unsigned arrived;        // lanes already there
    uint8_t kind;
    uint8_t size;            // sizeof the value type
    uint8_t width;           // shuffle segment width
};

struct Warp {
    unsigned exist;          // lanes that exist (the last warp of a block can be partial)
    unsigned nops;
    WarpOp ops[32];          // pending collectives, with pairwise disjoint masks
};

// ---- module state (one launch at a time; the Python side holds a lock per module) ----
Fiber* g_fibers = nullptr;
unsigned g_capacity = 0;          // fibers (and stacks) allocated
char* g_stacks = nullptr;
size_t g_stacks_bytes = 0;
unsigned g_order[kMaxThreads];    // g_order[pos] = fiber index
Warp g_warps[kMaxThreads / 32];
unsigned g_n = 0, g_live = 0, g_runnable = 0;
Fiber* g_cur = nullptr;
volatile bool g_in_fiber = false;
unsigned g_bar_arrived = 0;
uint8_t g_bar_kind = BAR_SYNC;
int g_bar_accum = 0, g_bar_result = 0;
const char* g_kernel_name = "";
void* g_kernel = nullptr;
void (*g_invoke)() = nullptr;
void** g_args = nullptr;
bool g_has_error = false;
char g_error[4096];
void* g_fault_addr = nullptr;     // SIGSEGV/SIGBUS address of the last launch's fault
int g_fault_access = 0;           // 0 none, 1 read, 2 write, 3 unknown (see gpt2np_emu_last_fault)
// extern __shared__ memory: each launch's bytes (rounded up to kDynSmemAlign, the alignment kernels may assume: WMMA
// needs 32 bytes) end where a PROT_NONE page starts, so a kernel that reads or writes past the dynamic shared memory
// its launch asked for faults here (on a GPU it would read or corrupt other memory silently); a write into the
// rounding's slack is found after the block by its canary bytes (fill_shared). g_dyn_smem_guard: that page; the
// region before it holds kMaxDynSmem.
constexpr unsigned kDynSmemAlign = 128;
unsigned char* g_dyn_smem = nullptr;
unsigned char* g_dyn_smem_guard = nullptr;
size_t g_page_bytes = 0;          // the guard page's size (read once: sysconf is not for a signal handler)
unsigned long long g_dyn_smem_bytes = 0;
alignas(16) unsigned char g_altstack[64 * 1024];
unsigned g_wmma_layout = 0;       // which element layout WMMA fragments use this launch (include/mma.h)
int g_wmma_tf32 = 1;              // 0: WMMA in fp32, a test aid (include/mma.h)

// Static __shared__ variables live in this section; the linker brackets it.
__attribute__((section("emu_shared"), used)) char g_shared_anchor[16];
extern "C" char __start_emu_shared[] __attribute__((visibility("hidden")));
extern "C" char __stop_emu_shared[] __attribute__((visibility("hidden")));

// ---------------------------------------------------------------- context switch ----------
#if defined(EMU_ASM_SWITCH)
extern "C" void __emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .globl __emu_switch
    .hidden __emu_switch
    .type __emu_switch, @function
__emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size __emu_switch, .-__emu_switch
)");
void* g_sched_sp = nullptr;
#else
ucontext_t g_sched_uc;
#endif

[[noreturn]] void fiber_main();

inline void switch_fiber(Fiber* from, Fiber* to) {
    asm volatile("" ::: "memory");
#if defined(EMU_ASM_SWITCH)
    __emu_switch(&from->sp, to->sp);
#else
    swapcontext(&from->uc, &to->uc);
#endif
    asm volatile("" ::: "memory");
}

inline void switch_to_scheduler(Fiber* from) {
    asm volatile("" ::: "memory");
#if defined(EMU_ASM_SWITCH)
    __emu_switch(&from->sp, g_sched_sp);
#else
    swapcontext(&from->uc, &g_sched_uc);
#endif
    __builtin_unreachable();  // the scheduler never resumes a fiber it was handed back from
}

inline void enter_from_scheduler(Fiber* to) {
    asm volatile("" ::: "memory");
#if defined(EMU_ASM_SWITCH)
    __emu_switch(&g_sched_sp, to->sp);
#else
    swapcontext(&g_sched_uc, &to->uc);
#endif
    asm volatile("" ::: "memory");
}

inline char* stack_base(unsigned i) {   // lowest usable byte of fiber i's stack
    return g_stacks + (size_t)i * (kStackBytes + kGuardBytes) + kGuardBytes;
}

inline void prepare_fiber(unsigned i) {
    Fiber* f = &g_fibers[i];
#if defined(EMU_ASM_SWITCH)
    uintptr_t* sp = (uintptr_t*)(stack_base(i) + kStackBytes);
    *--sp = 0;                             // fiber_main's (never used) return address
    *--sp = (uintptr_t)&fiber_main;        // where __emu_switch's ret goes
    for (int r = 0; r < 6; r++) *--sp = 0; // rbp rbx r12 r13 r14 r15
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = stack_base(i);
    f->uc.uc_stack.ss_size = kStackBytes;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, (void (*)())fiber_main, 0);
#endif
}

// ---------------------------------------------------------------- errors -------------------
inline int describe_thread(char* buf, size_t n, const Fiber* f) {
    return snprintf(buf, n, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u)", g_kernel_name,
                    blockIdx.x, blockIdx.y, blockIdx.z, f->tid.x, f->tid.y, f->tid.z);
}

inline void vset_error(const Fiber* f, const char* fmt, va_list ap) {
    int k = 0;
    if (f) {
        k = describe_thread(g_error, sizeof g_error, f);
        if (k < 0) k = 0;
        if ((size_t)k < sizeof g_error - 2) { g_error[k++] = ':'; g_error[k++] = ' '; }
    }
    if ((size_t)k < sizeof g_error) vsnprintf(g_error + k, sizeof g_error - k, fmt, ap);
    g_has_error = true;
}

inline void set_error(const Fiber* f, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset_error(f, fmt, ap);
    va_end(ap);
}

// Stop the launch from inside a fiber: record the message and go back to the scheduler.
[[noreturn]] inline void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset_error(g_cur, fmt, ap);
    va_end(ap);
    switch_to_scheduler(g_cur);
}

[[noreturn]] inline void assert_fail(const char* expr, const char* file, int line) {
    fail("assertion '%s' failed at %s:%d", expr, file, line);
}

// ---------------------------------------------------------------- scheduling ---------------
// Run the next runnable fiber after the current one in schedule order (the current one last).
inline void yield() {
    Fiber* cur = g_cur;
    if (g_runnable == 0) switch_to_scheduler(cur);   // all done, or deadlock
    const unsigned n = g_n;
    unsigned q = cur->pos;
    for (unsigned k = 0; k < n; k++) {
        if (++q == n) q = 0;
        Fiber* f = &g_fibers[g_order[q]];
        if (f->state == RUNNABLE) {
            if (f != cur) {
                g_cur = f;
                threadIdx = f->tid;
                switch_fiber(cur, f);
            }
            return;
        }
    }
    switch_to_scheduler(cur);
}

[[noreturn]] inline void fiber_main() {
    g_invoke();
    Fiber* f = g_cur;
    f->state = EXITED;
    g_live--;
    g_runnable--;
    yield();                     // never comes back: nobody resumes an exited fiber
    __builtin_trap();
}

inline void block(Fiber* f, uint8_t wait, uint8_t kind) {
    f->state = BLOCKED;
    f->wait = wait;
    f->kind = kind;
    g_runnable--;
}

inline void release(Fiber* f) {
    f->state = RUNNABLE;
    f->wait = WAIT_NONE;
    g_runnable++;
}

// __syncthreads and friends: every thread of the block must arrive (exited ones included).
inline int block_barrier(uint8_t kind, int pred) {
    Fiber* f = g_cur;
    if (g_bar_arrived == 0) {
        g_bar_kind = kind;
        g_bar_accum = kind == BAR_AND ? 1 : 0;
    } else if (kind != g_bar_kind) {
        fail("reached %s while other threads of the block wait at %s", kBarNames[kind],
             kBarNames[g_bar_kind]);
    }
    if (kind == BAR_COUNT) g_bar_accum += pred != 0;
    else if (kind == BAR_AND) g_bar_accum &= pred != 0;
    else if (kind == BAR_OR) g_bar_accum |= pred != 0;
    block(f, WAIT_BLOCK, kind);
    if (++g_bar_arrived == g_n) {
        g_bar_arrived = 0;
        g_bar_result = g_bar_accum;
        for (unsigned i = 0; i < g_n; i++) release(&g_fibers[i]);
    }
    yield();
    return g_bar_result;   // stays valid until every thread has left this barrier
}

inline unsigned lane_of(const Fiber* f) { return f->linear & 31u; }

inline void complete_warp_op(unsigned w, WarpOp& op) {
    Fiber* lanes = g_fibers + (size_t)w * 32;
    const unsigned m = op.mask;
    const unsigned width = op.width;
    const unsigned size = op.size;
    switch (op.kind) {
    case OP_SHFL_IDX: case OP_SHFL_UP: case OP_SHFL_DOWN: case OP_SHFL_XOR:
        for (unsigned l = 0; l < 32; l++) {
            if (!(m >> l & 1u)) continue;
            const unsigned seg = l & ~(width - 1);
            const int a = lanes[l].arg;
            unsigned src = l;
            if (op.kind == OP_SHFL_IDX) src = seg + ((unsigned)a & (width - 1));
            else if (op.kind == OP_SHFL_UP) src = (l - seg) >= (unsigned)a ? l - a : l;
            else if (op.kind == OP_SHFL_DOWN) src = (l - seg) + (unsigned)a < width ? l + a : l;
            else { src = l ^ (unsigned)a; if (src >= seg + width) src = l; }
            if (src < 32 && (m >> src & 1u)) memcpy(lanes[l].out, lanes[src].in, size);
            else memset(lanes[l].out, 0xFF, size);   // source lane not taking part: undefined
        }
        break;
    case OP_ALL: case OP_ANY: case OP_BALLOT: {
        unsigned ballot = 0;
        for (unsigned l = 0; l < 32; l++)
            if ((m >> l & 1u) && lanes[l].arg) ballot |= 1u << l;
        unsigned r = op.kind == OP_BALLOT ? ballot : op.kind == OP_ALL ? (ballot == m) : (ballot != 0);
        for (unsigned l = 0; l < 32; l++)
            if (m >> l & 1u) memcpy(lanes[l].out, &r, 4);
        break;
    }
    case OP_SYNCWARP:
        break;
    case OP_WMMA_LOAD: case OP_WMMA_STORE: case OP_WMMA_MMA: {
        // a warp-wide WMMA operation (include/mma.h): each lane handed in a pointer to its request
        // and the function that completes the operation for the whole warp; it runs once, here,
        // while every lane waits, so it may read and write every lane's fragment.
        void* requests[32];
        void (*finish)(void* const*) = nullptr;
        for (unsigned l = 0; l < 32; l++) {
            memcpy(&requests[l], lanes[l].in, sizeof(void*));
            void (*fn)(void* const*);
            memcpy(&fn, lanes[l].in + sizeof(void*), sizeof fn);
            if (finish && fn != finish)
                fail("lanes of warp %u reached %s with different fragment types or layouts: every "
                     "lane of the warp must call the same WMMA operation", w, kOpNames[op.kind]);
            finish = fn;
        }
        finish(requests);
        break;
    }
    case OP_MATCH_ANY: case OP_MATCH_ALL: {
        bool all_equal = true;
        unsigned first = __builtin_ctz(m);
        for (unsigned l = 0; l < 32; l++) {
            if (!(m >> l & 1u)) continue;
            unsigned same = 0;
            for (unsigned k = 0; k < 32; k++)
                if ((m >> k & 1u) && memcmp(lanes[l].in, lanes[k].in, size) == 0) same |= 1u << k;
            memcpy(lanes[l].out, &same, 4);
            if (memcmp(lanes[l].in, lanes[first].in, size) != 0) all_equal = false;
        }
        if (op.kind == OP_MATCH_ALL)
            for (unsigned l = 0; l < 32; l++)
                if (m >> l & 1u) {
                    unsigned r = all_equal ? m : 0u;
                    memcpy(lanes[l].out, &r, 4);
                    lanes[l].arg = all_equal;
                }
        break;
    }
    default: {   // integer reductions over 32-bit values
        uint32_t acc = 0;
        bool started = false;
        for (unsigned l = 0; l < 32; l++) {
            if (!(m >> l & 1u)) continue;
            uint32_t v;
            memcpy(&v, lanes[l].in, 4);
            if (!started) { acc = v; started = true; continue; }
            switch (op.kind) {
            case OP_REDUCE_ADD_I: case OP_REDUCE_ADD_U: acc += v; break;
            case OP_REDUCE_MIN_I: acc = (int32_t)v < (int32_t)acc ? v : acc; break;
            case OP_REDUCE_MIN_U: acc = v < acc ? v : acc; break;
            case OP_REDUCE_MAX_I: acc = (int32_t)v > (int32_t)acc ? v : acc; break;
            case OP_REDUCE_MAX_U: acc = v > acc ? v : acc; break;
            case OP_REDUCE_AND: acc &= v; break;
            case OP_REDUCE_OR: acc |= v; break;
            case OP_REDUCE_XOR: acc ^= v; break;
            }
        }
        for (unsigned l = 0; l < 32; l++)
            if (m >> l & 1u) memcpy(lanes[l].out, &acc, 4);
    }
    }
    for (unsigned l = 0; l < 32; l++)
        if (m >> l & 1u) release(&lanes[l]);
}

// A lane arrives at a warp collective; returns once every lane named in mask has arrived and
// the results are computed. `in` is copied before blocking and `out` read after.
inline void warp_collective(uint8_t kind, unsigned mask, const void* in, unsigned size, int arg,
                            int width) {
    Fiber* f = g_cur;
    const unsigned lane = lane_of(f), w = f->linear >> 5;
    Warp& warp = g_warps[w];
    if (!(mask >> lane & 1u))
        fail("%s called with mask 0x%08x that does not include the calling lane %u",
             kOpNames[kind], mask, lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail("%s: width %d is not a power of two in [1, 32]", kOpNames[kind], width);
    const unsigned eff = mask & warp.exist;
    WarpOp* op = nullptr;
    for (unsigned k = 0; k < warp.nops; k++) {
        if (warp.ops[k].mask & eff) { op = &warp.ops[k]; break; }
    }
    if (op) {
        if (op->mask != eff || op->kind != kind || op->width != width || op->size != size)
            fail("reached %s(mask 0x%08x, width %d) in warp %u while lanes 0x%08x of the warp wait "
                 "at %s(mask 0x%08x, width %d): lanes of a warp must meet at the same collective "
                 "with the same mask",
                 kOpNames[kind], mask, width, w, op->arrived, kOpNames[op->kind], op->mask,
                 (int)op->width);
    } else {
        op = &warp.ops[warp.nops++];
        op->mask = eff;
        op->arrived = 0;
        op->kind = kind;
        op->size = (uint8_t)size;
        op->width = (uint8_t)width;
    }
    memcpy(f->in, in, size);
    f->arg = arg;
    f->mask = eff;
    op->arrived |= 1u << lane;
    block(f, WAIT_WARP, kind);
    if (op->arrived == op->mask) {
        complete_warp_op(w, *op);
        *op = warp.ops[--warp.nops];
    }
    yield();
}

// Called by the scheduler when no fiber can run but some have not returned.
inline void report_deadlock() {
    const Fiber* stuck = nullptr;
    for (unsigned p = 0; p < g_n && !stuck; p++) {
        const Fiber* f = &g_fibers[g_order[p]];
        if (f->state == BLOCKED) stuck = f;
    }
    if (!stuck) { set_error(nullptr, "kernel '%s': scheduler lost its fibers", g_kernel_name); return; }
    auto doing = [](const Fiber* o, char* buf, size_t n) {
        if (o->state == EXITED) snprintf(buf, n, "has returned");
        else if (o->wait == WAIT_BLOCK) snprintf(buf, n, "waits at %s", kBarNames[o->kind]);
        else snprintf(buf, n, "waits at %s(mask 0x%08x)", kOpNames[o->kind], o->mask);
    };
    char other[160], what[128];
    if (stuck->wait == WAIT_BLOCK) {
        unsigned at = 0;
        const Fiber* miss = nullptr;
        for (unsigned i = 0; i < g_n; i++) {
            const Fiber* o = &g_fibers[i];
            if (o->state == BLOCKED && o->wait == WAIT_BLOCK) at++;
            else if (!miss) miss = o;
        }
        doing(miss, what, sizeof what);
        snprintf(other, sizeof other, "thread (%u,%u,%u) %s", miss->tid.x, miss->tid.y,
                 miss->tid.z, what);
        set_error(stuck, "%s reached by only %u of the block's %u threads (%s); every thread "
                  "of the block must reach each barrier", kBarNames[stuck->kind], at, g_n, other);
    } else {
        const unsigned w = stuck->linear >> 5;
        const Fiber* lanes = g_fibers + (size_t)w * 32;
        unsigned at = 0, total = __builtin_popcount(stuck->mask);
        const Fiber* miss = nullptr;
        for (unsigned l = 0; l < 32; l++) {
            if (!(stuck->mask >> l & 1u)) continue;
            const Fiber* o = &lanes[l];
            if (o->state == BLOCKED && o->wait == WAIT_WARP && o->kind == stuck->kind &&
                o->mask == stuck->mask) at++;
            else if (!miss) miss = o;
        }
        if (miss) {
            doing(miss, what, sizeof what);
            snprintf(other, sizeof other, "lane %u = thread (%u,%u,%u) %s", lane_of(miss),
                     miss->tid.x, miss->tid.y, miss->tid.z, what);
        } else {
            snprintf(other, sizeof other, "?");
        }
        set_error(stuck, "%s(mask 0x%08x) in warp %u reached by only %u of the %u lanes it names "
                  "(%s); every named lane must reach the same warp collective",
                  kOpNames[stuck->kind], stuck->mask, w, at, total, other);
    }
}

// ---------------------------------------------------------------- faults -------------------
struct sigaction g_old_actions[4];
static const int g_fault_signals[4] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
stack_t g_old_altstack;

pthread_t g_launch_thread;

// 1 read, 2 write, 3 unknown: the x86-64 page-fault error code says which (bit 1 = write).
inline int fault_access(void* ctx) {
#if defined(__x86_64__) && defined(REG_ERR)
    const ucontext_t* uc = (const ucontext_t*)ctx;
    return (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 2 : 1;
#else
    (void)ctx;
    return 3;
#endif
}

inline void on_fault(int sig, siginfo_t* info, void* ctx) {
    if (!g_in_fiber || !g_cur || !pthread_equal(pthread_self(), g_launch_thread)) {
        for (int k = 0; k < 4; k++)   // not ours: put the old handlers back and let it re-fault
            if (g_fault_signals[k] == sig) sigaction(sig, &g_old_actions[k], nullptr);
        return;
    }
    Fiber* f = g_cur;
    char* addr = (char*)info->si_addr;
    if (sig == SIGFPE) {
        set_error(f, "arithmetic exception (SIGFPE: integer division by zero?)");
    } else if (sig == SIGILL) {
        set_error(f, "illegal instruction (SIGILL)");
    } else {
        bool overflow = false;
        if (addr >= g_stacks && addr < g_stacks + g_stacks_bytes) {
            size_t off = (size_t)(addr - g_stacks) % (kStackBytes + kGuardBytes);
            overflow = off < kGuardBytes;
        }
        if (overflow)
            set_error(f, "fiber stack overflow (each emulated thread has %u KiB of stack: "
                      "very large local arrays?)", kStackBytes / 1024);
        else if (g_dyn_smem_guard && addr >= (char*)g_dyn_smem_guard
                 && addr < (char*)g_dyn_smem_guard + g_page_bytes)
            set_error(f, "%s of dynamic shared memory at byte %lld, past the %llu bytes "
                      "the launch gave (its shared_mem argument)",
                      fault_access(ctx) == 2 ? "write" : fault_access(ctx) == 1 ? "read" : "access",
                      (long long)(addr - (char*)g_dyn_smem), g_dyn_smem_bytes);
        else {
            g_fault_addr = addr;
            g_fault_access = fault_access(ctx);
            set_error(f, "invalid memory access at address %p (%s: out-of-bounds index or bad "
                      "pointer)", (void*)addr, sig == SIGBUS ? "SIGBUS" : "SIGSEGV");
        }
    }
    g_in_fiber = false;
    switch_to_scheduler(f);   // abandon the handler frame (on the alternate stack) and the fiber
}

inline void install_fault_handlers() {
    g_launch_thread = pthread_self();
    stack_t ss;
    ss.ss_sp = g_altstack;
    ss.ss_size = sizeof g_altstack;
    ss.ss_flags = 0;
    sigaltstack(&ss, &g_old_altstack);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int k = 0; k < 4; k++) sigaction(g_fault_signals[k], &sa, &g_old_actions[k]);
}

inline void restore_fault_handlers() {
    for (int k = 0; k < 4; k++) sigaction(g_fault_signals[k], &g_old_actions[k], nullptr);
    sigaltstack(&g_old_altstack, nullptr);
}

// ---------------------------------------------------------------- launch -------------------
struct LaunchConfig {          // mirrored by ctypes in emulator.py
    unsigned grid[3];
    unsigned block[3];
    unsigned long long shared_mem;
    int schedule;              // 0 forward, 1 reverse
    unsigned wmma_layout;      // WMMA fragment element layout: 0 natural, else a seed (include/mma.h)
    int wmma_tf32;             // 1: WMMA inputs are TF32 (the hardware); 0: fp32 (a test aid)
};

// The dynamic shared memory region and its guard page, made once.
inline bool ensure_dyn_smem() {
    if (g_dyn_smem_guard) return true;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t data = ((size_t)kMaxDynSmem + page - 1) / page * page;
    void* mem = mmap(nullptr, data + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return false;
    if (mprotect((char*)mem + data, page, PROT_NONE) != 0) {
        munmap(mem, data + page);
        return false;
    }
    g_dyn_smem_guard = (unsigned char*)mem + data;
    g_page_bytes = page;
    return true;
}

inline bool ensure_capacity(unsigned n) {
    if (n <= g_capacity) return true;
    unsigned cap = (n + 31) & ~31u;
    size_t bytes = (size_t)cap * (kStackBytes + kGuardBytes);
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (mem == MAP_FAILED) return false;
    for (unsigned i = 0; i < cap; i++)
        mprotect((char*)mem + (size_t)i * (kStackBytes + kGuardBytes), kGuardBytes, PROT_NONE);
    if (g_stacks) munmap(g_stacks, g_stacks_bytes);
    delete[] g_fibers;
    g_stacks = (char*)mem;
    g_stacks_bytes = bytes;
    g_fibers = new Fiber[cap];
    g_capacity = cap;
    return true;
}

constexpr unsigned char kDynSmemCanary = 0xA5;

inline void fill_shared() {
    memset(__start_emu_shared, 0xFF, (size_t)(__stop_emu_shared - __start_emu_shared));
    memset(g_dyn_smem, 0xFF, g_dyn_smem_bytes);
    // the bytes between the launch's shared_mem and the guard page (its rounding to kDynSmemAlign): a canary,
    // checked after the block, so that a write past shared_mem that stops short of the guard page is found too
    memset(g_dyn_smem + g_dyn_smem_bytes, kDynSmemCanary, (size_t)(g_dyn_smem_guard - g_dyn_smem) - g_dyn_smem_bytes);
}

// After a block: the first byte of the rounding slack past shared_mem that a thread wrote, or -1.
inline long long dyn_smem_slack_written() {
    const size_t slack = (size_t)(g_dyn_smem_guard - g_dyn_smem) - g_dyn_smem_bytes;
    for (size_t i = 0; i < slack; i++)
        if (g_dyn_smem[g_dyn_smem_bytes + i] != kDynSmemCanary) return (long long)(g_dyn_smem_bytes + i);
    return -1;
}

// Runs one block; returns false on error (message in g_error).
inline bool run_block() {
    const unsigned n = g_n;
    for (unsigned i = 0; i < n; i++) {
        Fiber* f = &g_fibers[i];
        f->state = RUNNABLE;
        f->wait = WAIT_NONE;
        prepare_fiber(i);
    }
    for (unsigned w = 0; w < (n + 31) / 32; w++) g_warps[w].nops = 0;
    g_live = g_runnable = n;
    g_bar_arrived = 0;
    fill_shared();
    Fiber* first = &g_fibers[g_order[0]];
    g_cur = first;
    threadIdx = first->tid;
    g_in_fiber = true;
    enter_from_scheduler(first);
    g_in_fiber = false;
    g_cur = nullptr;
    if (g_has_error) return false;
    if (g_live > 0) { report_deadlock(); return false; }
    const long long written = dyn_smem_slack_written();
    if (written >= 0) {
        set_error(nullptr, "kernel '%s' block (%u,%u,%u): write of dynamic shared memory at byte %lld, past the %llu "
                  "bytes the launch gave (its shared_mem argument; found after the block, thread unknown)",
                  g_kernel_name, blockIdx.x, blockIdx.y, blockIdx.z, written, g_dyn_smem_bytes);
        return false;
    }
    return true;
}

inline int run_grid(const LaunchConfig* c) {
    g_has_error = false;
    g_error[0] = 0;
    g_fault_addr = nullptr;
    g_fault_access = 0;
    const unsigned bx = c->block[0], by = c->block[1], bz = c->block[2];
    const unsigned long long n64 = (unsigned long long)bx * by * bz;
    if (n64 == 0 || n64 > kMaxThreads) {
        set_error(nullptr, "kernel '%s': %llu threads per block (must be 1..%u)", g_kernel_name,
                  n64, kMaxThreads);
        return 1;
    }
    if (c->shared_mem > kMaxDynSmem) {
        set_error(nullptr, "kernel '%s': %llu bytes of dynamic shared memory (at most %u)",
                  g_kernel_name, c->shared_mem, kMaxDynSmem);
        return 1;
    }
    if (!ensure_dyn_smem()) {
        set_error(nullptr, "kernel '%s': cannot map the dynamic shared memory", g_kernel_name);
        return 1;
    }
    const unsigned n = (unsigned)n64;
    if (!ensure_capacity(n)) {
        set_error(nullptr, "kernel '%s': cannot allocate %u fiber stacks", g_kernel_name, n);
        return 1;
    }
    g_n = n;
    for (unsigned i = 0; i < n; i++) {
        Fiber* f = &g_fibers[i];
        f->linear = i;
        f->tid = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        const unsigned p = c->schedule == 1 ? n - 1 - i : i;
        f->pos = p;
        g_order[p] = i;
    }
    for (unsigned w = 0; w < (n + 31) / 32; w++) {
        const unsigned have = n - w * 32;
        g_warps[w].exist = have >= 32 ? 0xFFFFFFFFu : (1u << have) - 1u;
    }
    blockDim = dim3(bx, by, bz);
    gridDim = dim3(c->grid[0], c->grid[1], c->grid[2]);
    g_dyn_smem_bytes = c->shared_mem;
    g_dyn_smem = g_dyn_smem_guard - (c->shared_mem + kDynSmemAlign - 1) / kDynSmemAlign * kDynSmemAlign;
    g_wmma_layout = c->wmma_layout;
    g_wmma_tf32 = c->wmma_tf32;
    const unsigned long long gx = c->grid[0], gy = c->grid[1], gz = c->grid[2];
    const unsigned long long nblocks = gx * gy * gz;
    install_fault_handlers();
    int rc = 0;
    for (unsigned long long k = 0; k < nblocks; k++) {
        const unsigned long long b = c->schedule == 1 ? nblocks - 1 - k : k;
        blockIdx = uint3{(unsigned)(b % gx), (unsigned)((b / gx) % gy), (unsigned)(b / (gx * gy))};
        if (!run_block()) { rc = 1; break; }
    }
    restore_fault_handlers();
    fflush(stdout);
    return rc;
}

template <class... A, size_t... I>
inline void call_kernel(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <class... A>
inline void invoke_kernel() {
    call_kernel((void (*)(A...))g_kernel, g_args, std::index_sequence_for<A...>{});
}

template <class... A>
inline int launch(void (*kernel)(A...), const char* name, const LaunchConfig* c, void** args) {
    g_kernel_name = name;
    g_kernel = (void*)kernel;
    g_invoke = &invoke_kernel<A...>;
    g_args = args;
    return run_grid(c);
}

// ---------------------------------------------------------------- signatures ---------------
// Type codes read by emulator.py: f4 float, f8 double, iN/uN N-byte signed/unsigned integer,
// b1 bool, V<elem>x<n> CUDA vector type, v0 void, o<N> any other N-byte type.
// A parameter is "S:<code>" (by value), "P:<code>" (pointer) or "Pc:<code>" (pointer to const).
template <class T> struct vec_info { enum { n = 0 }; using elem = void; };

template <class T>
inline int elem_code(char* buf, size_t n) {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_void_v<U>) return snprintf(buf, n, "v0");
    else if constexpr (std::is_same_v<U, bool>) return snprintf(buf, n, "b1");
    else if constexpr (std::is_floating_point_v<U>) return snprintf(buf, n, "f%zu", sizeof(U));
    else if constexpr (std::is_integral_v<U>)
        return snprintf(buf, n, "%c%zu", std::is_signed_v<U> ? 'i' : 'u', sizeof(U));
    else if constexpr (vec_info<U>::n > 0) {
        int k = snprintf(buf, n, "V");
        k += elem_code<typename vec_info<U>::elem>(buf + k, n - k);
        return k + snprintf(buf + k, n - k, "x%d", vec_info<U>::n);
    } else if constexpr (std::is_enum_v<U>) {
        return snprintf(buf, n, "i%zu", sizeof(U));
    } else {
        return snprintf(buf, n, "o%zu", sizeof(U));
    }
}

template <class T>
inline int param_code(char* buf, size_t n) {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) {
        using E = std::remove_pointer_t<U>;
        int k = snprintf(buf, n, std::is_const_v<E> ? "Pc:" : "P:");
        if constexpr (std::is_pointer_v<E>) return k + snprintf(buf + k, n - k, "o%zu", sizeof(E));
        else return k + elem_code<E>(buf + k, n - k);
    } else {
        int k = snprintf(buf, n, "S:");
        return k + elem_code<U>(buf + k, n - k);
    }
}

template <class... A>
inline const char* signature(void (*)(A...)) {
    // per thread: ranks run as threads in the tests, and two of them asking at once must not share the buffer
    static thread_local char buf[2048];
    size_t k = 0;
    buf[0] = 0;
    ((k += (k ? snprintf(buf + k, sizeof buf - k, ",") : 0),
      k += param_code<A>(buf + k, sizeof buf - k)), ...);
    return buf;
}

}  // namespace __emu

extern "C" __attribute__((visibility("default"))) const char* gpt2np_emu_last_error() {
    return __emu::g_error;
}

// The last launch's memory fault: returns 0 (none), 1 (read), 2 (write) or 3 (unknown access)
// and stores the faulting address in *addr.
extern "C" __attribute__((visibility("default"))) int gpt2np_emu_last_fault(void** addr) {
    *addr = __emu::g_fault_addr;
    return __emu::g_fault_access;
}
