// The CUDA backend's fusion decisions for rope with log-n (patches/0001), run on the host without a GPU.
//
// This translation unit is the patched ggml-cuda/ggml-cuda.cu itself (included below) plus a main()
// that builds small graphs on the CPU buffer type and asks the backend's own ggml_cuda_can_fuse():
//   RMS_NORM+MUL+ROPE                 fuses without log-n, declines with log-n (the fused kernel has none)
//   RMS_NORM+MUL+ROPE+VIEW+SET_ROWS   the same
//   ROPE+VIEW+SET_ROWS                fuses with and without log-n (the rope kernels apply it)
// for NORMAL and NEOX rope. Nothing here touches a device: the decisions read tensor metadata only.
// Built and run by native/cuda-compile.sh (linked against the installed libggml-base/libggml-cpu; the
// rest of the CUDA backend stays unresolved and is never called). Prints one line per case and
// "result: ok" when every decision is the expected one (exit 0), else exit 1.

#include "ggml-cuda.cu"

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <cstdio>

static int g_failed = 0;

static void expect(const char * what, int mode, int n_ctx_logn, bool got, bool want) {
    printf("%s: %-34s mode=%-6s log-n=%-4d fuses=%d (expected %d)\n", got == want ? "ok" : "FAILED", what,
           mode == GGML_ROPE_TYPE_NEOX ? "neox" : "normal", n_ctx_logn, got, want);
    g_failed += got == want ? 0 : 1;
}

// q = rope(rms_norm(x) * w), optionally with log-n; then a K-cache-like SET_ROWS of the rope output
static void run_case(int mode, int n_ctx_logn) {
    const int64_t head_dim = 64, n_head = 4, n_tokens = 3;

    ggml_init_params ip = { 64 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * x    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, head_dim, n_head, n_tokens);
    ggml_tensor * w    = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, head_dim);
    ggml_tensor * pos  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens);
    ggml_tensor * dst  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, head_dim * n_head, 16);
    ggml_tensor * rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);

    ggml_tensor * norm = ggml_rms_norm(ctx, x, 1e-6f);
    ggml_tensor * mul  = ggml_mul(ctx, norm, w);
    ggml_tensor * rope = ggml_rope_ext(ctx, mul, pos, nullptr, (int) head_dim, mode, 8192, 10000.0f, 1.0f, 0.0f, 1.0f,
                                       0.0f, 0.0f);
    if (n_ctx_logn) {
        rope = ggml_rope_set_logn(rope, n_ctx_logn);
    }
    ggml_tensor * view = ggml_view_2d(ctx, rope, head_dim * n_head, n_tokens, rope->nb[2], 0);
    ggml_tensor * set  = ggml_set_rows(ctx, dst, view, rows);

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, set);

    // the memory-range check of ggml_cuda_can_fuse needs buffers: any host buffer type does
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    GGML_ASSERT(buf != nullptr);

    int i_norm = -1, i_rope = -1;
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        if (ggml_graph_node(gf, i) == norm) {
            i_norm = i;
        }
        if (ggml_graph_node(gf, i) == rope) {
            i_rope = i;
        }
    }
    GGML_ASSERT(i_norm >= 0 && i_rope == i_norm + 2 && ggml_graph_n_nodes(gf) == i_norm + 5);
    GGML_ASSERT(ggml_graph_node(gf, i_rope + 1)->op == GGML_OP_VIEW && ggml_graph_node(gf, i_rope + 2) == set);

    const bool logn = n_ctx_logn != 0;
    expect("RMS_NORM+MUL+ROPE", mode, n_ctx_logn,
           ggml_cuda_can_fuse(gf, i_norm, { GGML_OP_RMS_NORM, GGML_OP_MUL, GGML_OP_ROPE }, {}), !logn);
    expect("RMS_NORM+MUL+ROPE+VIEW+SET_ROWS", mode, n_ctx_logn,
           ggml_cuda_can_fuse(gf, i_norm, { GGML_OP_RMS_NORM, GGML_OP_MUL, GGML_OP_ROPE, GGML_OP_VIEW, GGML_OP_SET_ROWS }, {}),
           !logn);
    expect("ROPE+VIEW+SET_ROWS", mode, n_ctx_logn,
           ggml_cuda_can_fuse(gf, i_rope, { GGML_OP_ROPE, GGML_OP_VIEW, GGML_OP_SET_ROWS }, {}), true);

    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

int main() {
    for (int mode : { GGML_ROPE_TYPE_NORMAL, GGML_ROPE_TYPE_NEOX }) {
        for (int n_ctx_logn : { 0, 8192 }) {
            run_case(mode, n_ctx_logn);
        }
    }
    printf("result: %s\n", g_failed ? "FAILED" : "ok");
    return g_failed ? 1 : 0;
}
