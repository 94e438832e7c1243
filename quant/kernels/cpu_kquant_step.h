/* One transformer block (Llama / Qwen2 family) for a few rows in one C call: the decode step's (and a speculative
 * verify's) per-layer host work next to its four products, included by cpu_kquant.c. Per row: RMSNorm, the fused
 * q/k/v product (+ bias), rotary (half-split, the first 2·rot_half of each head), the row's K/V written into the
 * float32 cache at its position, one-query attention over the keys 0..position of its slot (grouped-query heads),
 * o_proj added into the residual, RMSNorm, gate/up, SwiGLU, down added into the residual. Every row's values are one
 * fixed sequence of operations whatever the call's rows or threads (as kq_linear's), so a verify row equals the
 * decode step's bit for bit. Plain C (no intrinsics): the same code in the vector and the portable (KQ_SCALAR)
 * builds; the loops are written in 16 independent lanes so the compiler vectorizes them without reassociating. */

typedef struct {  /* one kq_linear's arguments */
    int nparts, k;
    const int* fmts;
    const uint8_t* const* qs;
    const uint8_t* const* qh;
    const uint8_t* const* meta;
    const int* ns;
    const int* kps;
} kq_lin;

typedef struct {
    int hidden, heads, kv_heads, head_dim, rot_half, inter;
    float eps;
    const float* attn_norm;  /* [hidden] */
    const float* ffn_norm;   /* [hidden] */
    const float* qkv_bias;   /* [heads·D + 2·kv_heads·D] or NULL */
    kq_lin qkv, o, gate_up, down;
} kq_block_t;

static int lin(const kq_lin* l, const float* x, int M, float* y, int nthreads, int scalar) {
    return linear_run(l->nparts, l->fmts, l->qs, l->qh, l->meta, l->ns, l->kps, l->k, x, M, y, nthreads, scalar);
}

/* e^x for x ≤ 88 (below −87: e^−87), relative error ~2e-7: Cephes' expf (range reduction by ln 2 in two parts, a
 * degree-5 polynomial, the power of two put into the exponent bits), in plain arithmetic so a loop of it
 * vectorizes (libm's expf does not: ~20 µs for a 1.5B's 8960 SwiGLU values, the whole block's other work) */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    union { int32_t i; float f; } two = { .i = ((int32_t)n + 127) << 23 };
    return (p * r * r + r + 1.f) * two.f;
}

/* sum of a[i]·b[i] in 16 lanes (i mod 16), then the lanes in a fixed tree: vectorizable, order fixed */
static float dot16(const float* a, const float* b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (; i < n; i++) acc[i & 15] += a[i] * b[i];
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* out[i] = x[i] / sqrt(mean(x²) + eps) · w[i] (torch.nn.functional.rms_norm's formula) */
static void rms_norm_row(const float* x, const float* w, int n, float eps, float* out) {
    const float r = 1.f / sqrtf(dot16(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* half-split rotary of one head's first 2·h values by cos / sin [h] */
static void rope_head(float* v, const float* c, const float* s, int h) {
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * c[i] - b * s[i];
        v[i + h] = b * c[i] + a * s[i];
    }
}

/* softmax(q·Kᵀ·scale) V over n keys of stride D for the G query heads q [G, D] that share one K/V head: out [G, D];
 * sc: G·(n + 1) floats of scratch. Each key and value row is read once for the G heads (grouped-query attention: a
 * 2,000-key cache of the 1.5B is 1 MB a KV head); every head's values are one fixed sequence of operations. */
static void attend(const float* q, int G, const float* K, const float* V, int n, int D, float scale, float* sc,
                   float* out) {
    float* inv = sc + (size_t)G * n;  /* [G]: 1 / each head's sum of exponentials */
    for (int j = 0; j < n; j++)
        for (int g = 0; g < G; g++) sc[(size_t)g * n + j] = dot16(q + (size_t)g * D, K + (size_t)j * D, D) * scale;
    for (int g = 0; g < G; g++) {
        float* s = sc + (size_t)g * n;
        float mx = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        for (int j = 0; j < n; j++) s[j] = exp_approx(s[j] - mx);
        for (int j = 0; j < n; j++) sum += s[j];
        inv[g] = 1.f / sum;
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] = 0.f;
    }
    for (int j = 0; j < n; j++) {
        const float* v = V + (size_t)j * D;
        for (int g = 0; g < G; g++) {
            const float p = sc[(size_t)g * n + j];
            float* o = out + (size_t)g * D;
            for (int d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] *= inv[g];
}

/* One block for M = B·T rows: out [M, hidden] = the block applied to x [M, hidden] (row b·T + t: batch row b, token
 * t); pos [B, T] their positions, slot [B] their cache slots; cos / sin [M, rot_half]; k_cache / v_cache the
 * layer's [slots, kv_heads, max_seq, D] float32, row m's K/V written at pos[m] and its query attending to keys
 * 0..pos[m]. 0 on success, -1 out of memory. */
int kq_block(const kq_block_t* b, float* k_cache, float* v_cache, int max_seq, const float* x, float* out, int B,
             int T, const int64_t* pos, const int64_t* slot, const float* cosv, const float* sinv, int nthreads,
             int scalar) {
    const int M = B * T, H = b->hidden, D = b->head_dim, NH = b->heads, KV = b->kv_heads, F = b->inter;
    const int Q = NH * D, W = Q + 2 * KV * D, R = b->rot_half, group = NH / KV;
    const float scale = 1.f / sqrtf((float)D);
    float* h = (float*)malloc(sizeof(float) * (size_t)M * (H > Q ? H : Q));  /* a norm's output, then attention's */
    float* big = (float*)malloc(sizeof(float) * (size_t)M * (2 * F > W ? 2 * F : W));  /* q/k/v, then gate/up */
    float* act = (float*)malloc(sizeof(float) * (size_t)M * (F > H ? F : H));  /* SwiGLU's output; products' */
    int failed = !h || !big || !act;
    if (!failed) {
        memcpy(out, x, sizeof(float) * (size_t)M * H);
        for (int m = 0; m < M; m++) rms_norm_row(out + (size_t)m * H, b->attn_norm, H, b->eps, h + (size_t)m * H);
        failed = lin(&b->qkv, h, M, big, nthreads, scalar);
    }
    if (!failed) {
        for (int m = 0; m < M; m++) {  /* bias, rotary, K/V into the cache */
            float* r = big + (size_t)m * W;
            if (b->qkv_bias) for (int i = 0; i < W; i++) r[i] += b->qkv_bias[i];
            const float* c = cosv + (size_t)m * R;
            const float* s = sinv + (size_t)m * R;
            for (int hh = 0; hh < NH + KV; hh++) rope_head(r + (size_t)hh * D, c, s, R);
            for (int g = 0; g < KV; g++) {
                const size_t at = (((size_t)slot[m / T] * KV + g) * max_seq + (size_t)pos[m]) * D;
                memcpy(k_cache + at, r + Q + (size_t)g * D, sizeof(float) * D);
                memcpy(v_cache + at, r + Q + (size_t)(KV + g) * D, sizeof(float) * D);
            }
        }
        #pragma omp parallel num_threads(nthreads)
        {
            int longest = 0;
            for (int m = 0; m < M; m++) longest = pos[m] + 1 > longest ? (int)pos[m] + 1 : longest;
            float* sc = (float*)malloc(sizeof(float) * (size_t)group * (longest + 1));
            if (!sc) { _Pragma("omp atomic write") failed = 1; }
            #pragma omp for schedule(static)
            for (int t = 0; t < M * KV; t++) {  /* a row's K/V head and the query heads it serves */
                if (!sc) continue;
                const int m = t / KV, g = t % KV;
                const size_t base = ((size_t)slot[m / T] * KV + g) * max_seq * D;
                attend(big + (size_t)m * W + (size_t)g * group * D, group, k_cache + base, v_cache + base,
                       (int)pos[m] + 1, D, scale, sc, h + (size_t)m * Q + (size_t)g * group * D);
            }
            free(sc);
        }
    }
    if (!failed) failed = lin(&b->o, h, M, act, nthreads, scalar);
    if (!failed) {
        for (size_t i = 0; i < (size_t)M * H; i++) out[i] += act[i];
        for (int m = 0; m < M; m++) rms_norm_row(out + (size_t)m * H, b->ffn_norm, H, b->eps, h + (size_t)m * H);
        failed = lin(&b->gate_up, h, M, big, nthreads, scalar);
    }
    if (!failed) {
        const int pieces = (F + 255) / 256;  /* silu(gate) · up, 256 values a task */
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int t = 0; t < M * pieces; t++) {
            const int m = t / pieces, i0 = (t % pieces) * 256, i1 = i0 + 256 < F ? i0 + 256 : F;
            const float* g = big + (size_t)m * 2 * F;
            float* a = act + (size_t)m * F;
            for (int i = i0; i < i1; i++) a[i] = g[i] / (1.f + exp_approx(-g[i])) * g[F + i];
        }
        failed = lin(&b->down, act, M, big, nthreads, scalar);
    }
    if (!failed)
        for (size_t i = 0; i < (size_t)M * H; i++) out[i] += big[i];
    free(h); free(big); free(act);
    return failed ? -1 : 0;
}
