// Fused elementwise kernels for the eager CPU decode step in bfloat16, built at first use by rlspmd/models/cpu_kernels.py.
// Each computes in float32 and rounds to bfloat16 exactly where the torch ops it replaces do (every torch op on bfloat16
// rounds its own result), so it returns the same bits as those ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace

TORCH_LIBRARY(rlspmd_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? y, Tensor w, float eps) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int start, int H, "
        "int KV) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlspmd_cpu, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_write", rope_write);
  m.impl("silu_mul", silu_mul);
}
