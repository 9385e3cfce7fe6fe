// y = x W^T + b with W in GGUF blocks (gguf_quants.h), many rows of x at a time: the GEMM for
// prompt rows and steps of more than a few generated rows, where the row kernel
// (gguf_linear.cpp) would multiply each row on its own. x is quantized to int8 per 32 values
// (llama.cpp's Q8_0, for every type), W is unpacked tile by tile (16 rows of one segment, the
// whole input width) to unsigned 8-bit values u, w = s u + o with s and o per group of G
// columns (G = 16 for Q6_K, 32 otherwise), in a layout where one 512-bit vector holds four
// columns of all 16 rows (each row's group expanded in registers as the row kernel does, then
// transposed in 32-bit runs); VNNI's dpbusd multiplies it by four values of one row of x
// broadcast, so an int32 lane sums one weight row's products and the group's scaling is one
// vector operation for 16 rows:
//
//   y[m, n] = sum over groups g of fma(float(sum_j u[n, j] q[m, j]), s[n, g] dx[m, g], .)
//             then fma(o[n, g], dx[m, g] sum_j q[m, j], .)          (in this order, from 0)
//
// Each value of y is a function of its row of x only, computed in the same order whatever the
// rows around it (batch-invariant; the scalar code without VNNI does the same fused
// multiply-adds in the same order). Unpacking a tile costs about two passes of the row kernel
// over its rows, repaid from about four rows of x on (RESULTS).
#include "gguf_quants.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace tandem_cpu::gguf;

// Weight rows of a tile: one int32 lane of a 512-bit vector each.
constexpr int kTileRows = 16;
// Rows of x per pass over a tile (their accumulators stay in registers).
constexpr int kXRows = 8;

// Up to 16 weight rows of one segment, unpacked for the whole input width: u in runs of four
// columns interleaved over the rows (u[64 (k / 4) + 4 r + k % 4] is row r's value at column
// k), s and o per group and row ([in / G, 16]).
struct Tile {
  std::vector<uint8_t> u;
  std::vector<float> s, o;
};

// Columns [32 c, 32 c + 32) of the tile's rows (u[r] row r's values) into the layout.
inline void put_group(const U32* const* u, int64_t c, Tile* t) {
  uint8_t* dst = t->u.data() + 8 * 64 * c;
#ifdef TANDEM_GGUF_VNNI
  // Two 8 x 8 transposes of 32-bit runs (rows 0-7 and 8-15), each row's run k to lane r of
  // vector k.
  __m256i col[2][8];
  for (int h = 0; h < 2; ++h) {
    __m256i a[8], b[8];
    for (int r = 0; r < 8; ++r) a[r] = *u[8 * h + r];
    for (int r = 0; r < 8; r += 2) {
      b[r] = _mm256_unpacklo_epi32(a[r], a[r + 1]);
      b[r + 1] = _mm256_unpackhi_epi32(a[r], a[r + 1]);
    }
    for (int r = 0; r < 8; r += 4) {
      a[r] = _mm256_unpacklo_epi64(b[r], b[r + 2]);
      a[r + 1] = _mm256_unpackhi_epi64(b[r], b[r + 2]);
      a[r + 2] = _mm256_unpacklo_epi64(b[r + 1], b[r + 3]);
      a[r + 3] = _mm256_unpackhi_epi64(b[r + 1], b[r + 3]);
    }
    for (int k = 0; k < 4; ++k) {
      col[h][k] = _mm256_permute2x128_si256(a[k], a[k + 4], 0x20);
      col[h][k + 4] = _mm256_permute2x128_si256(a[k], a[k + 4], 0x31);
    }
  }
  for (int k = 0; k < 8; ++k)
    _mm512_storeu_si512(dst + 64 * k, _mm512_inserti64x4(_mm512_castsi256_si512(col[0][k]), col[1][k], 1));
#else
  for (int r = 0; r < kTileRows; ++r)
    for (int k = 0; k < 8; ++k) std::memcpy(dst + 64 * k + 4 * r, u[r]->v + 4 * k, 4);
#endif
}

// The tile of rows [r0, r0 + rows) of a segment; rows past `rows` are zeros (their outputs
// are not stored).
template <int64_t Type>
void unpack(const Segment& seg, int64_t r0, int rows, int64_t in, Tile* t) {
  const U32* u[kTileRows];
  if constexpr (is_k_quant(Type)) {
    KBlock kb[kTileRows] = {};
    for (int64_t blk = 0; blk < in / 256; ++blk) {
      for (int r = 0; r < rows; ++r) expand_k<Type>(seg.data + (r0 + r) * seg.row_bytes + blk * seg.info.bytes, &kb[r]);
      for (int g = 0; g < 8; ++g) {
        for (int r = 0; r < kTileRows; ++r) u[r] = &kb[r].u[g];
        put_group(u, 8 * blk + g, t);
        for (int r = 0; r < kTileRows; ++r) {
          if constexpr (Type == kQ6_K) {
            for (int h = 0; h < 2; ++h) {
              t->s[16 * (16 * blk + 2 * g + h) + r] = kb[r].d * kb[r].sc[g][h];
              t->o[16 * (16 * blk + 2 * g + h) + r] = kb[r].off[2 * g + h];
            }
          } else {
            t->s[16 * (8 * blk + g) + r] = kb[r].d * kb[r].sc[g][0];
            t->o[16 * (8 * blk + g) + r] = kb[r].off[g];
          }
        }
      }
    }
  } else {
    U32 v[kTileRows] = {};
    float s[kTileRows] = {}, o[kTileRows] = {};
    for (int r = 0; r < kTileRows; ++r) u[r] = &v[r];
    for (int64_t blk = 0; blk < in / 32; ++blk) {
      for (int r = 0; r < rows; ++r)
        v[r] = expand32<Type>(seg.data + (r0 + r) * seg.row_bytes + blk * seg.info.bytes, &s[r], &o[r]);
      put_group(u, blk, t);
      std::memcpy(t->s.data() + 16 * blk, s, sizeof(s));
      std::memcpy(t->o.data() + 16 * blk, o, sizeof(o));
    }
  }
}

void unpack_tile(const Segment& seg, int64_t r0, int rows, int64_t in, Tile* t) {
  switch (seg.type) {
    case kQ4_0: return unpack<kQ4_0>(seg, r0, rows, in, t);
    case kQ4_1: return unpack<kQ4_1>(seg, r0, rows, in, t);
    case kQ5_0: return unpack<kQ5_0>(seg, r0, rows, in, t);
    case kQ5_1: return unpack<kQ5_1>(seg, r0, rows, in, t);
    case kQ8_0: return unpack<kQ8_0>(seg, r0, rows, in, t);
    case kQ4_K: return unpack<kQ4_K>(seg, r0, rows, in, t);
    case kQ5_K: return unpack<kQ5_K>(seg, r0, rows, in, t);
    default: return unpack<kQ6_K>(seg, r0, rows, in, t);
  }
}

// Rows [m0, m0 + MR) of x times a tile's `rows` weight rows, into y (fp32, row stride `out`,
// already at the tile's first column).
template <int G, int MR>
void multiply(const Tile& t, const QuantizedX& qx, int64_t m0, int64_t in, int rows, float* y, int64_t out) {
  const int64_t groups = in / G;
  const float* dsum = G == 16 ? qx.dsum.data() : qx.dsum32.data();
#ifdef TANDEM_GGUF_VNNI
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = t.u.data() + 64 * (G / 4) * g;
    // Independent chains of dpbusd (integer sums: their order does not change a bit): with
    // few rows one chain would wait on its own latency.
    constexpr int C = MR >= 4 ? 1 : 4 / MR;
    __m512i chain[MR][C];
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < C; ++c) chain[m][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < G / 4; ++k) {
      const __m512i wv = _mm512_loadu_si512(w + 64 * k);
      for (int m = 0; m < MR; ++m) {
        int32_t xv;
        std::memcpy(&xv, qx.q.data() + (m0 + m) * in + G * g + 4 * k, 4);
        chain[m][k % C] = _mm512_dpbusd_epi32(chain[m][k % C], wv, _mm512_set1_epi32(xv));
      }
    }
    __m512i isum[MR];
    for (int m = 0; m < MR; ++m) {
      isum[m] = chain[m][0];
      for (int c = 1; c < C; ++c) isum[m] = _mm512_add_epi32(isum[m], chain[m][c]);
    }
    const __m512 sv = _mm512_loadu_ps(t.s.data() + 16 * g), ov = _mm512_loadu_ps(t.o.data() + 16 * g);
    for (int m = 0; m < MR; ++m) {
      const float dx = qx.d[(m0 + m) * (in / 32) + G * g / 32];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(sv, _mm512_set1_ps(dx)), acc[m]);
      acc[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(dsum[(m0 + m) * groups + g]), acc[m]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * out, mask, acc[m]);
#else
  for (int m = 0; m < MR; ++m) {
    const int8_t* q = qx.q.data() + (m0 + m) * in;
    for (int r = 0; r < rows; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t isum = 0;
        for (int j = 0; j < G; ++j) {
          const int64_t k = G * g + j;
          isum += t.u[64 * (k / 4) + 4 * r + k % 4] * q[k];
        }
        const float dx = qx.d[(m0 + m) * (in / 32) + G * g / 32];
        acc = std::fma(static_cast<float>(isum), t.s[16 * g + r] * dx, acc);
        acc = std::fma(t.o[16 * g + r], dsum[(m0 + m) * groups + g], acc);
      }
      y[(m0 + m) * out + r] = acc;
    }
  }
#endif
}

template <int G>
void multiply_all(const Tile& t, const QuantizedX& qx, int64_t t_rows, int64_t in, int rows, float* y, int64_t out) {
  int64_t m0 = 0;
  for (; m0 + kXRows <= t_rows; m0 += kXRows) multiply<G, kXRows>(t, qx, m0, in, rows, y, out);
  switch (t_rows - m0) {
    case 7: return multiply<G, 7>(t, qx, m0, in, rows, y, out);
    case 6: return multiply<G, 6>(t, qx, m0, in, rows, y, out);
    case 5: return multiply<G, 5>(t, qx, m0, in, rows, y, out);
    case 4: return multiply<G, 4>(t, qx, m0, in, rows, y, out);
    case 3: return multiply<G, 3>(t, qx, m0, in, rows, y, out);
    case 2: return multiply<G, 2>(t, qx, m0, in, rows, y, out);
    case 1: return multiply<G, 1>(t, qx, m0, in, rows, y, out);
    default: return;
  }
}

struct TileRef {
  const Segment* seg;
  int64_t r0;
  int rows;
};

}  // namespace

namespace tandem_cpu {

namespace gguf {

at::Tensor gemm(const at::Tensor& x_in, const LinearCall& call, const std::optional<at::Tensor>& bias) {
  const int64_t t_rows = x_in.size(0), in = x_in.size(1), out = call.out;
  std::vector<TileRef> tiles;
  for (const Segment& s : call.segs)
    for (int64_t r0 = 0; r0 < s.rows; r0 += kTileRows)
      tiles.push_back({&s, r0, static_cast<int>(std::min<int64_t>(kTileRows, s.rows - r0))});
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({t_rows, out}, x.options());
  if (t_rows > 0) {
    QuantizedX qx;
    quantize_x32(x.data_ptr<float>(), t_rows, in, &qx);
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      Tile t{std::vector<uint8_t>(16 * in), std::vector<float>(in), std::vector<float>(in)};
      for (int64_t i = begin; i < end; ++i) {
        const TileRef& tr = tiles[i];
        unpack_tile(*tr.seg, tr.r0, tr.rows, in, &t);
        float* yt = yp + tr.seg->first_row + tr.r0;
        if (tr.seg->type == kQ6_K) {
          multiply_all<16>(t, qx, t_rows, in, tr.rows, yt, out);
        } else {
          multiply_all<32>(t, qx, t_rows, in, tr.rows, yt, out);
        }
      }
    });
  }
  return finish_linear(y, bias, x_in.scalar_type());
}

}  // namespace gguf

at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& segments,
                     const std::optional<at::Tensor>& bias) {
  return gguf::gemm(x, gguf::parse_linear(x, blocks, segments, bias, "gguf_gemm"), bias);
}

}  // namespace tandem_cpu
