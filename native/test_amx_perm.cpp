// The AMX permission and fallback logic of ggml-cpu/amx/amx.cpp (patches/0004), on any x86-64 host
// with AVX-512: this program is compiled together with the patched amx/amx.cpp (and amx/mmq.o) with
// the AMX compile flags and linked against the installed libggml-base and libggml-cpu (tests/test_amx.py
// does it). No tile instruction runs here; a host without AMX can run it.
//
//   test_amx_perm kernel   the kernel answers the XTILEDATA request (refused on a CPU without AMX)
//   test_amx_perm grant    the request is answered "granted" by this program
//   test_amx_perm refuse   the request is answered "refused" (EPERM) by this program
//
// amx.cpp asks with syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). The syscall()
// below is linked into the executable, so amx.cpp's call reaches it: it counts the requests per thread,
// and in grant/refuse mode answers as told; every other call (and kernel mode) goes to libc's.
// Prints one "key: value" line per fact and exits 0 when every check holds, 1 otherwise.

#include "ggml-backend.h"
#include "ggml.h"

#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

ggml_backend_buffer_type_t ggml_backend_amx_buffer_type(void);  // amx/amx.h
int ggml_amx_thread_init(void);                                  // amx/common.h (patch 0004)

static const long ARCH_REQ_XCOMP_PERM_ = 0x1023;
static const long XFEATURE_XTILEDATA_  = 18;

enum class perm_mode { kernel, grant, refuse };
static perm_mode g_mode = perm_mode::kernel;
static std::atomic<int> g_requests{0};
static thread_local int t_requests = 0;

extern "C" long syscall(long number, ...) noexcept {
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (long & x : a) {
        x = va_arg(ap, long);
    }
    va_end(ap);
    if (number == SYS_arch_prctl && a[0] == ARCH_REQ_XCOMP_PERM_ && a[1] == XFEATURE_XTILEDATA_) {
        g_requests++;
        t_requests++;
        if (g_mode == perm_mode::grant) {
            return 0;
        }
        if (g_mode == perm_mode::refuse) {
            errno = EPERM;
            return -1;
        }
    }
    using syscall_fn = long (*)(long, ...);
    static syscall_fn real = (syscall_fn) dlsym(RTLD_NEXT, "syscall");
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}

static std::vector<std::string> g_warnings;

static void log_cb(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) {
        g_warnings.emplace_back(text);
    }
}

static int g_failed = 0;

static void check(bool ok, const char * what) {
    printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    g_failed += ok ? 0 : 1;
}

int main(int argc, char ** argv) {
    const std::string m = argc > 1 ? argv[1] : "kernel";
    g_mode = m == "grant" ? perm_mode::grant : m == "refuse" ? perm_mode::refuse : perm_mode::kernel;
    ggml_log_set(log_cb, nullptr);

    // the buffer type is decided once: three calls, one request, the same answer
    ggml_backend_buffer_type_t b0 = ggml_backend_amx_buffer_type();
    ggml_backend_buffer_type_t b1 = ggml_backend_amx_buffer_type();
    ggml_backend_buffer_type_t b2 = ggml_backend_amx_buffer_type();
    printf("amx buffer type: %s\n", b0 ? "offered" : "not offered");
    printf("main thread requests: %d\n", t_requests);
    printf("warnings: %zu\n", g_warnings.size());
    for (const std::string & w : g_warnings) {
        printf("warning: %s", w.c_str());
    }
    check(b0 == b1 && b1 == b2, "the same answer on every call");
    check(t_requests == 1, "one request on the main thread for three calls");
    if (b0) {
        check(strcmp(ggml_backend_buft_name(b0), "AMX") == 0, "the buffer type is AMX");
        check(g_warnings.empty(), "no warning when granted");
    } else {
        check(g_warnings.size() == 1, "one warning when refused");
    }

    // every other thread asks for itself, once, however often it checks
    const int n_threads = 4;
    std::vector<std::thread> threads;
    std::vector<int> answers(n_threads, -1), counts(n_threads, -1);
    for (int i = 0; i < n_threads; i++) {
        threads.emplace_back([i, &answers, &counts] {
            int a = ggml_amx_thread_init();
            int b = ggml_amx_thread_init();
            int c = ggml_amx_thread_init();
            answers[i] = (a == b && b == c) ? a : -2;
            counts[i] = t_requests;
        });
    }
    for (auto & t : threads) {
        t.join();
    }
    bool once_each = true, consistent = true;
    for (int i = 0; i < n_threads; i++) {
        printf("thread %d: answer %d (%s), requests %d\n", i, answers[i],
               answers[i] > 0 ? strerror(answers[i]) : "granted", counts[i]);
        once_each = once_each && counts[i] == 1;
        consistent = consistent && answers[i] == (b0 ? 0 : answers[0]) && answers[i] >= 0;
    }
    check(once_each, "each worker thread made its own request, once");
    check(consistent, "each worker thread got the process's answer");
    check(g_requests == 1 + n_threads, "requests in all: one per thread");
    if (g_mode == perm_mode::grant) {
        check(b0 != nullptr, "granted: the AMX buffer type is offered");
    }
    if (g_mode == perm_mode::refuse) {
        check(b0 == nullptr, "refused: the AMX buffer type is not offered");
        check(answers[0] == EPERM, "refused: the worker threads see the refusal (EPERM)");
    }
    printf("result: %s\n", g_failed ? "FAILED" : "ok");
    return g_failed ? 1 : 0;
}
