// End-to-end instruction count driver for bench/decode_callgrind.sh (issue 5): one prefill of
// N tokens at positions P0..P0+N-1 on an empty context, then D single-token decodes, in one
// thread, CPU, flash attention on. Run under callgrind with --toggle-collect=llama_decode so that
// only the decoding is counted (not the model load).
//
//     decode_callgrind MODEL N P0 D [METHOD K B LOGN]
//
// METHOD K B LOGN (patched library only) are applied as kv overrides of the ggufrope keys:
// {arch}.rope.ntk.method (str), .factor (f32 K), .exponent (f32 B), {arch}.attention.logn_scaling
// (bool LOGN 0|1). P0 = 8192 puts every position beyond L (llama.cpp accepts any first position
// on an empty sequence), so log-n is active on every row. Token ids are fixed (i * 7919 mod n_vocab).

#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void quiet(enum ggml_log_level level, const char * text, void * ud) {
    (void) ud;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static void kv_key(struct llama_model_kv_override * o, enum llama_model_kv_override_type tag, const char * key) {
    o->tag = tag;
    snprintf(o->key, sizeof(o->key), "%s", key);
}

static void kv_str(struct llama_model_kv_override * o, const char * key, const char * v) {
    kv_key(o, LLAMA_KV_OVERRIDE_TYPE_STR, key);
    snprintf(o->val_str, sizeof(o->val_str), "%s", v);
}

static void kv_f64(struct llama_model_kv_override * o, const char * key, double v) {
    kv_key(o, LLAMA_KV_OVERRIDE_TYPE_FLOAT, key);
    o->val_f64 = v;
}

static void kv_bool(struct llama_model_kv_override * o, const char * key, bool v) {
    kv_key(o, LLAMA_KV_OVERRIDE_TYPE_BOOL, key);
    o->val_bool = v;
}

int main(int argc, char ** argv) {
    if (argc != 5 && argc != 9) {
        fprintf(stderr, "usage: %s MODEL N P0 D [METHOD K B LOGN]\n", argv[0]);
        return 2;
    }
    const int n = atoi(argv[2]), p0 = atoi(argv[3]), n_dec = atoi(argv[4]);
    llama_log_set(quiet, NULL);
    llama_backend_init();

    struct llama_model_kv_override kv[5];
    memset(kv, 0, sizeof(kv));
    struct llama_model_params mp = llama_model_default_params();
    if (argc == 9) {
        kv_str(&kv[0], "llama.rope.ntk.method", argv[5]);
        kv_f64(&kv[1], "llama.rope.ntk.factor", atof(argv[6]));
        kv_f64(&kv[2], "llama.rope.ntk.exponent", atof(argv[7]));
        kv_bool(&kv[3], "llama.attention.logn_scaling", atoi(argv[8]) != 0);
        mp.kv_overrides = kv;
    }
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "decode_callgrind: cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + n_dec + 256;
    cp.n_batch = cp.n_ubatch = n;
    cp.n_threads = cp.n_threads_batch = 1;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "decode_callgrind: cannot create the context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = (llama_token) ((i * 7919L) % n_vocab);
        b.pos[i] = p0 + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = i == n - 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b) != 0) {
        fprintf(stderr, "decode_callgrind: prefill failed\n");
        return 1;
    }
    for (int j = 0; j < n_dec; j++) {
        b.token[0] = (llama_token) ((j * 104729L) % n_vocab);
        b.pos[0] = p0 + n + j;
        b.logits[0] = 1;
        b.n_tokens = 1;
        if (llama_decode(ctx, b) != 0) {
            fprintf(stderr, "decode_callgrind: decode failed\n");
            return 1;
        }
    }
    const float * logits = llama_get_logits_ith(ctx, -1);
    printf("ok %s n=%d p0=%d decodes=%d logit0=%.6f\n", argc == 9 ? argv[5] : "(file)", n, p0, n_dec, logits[0]);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
