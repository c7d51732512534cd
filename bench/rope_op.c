// Rope-op micro-benchmark on the CPU: time of one GGML_OP_ROPE node for LLaMA shapes.
//
// Built twice by bench/rope_op.sh: against the unpatched ggml (bench/build-stock.sh) and against
// the patched one with -DGGUFROPE (which adds the NTK table and log-n variants). Prints one line per
// case: "<variant> head_dim=<d> n_tokens=<t> <microseconds per op, median of 7 batches>".
//
// Count mode, for instruction counts under valgrind (bench/rope_op_callgrind.sh):
//     rope_op <threads> <head_dim> <n_tokens> <variant 0|1|2> <n_ops>
// builds that one case and computes the node n_ops times (no timing, no warm-up).

#include "ggml.h"
#include "ggml-cpu.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec*1e6 + ts.tv_nsec*1e-3;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// variant: 0 plain, 1 freq factors (the NTK table), 2 freq factors + log-n
// n_ops > 0: count mode (compute n_ops times, return 0)
static double bench(int head_dim, int n_tokens, int variant, int n_threads, int n_ops) {
    struct ggml_init_params params = { (size_t) 4*head_dim*32*n_tokens*4 + 64*1024*1024, NULL, false };
    struct ggml_context * ctx = ggml_init(params);

    struct ggml_tensor * a   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head_dim, 32, n_tokens);
    struct ggml_tensor * pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens);
    struct ggml_tensor * ff  = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, head_dim/2);
    float * x = (float *) a->data;
    for (int64_t i = 0; i < ggml_nelements(a); i++) {
        x[i] = (float) rand() / RAND_MAX - 0.5f;
    }
    for (int i = 0; i < n_tokens; i++) {
        ((int32_t *) pos->data)[i] = 8000 + i; // straddles L = 8192
    }
    for (int i = 0; i < head_dim/2; i++) {
        ((float *) ff->data)[i] = 1.0f + (float) i/head_dim;
    }

    struct ggml_tensor * r = ggml_rope_ext(ctx, a, pos, variant ? ff : NULL, head_dim, GGML_ROPE_TYPE_NORMAL, 8192,
                                           100000.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
#ifdef GGUFROPE
    if (variant == 2) {
        r = ggml_rope_set_logn(r, 8192);
    }
#endif
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, r);

    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    struct ggml_threadpool * tp = ggml_threadpool_new(&tpp);
    struct ggml_cplan plan = ggml_graph_plan(g, n_threads, tp);
    uint8_t * work = (uint8_t *) malloc(plan.work_size + 1);
    plan.work_data = work;

    if (n_ops > 0) {
        for (int i = 0; i < n_ops; i++) {
            ggml_graph_compute(g, &plan);
        }
        free(work);
        ggml_threadpool_free(tp);
        ggml_free(ctx);
        return 0.0;
    }

    const int iters = n_tokens == 1 ? 20000 : 200;
    double t[7];
    ggml_graph_compute(g, &plan); // warm up
    for (int b = 0; b < 7; b++) {
        const double t0 = now_us();
        for (int i = 0; i < iters; i++) {
            ggml_graph_compute(g, &plan);
        }
        t[b] = (now_us() - t0) / iters;
    }
    qsort(t, 7, sizeof(double), cmp_double);
    free(work);
    ggml_threadpool_free(tp);
    ggml_free(ctx);
    return t[3];
}

int main(int argc, char ** argv) {
    const int n_threads = argc > 1 ? atoi(argv[1]) : 2;
    ggml_cpu_init();
#ifdef GGUFROPE
    const int n_variants = 3;
#else
    const int n_variants = 2;
#endif
    const char * names[3] = { "plain", "table", "table+logn" };
    if (argc == 6) {
        const int v = atoi(argv[4]);
        if (v < 0 || v >= n_variants) {
            fprintf(stderr, "rope_op: variant %d not in this build\n", v);
            return 2;
        }
        bench(atoi(argv[2]), atoi(argv[3]), v, n_threads, atoi(argv[5]));
        printf("%s head_dim=%s n_tokens=%s computed %s times\n", names[v], argv[2], argv[3], argv[5]);
        return 0;
    }
    for (int d = 64; d <= 128; d *= 2) {
        for (int t = 1; t <= 512; t *= 512) {
            for (int v = 0; v < n_variants; v++) {
                printf("%s head_dim=%d n_tokens=%d %.3f\n", names[v], d, t, bench(d, t, v, n_threads, 0));
                fflush(stdout);
            }
        }
    }
    return 0;
}
