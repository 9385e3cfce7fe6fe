// y = x W^T + b with W GGUF blocks repacked once, at load, into tiles of 16 weight rows laid
// out for AVX512-VNNI's u8 x s8 dot product (llama.cpp repacks its CPU weights likewise, its
// Q4_0x8 and kin), so that a call only streams the tiles: no unpacking, no transposing, and
// every row count runs the same code.
//
// Arithmetic (llama.cpp's CPU dot products, per 32): each row of x is quantized to int8 per 32
// values (dx = max|x| / 127, rounded to nearest even); the weights are the file's values u with
// w = s u + o per group of 32 columns (gguf_quants.h expands them), and
//
//   y[m, n] = sum over groups g of fma(float(sum_j u[n, j] q[m, j]), s[n, g] dx[m, g], .)
//             then fma(o[n, g], dx[m, g] sum_j q[m, j], .)          (in this order, from 0)
//
// except Q6_K, whose w = d sc (u - 32) has an integer scale sc per 16 columns: its whole group
// is one integer, as llama.cpp sums it,
//
//   y[m, n] = sum over groups g of fma(float(sum over halves of sc (sum_j u q - 32 sum_j q)),
//                                      d[n] dx[m, g], .)
//
// (|the integer| < 2^24, so exact in fp32). The integer sums are exact; s and o are products
// exact in fp32 (an fp16 times an integer of at most 8 bits, or a power of two). Each value of
// y is a function of its row of x only, in the same order whatever the rows around it
// (batch-invariant; the scalar code without VNNI does the same fused multiply-adds in the same
// order). The only error besides fp32 rounding is x's int8 rounding.
//
// Layout. One 512-bit vector of u holds four columns of all 16 rows (u[64 (k / 4) + 4 r + k % 4]
// is row r's value at column k of a group of 32: eight such vectors v0..v7 per group), and
// dpbusd multiplies it by four broadcast int8 values of x (one int32 lane per weight row), so a
// group's scaling is one vector operation for 16 rows. Each weight keeps the file's bits:
// u as 4-bit nibbles (four 64-byte vectors whose low nibbles are v0..v3, high nibbles v4..v7),
// plus for five bits one vector holding bit 4 of v_j's bytes at bit j (Q5_0, Q5_1, Q5_K), for
// six bits two holding bits 4-5 of v0..v3 (v4..v7) at bits 2j, 2j + 1 (Q6_K), or whole bytes
// (Q8_0); the scales as the file has them. A tile is a run of chunks, one per block column (32
// weights, 256 for a K-quant), each a header then its groups' values:
//   32-weight types: d [16] fp16 (row r at r), then m [16] fp16 for Q4_1 / Q5_1;
//   Q4_K / Q5_K: d [16], dmin [16] fp16, sc [8][16], m [8][16] uint8 (group, row);
//   Q6_K: d [16] fp16, sc [16][16] int8 (16-column group, row).
// A layer's tiles are its segments' (a fused layer's parts, each of its own type) one after
// another; `segments` [S, 3] int64 holds each one's GGML type id, row count and byte offset in
// the repacked bytes.
#include "gguf_quants.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace tandem_cpu::gguf;

constexpr int kXRows = 8;

constexpr int value_bits(int64_t type) {
  return type == kQ8_0 ? 8 : type == kQ6_K ? 6 : (type == kQ5_0 || type == kQ5_1 || type == kQ5_K) ? 5 : 4;
}
constexpr bool has_min32(int64_t type) { return type == kQ4_1 || type == kQ5_1; }
// Bytes of one group of 32 columns' values in a tile.
constexpr int64_t group_bytes(int64_t type) {
  return value_bits(type) == 8 ? 512 : 256 + 64 * (value_bits(type) - 4);
}
constexpr int64_t header_bytes(int64_t type) {
  return type == kQ6_K ? 32 + 256 : is_k_quant(type) ? 32 + 32 + 128 + 128 : has_min32(type) ? 64 : 32;
}
constexpr int64_t chunk_columns(int64_t type) { return is_k_quant(type) ? 256 : 32; }
constexpr int64_t chunk_bytes(int64_t type) {
  return header_bytes(type) + chunk_columns(type) / 32 * group_bytes(type);
}

int64_t tile_bytes_of(int64_t type, int64_t in) {
  switch (type) {
#define TANDEM_CASE(T) \
  case T: return in / chunk_columns(T) * chunk_bytes(T);
    TANDEM_CASE(kQ4_0) TANDEM_CASE(kQ4_1) TANDEM_CASE(kQ5_0) TANDEM_CASE(kQ5_1) TANDEM_CASE(kQ8_0)
    TANDEM_CASE(kQ4_K) TANDEM_CASE(kQ5_K) TANDEM_CASE(kQ6_K)
#undef TANDEM_CASE
    default: return 0;
  }
}

int64_t tiles_of(int64_t rows) { return (rows + kTileRows - 1) / kTileRows; }

// ------------------------------------------------------------------ repacking (once, at load)

// One group's values (t.u from column 32 c, eight 64-byte vectors) into `bits`' layout at dst.
void pack_values(const uint8_t* u, int bits, uint8_t* dst) {
  if (bits == 8) {
    std::memcpy(dst, u, 512);
    return;
  }
  for (int v = 0; v < 4; ++v)
    for (int i = 0; i < 64; ++i) dst[64 * v + i] = (u[64 * v + i] & 0xF) | ((u[64 * (v + 4) + i] & 0xF) << 4);
  uint8_t* hb = dst + 256;
  if (bits == 5) {
    for (int i = 0; i < 64; ++i) {
      uint8_t b = 0;
      for (int v = 0; v < 8; ++v) b |= ((u[64 * v + i] >> 4) & 1) << v;
      hb[i] = b;
    }
  } else if (bits == 6) {
    for (int half = 0; half < 2; ++half)
      for (int i = 0; i < 64; ++i) {
        uint8_t b = 0;
        for (int j = 0; j < 4; ++j) b |= ((u[64 * (4 * half + j) + i] >> 4) & 3) << (2 * j);
        hb[64 * half + i] = b;
      }
  }
}

inline void put_fp16(uint8_t* dst, const uint8_t* src) { std::memcpy(dst, src, 2); }

// A tile's chunk headers from the blocks of rows [r0, r0 + rows) (rows past `rows` are zeros).
void pack_headers(const Segment& seg, int64_t r0, int rows, int64_t in, uint8_t* tile) {
  const int64_t type = seg.type, chunks = in / chunk_columns(type);
  for (int64_t c = 0; c < chunks; ++c) {
    uint8_t* h = tile + c * chunk_bytes(type);
    std::memset(h, 0, header_bytes(type));
    for (int r = 0; r < rows; ++r) {
      const uint8_t* b = seg.data + (r0 + r) * seg.row_bytes + c * seg.info.bytes;
      if (type == kQ6_K) {
        put_fp16(h + 2 * r, b + 208);
        for (int g = 0; g < 16; ++g) h[32 + 16 * g + r] = b[192 + g];
      } else if (is_k_quant(type)) {
        put_fp16(h + 2 * r, b);
        put_fp16(h + 32 + 2 * r, b + 2);
        uint8_t sc[8], m[8];
        scales_mins_k4(b + 4, sc, m);
        for (int g = 0; g < 8; ++g) {
          h[64 + 16 * g + r] = sc[g];
          h[192 + 16 * g + r] = m[g];
        }
      } else {
        put_fp16(h + 2 * r, b);
        if (has_min32(type)) put_fp16(h + 32 + 2 * r, b + 2);
      }
    }
  }
}

void pack_tile(const Segment& seg, int64_t r0, int rows, int64_t in, Tile* t, uint8_t* tile) {
  unpack_tile(seg, r0, rows, in, t);
  pack_headers(seg, r0, rows, in, tile);
  const int64_t type = seg.type, per_chunk = chunk_columns(type) / 32;
  for (int64_t g = 0; g < in / 32; ++g) {
    uint8_t* dst = tile + g / per_chunk * chunk_bytes(type) + header_bytes(type) + g % per_chunk * group_bytes(type);
    pack_values(t->u.data() + 8 * 64 * g, value_bits(type), dst);
  }
}

// ------------------------------------------------------------------ the multiply

// Scales s and offsets o of one group of 32 columns (its two halves of 16 for Q6_K) for a
// tile's 16 rows, from the chunk header h (g: the group within the chunk); exact products.
struct GroupScales {
  float s[2][16], o[2][16];
};

template <int64_t Type>
void group_scales(const uint8_t* h, int g, GroupScales* gs) {
  for (int r = 0; r < kTileRows; ++r) {
    const float d = fp16(h + 2 * r);
    if constexpr (Type == kQ6_K) {
      for (int half = 0; half < 2; ++half) {
        const float sc = static_cast<float>(static_cast<int8_t>(h[32 + 16 * (2 * g + half) + r]));
        gs->s[half][r] = d * sc;
        gs->o[half][r] = sc * (d * -32.0f);
      }
    } else if constexpr (is_k_quant(Type)) {
      gs->s[0][r] = gs->s[1][r] = d * static_cast<float>(h[64 + 16 * g + r]);
      gs->o[0][r] = gs->o[1][r] = static_cast<float>(h[192 + 16 * g + r]) * -fp16(h + 32 + 2 * r);
    } else {
      constexpr float off = Type == kQ8_0 ? -128.0f : Type == kQ5_0 ? -16.0f : -8.0f;
      gs->s[0][r] = gs->s[1][r] = d;
      gs->o[0][r] = gs->o[1][r] = has_min32(Type) ? fp16(h + 32 + 2 * r) : -d * -off;
    }
  }
}

// Value u of row r at column k (< 32) of a group's packed values.
inline int value_at(const uint8_t* p, int bits, int r, int k) {
  const int v = k / 4, i = 4 * r + k % 4;
  if (bits == 8) return p[64 * v + i];
  int u = (p[64 * (v % 4) + i] >> (v < 4 ? 0 : 4)) & 0xF;
  if (bits == 5) u |= ((p[256 + i] >> v) & 1) << 4;
  if (bits == 6) u |= ((p[256 + 64 * (v / 4) + i] >> (2 * (v % 4))) & 3) << 4;
  return u;
}

// Row r of a tile dequantized: s u + o per value (the product exact in fp32, one rounding at
// the sum: gguf's own dequantized values, whose products are exact too).
template <int64_t Type>
void dequantize_row(const uint8_t* tile, int r, int64_t in, float* dst) {
  constexpr int per_chunk = static_cast<int>(chunk_columns(Type) / 32);
  for (int64_t g = 0; g < in / 32; ++g) {
    const uint8_t* h = tile + g / per_chunk * chunk_bytes(Type);
    const uint8_t* p = h + header_bytes(Type) + g % per_chunk * group_bytes(Type);
    GroupScales gs;
    group_scales<Type>(h, static_cast<int>(g % per_chunk), &gs);
    for (int k = 0; k < 32; ++k)
      dst[32 * g + k] = gs.s[k / 16][r] * static_cast<float>(value_at(p, value_bits(Type), r, k)) + gs.o[k / 16][r];
  }
}

void dequantize_tile_row(int64_t type, const uint8_t* tile, int r, int64_t in, float* dst) {
  switch (type) {
    case kQ4_0: return dequantize_row<kQ4_0>(tile, r, in, dst);
    case kQ4_1: return dequantize_row<kQ4_1>(tile, r, in, dst);
    case kQ5_0: return dequantize_row<kQ5_0>(tile, r, in, dst);
    case kQ5_1: return dequantize_row<kQ5_1>(tile, r, in, dst);
    case kQ8_0: return dequantize_row<kQ8_0>(tile, r, in, dst);
    case kQ4_K: return dequantize_row<kQ4_K>(tile, r, in, dst);
    case kQ5_K: return dequantize_row<kQ5_K>(tile, r, in, dst);
    default: return dequantize_row<kQ6_K>(tile, r, in, dst);
  }
}

#ifdef TANDEM_GGUF_VNNI
// group_scales for the 16 rows at once (the types scaled in fp32: all but Q6_K).
struct GroupScalesV {
  __m512 s, o;
};

inline __m512 negate(__m512 v) { return _mm512_xor_ps(v, _mm512_set1_ps(-0.0f)); }

template <int64_t Type>
inline void chunk_scales(const uint8_t* h, int g, GroupScalesV* gs) {
  static_assert(Type != kQ6_K, "Q6_K scales its integer sums");
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  if constexpr (is_k_quant(Type)) {
    auto bytes = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)));
    gs->s = _mm512_mul_ps(d, bytes(h + 64 + 16 * g));
    gs->o = _mm512_mul_ps(bytes(h + 192 + 16 * g), negate(dmin));
  } else {
    gs->s = d;
    if constexpr (has_min32(Type)) {
      gs->o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32)));
    } else {
      constexpr float off = Type == kQ8_0 ? -128.0f : Type == kQ5_0 ? -16.0f : -8.0f;
      gs->o = _mm512_mul_ps(negate(d), _mm512_set1_ps(-off));
    }
  }
}

template <int Bits>
inline void load_values(const uint8_t* p, __m512i* u) {
  auto ld = [](const uint8_t* q) { return _mm512_loadu_si512(q); };
  if constexpr (Bits == 8) {
    for (int k = 0; k < 8; ++k) u[k] = ld(p + 64 * k);
  } else {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m512i n = ld(p + 64 * v);
      u[v] = _mm512_and_si512(n, lo);
      u[v + 4] = _mm512_and_si512(_mm512_srli_epi16(n, 4), lo);
    }
    if constexpr (Bits == 5) {
      const __m512i hb = ld(p + 256), bit = _mm512_set1_epi8(0x10);
      u[0] = _mm512_or_si512(u[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), bit));
      u[1] = _mm512_or_si512(u[1], _mm512_and_si512(_mm512_slli_epi16(hb, 3), bit));
      u[2] = _mm512_or_si512(u[2], _mm512_and_si512(_mm512_slli_epi16(hb, 2), bit));
      u[3] = _mm512_or_si512(u[3], _mm512_and_si512(_mm512_slli_epi16(hb, 1), bit));
      u[4] = _mm512_or_si512(u[4], _mm512_and_si512(hb, bit));
      u[5] = _mm512_or_si512(u[5], _mm512_and_si512(_mm512_srli_epi16(hb, 1), bit));
      u[6] = _mm512_or_si512(u[6], _mm512_and_si512(_mm512_srli_epi16(hb, 2), bit));
      u[7] = _mm512_or_si512(u[7], _mm512_and_si512(_mm512_srli_epi16(hb, 3), bit));
    } else if constexpr (Bits == 6) {
      const __m512i bits = _mm512_set1_epi8(0x30);
      for (int half = 0; half < 2; ++half) {
        const __m512i hb = ld(p + 256 + 64 * half);
        u[4 * half] = _mm512_or_si512(u[4 * half], _mm512_and_si512(_mm512_slli_epi16(hb, 4), bits));
        u[4 * half + 1] = _mm512_or_si512(u[4 * half + 1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), bits));
        u[4 * half + 2] = _mm512_or_si512(u[4 * half + 2], _mm512_and_si512(hb, bits));
        u[4 * half + 3] = _mm512_or_si512(u[4 * half + 3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), bits));
      }
    }
  }
}

// Rows [m0, m0 + MR) of x times a packed tile, into y (fp32, row stride `out`, at the tile's
// first column; `rows` of its 16 columns stored); with Bytes, the tile's values are read from
// `bytes` (unpack_tile_values's output) instead of unpacked per group.
template <int64_t Type, int MR, bool Bytes = false>
void multiply(const uint8_t* tile, const QuantizedX& qx, int64_t m0, int64_t in, int rows, float* y, int64_t out,
              const uint8_t* bytes = nullptr) {
  constexpr int halves = Type == kQ6_K ? 2 : 1, per_chunk = static_cast<int>(chunk_columns(Type) / 32);
  // Independent dpbusd chains per row of x (integer sums: their order does not change a bit).
  constexpr int C = MR >= 2 ? 1 : 2;
  const int64_t groups32 = in / 32;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups32; ++g) {
    const uint8_t* h = tile + g / per_chunk * chunk_bytes(Type);
    const uint8_t* p = h + header_bytes(Type) + g % per_chunk * group_bytes(Type);
    __m512i u[8];
    if constexpr (Bytes) {
      load_values<8>(bytes + 512 * g, u);
    } else {
      load_values<value_bits(Type)>(p, u);
    }
    // Q6_K: one integer sum per group, sum over halves of sc (sum_j u q - 32 sum_j q); others
    // one per group too, scaled and offset in fp32.
    __m512i sc[halves];
    GroupScalesV gs;
    if constexpr (Type == kQ6_K) {
      for (int half = 0; half < 2; ++half)
        sc[half] = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 32 + 16 * (2 * (g % per_chunk) + half))));
    } else {
      chunk_scales<Type>(h, static_cast<int>(g % per_chunk), &gs);
    }
    __m512i total[MR];
    for (int half = 0; half < halves; ++half) {
      constexpr int K = 8 / halves;
      __m512i isum[MR][C];
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < C; ++c)
          isum[m][c] = Type == kQ6_K && c == 0 ? _mm512_set1_epi32(-32 * qx.qsum[(m0 + m) * 2 * groups32 + 2 * g + half])
                                               : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) {
        for (int m = 0; m < MR; ++m) {
          int32_t xv;
          std::memcpy(&xv, qx.q.data() + (m0 + m) * in + 32 * g + 4 * (K * half + k), 4);
          isum[m][k % C] = _mm512_dpbusd_epi32(isum[m][k % C], u[K * half + k], _mm512_set1_epi32(xv));
        }
      }
      for (int m = 0; m < MR; ++m) {
        __m512i is = isum[m][0];
        for (int c = 1; c < C; ++c) is = _mm512_add_epi32(is, isum[m][c]);
        if constexpr (Type == kQ6_K) {
          is = _mm512_mullo_epi32(is, sc[half]);
          total[m] = half == 0 ? is : _mm512_add_epi32(total[m], is);
        } else {
          total[m] = is;
        }
      }
    }
    if constexpr (Type == kQ6_K) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[m]), _mm512_mul_ps(d, _mm512_set1_ps(qx.d[(m0 + m) * groups32 + g])),
                                 acc[m]);
    } else {
      for (int m = 0; m < MR; ++m) {
        const float dx = qx.d[(m0 + m) * groups32 + g];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[m]), _mm512_mul_ps(gs.s, _mm512_set1_ps(dx)), acc[m]);
        acc[m] = _mm512_fmadd_ps(gs.o, _mm512_set1_ps(qx.dsum32[(m0 + m) * groups32 + g]), acc[m]);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * out, mask, acc[m]);
}
#else
template <int64_t Type, int MR>
void multiply(const uint8_t* tile, const QuantizedX& qx, int64_t m0, int64_t in, int rows, float* y, int64_t out) {
  constexpr int per_chunk = static_cast<int>(chunk_columns(Type) / 32);
  const int64_t groups32 = in / 32;
  float acc[MR][kTileRows] = {};
  for (int64_t g = 0; g < groups32; ++g) {
    const uint8_t* h = tile + g / per_chunk * chunk_bytes(Type);
    const uint8_t* p = h + header_bytes(Type) + g % per_chunk * group_bytes(Type);
    GroupScales gs;
    group_scales<Type>(h, static_cast<int>(g % per_chunk), &gs);
    for (int m = 0; m < MR; ++m) {
      const int8_t* q = qx.q.data() + (m0 + m) * in + 32 * g;
      const float dx = qx.d[(m0 + m) * groups32 + g];
      for (int r = 0; r < kTileRows; ++r) {
        int32_t total = 0;  // as the VNNI code: one integer sum per group
        if constexpr (Type == kQ6_K) {
          for (int half = 0; half < 2; ++half) {
            int32_t isum = -32 * qx.qsum[(m0 + m) * 2 * groups32 + 2 * g + half];
            for (int k = 16 * half; k < 16 * half + 16; ++k) isum += value_at(p, 6, r, k) * q[k];
            total += isum * static_cast<int8_t>(h[32 + 16 * (2 * (g % per_chunk) + half) + r]);
          }
          acc[m][r] = std::fma(static_cast<float>(total), fp16(h + 2 * r) * dx, acc[m][r]);
        } else {
          for (int k = 0; k < 32; ++k) total += value_at(p, value_bits(Type), r, k) * q[k];
          acc[m][r] = std::fma(static_cast<float>(total), gs.s[0][r] * dx, acc[m][r]);
          acc[m][r] = std::fma(gs.o[0][r], qx.dsum32[(m0 + m) * groups32 + g], acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < rows; ++r) y[(m0 + m) * out + r] = acc[m][r];
}
#endif

#ifdef TANDEM_GGUF_VNNI
// A tile's values as bytes, group after group (512 bytes each): for many rows of x, unpacked
// once instead of once per pass of kXRows rows (the same values, so the same bits).
template <int64_t Type>
void unpack_tile_values(const uint8_t* tile, int64_t in, uint8_t* bytes) {
  constexpr int per_chunk = static_cast<int>(chunk_columns(Type) / 32);
  for (int64_t g = 0; g < in / 32; ++g) {
    __m512i u[8];
    load_values<value_bits(Type)>(tile + g / per_chunk * chunk_bytes(Type) + header_bytes(Type) +
                                      g % per_chunk * group_bytes(Type),
                                  u);
    for (int k = 0; k < 8; ++k) _mm512_storeu_si512(bytes + 512 * g + 64 * k, u[k]);
  }
}
#endif

template <int64_t Type>
void multiply_all(const uint8_t* tile, const QuantizedX& qx, int64_t t_rows, int64_t in, int rows, float* y,
                  int64_t out) {
  int64_t m0 = 0;
#ifdef TANDEM_GGUF_VNNI
  if (value_bits(Type) < 8 && t_rows >= 2 * kXRows) {
    thread_local std::vector<uint8_t> bytes;
    bytes.resize(16 * in);
    unpack_tile_values<Type>(tile, in, bytes.data());
    for (; m0 + kXRows <= t_rows; m0 += kXRows) multiply<Type, kXRows, true>(tile, qx, m0, in, rows, y, out, bytes.data());
  }
#endif
  for (; m0 + kXRows <= t_rows; m0 += kXRows) multiply<Type, kXRows>(tile, qx, m0, in, rows, y, out);
  switch (t_rows - m0) {
    case 7: return multiply<Type, 7>(tile, qx, m0, in, rows, y, out);
    case 6: return multiply<Type, 6>(tile, qx, m0, in, rows, y, out);
    case 5: return multiply<Type, 5>(tile, qx, m0, in, rows, y, out);
    case 4: return multiply<Type, 4>(tile, qx, m0, in, rows, y, out);
    case 3: return multiply<Type, 3>(tile, qx, m0, in, rows, y, out);
    case 2: return multiply<Type, 2>(tile, qx, m0, in, rows, y, out);
    case 1: return multiply<Type, 1>(tile, qx, m0, in, rows, y, out);
    default: return;
  }
}

void multiply_tile(int64_t type, const uint8_t* tile, const QuantizedX& qx, int64_t t_rows, int64_t in, int rows,
                   float* y, int64_t out) {
  switch (type) {
    case kQ4_0: return multiply_all<kQ4_0>(tile, qx, t_rows, in, rows, y, out);
    case kQ4_1: return multiply_all<kQ4_1>(tile, qx, t_rows, in, rows, y, out);
    case kQ5_0: return multiply_all<kQ5_0>(tile, qx, t_rows, in, rows, y, out);
    case kQ5_1: return multiply_all<kQ5_1>(tile, qx, t_rows, in, rows, y, out);
    case kQ8_0: return multiply_all<kQ8_0>(tile, qx, t_rows, in, rows, y, out);
    case kQ4_K: return multiply_all<kQ4_K>(tile, qx, t_rows, in, rows, y, out);
    case kQ5_K: return multiply_all<kQ5_K>(tile, qx, t_rows, in, rows, y, out);
    default: return multiply_all<kQ6_K>(tile, qx, t_rows, in, rows, y, out);
  }
}

// A packed layer's tiles: each segment's tiles one after another.
struct PackedTile {
  const Segment* seg;
  int64_t offset;  // in the packed bytes
  int64_t r0;      // in the segment
  int rows;
};

std::vector<PackedTile> packed_tiles(const std::vector<Segment>& segs, int64_t in, int64_t* bytes) {
  std::vector<PackedTile> tiles;
  int64_t offset = 0;
  for (const Segment& s : segs) {
    const int64_t tb = tile_bytes_of(s.type, in);
    for (int64_t t = 0; t < tiles_of(s.rows); ++t) {
      tiles.push_back({&s, offset, kTileRows * t, static_cast<int>(std::min<int64_t>(kTileRows, s.rows - kTileRows * t))});
      offset += tb;
    }
  }
  *bytes = offset;
  return tiles;
}

// The segment table of a repacked layer of width `in`, checked against the repacked bytes.
std::vector<Segment> repacked_segments(const at::Tensor& repacked, const at::Tensor& segments, int64_t in,
                                       const char* op) {
  check_bytes(repacked, "repacked", op);
  TORCH_CHECK(in > 0 && in % 32 == 0, op, ": in_features ", in, " not a positive multiple of 32");
  const at::Tensor seg = segment_table(segments, op);
  const int64_t* sp = seg.data_ptr<int64_t>();
  std::vector<Segment> segs;
  int64_t out = 0, offset = 0;
  for (int64_t i = 0; i < seg.size(0); ++i) {
    Segment s{sp[3 * i], {}, sp[3 * i + 1], nullptr, 0, out};
    TORCH_CHECK(type_info(s.type, &s.info), op, ": GGML type ", s.type, " is not supported");
    TORCH_CHECK(in % s.info.weights == 0, op, ": in_features ", in, " not a multiple of the type's block of ",
                s.info.weights);
    TORCH_CHECK(s.rows > 0, op, ": segment ", i, " has no rows");
    TORCH_CHECK(sp[3 * i + 2] == offset, op, ": segment ", i, " at byte ", sp[3 * i + 2], ", expected ", offset,
                " (gguf_repack's table)");
    offset += tiles_of(s.rows) * tile_bytes_of(s.type, in);
    out += s.rows;
    segs.push_back(s);
  }
  TORCH_CHECK(offset == repacked.numel(), op, ": repacked holds ", repacked.numel(), " bytes, the segments at ",
              "in_features ", in, " need ", offset);
  return segs;
}

}  // namespace

namespace tandem_cpu {

bool gguf_vnni() {
#ifdef TANDEM_GGUF_VNNI
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> gguf_repack(const at::Tensor& blocks, const at::Tensor& segments,
                                               int64_t in_features) {
  TORCH_CHECK(in_features > 0 && in_features % 32 == 0, "gguf_repack: in_features ", in_features,
              " not a positive multiple of 32");
  const std::vector<gguf::Segment> segs = gguf::parse_segments(blocks, segments, in_features, "gguf_repack");
  int64_t bytes = 0;
  const std::vector<PackedTile> tiles = packed_tiles(segs, in_features, &bytes);
  at::Tensor packed = at::empty({bytes}, blocks.options());
  uint8_t* base = packed.data_ptr<uint8_t>();
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    gguf::Tile t{std::vector<uint8_t>(16 * in_features), std::vector<float>(in_features),
                 std::vector<float>(in_features)};
    for (int64_t i = begin; i < end; ++i)
      pack_tile(*tiles[i].seg, tiles[i].r0, tiles[i].rows, in_features, &t, base + tiles[i].offset);
  });
  at::Tensor table = at::empty({static_cast<int64_t>(segs.size()), 3}, segments.options().dtype(at::kLong));
  int64_t* tp = table.data_ptr<int64_t>();
  int64_t offset = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    tp[3 * i] = segs[i].type;
    tp[3 * i + 1] = segs[i].rows;
    tp[3 * i + 2] = offset;
    offset += tiles_of(segs[i].rows) * tile_bytes_of(segs[i].type, in_features);
  }
  return {packed, table};
}

at::Tensor gguf_repacked_linear(const at::Tensor& x_in, const at::Tensor& repacked, const at::Tensor& segments,
                                const std::optional<at::Tensor>& bias) {
  const char* op = "gguf_repacked_linear";
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), op, ": x must be a 2-d CPU tensor, got ", x_in.sizes());
  const int64_t t_rows = x_in.size(0), in = x_in.size(1);
  const std::vector<gguf::Segment> segs = repacked_segments(repacked, segments, in, op);
  const int64_t out = segs.back().first_row + segs.back().rows;
  if (bias.has_value()) TORCH_CHECK(bias->numel() == out, op, ": bias of ", bias->numel(), " values for ", out, " outputs");
  int64_t bytes = 0;
  const std::vector<PackedTile> tiles = packed_tiles(segs, in, &bytes);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({t_rows, out}, x.options());
  if (t_rows > 0) {
    gguf::QuantizedX qx;
    gguf::quantize_x32(x.data_ptr<float>(), t_rows, in, &qx);
    float* yp = y.data_ptr<float>();
    const uint8_t* base = repacked.data_ptr<uint8_t>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const PackedTile& pt = tiles[i];
        multiply_tile(pt.seg->type, base + pt.offset, qx, t_rows, in, pt.rows, yp + pt.seg->first_row + pt.r0, out);
      }
    });
  }
  return gguf::finish_linear(y, bias, x_in.scalar_type());
}

int64_t gguf_repacked_width(const at::Tensor& repacked, const at::Tensor& segments) {
  const char* op = "gguf_repacked_width";
  // The bytes are linear in the width: bytes = width * sum over segments of tiles * chunk bytes / chunk columns.
  const at::Tensor seg = gguf::segment_table(segments, op);
  const int64_t* sp = seg.data_ptr<int64_t>();
  int64_t per_256 = 0;  // bytes per 256 columns
  for (int64_t i = 0; i < seg.size(0); ++i) {
    gguf::TypeInfo info;
    TORCH_CHECK(gguf::type_info(sp[3 * i], &info), op, ": GGML type ", sp[3 * i], " is not supported");
    TORCH_CHECK(sp[3 * i + 1] > 0, op, ": segment ", i, " has no rows");
    per_256 += tiles_of(sp[3 * i + 1]) * tile_bytes_of(sp[3 * i], 256);
  }
  const int64_t width = repacked.numel() * 256 / per_256;
  TORCH_CHECK(width > 0 && width * per_256 == repacked.numel() * 256, op, ": ", repacked.numel(),
              " bytes fit no width of these segments");
  repacked_segments(repacked, segments, width, op);
  return width;
}

at::Tensor gguf_repacked_get_rows(const at::Tensor& repacked, const at::Tensor& segments, const at::Tensor& ids,
                                  int64_t cols, at::ScalarType dtype) {
  const char* op = "gguf_repacked_get_rows";
  TORCH_CHECK(ids.dim() == 1 && !at::isFloatingType(ids.scalar_type()), op, ": ids must be 1-d integers, got ",
              ids.sizes(), " ", ids.scalar_type());
  const std::vector<gguf::Segment> segs = repacked_segments(repacked, segments, cols, op);
  const int64_t rows = segs.back().first_row + segs.back().rows;
  int64_t bytes = 0;
  const std::vector<PackedTile> tiles = packed_tiles(segs, cols, &bytes);
  std::vector<int64_t> first_tile(segs.size());  // each segment's first tile
  for (size_t i = 1; i < segs.size(); ++i) first_tile[i] = first_tile[i - 1] + tiles_of(segs[i - 1].rows);
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < idx.numel(); ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, op, ": id ", ip[t], " outside the ", rows, " rows");
  at::Tensor out = at::empty({idx.numel(), cols}, repacked.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const uint8_t* base = repacked.data_ptr<uint8_t>();
  at::parallel_for(0, idx.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      size_t i = 0;
      while (ip[t] >= segs[i].first_row + segs[i].rows) ++i;
      const int64_t r = ip[t] - segs[i].first_row;
      const PackedTile& pt = tiles[first_tile[i] + r / kTileRows];
      dequantize_tile_row(segs[i].type, base + pt.offset, static_cast<int>(r % kTileRows), cols, dst + t * cols);
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace tandem_cpu
