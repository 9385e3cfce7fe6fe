// Decode attention over the paged KV cache, read in place: one query token per request,
// grouped-query attention. The torch path gathers every request's blocks into a buffer and
// calls scaled_dot_product_attention per layer; at one sequence that is ~15 dispatched ops and
// the pool woken several times per layer, and for a batch the gather copies the whole context.
//
// A request's keys are taken kSplitKeys at a time (flash-decoding, Dao et al. 2023): per split,
// in fp32, every query head's scores q.k * scale, their maximum m, e^(s - m), its sum l and the
// e^(s - m)-weighted sum of the values; the splits then merge in order (rescaled by e^(m_j - M)
// to their common maximum M). With AVX2 and a head_dim that is a multiple of 8 the scores are
// computed four keys at a time and the weighted sums in registers across a split's keys (FMA);
// otherwise by plain loops. The split size is fixed and a split is computed the same way
// whichever thread runs it, so a request's output does not depend on its batch or the thread
// count (exp is exp.h's polynomial, not libm's, so that it vectorizes and is the same on every
// machine).
#include "exp.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kSplitKeys = 256;
// Below this many multiply-adds a step's attention runs on the calling thread: waking the
// pool costs more than it saves at one or two short sequences.
constexpr int64_t kInlineWork = int64_t{1} << 19;

// s[t] = e^(s[t] - m) for s[t] <= m (softmax numerators).
inline void exp_shifted(float* s, int64_t n, float m) {
  for (int64_t t = 0; t < n; ++t) s[t] = tandem_cpu::exp_approx(s[t] - m);
}

// max of s[0..n), n >= 1, and the sum of s[0..n) in a fixed order (16 lanes, then halved
// pairwise): a chain of dependent scalar adds or maxes would bound the kernel.
inline float max_of(const float* s, int64_t n) {
  float lanes[16];
  for (int j = 0; j < 16; ++j) lanes[j] = s[0];
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
    for (int j = 0; j < 16; ++j) lanes[j] = lanes[j] > s[t + j] ? lanes[j] : s[t + j];
  for (; t < n; ++t) lanes[0] = lanes[0] > s[t] ? lanes[0] : s[t];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] = lanes[j] > lanes[j + w] ? lanes[j] : lanes[j + w];
  return lanes[0];
}

inline float sum_of(const float* s, int64_t n) {
  float lanes[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += s[t + j];
  for (; t < n; ++t) lanes[0] += s[t];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

#if defined(__AVX2__)
// Eight values widened to fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const double* p) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// The sum of q[i] * k[i] in a fixed order for this build: eight lanes, then the lanes halved
// pairwise (a chain of dependent scalar adds would bound the kernel).
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + i), load8(k + i)));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

// acc[i] += p * v[i].
template <typename T>
inline void add_scaled(float* acc, float p, const T* v, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(pv, load8(v + i))));
#endif
  for (; i < n; ++i) acc[i] += p * static_cast<float>(v[i]);
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Geometry {
  int64_t num_blocks, block_size, num_kv_heads, head_dim, num_heads, max_blocks;
  int64_t row() const { return num_kv_heads * head_dim; }  // one slot's keys (or values)
  int64_t group() const { return num_heads / num_kv_heads; }
};

// Calls f(row, t) for the cache rows of keys t in [first, last) of one request, in order.
template <typename T, typename F>
inline void for_each_row(const T* plane, const int32_t* table, int64_t first, int64_t last, const Geometry& g, F f) {
  for (int64_t t = first; t < last;) {
    const int64_t offset = t % g.block_size, count = std::min(g.block_size - offset, last - t);
    const T* rows = plane + (static_cast<int64_t>(table[t / g.block_size]) * g.block_size + offset) * g.row();
    for (int64_t o = 0; o < count; ++o) f(rows + o * g.row(), t + o);
    t += count;
  }
}

#if defined(__AVX2__)
// The four lane sums of a0..a3, each ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
inline __m128 sum_lanes4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// scores[t] = q . k_t * scale for the rows k[0..n) (D a multiple of 8), four keys at a time
// (four independent accumulators; a tail block repeats its first key and keeps only it).
template <typename T>
void scores_avx2(const float* q, const T* const* k, int64_t n, int64_t d, float scale, float* scores) {
  const __m128 sc = _mm_set1_ps(scale);
  for (int64_t t = 0; t < n; t += 4) {
    const T* r0 = k[t];
    const T* r1 = t + 1 < n ? k[t + 1] : r0;
    const T* r2 = t + 2 < n ? k[t + 2] : r0;
    const T* r3 = t + 3 < n ? k[t + 3] : r0;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
      a0 = _mm256_fmadd_ps(qv, load8(r0 + c), a0);
      a1 = _mm256_fmadd_ps(qv, load8(r1 + c), a1);
      a2 = _mm256_fmadd_ps(qv, load8(r2 + c), a2);
      a3 = _mm256_fmadd_ps(qv, load8(r3 + c), a3);
    }
    alignas(16) float out[4];
    _mm_store_ps(out, _mm_mul_ps(sum_lanes4(a0, a1, a2, a3), sc));
    for (int64_t j = 0; j < 4 && t + j < n; ++j) scores[t + j] = out[j];
  }
}

// acc[0..8N) = sum_t p[t] * v_t[0..8N) (in key order), the accumulators held in registers.
template <int N, typename T>
void weighted_sum_avx2(const float* p, const T* const* v, int64_t n, int64_t offset, float* acc) {
  __m256 a[N];
  for (int j = 0; j < N; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    const T* row = v[t] + offset;
    for (int j = 0; j < N; ++j) a[j] = _mm256_fmadd_ps(pt, load8(row + 8 * j), a[j]);
  }
  for (int j = 0; j < N; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

// acc[0..D) = sum_t p[t] * v_t[0..D), D a multiple of 8, in blocks of up to 64 values.
template <typename T>
void weighted_sum_rows_avx2(const float* p, const T* const* v, int64_t n, int64_t d, float* acc) {
  for (int64_t c = 0; c < d; c += 64) {
    switch (std::min<int64_t>(8, (d - c) / 8)) {
      case 8: weighted_sum_avx2<8>(p, v, n, c, acc + c); break;
      case 7: weighted_sum_avx2<7>(p, v, n, c, acc + c); break;
      case 6: weighted_sum_avx2<6>(p, v, n, c, acc + c); break;
      case 5: weighted_sum_avx2<5>(p, v, n, c, acc + c); break;
      case 4: weighted_sum_avx2<4>(p, v, n, c, acc + c); break;
      case 3: weighted_sum_avx2<3>(p, v, n, c, acc + c); break;
      case 2: weighted_sum_avx2<2>(p, v, n, c, acc + c); break;
      default: weighted_sum_avx2<1>(p, v, n, c, acc + c); break;
    }
  }
}
#endif

// One split of one request: keys [first, last). Writes m [Hq], l [Hq] and acc [Hq, D] (the
// unnormalized weighted sum of the values). q: [Hq, D] rows q_head_stride apart.
template <typename T>
void attend_split(const T* q, int64_t q_head_stride, const T* keys, const T* values, const int32_t* table,
                  int64_t first, int64_t last, const Geometry& g, float scale, float* m, float* l, float* acc,
                  std::vector<float>& buf, std::vector<const T*>& rows) {
  const int64_t d = g.head_dim, hq = g.num_heads, group = g.group(), n = last - first;
  buf.resize(static_cast<size_t>(hq * d + hq * n));
  float* qf = buf.data();
  float* scores = qf + hq * d;  // [Hq, n]
  for (int64_t i = 0; i < hq; ++i) widen(q + i * q_head_stride, qf + i * d, d);
  rows.resize(static_cast<size_t>(n));
  for_each_row(keys, table, first, last, g, [&](const T* k, int64_t t) { rows[t - first] = k; });
  const int64_t to_values = values - keys;
#if defined(__AVX2__)
  if (d % 8 == 0) {
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      if (h) for (auto& r : rows) r += d;  // the rows' pointers at KV head h
      for (int64_t i = h * group; i < (h + 1) * group; ++i)
        scores_avx2(qf + i * d, rows.data(), n, d, scale, scores + i * n);
    }
    for (auto& r : rows) r += to_values - (g.num_kv_heads - 1) * d;  // the values of KV head 0
    for (int64_t i = 0; i < hq; ++i) {
      float* s = scores + i * n;
      m[i] = max_of(s, n);
      exp_shifted(s, n, m[i]);
      l[i] = sum_of(s, n);
    }
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      if (h) for (auto& r : rows) r += d;
      for (int64_t i = h * group; i < (h + 1) * group; ++i)
        weighted_sum_rows_avx2(scores + i * n, rows.data(), n, d, acc + i * d);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < hq; ++i) scores[i * n + t] = dot(qf + i * d, rows[t] + i / group * d, d) * scale;
  for (int64_t i = 0; i < hq; ++i) {
    float* s = scores + i * n;
    m[i] = max_of(s, n);
    exp_shifted(s, n, m[i]);
    l[i] = sum_of(s, n);
  }
  std::fill(acc, acc + hq * d, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < hq; ++i) add_scaled(acc + i * d, scores[i * n + t], rows[t] + to_values + i / group * d, d);
}

// out [Hq, D] of one request from its `splits` partials (m, l, acc per split, in order).
template <typename T>
void merge_splits(const float* partials, int64_t splits, const Geometry& g, T* out, std::vector<float>& w) {
  const int64_t d = g.head_dim, hq = g.num_heads, stride = hq * (d + 2);
  w.resize(static_cast<size_t>(splits));
  for (int64_t i = 0; i < hq; ++i) {
    float top = partials[i];
    for (int64_t j = 1; j < splits; ++j) top = std::max(top, partials[j * stride + i]);
    for (int64_t j = 0; j < splits; ++j) w[j] = partials[j * stride + i];
    exp_shifted(w.data(), splits, top);  // e^(m_j - M): exactly 1 for the split holding the maximum
    float total = 0.f;
    for (int64_t j = 0; j < splits; ++j) total += partials[j * stride + hq + i] * w[j];
    const float inv = 1.f / total;
    for (int64_t c = 0; c < d; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < splits; ++j) sum += partials[j * stride + 2 * hq + i * d + c] * w[j];
      out[i * d + c] = static_cast<T>(sum * inv);
    }
  }
}

}  // namespace

namespace tandem_cpu {

at::Tensor paged_attention_decode(const at::Tensor& q_in, const at::Tensor& kv_cache, const at::Tensor& tables_in,
                                  const at::Tensor& seq_lens_in, double scale) {
  const char* op = "paged_attention_decode";
  TORCH_CHECK(q_in.device().is_cpu() && kv_cache.device().is_cpu() && tables_in.device().is_cpu() &&
                  seq_lens_in.device().is_cpu(),
              op, ": CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3, op, ": q must be [num_seqs, num_heads, head_dim], got ", q_in.sizes());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), op,
              ": kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim], got ",
              kv_cache.sizes());
  TORCH_CHECK(kv_cache.scalar_type() == q_in.scalar_type(), op, ": kv_cache dtype ", kv_cache.scalar_type(),
              " is not q's ", q_in.scalar_type());
  const int64_t n = q_in.size(0), hq = q_in.size(1), d = q_in.size(2);
  Geometry g{kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), kv_cache.size(4), hq, 0};
  TORCH_CHECK(g.head_dim == d && g.num_kv_heads > 0 && hq % g.num_kv_heads == 0, op, ": q ", q_in.sizes(),
              " does not fit kv_cache ", kv_cache.sizes(), " (head_dim, and num_heads a multiple of num_kv_heads)");
  TORCH_CHECK(tables_in.dim() == 2 && tables_in.size(0) >= n && tables_in.scalar_type() == at::kInt, op,
              ": block_tables must be int32 [>= ", n, ", max_blocks], got ", tables_in.sizes(), " ",
              tables_in.scalar_type());
  TORCH_CHECK(seq_lens_in.dim() == 1 && seq_lens_in.size(0) >= n && seq_lens_in.scalar_type() == at::kInt, op,
              ": seq_lens must be int32 [>= ", n, "], got ", seq_lens_in.sizes(), " ", seq_lens_in.scalar_type());
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor tables = tables_in.contiguous(), seq_lens = seq_lens_in.contiguous();
  g.max_blocks = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  // Tasks: (request, split), requests in order; first_task[r] indexes a request's first split.
  std::vector<int64_t> first_task(static_cast<size_t>(n + 1), 0);
  int64_t work = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t len = lp[r];
    TORCH_CHECK(len >= 1 && len <= g.max_blocks * g.block_size, op, ": seq_lens[", r, "] = ", len,
                " outside [1, max_blocks * block_size = ", g.max_blocks * g.block_size, "]");
    for (int64_t b = 0; b < (len + g.block_size - 1) / g.block_size; ++b) {
      const int64_t id = tp[r * g.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < g.num_blocks, op, ": block_tables[", r, ", ", b, "] = ", id, " outside [0, ",
                  g.num_blocks, ")");
    }
    first_task[r + 1] = first_task[r] + (len + kSplitKeys - 1) / kSplitKeys;
    work += len * hq * d * 2;
  }
  const int64_t tasks = first_task[n], stride = hq * (d + 2);
  std::vector<int64_t> task_req(static_cast<size_t>(tasks));
  for (int64_t r = 0; r < n; ++r) std::fill(task_req.begin() + first_task[r], task_req.begin() + first_task[r + 1], r);
  std::vector<float> partials(static_cast<size_t>(tasks * stride));
  at::Tensor out = at::empty({n, hq, d}, q.options());
  const bool inline_work = work < kInlineWork;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* keys = kv_cache.data_ptr<scalar_t>();
    const scalar_t* values = keys + kv_cache.stride(0);
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, inline_work ? tasks + 1 : 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      std::vector<const scalar_t*> rows;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task_req[task], first = (task - first_task[r]) * kSplitKeys;
        float* part = partials.data() + task * stride;
        attend_split(qp + r * q.stride(0), q.stride(1), keys, values, tp + r * g.max_blocks, first,
                     std::min<int64_t>(first + kSplitKeys, lp[r]), g, static_cast<float>(scale), part, part + hq,
                     part + 2 * hq, buf, rows);
      }
    });
    at::parallel_for(0, n, inline_work ? n + 1 : 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w;
      for (int64_t r = begin; r < end; ++r)
        merge_splits(partials.data() + first_task[r] * stride, first_task[r + 1] - first_task[r], g,
                     outp + r * hq * d, w);
    });
  });
  return out;
}

}  // namespace tandem_cpu
