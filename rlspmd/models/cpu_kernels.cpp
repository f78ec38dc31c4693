// rlspmd's CPU kernels, built at first use by rlspmd/models/cpu_kernels.py.
//
// Fused elementwise kernels for the eager CPU decode step in bfloat16: each computes in float32 and rounds to bfloat16
// exactly where the torch ops it replaces do (every torch op on bfloat16 rounds its own result), so it returns the same
// bits as those ops.
//
// Packed attention for training (attn_kernel=cpu_fused): segment_attention and its backward, one call per pack.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // AVX-512 / AVX2 below; other CPUs build the scalar branch
#endif

namespace {

using at::Tensor;

inline float bf2f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // c10::BFloat16's round to nearest even, NaN to 0x7FC0; branch-free, so loops vectorise
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : r;
}

inline float rnd(float f) { return bf2f(f2bf(f)); }

const uint16_t* cptr(const Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); }
uint16_t* mptr(const Tensor& t) { return reinterpret_cast<uint16_t*>(t.mutable_data_ptr()); }

void check_bf16(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
}

// h += y (when given, in place), then x = w * bf16(h * rsqrt(mean(h^2) + eps)) over the last dim; returns x. The sum of
// squares is torch's own reduction (at::sum, which torch's mean on CPU also runs before dividing: the same float32 sum,
// in torch's order); the rest is one pass per row before it and one after.
Tensor add_rms_norm(const Tensor& h, const std::optional<Tensor>& y, const Tensor& w, double eps) {
  check_bf16(h, "h");
  check_bf16(w, "w");
  TORCH_CHECK(h.is_contiguous() && w.is_contiguous(), "h and w must be contiguous");
  const int64_t D = h.size(-1), N = h.numel() / D;
  TORCH_CHECK(w.numel() == D, "w has ", w.numel(), " elements, rows have ", D);
  const uint16_t* yp = nullptr;
  if (y.has_value()) {
    check_bf16(*y, "y");
    TORCH_CHECK(y->is_contiguous() && y->numel() == h.numel(), "y must be contiguous and shaped like h");
    yp = cptr(*y);
  }
  uint16_t* hp = mptr(h);
  Tensor sq = at::empty({N, D}, h.options().dtype(at::kFloat));
  float* sp = sq.mutable_data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      uint16_t* hr = hp + n * D;
      float* sr = sp + n * D;
      if (yp) {
        const uint16_t* yr = yp + n * D;
        for (int64_t d = 0; d < D; ++d) hr[d] = f2bf(bf2f(hr[d]) + bf2f(yr[d]));
      }
      for (int64_t d = 0; d < D; ++d) {
        const float f = bf2f(hr[d]);
        sr[d] = f * f;
      }
    }
  });
  const Tensor ss = at::sum(sq, -1);
  const float* ssp = ss.const_data_ptr<float>();
  Tensor x = at::empty_like(h);
  uint16_t* xp = mptr(x);
  const uint16_t* wp = cptr(w);
  const float epsf = static_cast<float>(eps), Df = static_cast<float>(D);
  at::parallel_for(0, N, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const uint16_t* hr = hp + n * D;
      uint16_t* xr = xp + n * D;
      const float r = 1.f / std::sqrt(ssp[n] / Df + epsf);
      for (int64_t d = 0; d < D; ++d) xr[d] = f2bf(bf2f(wp[d]) * rnd(bf2f(hr[d]) * r));
    }
  });
  return x;
}

// x * cos + roll(x, D / 2) * sin_signed over one head of D values, each product and the sum rounded to bfloat16.
inline void rope_head(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d)  // two loops, so that each reads its partner half contiguously
    out[d] = f2bf(rnd(bf2f(x[d]) * bf2f(c[d])) + rnd(bf2f(x[d + half]) * bf2f(s[d])));
  for (int64_t d = half; d < D; ++d)
    out[d] = f2bf(rnd(bf2f(x[d]) * bf2f(c[d])) + rnd(bf2f(x[d - half]) * bf2f(s[d])));
}

// One decode token per row: qkv (B, 1, (H + 2 KV) D), the q/k/v projections side by side; cos and sin_signed
// (B, 1, 1, D). RoPE on q and k; k and v written into slot ``start`` of k_cache and v_cache (B, KV, L, D, any
// strides); returns the rotated q, (B, H, 1, D).
Tensor rope_write(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& k_cache,
                  const Tensor& v_cache, int64_t start, int64_t H, int64_t KV) {
  for (auto* t : {&qkv, &cos, &sin, &k_cache, &v_cache}) check_bf16(*t, "rope_write's tensors");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "qkv, cos, sin must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be (B, KV, L, D)");
  const int64_t B = k_cache.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.numel() == B * (H + 2 * KV) * D, "qkv must be (B, 1, (H + 2 KV) D)");
  TORCH_CHECK(cos.numel() == B * D && sin.numel() == B * D, "cos and sin must be (B, 1, 1, D)");
  TORCH_CHECK(k_cache.size(1) == KV && v_cache.size(1) == KV && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "caches must be (B, KV, L, D) with unit stride in D");
  TORCH_CHECK(start >= 0 && start < k_cache.size(2) && start < v_cache.size(2), "slot ", start, " is outside the cache");
  Tensor q = at::empty({B, H, 1, D}, qkv.options());
  const uint16_t *xp = cptr(qkv), *cp = cptr(cos), *sp = cptr(sin);
  uint16_t *qp = mptr(q), *kp = mptr(k_cache), *vp = mptr(v_cache);
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1), kl = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1), vl = v_cache.stride(2);
  at::parallel_for(0, B, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const uint16_t* row = xp + b * (H + 2 * KV) * D;
      const uint16_t *c = cp + b * D, *s = sp + b * D;
      for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, c, s, D, qp + (b * H + h) * D);
      for (int64_t j = 0; j < KV; ++j) {
        rope_head(row + (H + j) * D, c, s, D, kp + b * kb + j * kh + start * kl);
        std::memcpy(vp + b * vb + j * vh + start * vl, row + (H + KV + j) * D, D * sizeof(uint16_t));
      }
    }
  });
  return q;
}

// silu(gate) * up for gu = [gate | up] along the last dim (..., 2F) -> (..., F): torch's own kernels (vectorised
// exp), called from here without the Python dispatch of each.
Tensor silu_mul(const Tensor& gu) {
  TORCH_CHECK(gu.size(-1) % 2 == 0, "gu must have an even last dim");
  const int64_t F = gu.size(-1) / 2;
  return at::silu(gu.narrow(-1, 0, F)).mul_(gu.narrow(-1, F, F));
}

// ---------------------------------------------------------------------------------------------------------------------
// Packed attention for training on CPU (attn_kernel=cpu_fused): one call per pack each way, float32 inside.

// Vector registers of float32 for the attention kernels' inner products (AVX-512, else AVX2 with FMA, else scalar).
#if defined(__AVX512F__)
using vfloat = __m512;
constexpr int64_t kW = 16;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm512_storeu_ps(p, x); }
inline vfloat vset1(float a) { return _mm512_set1_ps(a); }
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline float hsum(vfloat a) { return _mm512_reduce_add_ps(a); }
inline float hmax(vfloat a) { return _mm512_reduce_max_ps(a); }
inline vfloat vround(vfloat a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat vload_bf16(const uint16_t* p) {  // kW bfloat16 values, widened (exactly)
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline vfloat vexp2i(vfloat n) {  // 2^n for integral n in [-127, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
using vfloat = __m256;
constexpr int64_t kW = 8;
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm256_storeu_ps(p, x); }
inline vfloat vset1(float a) { return _mm256_set1_ps(a); }
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline float hsum(vfloat a) {
  float x[8];
  _mm256_storeu_ps(x, a);
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}
inline float hmax(vfloat a) {
  float x[8];
  _mm256_storeu_ps(x, a);
  const float a0 = std::max(std::max(x[0], x[1]), std::max(x[2], x[3]));
  return std::max(a0, std::max(std::max(x[4], x[5]), std::max(x[6], x[7])));
}
inline vfloat vround(vfloat a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat vload_bf16(const uint16_t* p) {  // kW bfloat16 values, widened (exactly)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline vfloat vexp2i(vfloat n) {  // 2^n for integral n in [-127, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#else
using vfloat = float;
constexpr int64_t kW = 1;
inline vfloat vload(const float* p) { return *p; }
inline void vstore(float* p, vfloat x) { *p = x; }
inline vfloat vset1(float a) { return a; }
inline vfloat vzero() { return 0.0f; }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return std::fma(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return a + b; }
inline vfloat vsub(vfloat a, vfloat b) { return a - b; }
inline vfloat vmul(vfloat a, vfloat b) { return a * b; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
inline float hsum(vfloat a) { return a; }
inline float hmax(vfloat a) { return a; }
inline vfloat vround(vfloat a) { return std::nearbyint(a); }
inline vfloat vload_bf16(const uint16_t* p) { return bf2f(*p); }
inline vfloat vexp2i(vfloat n) {  // 2^n for integral n in [-127, 127]
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float f;
  std::memcpy(&f, &e, 4);
  return f;
}
#endif
// exp(x) for x <= 0 (softmax arguments; below -87 it returns exp(-87), about 1e-38), a vector at a time: Cephes'
// single-precision polynomial after range reduction (libm's expf does not vectorise).
inline vfloat vexp_neg(vfloat x) {
  x = vmax(x, vset1(-87.0f));
  const vfloat n = vround(vmul(x, vset1(1.44269504088896341f)));
  vfloat r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vfloat p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vadd(vfma(vmul(p, r), r, r), vset1(1.0f));
  return vmul(p, vexp2i(n));
}

// sum_j a[j] * b[j] over n, a multiple of kW
inline float row_dot(const float* a, const float* b, int64_t n) {
  vfloat acc = vzero();
  for (int64_t j = 0; j < n; j += kW) acc = vfma(vload(a + j), vload(b + j), acc);
  return hsum(acc);
}

// y[0:n] += a * x[0:n]
inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = __builtin_fmaf(a, x[j], y[j]);
}

// Element access of a (T, heads, D) tensor's data in its own dtype.
struct Rows {
  const void* p;
  bool bf16;
  int64_t heads, D;
  void load(float* dst, int64_t t, int64_t h) const {
    const int64_t o = (t * heads + h) * D;
    if (bf16) {
      const uint16_t* s = static_cast<const uint16_t*>(p) + o;
      for (int64_t d = 0; d < D; ++d) dst[d] = bf2f(s[d]);
    } else {
      std::memcpy(dst, static_cast<const float*>(p) + o, D * sizeof(float));
    }
  }
};

// src[0:n] into elements [o, o + n) of p, rounded once to bfloat16 or copied as float32.
inline void store(void* p, bool bf16, int64_t o, const float* src, int64_t n) {
  if (bf16) {
    uint16_t* d = static_cast<uint16_t*>(p) + o;
    for (int64_t i = 0; i < n; ++i) d[i] = f2bf(src[i]);
  } else {
    std::memcpy(static_cast<float*>(p) + o, src, n * sizeof(float));
  }
}


inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A float32 scratch buffer aligned to 64 bytes, so that vector loads and stores never straddle cache lines (a store
// then a load of the same vector across two lines cannot be forwarded and stalls).
class Floats {
 public:
  float* data() { return p_.get(); }
  const float* data() const { return p_.get(); }
  float& operator[](int64_t i) { return p_.get()[i]; }
  const float& operator[](int64_t i) const { return p_.get()[i]; }
  void resize(int64_t n) {
    if (n > cap_) {
      p_.reset(static_cast<float*>(std::aligned_alloc(64, round_up(std::max<int64_t>(n, 1) * 4, 64))));
      TORCH_CHECK(p_ != nullptr, "out of memory for ", n, " floats of attention scratch");
      cap_ = n;
    }
  }
  void assign(int64_t n, float x) {
    resize(n);
    std::fill(p_.get(), p_.get() + n, x);
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> p_;
  int64_t cap_ = 0;
};

constexpr int64_t kMR = 4;  // rows of C per tile

// C[m x n] (+)= A[m x k] . B[k x n] (A^T B with TransA), row-major float32; m a multiple of kMR and n of kW (callers
// pad with zeros). Each tile of kMR rows by 2 vectors of C stays in registers across k.
template <bool Accumulate, bool TransA = false>
void gemm(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb, float* __restrict C,
          int64_t ldc, int64_t m, int64_t n, int64_t k) {
  // TransA: A is stored k x m (C = A^T B), its kMR values of one p contiguous
  const auto a_at = [&](int64_t row, int64_t p) { return TransA ? A[p * lda + row] : A[row * lda + p]; };
  for (int64_t i = 0; i < m; i += kMR) {
    int64_t j = 0;
    for (; j + 2 * kW <= n; j += 2 * kW) {
      vfloat c0[kMR], c1[kMR];
      for (int r = 0; r < kMR; ++r) {
        c0[r] = Accumulate ? vload(C + (i + r) * ldc + j) : vzero();
        c1[r] = Accumulate ? vload(C + (i + r) * ldc + j + kW) : vzero();
      }
      for (int64_t p = 0; p < k; ++p) {
        const vfloat b0 = vload(B + p * ldb + j), b1 = vload(B + p * ldb + j + kW);
        for (int r = 0; r < kMR; ++r) {
          const vfloat a = vset1(a_at(i + r, p));
          c0[r] = vfma(a, b0, c0[r]);
          c1[r] = vfma(a, b1, c1[r]);
        }
      }
      for (int r = 0; r < kMR; ++r) {
        vstore(C + (i + r) * ldc + j, c0[r]);
        vstore(C + (i + r) * ldc + j + kW, c1[r]);
      }
    }
    for (; j < n; j += kW) {
      vfloat c0[kMR];
      for (int r = 0; r < kMR; ++r) c0[r] = Accumulate ? vload(C + (i + r) * ldc + j) : vzero();
      for (int64_t p = 0; p < k; ++p) {
        const vfloat b0 = vload(B + p * ldb + j);
        for (int r = 0; r < kMR; ++r) c0[r] = vfma(vset1(a_at(i + r, p)), b0, c0[r]);
      }
      for (int r = 0; r < kMR; ++r) vstore(C + (i + r) * ldc + j, c0[r]);
    }
  }
}


// Key counts are padded to this: a whole number of the products' column tiles (2 vectors), and of their row tiles (kMR)
// where keys are the rows (the backward's key and value gradients).
constexpr int64_t kKeyPad = std::max<int64_t>(2 * kW, kMR);
constexpr int64_t kRowBlock = 64;  // query rows per block (a multiple of 4): the scores of a block are kRowBlock x keys

// One segment and KV head, float32: its keys and values (the prompt's np rows, then the segment's own nq; zero rows up
// to a multiple of kKeyPad), row-major and transposed; its query rows are (position i, head g), i-major, G heads per
// KV head.
struct Segment {
  int64_t D, G, q0 = 0, nq = 0, p0 = 0, np = 0, n = 0, npad = 0;
  Floats k, v, kt, vt;
  Floats row;
  void at(const int64_t* segs, int64_t si) {
    q0 = segs[si * 4], nq = segs[si * 4 + 1], p0 = segs[si * 4 + 2], np = segs[si * 4 + 3];
  }
  // the segment's keys into kt (transposed) and, for the backward, k (row-major); its values into v (forward) or vt
  // (backward, transposed)
  void fill(const Rows& K, const Rows& V, int64_t kv, bool backward) {
    n = np + nq;
    npad = round_up(n, kKeyPad);
    row.resize(D);
    kt.assign(npad * D, 0.0f);
    (backward ? vt : v).assign(npad * D, 0.0f);
    if (backward) k.assign(npad * D, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = token(j);
      K.load(row.data(), t, kv);
      for (int64_t d = 0; d < D; ++d) kt[d * npad + j] = row[d];
      if (backward) {
        std::memcpy(&k[j * D], row.data(), D * sizeof(float));
        V.load(row.data(), t, kv);
        for (int64_t d = 0; d < D; ++d) vt[d * npad + j] = row[d];
      } else {
        V.load(&v[j * D], t, kv);
      }
    }
  }
  int64_t token(int64_t j) const { return j < np ? p0 + j : q0 + (j - np); }
  // rows [r0, r0 + rows) of the block: their keys' count (the last row's causal limit), padded to kKeyPad
  int64_t block_keys(int64_t r0, int64_t rows) const {
    return std::min(npad, round_up(np + (r0 + rows - 1) / G + 1, kKeyPad));
  }
};

// Loads the block's query-like rows (rows [r0, r0 + rows) of the segment, (i, g) i-major) into dst (rows padded to kMR
// with zeros), D floats each.
void load_block(float* dst, const Rows& X, const Segment& s, int64_t kv, int64_t r0, int64_t rows) {
  for (int64_t r = 0; r < round_up(rows, kMR); ++r) {
    if (r < rows) {
      const int64_t row = r0 + r;
      X.load(dst + r * s.D, s.q0 + row / s.G, kv * s.G + row % s.G);
    } else {
      std::fill(dst + r * s.D, dst + (r + 1) * s.D, 0.0f);
    }
  }
}

void check_attn(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segs) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "q, k, v must be on CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be (tokens, heads, head_dim)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q, k, v: bfloat16 or float32");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2), "k, v shaped like q");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");  // of kW, on every ISA
  TORCH_CHECK(segs.scalar_type() == at::kLong && segs.dim() == 2 && segs.size(1) == 4 && segs.is_contiguous(),
              "segs must be contiguous int64 (segments, 4)");
  const int64_t T = q.size(0), *sg = segs.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < segs.size(0); ++i) {
    const int64_t q0 = sg[i * 4], nq = sg[i * 4 + 1], p0 = sg[i * 4 + 2], np = sg[i * 4 + 3];
    TORCH_CHECK(q0 >= 0 && nq >= 0 && q0 + nq <= T && p0 >= 0 && np >= 0 && p0 + np <= T, "segment ", i, " (", q0,
                ", ", nq, ", ", p0, ", ", np, ") lies outside the ", T, " tokens");
  }
}


// Masks the block's scores beyond each row's causal limit and exponentiates the rest: with lse given, exp(s - lse[row])
// (backward: the probabilities); else exp(s - max) (forward), writing the row's lse and the reciprocal of its sum, by
// which the caller scales the row's output.
void block_probs(float* s, int64_t ld, const Segment& sg, int64_t r0, int64_t rows, int64_t nb, const float* lse_in,
                 float* lse_out, float* inv_out) {
  for (int64_t r = 0; r < round_up(rows, kMR); ++r) {
    float* x = s + r * ld;
    const int64_t lim = r < rows ? sg.np + (r0 + r) / sg.G + 1 : 0, lv = round_up(lim, kW);  // lv <= nb
    if (lse_in != nullptr) {
      const vfloat l = vset1(lse_in[r]);
      for (int64_t j = 0; j < lv; j += kW) vstore(x + j, vexp_neg(vsub(vload(x + j), l)));
    } else if (lim > 0) {
      std::fill(x + lim, x + lv, -INFINITY);
      vfloat mx = vset1(-INFINITY);
      for (int64_t j = 0; j < lv; j += kW) mx = vmax(mx, vload(x + j));
      const float m = hmax(mx);
      const vfloat vm = vset1(m);
      std::fill(x + lim, x + lv, m - 100.0f);  // exp(-100) ~ 4e-44: nothing next to the row maximum's 1
      vfloat acc = vzero();
      for (int64_t j = 0; j < lv; j += kW) {
        const vfloat e = vexp_neg(vsub(vload(x + j), vm));
        vstore(x + j, e);
        acc = vadd(acc, e);
      }
      const float l = hsum(acc);
      inv_out[r] = 1.0f / l;  // the caller scales the row's output, not its lv probabilities
      lse_out[r] = m + std::log(l);
    }
    std::fill(x + lim, x + nb, 0.0f);
  }
}

// Forward. segs rows (q0, nq, p0, np): queries q0..q0+nq attend to keys p0..p0+np and causally to their own segment.
// Returns out (like q) and lse (tokens, heads) float32 (natural log of each row's softmax denominator, scale included).
std::tuple<Tensor, Tensor> segment_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segs,
                                             double scale) {
  check_attn(q, k, v, segs);
  const int64_t T = q.size(0), H = q.size(1), KV = k.size(1), D = q.size(2), G = H / KV, S = segs.size(0);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  Tensor out = at::zeros_like(q);
  Tensor lse = at::zeros({T, H}, q.options().dtype(at::kFloat));
  const int64_t* sg = segs.const_data_ptr<int64_t>();
  const Rows Q{q.const_data_ptr(), bf16, H, D}, K{k.const_data_ptr(), bf16, KV, D}, V{v.const_data_ptr(), bf16, KV, D};
  void* op = out.mutable_data_ptr();
  float* lp = lse.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, S * KV, 1, [&](int64_t lo, int64_t hi) {
    Segment seg{D, G};
    Floats qb, ob, s, lb, linv;
    qb.resize(kRowBlock * D);
    ob.resize(kRowBlock * D);
    lb.resize(kRowBlock);
    linv.resize(kRowBlock);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t kv = item % KV;
      seg.at(sg, item / KV);
      if (seg.nq == 0) continue;
      seg.fill(K, V, kv, false);
      s.resize(kRowBlock * seg.npad);
      const int64_t M = seg.nq * G;
      for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, M - r0), mp = round_up(rows, kMR), nb = seg.block_keys(r0, rows);
        load_block(qb.data(), Q, seg, kv, r0, rows);
        for (int64_t x = 0; x < mp * D; ++x) qb[x] *= sc;
        gemm<false>(qb.data(), D, seg.kt.data(), seg.npad, s.data(), nb, mp, nb, D);
        block_probs(s.data(), nb, seg, r0, rows, nb, nullptr, lb.data(), linv.data());
        gemm<false>(s.data(), nb, seg.v.data(), D, ob.data(), D, mp, D, nb);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = seg.q0 + (r0 + r) / G, h = kv * G + (r0 + r) % G;
          const vfloat inv = vset1(linv[r]);
          for (int64_t d = 0; d < D; d += kW) vstore(&ob[r * D + d], vmul(vload(&ob[r * D + d]), inv));
          store(op, bf16, (t * H + h) * D, &ob[r * D], D);
          lp[t * H + h] = lb[r];
        }
      }
    }
  });
  return {out, lse};
}

// Backward of segment_attention. groups rows (first segment, end segment, first token, end token): segments whose keys
// all lie in the group's tokens, so each group's key and value gradients are its own (the parallel unit).
std::tuple<Tensor, Tensor, Tensor> segment_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                              const Tensor& v, const Tensor& lse, const Tensor& segs,
                                                              const Tensor& groups, double scale) {
  check_attn(q, k, v, segs);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type() && dout.is_contiguous(),
              "dout must be contiguous and like q");
  TORCH_CHECK(groups.scalar_type() == at::kLong && groups.dim() == 2 && groups.size(1) == 4 && groups.is_contiguous(),
              "groups must be contiguous int64 (groups, 4)");
  const int64_t H = q.size(1), KV = k.size(1), D = q.size(2), G = H / KV, NG = groups.size(0);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  const int64_t* sg = segs.const_data_ptr<int64_t>();
  const int64_t* gr = groups.const_data_ptr<int64_t>();
  const Rows Q{q.const_data_ptr(), bf16, H, D}, K{k.const_data_ptr(), bf16, KV, D}, V{v.const_data_ptr(), bf16, KV, D},
      DO{dout.const_data_ptr(), bf16, H, D};
  const float* lp = lse.const_data_ptr<float>();
  void *dqp = dq.mutable_data_ptr(), *dkp = dk.mutable_data_ptr(), *dvp = dv.mutable_data_ptr();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, NG * KV, 1, [&](int64_t lo, int64_t hi) {
    Segment seg{D, G};
    Floats qb, dob, dqb, lb, p, dp, dks, dvs, dkg, dvg;
    for (Floats* b : {&qb, &dob, &dqb}) b->resize(kRowBlock * D);
    lb.resize(kRowBlock);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t gi = item / KV, kv = item % KV;
      const int64_t s_lo = gr[gi * 4], s_hi = gr[gi * 4 + 1], t_lo = gr[gi * 4 + 2], t_hi = gr[gi * 4 + 3];
      dkg.assign((t_hi - t_lo) * D, 0.0f);
      dvg.assign((t_hi - t_lo) * D, 0.0f);
      for (int64_t si = s_lo; si < s_hi; ++si) {
        seg.at(sg, si);
        if (seg.nq == 0) continue;
        seg.fill(K, V, kv, true);
        const int64_t M = seg.nq * G;
        p.resize(kRowBlock * seg.npad);
        dp.resize(kRowBlock * seg.npad);
        dks.assign(seg.npad * D, 0.0f);
        dvs.assign(seg.npad * D, 0.0f);
        for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
          const int64_t rows = std::min(kRowBlock, M - r0), mp = round_up(rows, kMR), nb = seg.block_keys(r0, rows);
          load_block(qb.data(), Q, seg, kv, r0, rows);
          load_block(dob.data(), DO, seg, kv, r0, rows);
          for (int64_t r = 0; r < rows; ++r)
            lb[r] = lp[(seg.q0 + (r0 + r) / G) * H + kv * G + (r0 + r) % G];
          for (int64_t x = 0; x < mp * D; ++x) dqb[x] = qb[x] * sc;  // scaled queries, for the scores
          gemm<false>(dqb.data(), D, seg.kt.data(), seg.npad, p.data(), nb, mp, nb, D);
          block_probs(p.data(), nb, seg, r0, rows, nb, lb.data(), nullptr, nullptr);
          gemm<false>(dob.data(), D, seg.vt.data(), seg.npad, dp.data(), nb, mp, nb, D);
          for (int64_t r = 0; r < mp; ++r) {  // dS = P (dP - rowsum(P dP)) * scale, in dp
            const float* pr = &p[r * nb];
            float* dr = &dp[r * nb];
            const vfloat delta = vset1(row_dot(pr, dr, nb)), vsc = vset1(sc);
            for (int64_t j = 0; j < nb; j += kW)
              vstore(dr + j, vmul(vmul(vload(pr + j), vsub(vload(dr + j), delta)), vsc));
          }
          gemm<false>(dp.data(), nb, seg.k.data(), D, dqb.data(), D, mp, D, nb);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = seg.q0 + (r0 + r) / G, h = kv * G + (r0 + r) % G;
            store(dqp, bf16, (t * H + h) * D, &dqb[r * D], D);
          }
          gemm<true, true>(dp.data(), nb, qb.data(), D, dks.data(), D, nb, D, mp);  // dK += dS^T Q
          gemm<true, true>(p.data(), nb, dob.data(), D, dvs.data(), D, nb, D, mp);  // dV += P^T dO
        }
        for (int64_t j = 0; j < seg.n; ++j) {
          const int64_t r = seg.token(j) - t_lo;
          TORCH_CHECK(r >= 0 && r < t_hi - t_lo, "a segment's keys lie outside its group's tokens");
          axpy(&dkg[r * D], 1.0f, &dks[j * D], D);
          axpy(&dvg[r * D], 1.0f, &dvs[j * D], D);
        }
      }
      for (int64_t r = 0; r < t_hi - t_lo; ++r) {
        store(dkp, bf16, ((t_lo + r) * KV + kv) * D, &dkg[r * D], D);
        store(dvp, bf16, ((t_lo + r) * KV + kv) * D, &dvg[r * D], D);
      }
    }
  });
  return {dq, dk, dv};
}


// Decode-step attention (rollout.engine.cpu_kernels): one query token per row against the first M slots of a layer's
// KV cache, in float32 from bfloat16, the output rounded once. q (B, H, 1, D) contiguous; k_cache, v_cache (B, KV, L,
// D) contiguous; mask (B, M) contiguous, additive (0, or -inf at prompt padding). Returns (B, 1, H * D),
// the layout the output projection reads. Replaces SDPA there: at 16 rows its per-call set-up cost more than the
// arithmetic (SmolLM2-135M: 0.17 ms a layer).
constexpr uint16_t kNegInfBf16 = 0xFF80;

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& mask) {
  check_bf16(q, "q");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  check_bf16(mask, "mask");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.is_contiguous(), "q must be contiguous (B, H, 1, D)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous (B, KV, L, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), KV = k_cache.size(1), L = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(3) == D && H % KV == 0, "q and the caches disagree in shape");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");  // of kW, on every ISA
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == B && mask.is_contiguous(), "mask must be contiguous (B, M)");
  const int64_t M = mask.size(1);
  TORCH_CHECK(M >= 1 && M <= L, "mask's M (", M, ") must be in [1, ", L, "], the cache's slots");
  const int64_t G = H / KV, ND = D / kW;
  constexpr int64_t kMaxG = 8, kMaxND = 256 / kW;  // G x ND accumulators: up to 8 heads per KV head, head_dim 256
  TORCH_CHECK(G <= kMaxG && ND <= kMaxND, "decode_attention takes up to ", kMaxG, " heads per KV head and head_dim ",
              kMaxND * kW);
  Tensor out = at::empty({B, 1, H * D}, q.options());
  const uint16_t *qp = cptr(q), *kp = cptr(k_cache), *vp = cptr(v_cache), *mp = cptr(mask);
  void* op = out.mutable_data_ptr();
  const float sc = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * KV, 1, [&](int64_t lo, int64_t hi) {
    Floats s, qf, of;
    s.resize(G * round_up(M, kW));
    qf.resize(G * D);
    of.resize(G * D);
    const int64_t ld = round_up(M, kW);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / KV, kv = item % KV;
      const uint16_t* kb = kp + (b * KV + kv) * L * D;
      const uint16_t* vb = vp + (b * KV + kv) * L * D;
      const uint16_t* mb = mp + b * M;
      for (int64_t x = 0; x < G * D; ++x) qf[x] = bf2f(qp[(b * H + kv * G) * D + x]) * sc;
      // scores: a dot product per key and head
      for (int64_t j = 0; j < M; ++j) {
        vfloat kr[kMaxND];
        for (int64_t c = 0; c < ND; ++c) kr[c] = vload_bf16(kb + j * D + c * kW);
        const float m = bf2f(mb[j]);
        for (int64_t g = 0; g < G; ++g) {
          vfloat acc = vzero();
          for (int64_t c = 0; c < ND; ++c) acc = vfma(vload(&qf[g * D + c * kW]), kr[c], acc);
          s[g * ld + j] = hsum(acc) + m;
        }
      }
      // softmax per head; a masked slot (-inf) gets probability 0
      float inv[kMaxG];
      const int64_t lv = round_up(M, kW);
      for (int64_t g = 0; g < G; ++g) {
        float* x = &s[g * ld];
        std::fill(x + M, x + lv, -INFINITY);
        vfloat mx = vset1(-INFINITY);
        for (int64_t j = 0; j < lv; j += kW) mx = vmax(mx, vload(x + j));
        const vfloat vm = vset1(hmax(mx));
        for (int64_t j = 0; j < lv; j += kW) vstore(x + j, vexp_neg(vsub(vload(x + j), vm)));
        for (int64_t j = 0; j < M; ++j) x[j] = mb[j] == kNegInfBf16 ? 0.0f : x[j];
        std::fill(x + M, x + lv, 0.0f);
        vfloat acc = vzero();
        for (int64_t j = 0; j < lv; j += kW) acc = vadd(acc, vload(x + j));
        inv[g] = 1.0f / hsum(acc);
      }
      // output: probability-weighted values
      vfloat o[kMaxG][kMaxND];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < ND; ++c) o[g][c] = vzero();
      for (int64_t j = 0; j < M; ++j) {
        vfloat vr[kMaxND];
        for (int64_t c = 0; c < ND; ++c) vr[c] = vload_bf16(vb + j * D + c * kW);
        for (int64_t g = 0; g < G; ++g) {
          const vfloat pj = vset1(s[g * ld + j]);
          for (int64_t c = 0; c < ND; ++c) o[g][c] = vfma(pj, vr[c], o[g][c]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t c = 0; c < ND; ++c) vstore(&of[g * D + c * kW], vmul(o[g][c], vset1(inv[g])));
        store(op, true, b * H * D + (kv * G + g) * D, &of[g * D], D);
      }
    }
  });
  return out;
}


// ---------------------------------------------------------------------------------------------------------------------
// Log-probabilities and entropy of rows of logits (models/logprobs.py: chunked_logprobs), float32 inside: one kernel
// per chunk each way instead of about fourteen torch ops per block of a few rows.

// x = z[0:V] / temperature, a vector at a time from bfloat16 or float32 (the tail, V % kW, scalar)
struct LogitRow {
  const void* p;
  bool bf16;
  int64_t V;
  float inv_tau;
  vfloat vec(int64_t j) const {
    const vfloat x = bf16 ? vload_bf16(static_cast<const uint16_t*>(p) + j) : vload(static_cast<const float*>(p) + j);
    return vmul(x, vset1(inv_tau));
  }
  float at(int64_t j) const {
    return (bf16 ? bf2f(static_cast<const uint16_t*>(p)[j]) : static_cast<const float*>(p)[j]) * inv_tau;
  }
};

void check_logits(const Tensor& z, const Tensor& targets) {
  TORCH_CHECK(z.device().is_cpu() && z.dim() == 2 && z.is_contiguous(),
              "logits must be contiguous (rows, vocab) on CPU");
  TORCH_CHECK(z.scalar_type() == at::kBFloat16 || z.scalar_type() == at::kFloat, "logits: bfloat16 or float32");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == z.size(0) &&
                  targets.is_contiguous(),
              "targets must be contiguous int64 (rows,)");
}

// Per row of x = z / temperature: lp = x[target] - lse, the entropy -sum p log p (as sum p (lse - x): terms >= 0, no
// cancellation; 0 without with_entropy) and lse = log sum exp x. Two passes over the row (its max, then the sums).
std::tuple<Tensor, Tensor, Tensor> logprob_rows(const Tensor& z, const Tensor& targets, double temperature,
                                                bool with_entropy) {
  check_logits(z, targets);
  const int64_t N = z.size(0), V = z.size(1), Vv = V / kW * kW;
  const bool bf16 = z.scalar_type() == at::kBFloat16;
  const auto f32 = z.options().dtype(at::kFloat);
  Tensor lp = at::empty({N}, f32), ent = at::zeros({N}, f32), lse = at::empty({N}, f32);
  const int64_t* y = targets.const_data_ptr<int64_t>();
  float *lpp = lp.mutable_data_ptr<float>(), *ep = ent.mutable_data_ptr<float>(), *lsp = lse.mutable_data_ptr<float>();
  const int64_t elem = bf16 ? 2 : 4;
  const char* base = static_cast<const char*>(z.const_data_ptr());
  const float inv_tau = static_cast<float>(1.0 / temperature);
  at::parallel_for(0, N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      TORCH_CHECK(y[r] >= 0 && y[r] < V, "target ", y[r], " of row ", r, " is outside the vocabulary of ", V);
      const LogitRow x{base + r * V * elem, bf16, V, inv_tau};
      vfloat mx = vset1(-INFINITY);
      for (int64_t j = 0; j < Vv; j += kW) mx = vmax(mx, x.vec(j));
      float m = hmax(mx);
      for (int64_t j = Vv; j < V; ++j) m = std::max(m, x.at(j));
      const vfloat vm = vset1(m);
      vfloat acc = vzero(), acc_h = vzero();
      for (int64_t j = 0; j < Vv; j += kW) {
        const vfloat d = vsub(x.vec(j), vm);  // <= 0
        const vfloat e = vexp_neg(d);
        acc = vadd(acc, e);
        acc_h = vfma(e, d, acc_h);  // sum e (x - m), <= 0 term by term
      }
      float l = hsum(acc), sh = hsum(acc_h);
      for (int64_t j = Vv; j < V; ++j) {
        const float d = x.at(j) - m, e = std::exp(d);
        l += e;
        sh += e * d;
      }
      const float log_l = std::log(l);
      lsp[r] = m + log_l;
      lpp[r] = x.at(y[r]) - lsp[r];
      if (with_entropy) ep[r] = log_l - sh / l;  // sum p (lse - x) = log l - sum p (x - m)
    }
  });
  return {lp, ent, lse};
}

// Backward of logprob_rows, written over z (the chunk's logits, no longer needed): with x = z / temperature, p =
// exp(x - lse), d/dz = p * c + g_lp * onehot(target) with c = -(g_lp + g_ent * (x - lse + H)), where g_lp and g_ent
// arrive already divided by the temperature (g_ent may be undefined: no entropy gradient). One pass per row.
void logprob_rows_backward_(const Tensor& z, const Tensor& targets, const Tensor& lse, const Tensor& ent,
                            const Tensor& g_lp, const std::optional<Tensor>& g_ent, double temperature) {
  check_logits(z, targets);
  const int64_t N = z.size(0), V = z.size(1);
  for (const Tensor* t : {&lse, &ent, &g_lp})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == N && t->is_contiguous(),
                "lse, ent and g_lp must be contiguous float32 (rows,)");
  const float* ge = nullptr;
  if (g_ent.has_value()) {
    TORCH_CHECK(g_ent->scalar_type() == at::kFloat && g_ent->numel() == N && g_ent->is_contiguous(),
                "g_ent must be contiguous float32 (rows,)");
    ge = g_ent->const_data_ptr<float>();
  }
  const bool bf16 = z.scalar_type() == at::kBFloat16;
  const int64_t* y = targets.const_data_ptr<int64_t>();
  const float *lsp = lse.const_data_ptr<float>(), *ep = ent.const_data_ptr<float>(), *gl = g_lp.const_data_ptr<float>();
  char* base = static_cast<char*>(z.mutable_data_ptr());
  const int64_t elem = bf16 ? 2 : 4;
  const float inv_tau = static_cast<float>(1.0 / temperature);
  constexpr int64_t kBlock = 256;  // floats computed before their rounding pass
  at::parallel_for(0, N, 8, [&](int64_t lo, int64_t hi) {
    alignas(64) float buf[kBlock];
    for (int64_t r = lo; r < hi; ++r) {
      TORCH_CHECK(y[r] >= 0 && y[r] < V, "target ", y[r], " of row ", r, " is outside the vocabulary of ", V);
      char* row = base + r * V * elem;
      const LogitRow x{row, bf16, V, inv_tau};
      const float l = lsp[r], g1 = gl[r], g2 = ge != nullptr ? ge[r] : 0.0f;
      const float c0 = -(g1 + g2 * (ep[r] - l));  // c = c0 - g2 * x
      const vfloat vl = vset1(l), vc0 = vset1(c0), vg2 = vset1(g2);
      for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
        const int64_t n = std::min(kBlock, V - j0), nv = n / kW * kW;
        for (int64_t j = 0; j < nv; j += kW) {
          const vfloat xj = x.vec(j0 + j);
          const vfloat p = vexp_neg(vsub(xj, vl));
          vstore(buf + j, vmul(p, vsub(vc0, vmul(vg2, xj))));
        }
        for (int64_t j = nv; j < n; ++j) {
          const float xj = x.at(j0 + j);
          buf[j] = std::exp(xj - l) * (c0 - g2 * xj);
        }
        if (y[r] >= j0 && y[r] < j0 + n) buf[y[r] - j0] += g1;
        store(row, bf16, j0, buf, n);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(rlspmd_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? y, Tensor w, float eps) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int start, int H, "
        "int KV) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor mask) -> Tensor");
  m.def("logprob_rows(Tensor z, Tensor targets, float temperature, bool with_entropy) -> (Tensor, Tensor, Tensor)");
  m.def("logprob_rows_backward_(Tensor(a!) z, Tensor targets, Tensor lse, Tensor ent, Tensor g_lp, Tensor? g_ent, "
        "float temperature) -> ()");
  m.def("segment_attention(Tensor q, Tensor k, Tensor v, Tensor segs, float scale) -> (Tensor, Tensor)");
  m.def("segment_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor segs, "
        "Tensor groups, float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rlspmd_cpu, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_write", rope_write);
  m.impl("silu_mul", silu_mul);
  m.impl("decode_attention", decode_attention);
  m.impl("logprob_rows", logprob_rows);
  m.impl("logprob_rows_backward_", logprob_rows_backward_);
  m.impl("segment_attention", segment_attention);
  m.impl("segment_attention_backward", segment_attention_backward);
}
