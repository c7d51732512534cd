// The log-n guard in ggml_backend_dev_supports_op (patches/0001), checked on the CPU.
//
// Two fake GPU devices whose own supports_op accepts everything, registered as "Metal" and
// "CUDA", and the real CPU device: a rope with log-n set (ggml_rope_set_logn) must be declined by
// "Metal" (so the scheduler runs it on the CPU) and accepted by "CUDA" and the CPU; plain rope is
// accepted by all three. Prints one line per check, exits 1 on the first failure.
//
// Build: cc -I<llama.cpp>/ggml/include -I<llama.cpp>/ggml/src test_supports_op.c -lggml-base -lggml -lggml-cpu

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-backend-impl.h"

#include <stdio.h>
#include <string.h>

static const char * fake_reg_name(ggml_backend_reg_t reg) {
    return (const char *) reg->context;
}

static enum ggml_backend_dev_type fake_dev_type(ggml_backend_dev_t dev) {
    (void) dev;
    return GGML_BACKEND_DEVICE_TYPE_GPU;
}

static bool fake_supports_everything(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    (void) dev;
    (void) op;
    return true;
}

static int check(const char * what, bool got, bool want) {
    printf("%-48s %s (expected %s)\n", what, got ? "supported" : "declined", want ? "supported" : "declined");
    return got == want ? 0 : 1;
}

int main(void) {
    struct ggml_backend_reg reg_metal, reg_cuda;
    memset(&reg_metal, 0, sizeof(reg_metal));
    reg_metal.api_version      = GGML_BACKEND_API_VERSION;
    reg_metal.iface.get_name   = fake_reg_name;
    reg_metal.context          = (void *) "Metal";
    reg_cuda                   = reg_metal;
    reg_cuda.context           = (void *) "CUDA";

    struct ggml_backend_device dev_metal, dev_cuda;
    memset(&dev_metal, 0, sizeof(dev_metal));
    dev_metal.iface.get_type    = fake_dev_type;
    dev_metal.iface.supports_op = fake_supports_everything;
    dev_metal.reg               = &reg_metal;
    dev_cuda                    = dev_metal;
    dev_cuda.reg                = &reg_cuda;

    ggml_backend_dev_t dev_cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (dev_cpu == NULL) {
        fprintf(stderr, "no CPU device\n");
        return 1;
    }

    struct ggml_init_params params = { 16*1024*1024, NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * a    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 64, 4, 8);
    struct ggml_tensor * pos  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 8);
    struct ggml_tensor * ff   = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 32);

    int fails = 0;
    for (int mode = 0; mode <= 2; mode += 2) { // GGML_ROPE_TYPE_NORMAL, GGML_ROPE_TYPE_NEOX
        struct ggml_tensor * plain = ggml_rope_ext(ctx, a, pos, ff, 64, mode, 8192, 10000.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
        struct ggml_tensor * logn  = ggml_rope_ext(ctx, a, pos, ff, 64, mode, 8192, 10000.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
        logn = ggml_rope_set_logn(logn, 8192);

        const char * m = mode == 0 ? "NORMAL" : "NEOX";
        char what[64];
        snprintf(what, sizeof(what), "Metal, %s rope, plain", m); fails += check(what, ggml_backend_dev_supports_op(&dev_metal, plain), true);
        snprintf(what, sizeof(what), "Metal, %s rope, log-n", m); fails += check(what, ggml_backend_dev_supports_op(&dev_metal, logn),  false);
        snprintf(what, sizeof(what), "CUDA, %s rope, plain",  m); fails += check(what, ggml_backend_dev_supports_op(&dev_cuda,  plain), true);
        snprintf(what, sizeof(what), "CUDA, %s rope, log-n",  m); fails += check(what, ggml_backend_dev_supports_op(&dev_cuda,  logn),  true);
        snprintf(what, sizeof(what), "CPU, %s rope, plain",   m); fails += check(what, ggml_backend_dev_supports_op(dev_cpu,    plain), true);
        snprintf(what, sizeof(what), "CPU, %s rope, log-n",   m); fails += check(what, ggml_backend_dev_supports_op(dev_cpu,    logn),  true);
    }
    // other ops are not affected by the guard
    struct ggml_tensor * add = ggml_add(ctx, a, a);
    fails += check("Metal, ADD", ggml_backend_dev_supports_op(&dev_metal, add), true);

    ggml_free(ctx);
    printf("%s\n", fails ? "FAILED" : "OK");
    return fails ? 1 : 0;
}
