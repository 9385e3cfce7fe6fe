// GGUF blocks unpacked tile by tile (16 weight rows of one segment, the whole input width) to
// unsigned 8-bit values u, w = s u + o with s and o per group of G columns (G = 16 for Q6_K, 32
// otherwise), in the layout the repacked GEMM multiplies from (gguf_repacked.cpp, which packs
// these values back to the file's bits once, at load): one 512-bit vector holds four columns of
// all 16 rows, each row's group expanded in registers (gguf_quants.h) and then transposed in
// 32-bit runs.
#include "gguf_quants.h"

#include <cstring>

namespace {

using namespace tandem_cpu::gguf;

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

void unpack_any(const Segment& seg, int64_t r0, int rows, int64_t in, Tile* t) {
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

}  // namespace

namespace tandem_cpu::gguf {

void unpack_tile(const Segment& seg, int64_t r0, int rows, int64_t in, Tile* t) { unpack_any(seg, r0, rows, in, t); }

}  // namespace tandem_cpu::gguf
